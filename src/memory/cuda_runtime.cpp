#include "memory/cuda_runtime.hpp"

#include <dlfcn.h>

#include <fmt/format.h>

#include <cstring>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "hbmio/memory.hpp"

#ifdef HBMIO_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace hbmio {

namespace {
class CudaCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cuda"; }
  std::string message(int code) const override {
#ifdef HBMIO_HAVE_CUDA
    const auto err = static_cast<cudaError_t>(code);
    return fmt::format("{}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
#else
    return fmt::format("CUDA error {}", code);
#endif
  }
};
}  // namespace

const std::error_category& cuda_category() noexcept {
  static const CudaCategory category;
  return category;
}

bool built_with_cuda() noexcept {
#ifdef HBMIO_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

namespace {
struct DeviceQuery {
  int count = 0;
  std::string reason;
};

#ifdef HBMIO_HAVE_CUDA
bool driver_installed() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) return false;
  ::dlclose(lib);
  return true;
}
#endif

// Asked once: cudaGetDeviceCount initialises the runtime (loads the driver, enumerates the
// devices), which is slow the first time (bench/RESULTS.md, "First use") and is not paid per call.
const DeviceQuery& device_query() {
  static const DeviceQuery query = [] {
    DeviceQuery q;
#ifdef HBMIO_HAVE_CUDA
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaErrorInsufficientDriver && !driver_installed()) {
      // The runtime says "driver version is insufficient" also when there is no driver at all.
      q.reason = "no CUDA device (no NVIDIA driver: libcuda.so.1 is not installed)";
      (void)cudaGetLastError();
    } else if (err != cudaSuccess) {
      q.reason = fmt::format("no CUDA device ({}: {})", cudaGetErrorName(err), cudaGetErrorString(err));
      (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    } else if (count == 0) {
      q.reason = "no CUDA device";
    } else {
      q.count = count;
    }
#else
    q.reason = "hbmio was built without CUDA (HBMIO_CUDA=OFF or no toolkit found)";
#endif
    return q;
  }();
  return query;
}
}  // namespace

int cuda_device_count() noexcept {
  try {
    return device_query().count;
  } catch (...) {
    return 0;
  }
}
std::string cuda_unavailable_reason() { return device_query().reason; }

int cuda_built_version() noexcept {
#ifdef HBMIO_HAVE_CUDA
  return CUDART_VERSION;
#else
  return 0;
#endif
}

std::string cuda_device_name(int device) {
#ifdef HBMIO_HAVE_CUDA
  cudaDeviceProp prop{};
  if (cuda_device_count() > device && cudaGetDeviceProperties(&prop, device) == cudaSuccess) return prop.name;
#else
  (void)device;
#endif
  return {};
}

}  // namespace hbmio

namespace hbmio::cuda {

#ifdef HBMIO_HAVE_CUDA
namespace {
void check(cudaError_t err, const ErrorContext& context, const char* call) {
  if (err == cudaSuccess) return;
  throw Error(std::error_code(static_cast<int>(err), cuda_category()), context, call);
}
void require_device(const ErrorContext& context) {
  if (cuda_device_count() == 0) throw Error(errno_code(ENODEV), context, cuda_unavailable_reason());
}
}  // namespace

bool available() noexcept { return cuda_device_count() > 0; }

void set_device(int device, const ErrorContext& context) {
  require_device(context);
  if (device < 0 || device >= cuda_device_count())
    throw Error(errno_code(ENODEV), context, fmt::format("cuda:{} does not exist ({} device(s))", device, cuda_device_count()));
  check(cudaSetDevice(device), context, "cudaSetDevice");
}

namespace {
// The driver's context calls, reached through the runtime (the static runtime links no libcuda):
// the runtime API cannot say "no context is current", nor make none current again.
struct ContextCalls {
  int (*get_current)(void** context) = nullptr;    // cuCtxGetCurrent
  int (*set_current)(void* context) = nullptr;     // cuCtxSetCurrent
  int (*get_device)(int* device) = nullptr;        // cuCtxGetDevice
};
const ContextCalls& context_calls() {
  static const ContextCalls calls = [] {
    ContextCalls c;
    cudaDriverEntryPointQueryResult found{};
    const auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
          found == cudaDriverEntryPointSuccess)
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuCtxGetCurrent", c.get_current);
    get("cuCtxSetCurrent", c.set_current);
    get("cuCtxGetDevice", c.get_device);
    return c;
  }();
  return calls;
}
}  // namespace

