#include "shim/cufile_api.hpp"

#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hbmio/config.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "memory/cuda_runtime.hpp"
#include "shim/dl.hpp"

namespace hbmio {
namespace shim {
namespace {

struct ErrorEntry {
  int code;
  const char* name;
  const char* description;
};

// cufile.h keeps its strings in a static inline function we cannot call without its header,
// and libcufile exports no error-string function: hence our own table. The descriptions say what
// the code usually means in practice, which the header's one-liners do not always convey.
constexpr ErrorEntry kErrors[] = {
    {CU_FILE_SUCCESS, "CU_FILE_SUCCESS", "success"},
    {CU_FILE_DRIVER_NOT_INITIALIZED, "CU_FILE_DRIVER_NOT_INITIALIZED",
     "cuFile driver not initialised: nvidia-fs is not loaded and compatibility mode is off, or "
     "cuFileDriverOpen was not called"},
    {CU_FILE_DRIVER_INVALID_PROPS, "CU_FILE_DRIVER_INVALID_PROPS", "invalid driver property"},
    {CU_FILE_DRIVER_UNSUPPORTED_LIMIT, "CU_FILE_DRIVER_UNSUPPORTED_LIMIT", "driver property out of range"},
    {CU_FILE_DRIVER_VERSION_MISMATCH, "CU_FILE_DRIVER_VERSION_MISMATCH",
     "nvidia-fs kernel module and libcufile versions do not match"},
    {CU_FILE_DRIVER_VERSION_READ_ERROR, "CU_FILE_DRIVER_VERSION_READ_ERROR", "could not read the nvidia-fs version"},
    {CU_FILE_DRIVER_CLOSING, "CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"},
    {CU_FILE_PLATFORM_NOT_SUPPORTED, "CU_FILE_PLATFORM_NOT_SUPPORTED", "GPUDirect Storage not supported on this platform"},
    {CU_FILE_IO_NOT_SUPPORTED, "CU_FILE_IO_NOT_SUPPORTED",
     "GPUDirect Storage not supported on this file (file system or device not supported)"},
    {CU_FILE_DEVICE_NOT_SUPPORTED, "CU_FILE_DEVICE_NOT_SUPPORTED", "GPUDirect Storage not supported on this GPU"},
    {CU_FILE_NVFS_DRIVER_ERROR, "CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl failed"},
    {CU_FILE_CUDA_DRIVER_ERROR, "CU_FILE_CUDA_DRIVER_ERROR", "CUDA driver API call failed (see the CUresult)"},
    {CU_FILE_CUDA_POINTER_INVALID, "CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"},
    {CU_FILE_CUDA_MEMORY_TYPE_INVALID, "CU_FILE_CUDA_MEMORY_TYPE_INVALID", "pointer is not of a supported memory type"},
    {CU_FILE_CUDA_POINTER_RANGE_ERROR, "CU_FILE_CUDA_POINTER_RANGE_ERROR",
     "buffer range exceeds the allocation of the device pointer"},
    {CU_FILE_CUDA_CONTEXT_MISMATCH, "CU_FILE_CUDA_CONTEXT_MISMATCH",
     "the current CUDA context is not the one that owns the buffer"},
    {CU_FILE_INVALID_MAPPING_SIZE, "CU_FILE_INVALID_MAPPING_SIZE", "access beyond the maximum pinned size"},
    {CU_FILE_INVALID_MAPPING_RANGE, "CU_FILE_INVALID_MAPPING_RANGE", "access beyond the mapped size"},
    {CU_FILE_INVALID_FILE_TYPE, "CU_FILE_INVALID_FILE_TYPE", "not a regular file (or an unsupported file type)"},
    {CU_FILE_INVALID_FILE_OPEN_FLAG, "CU_FILE_INVALID_FILE_OPEN_FLAG",
     "unsupported file open flags (e.g. no O_DIRECT with compatibility mode off)"},
    {CU_FILE_DIO_NOT_SET, "CU_FILE_DIO_NOT_SET", "file descriptor is not opened with O_DIRECT"},
    {CU_FILE_INVALID_VALUE, "CU_FILE_INVALID_VALUE", "invalid argument"},
    {CU_FILE_MEMORY_ALREADY_REGISTERED, "CU_FILE_MEMORY_ALREADY_REGISTERED", "buffer is already registered"},
    {CU_FILE_MEMORY_NOT_REGISTERED, "CU_FILE_MEMORY_NOT_REGISTERED", "buffer is not registered"},
    {CU_FILE_PERMISSION_DENIED, "CU_FILE_PERMISSION_DENIED", "permission denied by the driver or on the file"},
    {CU_FILE_DRIVER_ALREADY_OPEN, "CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"},
    {CU_FILE_HANDLE_NOT_REGISTERED, "CU_FILE_HANDLE_NOT_REGISTERED",
     "file handle not registered (cuFile refused the descriptor; cufile.log says why)"},
    {CU_FILE_HANDLE_ALREADY_REGISTERED, "CU_FILE_HANDLE_ALREADY_REGISTERED", "file descriptor is already registered"},
    {CU_FILE_DEVICE_NOT_FOUND, "CU_FILE_DEVICE_NOT_FOUND", "GPU not found"},
    {CU_FILE_INTERNAL_ERROR, "CU_FILE_INTERNAL_ERROR", "internal cuFile error"},
    {CU_FILE_GETNEWFD_FAILED, "CU_FILE_GETNEWFD_FAILED", "could not obtain a new file descriptor"},
    {CU_FILE_NVFS_SETUP_ERROR, "CU_FILE_NVFS_SETUP_ERROR",
     "cuFile initialisation failed (CUDA driver not loadable, or nvidia-fs setup failed)"},
    {CU_FILE_IO_DISABLED, "CU_FILE_IO_DISABLED", "GPUDirect Storage disabled by cufile.json for this file"},
    {CU_FILE_BATCH_SUBMIT_FAILED, "CU_FILE_BATCH_SUBMIT_FAILED", "batch submission failed"},
    {CU_FILE_GPU_MEMORY_PINNING_FAILED, "CU_FILE_GPU_MEMORY_PINNING_FAILED",
     "could not pin GPU memory (BAR1 space exhausted?)"},
    {CU_FILE_BATCH_FULL, "CU_FILE_BATCH_FULL", "batch queue is full"},
    {CU_FILE_ASYNC_NOT_SUPPORTED, "CU_FILE_ASYNC_NOT_SUPPORTED", "stream (async) operations not supported"},
    {CU_FILE_INTERNAL_BATCH_SETUP_ERROR, "CU_FILE_INTERNAL_BATCH_SETUP_ERROR", "batch setup internal error; retry later"},
    {CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR, "CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR", "batch submit internal error; retry later"},
    {CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR, "CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
     "batch status internal error; retry later"},
    {CU_FILE_INTERNAL_BATCH_CANCEL_ERROR, "CU_FILE_INTERNAL_BATCH_CANCEL_ERROR", "batch cancel internal error; retry later"},
    {CU_FILE_NOMEM_ERROR, "CU_FILE_NOMEM_ERROR", "out of memory inside cuFile; retry later"},
    {CU_FILE_IO_ERROR, "CU_FILE_IO_ERROR", "I/O error"},
    {CU_FILE_INTERNAL_BUF_REGISTER_ERROR, "CU_FILE_INTERNAL_BUF_REGISTER_ERROR", "internal buffer registration failed"},
    {CU_FILE_HASH_OPR_ERROR, "CU_FILE_HASH_OPR_ERROR", "internal hash table operation failed"},
    {CU_FILE_INVALID_CONTEXT_ERROR, "CU_FILE_INVALID_CONTEXT_ERROR", "invalid CUDA context"},
    {CU_FILE_NVFS_INTERNAL_DRIVER_ERROR, "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR", "nvidia-fs internal driver error"},
    {CU_FILE_BATCH_NOCOMPAT_ERROR, "CU_FILE_BATCH_NOCOMPAT_ERROR", "batch I/O needs compatibility mode, which is off"},
    {CU_FILE_IO_MAX_ERROR, "CU_FILE_IO_MAX_ERROR", "end of the cuFile error range"},
};

const ErrorEntry* find_error(int code) noexcept {
  if (code < 0) code = -code;  // cuFileRead/Write report -code
  for (const ErrorEntry& entry : kErrors)
    if (entry.code == code) return &entry;
  return nullptr;
}

template <class Fn>
Fn symbol(void* handle, const char* name) noexcept {
  // POSIX guarantees a dlsym() result can be converted to a function pointer.
  return reinterpret_cast<Fn>(::dlsym(handle, name));
}

}  // namespace

const char* cufile_error_name(int code) noexcept {
  const ErrorEntry* entry = find_error(code);
  return entry ? entry->name : nullptr;
}

const char* cufile_error_description(int code) noexcept {
  const ErrorEntry* entry = find_error(code);
  return entry ? entry->description : nullptr;
}

std::string describe_cufile_error(CUfileError_t status) {
  std::string text = std::error_code(status.err, cufile_category()).message();
  if (status.err == CU_FILE_CUDA_DRIVER_ERROR) text += fmt::format(" (CUresult {})", status.cu_err);
  return text;
}

// ---------------------------------------------------------------------------------------------

namespace {

// The Python environments this code may belong to, as prefixes holding lib/python3.*/: the one
// whose bin/ holds this program (`pip install .` puts the hbmio command there), the one whose
// site-packages holds this code (the Python extension), and the active virtualenv or conda one.
std::vector<std::string> python_prefixes() {
  std::vector<std::string> prefixes;
  const auto add = [&](std::string prefix) {
    while (prefix.size() > 1 && prefix.back() == '/') prefix.pop_back();
    if (!prefix.empty() && std::find(prefixes.begin(), prefixes.end(), prefix) == prefixes.end()) prefixes.push_back(prefix);
  };
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && exe.parent_path().filename() == "bin") add(exe.parent_path().parent_path().string());
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&python_prefixes), &info) != 0 && info.dli_fname != nullptr) {
    const std::string self = info.dli_fname;
    if (const auto at = self.find("/lib/python3"); at != std::string::npos) add(self.substr(0, at));
  }
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (const char* value = std::getenv(var); value != nullptr && *value) add(value);
  return prefixes;
}

}  // namespace

