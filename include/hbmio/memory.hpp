// Where bytes land: host pageable, host pinned, or CUDA device memory.
//
// `Buffer` owns an allocation of one kind; `MemorySpan` is a non-owning view that engines take.
// A span does not keep its memory alive: the caller keeps the Buffer (or its own allocation)
// alive until every transfer using the span has completed (for futures: until get() returns).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace hbmio {

enum class MemoryKind { host, pinned, device };

// A kind plus, for device memory, the CUDA device index. Text form: "host", "pinned", "cuda:N".
struct MemoryLocation {
  MemoryKind kind = MemoryKind::host;
  int device = 0;

  static MemoryLocation parse(std::string_view text);  // throws Error(EINVAL) on bad text
  std::string to_string() const;
  friend bool operator==(const MemoryLocation&, const MemoryLocation&) = default;
};

struct MemorySpan {
  std::byte* data = nullptr;
  std::size_t size = 0;
  MemoryLocation location{};

  MemoryKind kind() const noexcept { return location.kind; }
  // Bytes [offset, offset + length) of this span; throws Error(EINVAL) when out of range.
  MemorySpan subspan(std::size_t offset, std::size_t length) const;
};

// An owning allocation. Move-only; the destructor frees (never throws).
//  - host: page-aligned pageable memory (2 MiB-aligned with transparent huge pages from 2 MiB).
//  - pinned: page-locked host memory. With a CUDA device present it is host memory as above,
//    registered with cudaHostRegister (portable, usable for async copies to any device; faster
//    to set up than cudaHostAlloc); without one it is locked with mlock where the limit allows
//    (cuda_registered() tells which).
//  - device: cudaMalloc on the given device (256-byte aligned); throws when built without CUDA
//    or when the device does not exist.
class Buffer {
 public:
  Buffer() = default;
  static Buffer allocate(MemoryLocation where, std::size_t size);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  MemoryLocation location() const noexcept { return location_; }
  bool cuda_registered() const noexcept { return cuda_registered_; }
  MemorySpan span() const noexcept { return {data_, size_, location_}; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  MemoryLocation location_{};
  bool cuda_registered_ = false;
  bool locked_ = false;
};

// Copies between any two spans of equal size (cudaMemcpy where a device is involved). Blocking.
void copy_memory(MemorySpan dst, MemorySpan src);
// Fills a span with a byte value (cudaMemset for device memory). Blocking.
void fill_memory(MemorySpan dst, std::byte value);

// Live Buffer allocations by kind, for leak checks and reporting.
struct MemoryCounters {
  std::int64_t host_buffers = 0, pinned_buffers = 0, device_buffers = 0;
  std::int64_t host_bytes = 0, pinned_bytes = 0, device_bytes = 0;
};
MemoryCounters memory_counters() noexcept;

// CUDA as this process sees it.
bool built_with_cuda() noexcept;
int cuda_built_version() noexcept;           // the CUDA runtime hbmio was built with (13000 for 13.0); 0 without
int cuda_device_count() noexcept;            // 0 without CUDA, driver or device
std::string cuda_unavailable_reason();       // empty when cuda_device_count() > 0
std::string cuda_device_name(int device);    // "" when unknown

}  // namespace hbmio
