// The thin layer over the CUDA runtime that the rest of the library uses. Every function exists
// in builds without CUDA too: there, they throw Error(ENOTSUP, "built without CUDA"), so callers
// need no #ifdefs. Errors become hbmio::Error (cuda_category) here, at one boundary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hbmio/error.hpp"

namespace hbmio::cuda {

// Opaque handles (cudaStream_t / cudaEvent_t) so that headers need no CUDA include.
using StreamHandle = void*;
using EventHandle = void*;

bool available() noexcept;  // built with CUDA and at least one device
// Makes `device` current on this thread and leaves it so: for the library's own worker threads
// only. Code that runs on a caller's thread uses DeviceGuard.
void set_device(int device, const ErrorContext& context);

// Makes `device` current on the calling thread for the guard's life, then restores exactly the
// context that was current before (none included: restoring through cudaSetDevice would create
// a context on that device). Every public call that touches CUDA on the caller's thread holds
// one, so none leaves the caller's current device changed.
class DeviceGuard {
 public:
  DeviceGuard(int device, const ErrorContext& context);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void* previous_ = nullptr;  // the CUcontext current before
  bool restore_ = false;
};

// The device of the context current on this thread, or -1 when none is (no context is created).
int current_device() noexcept;
// Throws unless `ptr` is device memory on `device` (cudaPointerGetAttributes).
void check_device_pointer(const void* ptr, int device, const ErrorContext& context);

void* malloc_device(std::size_t size, int device, const ErrorContext& context);
void free_device(void* ptr) noexcept;
// Page-locks host memory for every CUDA context (cudaHostRegister, portable); undone by
// unregister_host before the memory is unmapped.
void register_host(void* ptr, std::size_t size, const ErrorContext& context);
void unregister_host(void* ptr) noexcept;

// Page-locks a read-only mapping (cudaHostRegisterReadOnly | Portable): pages that may not be
// written, such as a sealed memfd's, which a plain registration would refuse.
void register_host_read_only(void* ptr, std::size_t size, const ErrorContext& context);

// Device memory shared between processes (CUDA IPC). The handle names a whole allocation (the
// one cudaMalloc returned), so a pointer inside one travels as its allocation's handle and the
// offset from that allocation's start; the device as its PCI bus id, since processes may number
// their devices differently (CUDA_VISIBLE_DEVICES).
struct IpcAllocation {
  std::string handle;  // cudaIpcMemHandle_t's 64 bytes
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::string pci_bus_id;  // "0000:3b:00.0"
};
// The allocation holding device pointer `ptr` (Error where it is no device memory, or the memory
// cannot be shared: made by cudaMallocAsync or the VMM API).
IpcAllocation ipc_allocation_of(const void* ptr, const ErrorContext& context);
// The size of the allocation that starts at `ptr` (one ipc_open returned, say).
std::size_t device_allocation_size(const void* ptr, const ErrorContext& context);
// This process's device with that PCI bus id (Error ENODEV where it has none).
int device_of_pci_bus_id(const std::string& pci_bus_id, const ErrorContext& context);
// The PCI bus id of this process's `device` ("0000:3b:00.0").
std::string pci_bus_id_of(int device, const ErrorContext& context);
// Maps another process's allocation into this one (current device: `device`); undone by ipc_close.
void* ipc_open(const std::string& handle, int device, const ErrorContext& context);
void ipc_close(void* ptr) noexcept;
// ipc_close once the work queued on `device` is done: a mapping another process's memory may be
// read through by kernels still queued (a framework frees a tensor as soon as it queued its last
// use, which a mapping of its own does not see) must outlive them.
void ipc_close_when_idle(void* ptr, int device) noexcept;

void memcpy_sync(void* dst, const void* src, std::size_t size, const ErrorContext& context);
void memset_device(void* dst, int value, std::size_t size, const ErrorContext& context);

// Move-only stream + the events of one worker, all on one device.
class Stream {
 public:
  Stream() = default;
  Stream(int device, const ErrorContext& context);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  bool valid() const noexcept { return handle_ != nullptr; }
  int device() const noexcept { return device_; }
  StreamHandle handle() const noexcept { return handle_; }
  void copy_to_device_async(void* dst, const void* src, std::size_t size, const ErrorContext& context);
  void copy_to_host_async(void* dst, const void* src, std::size_t size, const ErrorContext& context);
  // Either way, or between two allocations of GPU memory (the kind inferred from the pointers).
  void copy_async(void* dst, const void* src, std::size_t size, const ErrorContext& context);
  void synchronize(const ErrorContext& context);
  void synchronize_noexcept() noexcept;

 private:
  StreamHandle handle_ = nullptr;
  int device_ = -1;
};

class Event {
 public:
  Event() = default;
  explicit Event(const ErrorContext& context);  // timing disabled: cheapest to record and query
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(const Stream& stream, const ErrorContext& context);
  void record(StreamHandle stream, const ErrorContext& context);  // a caller's stream (nullptr: the legacy one)
  bool ready(const ErrorContext& context);  // cudaEventQuery
  void synchronize(const ErrorContext& context);

 private:
  EventHandle handle_ = nullptr;
};

}  // namespace hbmio::cuda