// One search order for the command line and Python: a Python process often has libcufile loaded
// already (torch loads the nvidia-cufile wheel's copy), which "libcufile.so.0" then finds by its
// name; the hbmio command finds the same wheel through the environment it is installed in.
std::vector<std::string> CufileApi::default_candidates() {
  if (std::string explicit_path = configured_library("HBMIO_CUFILE_LIBRARY"); !explicit_path.empty()) return {explicit_path};
  std::vector<std::string> candidates = {"libcufile.so.0", "/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.0"};
  for (const std::string& prefix : python_prefixes()) {
    // nvidia-cufile wheels: CUDA 13's lay libraries out in nvidia/cu13/lib, CUDA 12's in nvidia/cufile/lib.
    for (const char* layout : {"nvidia/cu13/lib", "nvidia/cufile/lib"}) {
      const std::string pattern = prefix + "/lib/python3*/site-packages/" + layout + "/libcufile.so.0";
      glob_t found{};
      if (::glob(pattern.c_str(), 0, nullptr, &found) == 0)
        for (std::size_t i = 0; i < found.gl_pathc; ++i) candidates.emplace_back(found.gl_pathv[i]);
      ::globfree(&found);
    }
  }
  return candidates;
}

std::unique_ptr<CufileApi> CufileApi::load(const std::vector<std::string>& candidates) {
  std::unique_ptr<CufileApi> api(new CufileApi());
  std::vector<std::string> failures;
  for (const std::string& path : candidates) {
    api->tried_.push_back(path);
    ::dlerror();  // clear any stale message
    // RTLD_NOW: a broken library fails here, not at the first I/O. RTLD_LOCAL: its symbols
    // must not interpose on anyone else's (another copy of libcufile in the process, say).
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failures.push_back(dl_failure(path, ::dlerror()));
      continue;
    }
    std::string missing;
    if (!api->resolve(handle, missing)) {
      failures.push_back(fmt::format("{}: not a usable libcufile (no symbol {})", path, missing));
      ::dlclose(handle);
      continue;
    }
    api->handle_ = handle;
    api->library_path_ = loaded_file(handle, path);
    if (api->get_version) {
      int version = 0;
      if (api->get_version(&version).err == CU_FILE_SUCCESS) api->version_ = version;
    }
    return api;
  }
  api->load_error_ = candidates.empty() ? std::string("libcufile could not be loaded: no paths to try")
                                        : fmt::format("libcufile could not be loaded; tried: {}", fmt::join(failures, "; "));
  return api;
}