DeviceGuard::DeviceGuard(int device, const ErrorContext& context) {
  const ContextCalls& calls = context_calls();
  if (calls.get_current != nullptr && calls.set_current != nullptr && calls.get_current(&previous_) == 0) restore_ = true;
  set_device(device, context);
}

DeviceGuard::~DeviceGuard() {
  if (restore_) (void)context_calls().set_current(previous_);
}

int current_device() noexcept {
  if (cuda_device_count() == 0) return -1;
  const ContextCalls& calls = context_calls();
  void* current = nullptr;
  int device = -1;
  if (calls.get_current == nullptr || calls.get_device == nullptr || calls.get_current(&current) != 0 || current == nullptr)
    return -1;
  return calls.get_device(&device) == 0 ? device : -1;
}

void check_device_pointer(const void* ptr, int device, const ErrorContext& context) {
  require_device(context);
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, ptr), context, "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    throw Error(errno_code(EINVAL), context, fmt::format("{} is not CUDA device memory", ptr));
  if (attributes.device != device)
    throw Error(errno_code(EINVAL), context, fmt::format("{} is memory of cuda:{}, not cuda:{}", ptr, attributes.device, device));
}

void* malloc_device(std::size_t size, int device, const ErrorContext& context) {
  const DeviceGuard guard(device, context);
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, size), context, "cudaMalloc");
  return ptr;
}
void free_device(void* ptr) noexcept { if (ptr) (void)cudaFree(ptr); }

void register_host(void* ptr, std::size_t size, const ErrorContext& context) {
  require_device(context);
  check(cudaHostRegister(ptr, size, cudaHostRegisterPortable), context, "cudaHostRegister");
}
void unregister_host(void* ptr) noexcept { if (ptr) (void)cudaHostUnregister(ptr); }
void register_host_read_only(void* ptr, std::size_t size, const ErrorContext& context) {
  require_device(context);
  check(cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterReadOnly), context, "cudaHostRegister(ReadOnly)");
}

namespace {
// The start and size of the allocation holding `ptr`, in the current context: the driver's
// cuMemGetAddressRange (the runtime has no counterpart), reached through the runtime so that the
// library links no libcuda.
std::pair<std::uintptr_t, std::size_t> address_range(const void* ptr, const ErrorContext& context) {
  using GetAddressRange = int (*)(std::uintptr_t*, std::size_t*, std::uintptr_t);
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found), context,
        "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)");
  if (entry == nullptr || found != cudaDriverEntryPointSuccess) throw Error(errno_code(ENOTSUP), context, "the driver has no cuMemGetAddressRange");
  std::uintptr_t base = 0;
  std::size_t size = 0;
  if (const int err = reinterpret_cast<GetAddressRange>(entry)(&base, &size, reinterpret_cast<std::uintptr_t>(ptr)); err != 0)
    throw Error(errno_code(EINVAL), context, fmt::format("cuMemGetAddressRange: CUDA driver error {}", err));
  return {base, size};
}
}  // namespace

std::size_t device_allocation_size(const void* ptr, const ErrorContext& context) {
  require_device(context);
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, ptr), context, "cudaPointerGetAttributes");
  DeviceGuard guard(attributes.device, context);
  const auto [base, size] = address_range(ptr, context);
  return size - (reinterpret_cast<std::uintptr_t>(ptr) - base);
}

