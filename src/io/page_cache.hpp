// How much of a file range sits in the page cache: the input to O_DIRECT "auto".
// A warm range read with O_DIRECT would go back to the disk at a fraction of memory speed;
// a cold one read through the cache pays an extra copy and evicts other data.
#pragma once

#include <cstdint>

namespace hbmio::detail {

struct Residency {
  std::uint64_t cached_pages = 0;
  std::uint64_t total_pages = 0;
  const char* method = "none";  // "cachestat", "mincore" or "none" (unknown: treated as cold)
  double fraction() const noexcept {
    return total_pages ? static_cast<double>(cached_pages) / static_cast<double>(total_pages) : 0.0;
  }
};

// cachestat(2) (Linux 6.5+) where the kernel has it, else mmap + mincore(2).
Residency page_cache_residency(int fd, std::uint64_t offset, std::uint64_t length) noexcept;
// The mmap + mincore(2) answer alone (what kernels before 6.5 get), for tests on newer ones.
Residency mincore_residency(int fd, std::uint64_t offset, std::uint64_t length) noexcept;

}  // namespace hbmio::detail