bool CufileApi::resolve(void* handle, std::string& missing) {
  // Required: the GDS 1.0 API that every transfer needs.
  driver_open = symbol<PFN_cuFileDriverOpen>(handle, "cuFileDriverOpen");
  // cufile.h maps cuFileDriverClose to cuFileDriverClose_v2 (GDS 1.4); the unversioned one is
  // kept only for old binaries, so prefer _v2 as a compiled caller would.
  driver_close = symbol<PFN_cuFileDriverClose>(handle, "cuFileDriverClose_v2");
  if (driver_close == nullptr) driver_close = symbol<PFN_cuFileDriverClose>(handle, "cuFileDriverClose");
  driver_get_properties = symbol<PFN_cuFileDriverGetProperties>(handle, "cuFileDriverGetProperties");
  driver_set_poll_mode = symbol<PFN_cuFileDriverSetPollMode>(handle, "cuFileDriverSetPollMode");
  driver_set_max_direct_io_size = symbol<PFN_cuFileDriverSetMaxDirectIOSize>(handle, "cuFileDriverSetMaxDirectIOSize");
  driver_set_max_cache_size = symbol<PFN_cuFileDriverSetMaxCacheSize>(handle, "cuFileDriverSetMaxCacheSize");
  driver_set_max_pinned_mem_size = symbol<PFN_cuFileDriverSetMaxPinnedMemSize>(handle, "cuFileDriverSetMaxPinnedMemSize");
  handle_register = symbol<PFN_cuFileHandleRegister>(handle, "cuFileHandleRegister");
  handle_deregister = symbol<PFN_cuFileHandleDeregister>(handle, "cuFileHandleDeregister");
  buf_register = symbol<PFN_cuFileBufRegister>(handle, "cuFileBufRegister");
  buf_deregister = symbol<PFN_cuFileBufDeregister>(handle, "cuFileBufDeregister");
  read = symbol<PFN_cuFileRead>(handle, "cuFileRead");
  write = symbol<PFN_cuFileWrite>(handle, "cuFileWrite");

  // Optional: newer than GDS 1.0; callers check for null.
  batch_io_set_up = symbol<PFN_cuFileBatchIOSetUp>(handle, "cuFileBatchIOSetUp");
  batch_io_submit = symbol<PFN_cuFileBatchIOSubmit>(handle, "cuFileBatchIOSubmit");
  batch_io_get_status = symbol<PFN_cuFileBatchIOGetStatus>(handle, "cuFileBatchIOGetStatus");
  batch_io_cancel = symbol<PFN_cuFileBatchIOCancel>(handle, "cuFileBatchIOCancel");
  batch_io_destroy = symbol<PFN_cuFileBatchIODestroy>(handle, "cuFileBatchIODestroy");
  use_count = symbol<PFN_cuFileUseCount>(handle, "cuFileUseCount");
  read_async = symbol<PFN_cuFileReadAsync>(handle, "cuFileReadAsync");
  write_async = symbol<PFN_cuFileWriteAsync>(handle, "cuFileWriteAsync");
  stream_register = symbol<PFN_cuFileStreamRegister>(handle, "cuFileStreamRegister");
  stream_deregister = symbol<PFN_cuFileStreamDeregister>(handle, "cuFileStreamDeregister");
  get_version = symbol<PFN_cuFileGetVersion>(handle, "cuFileGetVersion");
  get_parameter_size_t = symbol<PFN_cuFileGetParameterSizeT>(handle, "cuFileGetParameterSizeT");
  get_parameter_bool = symbol<PFN_cuFileGetParameterBool>(handle, "cuFileGetParameterBool");
  get_parameter_string = symbol<PFN_cuFileGetParameterString>(handle, "cuFileGetParameterString");
  set_parameter_size_t = symbol<PFN_cuFileSetParameterSizeT>(handle, "cuFileSetParameterSizeT");
  set_parameter_bool = symbol<PFN_cuFileSetParameterBool>(handle, "cuFileSetParameterBool");
  set_parameter_string = symbol<PFN_cuFileSetParameterString>(handle, "cuFileSetParameterString");

  const std::pair<const char*, bool> required[] = {
      {"cuFileDriverOpen", driver_open != nullptr},
      {"cuFileDriverClose_v2/cuFileDriverClose", driver_close != nullptr},
      {"cuFileDriverGetProperties", driver_get_properties != nullptr},
      {"cuFileHandleRegister", handle_register != nullptr},
      {"cuFileHandleDeregister", handle_deregister != nullptr},
      {"cuFileBufRegister", buf_register != nullptr},
      {"cuFileBufDeregister", buf_deregister != nullptr},
      {"cuFileRead", read != nullptr},
      {"cuFileWrite", write != nullptr},
  };
  for (const auto& [name, present] : required) {
    if (!present) {
      missing = name;
      return false;
    }
  }
  return true;
}

