// Helpers shared by the tests: temporary directories, random files, independent reads.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "hbmio/hbmio.hpp"

namespace hbmio::test {

// A directory removed with its contents at scope exit. Under $HBMIO_TEST_DIR, else $TMPDIR or
// /var/tmp (a disk file system: /tmp may be tmpfs, which refuses O_DIRECT).
class TempDir {
 public:
  explicit TempDir(const std::string& parent = "") {
    std::string base = parent;
    if (base.empty()) {
      const char* env = std::getenv("HBMIO_TEST_DIR");
      base = env && *env ? env : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/var/tmp");
    }
    std::string pattern = base + "/hbmio-test-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp in " + base + ": " + std::strerror(errno));
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Whether `name` ("uring", "cufile", ...) runs on this machine.
inline bool backend_available(const std::string& name) {
  for (const auto& b : probe_backends())
    if (b.name == name) return b.available;
  return false;
}

inline std::vector<std::byte> random_bytes(std::size_t size, std::uint64_t seed) {
  std::vector<std::byte> data(size);
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(data.data() + i, &v, 8);
  }
  for (; i < size; ++i) data[i] = static_cast<std::byte>(rng());
  return data;
}

inline void write_file(const std::string& path, const std::vector<std::byte>& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("open " + path);
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t r = ::write(fd, data.data() + done, data.size() - done);
    if (r <= 0) throw std::runtime_error("write " + path);
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
}

// The independent source every test compares against: plain pread.
inline std::vector<std::byte> pread_range(const std::string& path, std::uint64_t offset, std::size_t length) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("open " + path);
  std::vector<std::byte> data(length);
  std::size_t done = 0;
  while (done < length) {
    const ssize_t r = ::pread(fd, data.data() + done, length - done, static_cast<off_t>(offset + done));
    if (r <= 0) {
      ::close(fd);
      throw std::runtime_error("pread " + path);
    }
    done += static_cast<std::size_t>(r);
  }
  ::close(fd);
  return data;
}

inline std::vector<std::byte> to_host(MemorySpan span) {
  std::vector<std::byte> out(span.size);
  copy_memory({out.data(), out.size(), {}}, span);
  return out;
}

// Index of the first differing byte, or -1: a failure message names the offset, not a blob.
inline long long first_mismatch(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  if (a.size() != b.size()) return -2;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<long long>(i);
  return -1;
}

inline int open_fd_count() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++n;
    ::closedir(dir);
  }
  return n;
}

// Small sizes so that every path (many chunks, many pieces, slot reuse) runs in milliseconds.
inline Options small_options(DirectIo direct = DirectIo::automatic) {
  Options o;
  o.chunk_size = 256 << 10;
  o.bounce_buffer_size = 64 << 10;
  o.bounce_buffers = 3;
  o.queue_depth = 4;
  o.workers = 3;
  o.direct_io = direct;
  return o;
}

}  // namespace hbmio::test