IpcAllocation ipc_allocation_of(const void* ptr, const ErrorContext& context) {
  require_device(context);
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, ptr), context, "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice) throw Error(errno_code(EINVAL), context, "not device memory");
  IpcAllocation out;
  DeviceGuard guard(attributes.device, context);
  std::tie(out.base, out.size) = address_range(ptr, context);
  cudaIpcMemHandle_t handle{};
  check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(out.base)), context, "cudaIpcGetMemHandle");
  out.handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
  char bus[32] = {};
  check(cudaDeviceGetPCIBusId(bus, sizeof bus, attributes.device), context, "cudaDeviceGetPCIBusId");
  out.pci_bus_id = bus;
  return out;
}

int device_of_pci_bus_id(const std::string& pci_bus_id, const ErrorContext& context) {
  require_device(context);
  int device = -1;
  if (cudaDeviceGetByPCIBusId(&device, pci_bus_id.c_str()) != cudaSuccess || device < 0) {
    (void)cudaGetLastError();
    throw Error(errno_code(ENODEV), context, fmt::format("no GPU with PCI bus id {} here", pci_bus_id));
  }
  return device;
}

std::string pci_bus_id_of(int device, const ErrorContext& context) {
  require_device(context);
  char bus[32] = {};
  check(cudaDeviceGetPCIBusId(bus, sizeof bus, device), context, "cudaDeviceGetPCIBusId");
  return bus;
}

void* ipc_open(const std::string& handle, int device, const ErrorContext& context) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) throw Error(errno_code(EINVAL), context, "an IPC handle of the wrong size");
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle.data(), sizeof h);
  DeviceGuard guard(device, context);
  void* ptr = nullptr;
  check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess), context, "cudaIpcOpenMemHandle");
  return ptr;
}
void ipc_close(void* ptr) noexcept { if (ptr) (void)cudaIpcCloseMemHandle(ptr); }
void ipc_close_when_idle(void* ptr, int device) noexcept {
  if (!ptr) return;
  try {
    DeviceGuard guard(device, {.op = "close a CUDA IPC mapping"});
    (void)cudaDeviceSynchronize();
  } catch (...) {  // no such device any more: nothing can run on it either
  }
  (void)cudaIpcCloseMemHandle(ptr);
}

// cudaMemcpy returns before a device-to-device copy is done, and cudaMemset before the memory is
// set: both are queued on the legacy default stream, which is synchronised here so that the
// copy is complete on return whatever the kinds (a background save reads its device staging
// from the engine's own streams right after).
void memcpy_sync(void* dst, const void* src, std::size_t size, const ErrorContext& context) {
  check(cudaMemcpy(dst, src, size, cudaMemcpyDefault), context, "cudaMemcpy");
  check(cudaStreamSynchronize(nullptr), context, "cudaStreamSynchronize after cudaMemcpy");
}
void memset_device(void* dst, int value, std::size_t size, const ErrorContext& context) {
  check(cudaMemset(dst, value, size), context, "cudaMemset");
  check(cudaStreamSynchronize(nullptr), context, "cudaStreamSynchronize after cudaMemset");
}

Stream::Stream(int device, const ErrorContext& context) : device_(device) {
  const DeviceGuard guard(device, context);
  cudaStream_t stream = nullptr;
  // Non-blocking: our copies must not serialise against work on the legacy default stream.
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), context, "cudaStreamCreate");
  handle_ = stream;
}
Stream::~Stream() {
  if (handle_) {
    synchronize_noexcept();
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
  }
}
Stream::Stream(Stream&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)), device_(std::exchange(other.device_, -1)) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Stream old(std::move(*this));
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}
void Stream::copy_to_device_async(void* dst, const void* src, std::size_t size, const ErrorContext& context) {
  check(cudaMemcpyAsync(dst, src, size, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(handle_)), context,
        "cudaMemcpyAsync (host to device)");
}
void Stream::copy_async(void* dst, const void* src, std::size_t size, const ErrorContext& context) {
  check(cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, static_cast<cudaStream_t>(handle_)), context, "cudaMemcpyAsync");
}
void Stream::copy_to_host_async(void* dst, const void* src, std::size_t size, const ErrorContext& context) {
  check(cudaMemcpyAsync(dst, src, size, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(handle_)), context,
        "cudaMemcpyAsync (device to host)");
}
void Stream::synchronize(const ErrorContext& context) {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)), context, "cudaStreamSynchronize");
}
void Stream::synchronize_noexcept() noexcept {
  if (handle_) (void)cudaStreamSynchronize(static_cast<cudaStream_t>(handle_));
}