CufileApi::~CufileApi() {
  if (handle_ != nullptr) ::dlclose(handle_);
}

CufileApi& CufileApi::instance() {
  // Created once (a function-local static is initialised thread-safely) and never destroyed:
  // the driver session keeps libcufile in use until the process ends (see DriverSession), so
  // unloading it from a static destructor could pull the code out from under its own atexit
  // handlers.
  static CufileApi* const api = load(default_candidates()).release();
  return *api;
}

std::string CufileApi::version_string() const {
  if (version_ <= 0) return "unknown (before GDS 1.8)";
  return fmt::format("{}.{}", version_ / 1000, (version_ % 1000) / 10);
}

// ---------------------------------------------------------------------------------------------

CUfileError_t FileHandle::register_fd(const CufileApi& api, int fd, FileHandle& out) noexcept {
  out.reset();
  if (!api.loaded()) return {CU_FILE_DRIVER_NOT_INITIALIZED, 0};
  CUfileDescr_t descr{};
  descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
  descr.handle.fd = fd;
  descr.fs_ops = nullptr;  // required for OPAQUE_FD: cuFile discovers the file system itself
  CUfileHandle_t handle = nullptr;
  const CUfileError_t status = api.handle_register(&handle, &descr);
  if (status.err == CU_FILE_SUCCESS) {
    out.api_ = &api;
    out.handle_ = handle;
  }
  return status;
}

