#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include <fmt/format.h>

#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio {
namespace {

struct LiveCounters {
  std::atomic<std::int64_t> buffers[3]{};
  std::atomic<std::int64_t> bytes[3]{};
};
LiveCounters& live() {
  static LiveCounters counters;
  return counters;
}
void count(MemoryKind kind, std::size_t size, int sign) {
  const auto k = static_cast<int>(kind);
  live().buffers[k] += sign;
  live().bytes[k] += sign * static_cast<std::int64_t>(size);
}

// Host memory comes from mmap: page aligned (O_DIRECT-ready) and returned to the kernel on free.
// Mappings of 2 MiB and more start on a 2 MiB boundary and ask for transparent huge pages: a
// fresh multi-GiB host destination then takes 512 times fewer page faults, and pinning it is
// faster than cudaHostAlloc of the same size (bench/RESULTS.md, "First use").
std::byte* map_anonymous(std::size_t size, const ErrorContext& context) {
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  const bool huge = size >= kHuge;
  if (size > std::numeric_limits<std::size_t>::max() - kHuge) throw Error(errno_code(ENOMEM), context, "mmap");
  const std::size_t mapped = huge ? size + kHuge : size;  // room to move the start to a boundary
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(errno_code(errno), context, "mmap");
  auto* start = static_cast<std::byte*>(p);
  if (huge) {
    auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(start) + kHuge - 1) / kHuge * kHuge);
    // Unmap the slack on both sides: the buffer owns exactly [aligned, aligned + size) (rounded
    // up to whole pages by the kernel, as munmap of the same size will be).
    const std::size_t head = static_cast<std::size_t>(aligned - start);
    if (head != 0) ::munmap(start, head);
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t used = (size + page - 1) / page * page;
    if (mapped - head > used) ::munmap(aligned + used, mapped - head - used);
    start = aligned;
    (void)::madvise(start, size, MADV_HUGEPAGE);  // advice only: where THP is off, 4 KiB pages
  }
  return start;
}

}  // namespace

// The forms torch.device takes for the same memory (plus pinned), so that the command line and
// Python accept and refuse the same words: "gpu" is not one of them.
MemoryLocation MemoryLocation::parse(std::string_view text) {
  if (text == "host" || text == "cpu") return {MemoryKind::host, 0};
  if (text == "pinned") return {MemoryKind::pinned, 0};
  if (text == "cuda") return {MemoryKind::device, 0};
  constexpr std::string_view prefix = "cuda:";
  const std::string_view number = text.substr(std::min(prefix.size(), text.size()));
  if (text.substr(0, prefix.size()) == prefix && !number.empty() && number.size() <= 4 &&
      std::all_of(number.begin(), number.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    int device = 0;
    for (char c : number) device = device * 10 + (c - '0');
    return {MemoryKind::device, device};
  }
  throw Error(errno_code(EINVAL), {.op = "parse memory location"},
              fmt::format("'{}' is not a memory location: use host (or cpu), pinned, cuda (the first GPU) or cuda:N", text));
}

std::string MemoryLocation::to_string() const {
  switch (kind) {
    case MemoryKind::host: return "host";
    case MemoryKind::pinned: return "pinned";
    case MemoryKind::device: return fmt::format("cuda:{}", device);
  }
  return "?";
}

MemorySpan MemorySpan::subspan(std::size_t offset, std::size_t length) const {
  if (offset > size || length > size - offset)
    throw Error(errno_code(EINVAL), {.op = "subspan"},
                fmt::format("[{}, +{}) is outside a span of {} bytes", offset, length, size));
  return {data + offset, length, location};
}

Buffer Buffer::allocate(MemoryLocation where, std::size_t size) {
  // The size goes into the words, not into .length: "[offset 0, length N]" reads as a file range.
  const ErrorContext context{.op = fmt::format("allocate {} bytes of {}", size, where.to_string())};
  Buffer buffer;
  buffer.location_ = where;
  buffer.size_ = size;
  if (size == 0) return buffer;
  switch (where.kind) {
    case MemoryKind::host:
      buffer.data_ = map_anonymous(size, context);
      break;
    case MemoryKind::pinned:
      if (cuda::available()) {
        std::byte* data = map_anonymous(size, context);
        try {
          cuda::register_host(data, size, context);
        } catch (...) {
          ::munmap(data, size);  // `buffer` does not own it yet: its destructor frees nothing
          throw;
        }
        buffer.data_ = data;
        buffer.cuda_registered_ = true;
      } else {
        // No GPU: page-locked memory is still what "pinned" promises to storage I/O. mlock may
        // be refused by RLIMIT_MEMLOCK; the memory is then ordinary, which only costs speed.
        buffer.data_ = map_anonymous(size, context);
        buffer.locked_ = ::mlock(buffer.data_, size) == 0;
      }
      break;
    case MemoryKind::device:
      // Said before the context's [offset, length], which mean nothing when there is no GPU to
      // allocate on; the same words as Python's device check ("this machine has no GPU (...)").
      if (cuda_device_count() == 0)
        throw Error(errno_code(ENODEV), {.op = "allocate " + where.to_string()},
                    fmt::format("this machine has no GPU ({})", cuda_unavailable_reason()));
      buffer.data_ = static_cast<std::byte*>(cuda::malloc_device(size, where.device, context));
      break;
  }
  count(where.kind, size, +1);
  return buffer;
}

void Buffer::release() noexcept {
  if (data_ == nullptr) return;
  switch (location_.kind) {
    case MemoryKind::host: ::munmap(data_, size_); break;
    case MemoryKind::pinned:
      if (cuda_registered_) cuda::unregister_host(data_);
      if (locked_) ::munlock(data_, size_);
      ::munmap(data_, size_);
      break;
    case MemoryKind::device: cuda::free_device(data_); break;
  }
  count(location_.kind, size_, -1);
  data_ = nullptr;
  size_ = 0;
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      location_(other.location_),
      cuda_registered_(other.cuda_registered_),
      locked_(other.locked_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    location_ = other.location_;
    cuda_registered_ = other.cuda_registered_;
    locked_ = other.locked_;
  }
  return *this;
}

void copy_memory(MemorySpan dst, MemorySpan src) {
  const ErrorContext context{.op = fmt::format("copy {} to {}", src.location.to_string(), dst.location.to_string()),
                             .length = src.size};
  if (dst.size != src.size)
    throw Error(errno_code(EINVAL), context, fmt::format("sizes differ: {} and {}", dst.size, src.size));
  if (src.size == 0) return;
  if (dst.kind() != MemoryKind::device && src.kind() != MemoryKind::device) {
    std::memcpy(dst.data, src.data, src.size);
    return;
  }
  const cuda::DeviceGuard guard(dst.kind() == MemoryKind::device ? dst.location.device : src.location.device, context);
  cuda::memcpy_sync(dst.data, src.data, src.size, context);
}

void fill_memory(MemorySpan dst, std::byte value) {
  if (dst.size == 0) return;
  if (dst.kind() != MemoryKind::device) {
    std::memset(dst.data, static_cast<int>(value), dst.size);
    return;
  }
  const ErrorContext context{.op = "fill " + dst.location.to_string(), .length = dst.size};
  const cuda::DeviceGuard guard(dst.location.device, context);
  cuda::memset_device(dst.data, static_cast<int>(value), dst.size, context);
}

MemoryCounters memory_counters() noexcept {
  auto& c = live();
  return {c.buffers[0], c.buffers[1], c.buffers[2], c.bytes[0], c.bytes[1], c.bytes[2]};
}

}  // namespace hbmio