Event::Event(const ErrorContext& context) {
  cudaEvent_t event = nullptr;
  // BlockingSync: a waiting worker sleeps instead of spinning a core (the runtime's default
  // spin-wait made 16 workers burn every core while the copy engines did the work). Set per
  // event, so the process's own device flags stay the caller's.
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync), context, "cudaEventCreate");
  handle_ = event;
}
Event::~Event() {
  if (handle_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}
Event::Event(Event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    Event old(std::move(*this));
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}
void Event::record(const Stream& stream, const ErrorContext& context) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream.handle())), context,
        "cudaEventRecord");
}
void Event::record(StreamHandle stream, const ErrorContext& context) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(stream)), context, "cudaEventRecord");
}
bool Event::ready(const ErrorContext& context) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (err == cudaErrorNotReady) return false;
  check(err, context, "cudaEventQuery");
  return true;
}
void Event::synchronize(const ErrorContext& context) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)), context, "cudaEventSynchronize");
}

#else  // built without CUDA: every entry point says so.

namespace {
[[noreturn]] void no_cuda(const ErrorContext& context) {
  throw Error(errno_code(ENOTSUP), context, cuda_unavailable_reason());
}
}  // namespace

bool available() noexcept { return false; }
void set_device(int, const ErrorContext& context) { no_cuda(context); }
DeviceGuard::DeviceGuard(int, const ErrorContext& context) { no_cuda(context); }
DeviceGuard::~DeviceGuard() = default;
int current_device() noexcept { return -1; }
void check_device_pointer(const void*, int, const ErrorContext& context) { no_cuda(context); }
void* malloc_device(std::size_t, int, const ErrorContext& context) { no_cuda(context); }
void free_device(void*) noexcept {}
void register_host(void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
void unregister_host(void*) noexcept {}
void register_host_read_only(void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
IpcAllocation ipc_allocation_of(const void*, const ErrorContext& context) { no_cuda(context); }
int device_of_pci_bus_id(const std::string&, const ErrorContext& context) { no_cuda(context); }
std::string pci_bus_id_of(int, const ErrorContext& context) { no_cuda(context); }
std::size_t device_allocation_size(const void*, const ErrorContext& context) { no_cuda(context); }
void* ipc_open(const std::string&, int, const ErrorContext& context) { no_cuda(context); }
void ipc_close(void*) noexcept {}
void ipc_close_when_idle(void*, int) noexcept {}
void memcpy_sync(void*, const void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
void memset_device(void*, int, std::size_t, const ErrorContext& context) { no_cuda(context); }
Stream::Stream(int, const ErrorContext& context) { no_cuda(context); }
Stream::~Stream() = default;
Stream::Stream(Stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)), device_(other.device_) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  handle_ = std::exchange(other.handle_, nullptr);
  device_ = other.device_;
  return *this;
}
void Stream::copy_to_device_async(void*, const void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
void Stream::copy_to_host_async(void*, const void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
void Stream::copy_async(void*, const void*, std::size_t, const ErrorContext& context) { no_cuda(context); }
void Stream::synchronize(const ErrorContext& context) { no_cuda(context); }
void Stream::synchronize_noexcept() noexcept {}
Event::Event(const ErrorContext& context) { no_cuda(context); }
Event::~Event() = default;
Event::Event(Event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
Event& Event::operator=(Event&& other) noexcept {
  handle_ = std::exchange(other.handle_, nullptr);
  return *this;
}
void Event::record(const Stream&, const ErrorContext& context) { no_cuda(context); }
void Event::record(StreamHandle, const ErrorContext& context) { no_cuda(context); }
bool Event::ready(const ErrorContext& context) { no_cuda(context); }
void Event::synchronize(const ErrorContext& context) { no_cuda(context); }

#endif

}  // namespace hbmio::cuda