FileHandle& FileHandle::operator=(FileHandle&& other) noexcept {
  if (this != &other) {
    reset();
    api_ = other.api_;
    handle_ = other.handle_;
    other.handle_ = nullptr;
  }
  return *this;
}

void FileHandle::reset() noexcept {
  if (handle_ != nullptr && api_ != nullptr) api_->handle_deregister(handle_);
  handle_ = nullptr;
}

// ---------------------------------------------------------------------------------------------

const DriverSession& DriverSession::acquire(int device) noexcept {
  // Leaked on purpose, like CufileApi::instance(): see the class comment for why the driver is
  // never closed.
  static const DriverSession* const session = new DriverSession(device);
  return *session;
}

DriverSession::DriverSession(int device) : api_(&CufileApi::instance()) {
  try {
    // Collect every blocking problem, not just the first: "no library" and "no GPU" are
    // separate fixes, and the caller should learn both at once.
    std::vector<std::string> problems;
    if (!api_->loaded()) {
      error_ = errno_code(ENOENT);
      problems.push_back(api_->load_error() + (!configured_library("HBMIO_CUFILE_LIBRARY").empty()
                                                   ? " (the path given by HBMIO_CUFILE_LIBRARY)"
                                                   : " (set HBMIO_CUFILE_LIBRARY to the path of libcufile.so.0)"));
    }
    if (!cuda::available()) {
      if (!error_) error_ = errno_code(ENODEV);
      const std::string why = cuda_unavailable_reason();
      // cuda_unavailable_reason() usually says "no CUDA device (...)" itself.
      problems.push_back(why.empty()                              ? std::string("no CUDA device")
                         : why.rfind("no CUDA device", 0) == 0 ? why
                                                                 : "no CUDA device: " + why);
    }
    if (!problems.empty()) {
      reason_ = fmt::format("{}", fmt::join(problems, "; "));
      return;
    }

    // cuFileDriverOpen initialises per-GPU state through the CUDA driver and needs a current
    // context: the caller's if it has one, else the requested device's primary context, made
    // current for the open only.
    std::optional<cuda::DeviceGuard> guard;
    try {
      if (cuda::current_device() < 0)
        guard.emplace(device >= 0 ? device : 0,
                      ErrorContext{.op = "open cuFile driver", .path = {}, .offset = 0, .length = 0, .backend = "cufile"});
    } catch (const Error& e) {
      error_ = e.code();
      reason_ = std::string("no CUDA device usable for cuFile: ") + e.what();
      return;
    }

    const CUfileError_t status = api_->driver_open();
    // DRIVER_ALREADY_OPEN: someone else in the process (another library) opened it; cuFile
    // reference-counts opens, so it is as good as ours.
    if (status.err != CU_FILE_SUCCESS && status.err != CU_FILE_DRIVER_ALREADY_OPEN) {
      error_ = std::error_code(status.err, cufile_category());
      reason_ = fmt::format(
          "cuFileDriverOpen failed: {} (library {} {}; run with CUFILE_LOGGING_LEVEL=TRACE and read cufile.log, "
          "written to the working directory unless cufile.json sets logging.dir)",
          describe_cufile_error(status), api_->library_path(), api_->version_string());
      return;
    }
    open_ = true;

    has_properties_ = api_->driver_get_properties(&properties_).err == CU_FILE_SUCCESS;
    // P2PDMA (GDS 1.13+, no nvidia-fs): the driver sets CU_FILE_NVME_P2P_SUPPORTED when the
    // kernel and GPU module allow it; where the parameter API exists, use_pci_p2pdma must also
    // be on in cufile.json, or cuFile will not use the path even though it could.
    const bool p2p_capable =
        has_properties_ && (properties_.nvfs.dstatusflags & (1u << CU_FILE_NVME_P2P_SUPPORTED)) != 0;
    bool p2p_enabled = true;
    if (api_->get_parameter_bool) {
      bool value = false;
      p2p_enabled = api_->get_parameter_bool(CUFILE_PARAM_USE_PCIP2PDMA, &value).err == CU_FILE_SUCCESS && value;
    }
    p2pdma_ = p2p_capable && p2p_enabled;
  } catch (const std::exception& e) {
    open_ = false;
    if (!error_) error_ = errno_code(ENOTSUP);
    reason_ = std::string("cuFile setup failed: ") + e.what();
  }
}

