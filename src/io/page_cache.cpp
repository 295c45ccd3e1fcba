#include "io/page_cache.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>

namespace hbmio::detail {
namespace {

#ifndef __NR_cachestat
#define __NR_cachestat 451  // same number on every architecture (added in Linux 6.5)
#endif

struct CachestatRange {
  std::uint64_t off, len;
};
struct Cachestat {
  std::uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

// Remembered once the kernel says ENOSYS, so old kernels pay for the probe only once.
std::atomic<bool> cachestat_missing{false};

// The pages [first, last) holding bytes [offset, offset + length), of `size` bytes each.
struct Pages {
  std::uint64_t size, first, last;
};
Pages pages_of(std::uint64_t offset, std::uint64_t length) noexcept {
  const auto size = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return {size, offset / size, (offset + length + size - 1) / size};
}

}  // namespace

Residency page_cache_residency(int fd, std::uint64_t offset, std::uint64_t length) noexcept {
  const Pages p = pages_of(offset, length);
  Residency r{.total_pages = p.last - p.first};
  if (length == 0) return r;
  const std::uint64_t page = p.size, first = p.first, last = p.last;

  if (!cachestat_missing.load(std::memory_order_relaxed)) {
    CachestatRange range{first * page, (last - first) * page};
    Cachestat cs{};
    if (::syscall(__NR_cachestat, fd, &range, &cs, 0) == 0) {
      r.cached_pages = cs.nr_cache;
      r.method = "cachestat";
      return r;
    }
    if (errno == ENOSYS) cachestat_missing.store(true, std::memory_order_relaxed);
  }

  return mincore_residency(fd, offset, length);
}

Residency mincore_residency(int fd, std::uint64_t offset, std::uint64_t length) noexcept {
  const Pages p = pages_of(offset, length);
  Residency r{.total_pages = p.last - p.first};
  if (length == 0) return r;
  const std::uint64_t page = p.size, first = p.first, last = p.last;
  // mincore needs a mapping; mapping does not fault pages in, so this does not disturb the cache.
  const std::uint64_t map_offset = first * page, map_length = (last - first) * page;
  void* map = ::mmap(nullptr, map_length, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(map_offset));
  if (map == MAP_FAILED) return r;
  // A fixed window of the vector mincore fills, walked over the range: nothing to allocate in a
  // function that must not throw.
  std::array<unsigned char, 1024> vec{};
  std::uint64_t cached = 0;
  bool ok = true;
  for (std::uint64_t done = 0; done < r.total_pages && ok; done += vec.size()) {
    const std::uint64_t pages = std::min<std::uint64_t>(vec.size(), r.total_pages - done);
    ok = ::mincore(static_cast<char*>(map) + done * page, pages * page, vec.data()) == 0;
    for (std::uint64_t i = 0; ok && i < pages; ++i) cached += vec[i] & 1;
  }
  if (ok) {
    r.cached_pages = cached;
    r.method = "mincore";
  }
  ::munmap(map, map_length);
  return r;
}

}  // namespace hbmio::detail