bool DriverSession::nvidia_fs() const noexcept {
  return has_properties_ && (properties_.nvfs.major_version != 0 || properties_.nvfs.minor_version != 0);
}

bool DriverSession::allow_compat_mode() const noexcept {
  return has_properties_ && (properties_.nvfs.dcontrolflags & (1u << CU_FILE_ALLOW_COMPAT_MODE)) != 0;
}

std::string DriverSession::nvidia_fs_version() const {
  return fmt::format("{}.{}", properties_.nvfs.major_version, properties_.nvfs.minor_version);
}

}  // namespace shim

// ---------------------------------------------------------------------------------------------

namespace {

class CufileCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "cufile"; }

  // "CU_FILE_HANDLE_NOT_REGISTERED (5027): ..."; codes below 5000 are errno values (cuFileRead
  // and cuFileWrite return -errno for system errors).
  std::string message(int code) const override {
    const int magnitude = code < 0 ? -code : code;
    if (magnitude != 0 && magnitude < shim::kCufileOpBaseError) return std::generic_category().message(magnitude);  // strerror, thread-safe
    const char* name = shim::cufile_error_name(magnitude);
    if (name == nullptr) return fmt::format("unknown cuFile error ({})", magnitude);
    return fmt::format("{} ({}): {}", name, magnitude, shim::cufile_error_description(magnitude));
  }

  // errno values compare equal to std::errc; a few cuFile codes have an obvious errno twin.
  std::error_condition default_error_condition(int code) const noexcept override {
    const int magnitude = code < 0 ? -code : code;
    if (magnitude != 0 && magnitude < shim::kCufileOpBaseError) return {magnitude, std::generic_category()};
    switch (magnitude) {
      case shim::CU_FILE_INVALID_VALUE: return std::errc::invalid_argument;
      case shim::CU_FILE_PERMISSION_DENIED: return std::errc::permission_denied;
      case shim::CU_FILE_NOMEM_ERROR: return std::errc::not_enough_memory;
      case shim::CU_FILE_IO_ERROR: return std::errc::io_error;
      case shim::CU_FILE_IO_NOT_SUPPORTED:
      case shim::CU_FILE_PLATFORM_NOT_SUPPORTED:
      case shim::CU_FILE_DEVICE_NOT_SUPPORTED: return std::errc::not_supported;
      default: return {code, *this};
    }
  }
};

}  // namespace

const std::error_category& cufile_category() noexcept {
  static const CufileCategory category;
  return category;
}

}  // namespace hbmio
