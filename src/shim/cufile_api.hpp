// hbmio's own declarations of the cuFile C ABI (GPUDirect Storage), and the run-time loader.
//
// Why our own declarations: libcufile is optional. It is loaded with dlopen() at first use, so
// hbmio builds and runs where neither cufile.h nor libcufile.so exists, and one binary works
// with whichever libcufile the host has. The layouts below follow the documented ABI (x86-64,
// cufile.h of GDS 1.15 / CUDA 13.0); tests/cufile_abi_test.cpp checks every size, offset and
// enum value against the real header wherever one is installed.
//
// Names mirror cufile.h inside namespace hbmio::shim, so the NVIDIA documentation reads
// directly onto this code. Macros of cufile.h (CUFILEOP_BASE_ERR, CU_FILE_RDMA_REGISTER,
// cuFileDriverClose, ...) are deliberately NOT reused as names here: a translation unit that
// includes both headers would otherwise have our names rewritten by the preprocessor.
#pragma once

#include <sys/types.h>  // off_t, ssize_t

#include <cstddef>
#include <ctime>  // timespec
#include <memory>
#include <string>
#include <system_error>
#include <vector>

// The CUDA driver's stream type, declared exactly as cuda.h does (`typedef struct CUstream_st*
// CUstream`), at global scope, so that our stream-API signatures are the very same types.
struct CUstream_st;

namespace hbmio::shim {

// ---------------------------------------------------------------------------------------------
// Error codes
// ---------------------------------------------------------------------------------------------

// Codes above this are cuFile's own (CUfileOpError); below are errno values. cuFileRead/Write
// return -code for both kinds.
inline constexpr int kCufileOpBaseError = 5000;

enum CUfileOpError : int {
  CU_FILE_SUCCESS = 0,
  CU_FILE_DRIVER_NOT_INITIALIZED = 5001,
  CU_FILE_DRIVER_INVALID_PROPS = 5002,
  CU_FILE_DRIVER_UNSUPPORTED_LIMIT = 5003,
  CU_FILE_DRIVER_VERSION_MISMATCH = 5004,
  CU_FILE_DRIVER_VERSION_READ_ERROR = 5005,
  CU_FILE_DRIVER_CLOSING = 5006,
  CU_FILE_PLATFORM_NOT_SUPPORTED = 5007,
  CU_FILE_IO_NOT_SUPPORTED = 5008,
  CU_FILE_DEVICE_NOT_SUPPORTED = 5009,
  CU_FILE_NVFS_DRIVER_ERROR = 5010,
  CU_FILE_CUDA_DRIVER_ERROR = 5011,
  CU_FILE_CUDA_POINTER_INVALID = 5012,
  CU_FILE_CUDA_MEMORY_TYPE_INVALID = 5013,
  CU_FILE_CUDA_POINTER_RANGE_ERROR = 5014,
  CU_FILE_CUDA_CONTEXT_MISMATCH = 5015,
  CU_FILE_INVALID_MAPPING_SIZE = 5016,
  CU_FILE_INVALID_MAPPING_RANGE = 5017,
  CU_FILE_INVALID_FILE_TYPE = 5018,
  CU_FILE_INVALID_FILE_OPEN_FLAG = 5019,
  CU_FILE_DIO_NOT_SET = 5020,
  // 5021 is not used by any released header.
  CU_FILE_INVALID_VALUE = 5022,
  CU_FILE_MEMORY_ALREADY_REGISTERED = 5023,
  CU_FILE_MEMORY_NOT_REGISTERED = 5024,
  CU_FILE_PERMISSION_DENIED = 5025,
  CU_FILE_DRIVER_ALREADY_OPEN = 5026,
  CU_FILE_HANDLE_NOT_REGISTERED = 5027,
  CU_FILE_HANDLE_ALREADY_REGISTERED = 5028,
  CU_FILE_DEVICE_NOT_FOUND = 5029,
  CU_FILE_INTERNAL_ERROR = 5030,
  CU_FILE_GETNEWFD_FAILED = 5031,
  // 5032 is not used by any released header.
  CU_FILE_NVFS_SETUP_ERROR = 5033,
  CU_FILE_IO_DISABLED = 5034,
  CU_FILE_BATCH_SUBMIT_FAILED = 5035,
  CU_FILE_GPU_MEMORY_PINNING_FAILED = 5036,
  CU_FILE_BATCH_FULL = 5037,
  CU_FILE_ASYNC_NOT_SUPPORTED = 5038,
  CU_FILE_INTERNAL_BATCH_SETUP_ERROR = 5039,
  CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR = 5040,
  CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR = 5041,
  CU_FILE_INTERNAL_BATCH_CANCEL_ERROR = 5042,
  CU_FILE_NOMEM_ERROR = 5043,
  CU_FILE_IO_ERROR = 5044,
  CU_FILE_INTERNAL_BUF_REGISTER_ERROR = 5045,
  CU_FILE_HASH_OPR_ERROR = 5046,
  CU_FILE_INVALID_CONTEXT_ERROR = 5047,
  CU_FILE_NVFS_INTERNAL_DRIVER_ERROR = 5048,
  CU_FILE_BATCH_NOCOMPAT_ERROR = 5049,
  CU_FILE_IO_MAX_ERROR = 5050,  // sentinel in cufile.h (1.15), not returned by calls
};

// What every cuFile call except the data path returns. `cu_err` is a CUresult and is meaningful
// only when err == CU_FILE_CUDA_DRIVER_ERROR.
struct CUfileError_t {
  CUfileOpError err;
  int cu_err;
};

// "CU_FILE_HANDLE_NOT_REGISTERED" for 5027 (a negative code is read as its magnitude, as
// cuFileRead/Write return them); nullptr for a code that is not a CUfileOpError.
const char* cufile_error_name(int code) noexcept;
// A short explanation of a CUfileOpError in our words; nullptr where none is known.
const char* cufile_error_description(int code) noexcept;
// "CU_FILE_CUDA_DRIVER_ERROR (5011): ... (CUresult 201)": for messages.
std::string describe_cufile_error(CUfileError_t status);

// ---------------------------------------------------------------------------------------------
// Driver properties
// ---------------------------------------------------------------------------------------------

// Bit numbers in CUfileDrvProps_t::nvfs.dstatusflags: back ends the driver supports.
enum CUfileDriverStatusFlags_t : int {
  CU_FILE_LUSTRE_SUPPORTED = 0,
  CU_FILE_WEKAFS_SUPPORTED = 1,
  CU_FILE_NFS_SUPPORTED = 2,
  CU_FILE_GPFS_SUPPORTED = 3,
  CU_FILE_NVME_SUPPORTED = 4,
  CU_FILE_NVMEOF_SUPPORTED = 5,
  CU_FILE_SCSI_SUPPORTED = 6,
  CU_FILE_SCALEFLUX_CSD_SUPPORTED = 7,
  CU_FILE_NVMESH_SUPPORTED = 8,
  CU_FILE_BEEGFS_SUPPORTED = 9,
  // 10 is reserved (YRCloudFile).
  CU_FILE_NVME_P2P_SUPPORTED = 11,  // NVMe through PCI P2PDMA, without nvidia-fs
  CU_FILE_SCATEFS_SUPPORTED = 12,
};

// Bit numbers in CUfileDrvProps_t::nvfs.dcontrolflags.
enum CUfileDriverControlFlags_t : int {
  CU_FILE_USE_POLL_MODE = 0,      // properties.use_poll_mode
  CU_FILE_ALLOW_COMPAT_MODE = 1,  // properties.allow_compat_mode
};

// Bit numbers in CUfileDrvProps_t::fflags.
enum CUfileFeatureFlags_t : int {
  CU_FILE_DYN_ROUTING_SUPPORTED = 0,
  CU_FILE_BATCH_IO_SUPPORTED = 1,
  CU_FILE_STREAMS_SUPPORTED = 2,
  CU_FILE_PARALLEL_IO_SUPPORTED = 3,
};

struct CUfileDrvProps_t {
  struct Nvfs {  // anonymous in cufile.h; named here so it can be spelled
    unsigned int major_version;  // nvidia-fs kernel module version; 0.0 when it is not loaded
    unsigned int minor_version;
    std::size_t poll_thresh_size;    // KiB
    std::size_t max_direct_io_size;  // KiB
    unsigned int dstatusflags;       // bits: CUfileDriverStatusFlags_t
    unsigned int dcontrolflags;      // bits: CUfileDriverControlFlags_t
  } nvfs;
  unsigned int fflags;  // bits: CUfileFeatureFlags_t
  unsigned int max_device_cache_size;
  unsigned int per_buffer_cache_size;
  unsigned int max_device_pinned_mem_size;
  unsigned int max_batch_io_size;
  unsigned int max_batch_io_timeout_msecs;
};

// cuFileBufRegister flags (CU_FILE_RDMA_REGISTER, CU_FILE_RDMA_RELAXED_ORDERING in cufile.h).
inline constexpr int kBufRegisterRdma = 1;
inline constexpr int kBufRegisterRdmaRelaxedOrdering = 1 << 1;

// cuFileStreamRegister flags (CU_FILE_STREAM_* in cufile.h).
inline constexpr unsigned kStreamFixedBufOffset = 1;
inline constexpr unsigned kStreamFixedFileOffset = 2;
inline constexpr unsigned kStreamFixedFileSize = 4;
inline constexpr unsigned kStreamPageAlignedInputs = 8;

// ---------------------------------------------------------------------------------------------
// File handles
// ---------------------------------------------------------------------------------------------

enum CUfileFileHandleType : int {
  CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1,     // a Linux file descriptor
  CU_FILE_HANDLE_TYPE_OPAQUE_WIN32 = 2,  // unsupported
  CU_FILE_HANDLE_TYPE_USERSPACE_FS = 3,
};

// The user-space file system hook table (CUfileFSOps_t) is never used by hbmio: it is opaque.
struct CUfileFSOps_t;

struct CUfileDescr_t {
  CUfileFileHandleType type;
  union {
    int fd;
    void* handle;
  } handle;
  const CUfileFSOps_t* fs_ops;  // must be null for OPAQUE_FD
};

using CUfileHandle_t = void*;

// ---------------------------------------------------------------------------------------------
// Batch API (GDS 1.2+)
// ---------------------------------------------------------------------------------------------

enum CUfileOpcode_t : int { CUFILE_READ = 0, CUFILE_WRITE = 1 };

enum CUfileStatus_t : int {
  CUFILE_WAITING = 0x01,
  CUFILE_PENDING = 0x02,
  CUFILE_INVALID = 0x04,
  CUFILE_CANCELED = 0x08,
  CUFILE_COMPLETE = 0x10,
  CUFILE_TIMEOUT = 0x20,
  CUFILE_FAILED = 0x40,
};

enum CUfileBatchMode_t : int { CUFILE_BATCH = 1 };

struct CUfileIOParams_t {
  CUfileBatchMode_t mode;  // must be the first field
  union {
    struct {
      void* devPtr_base;  // device or host pointer
      off_t file_offset;
      off_t devPtr_offset;
      std::size_t size;
    } batch;
  } u;
  CUfileHandle_t fh;
  CUfileOpcode_t opcode;
  void* cookie;
};

struct CUfileIOEvents_t {
  void* cookie;
  CUfileStatus_t status;
  std::size_t ret;  // bytes done, or a negative error stored in a size_t
};

using CUfileBatchHandle_t = void*;

// ---------------------------------------------------------------------------------------------
// Configuration parameters (GDS 1.14+)
// ---------------------------------------------------------------------------------------------

enum CUFileSizeTConfigParameter_t : int {
  CUFILE_PARAM_PROFILE_STATS,
  CUFILE_PARAM_EXECUTION_MAX_IO_QUEUE_DEPTH,
  CUFILE_PARAM_EXECUTION_MAX_IO_THREADS,
  CUFILE_PARAM_EXECUTION_MIN_IO_THRESHOLD_SIZE_KB,
  CUFILE_PARAM_EXECUTION_MAX_REQUEST_PARALLELISM,
  CUFILE_PARAM_PROPERTIES_MAX_DIRECT_IO_SIZE_KB,
  CUFILE_PARAM_PROPERTIES_MAX_DEVICE_CACHE_SIZE_KB,
  CUFILE_PARAM_PROPERTIES_PER_BUFFER_CACHE_SIZE_KB,
  CUFILE_PARAM_PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB,
  CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE,
  CUFILE_PARAM_POLLTHRESHOLD_SIZE_KB,
  CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS,
};

enum CUFileBoolConfigParameter_t : int {
  CUFILE_PARAM_PROPERTIES_USE_POLL_MODE,
  CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE,
  CUFILE_PARAM_FORCE_COMPAT_MODE,
  CUFILE_PARAM_FS_MISC_API_CHECK_AGGRESSIVE,
  CUFILE_PARAM_EXECUTION_PARALLEL_IO,
  CUFILE_PARAM_PROFILE_NVTX,
  CUFILE_PARAM_PROPERTIES_ALLOW_SYSTEM_MEMORY,
  CUFILE_PARAM_USE_PCIP2PDMA,
  CUFILE_PARAM_PREFER_IO_URING,
  CUFILE_PARAM_FORCE_ODIRECT_MODE,
  CUFILE_PARAM_SKIP_TOPOLOGY_DETECTION,
  CUFILE_PARAM_STREAM_MEMOPS_BYPASS,
};

enum CUFileStringConfigParameter_t : int {
  CUFILE_PARAM_LOGGING_LEVEL,
  CUFILE_PARAM_ENV_LOGFILE_PATH,
  CUFILE_PARAM_LOG_DIR,
};

// ---------------------------------------------------------------------------------------------
// Function signatures (PFN_ like CUDA's own cudaTypedefs.h)
// ---------------------------------------------------------------------------------------------

using CUstream = ::CUstream_st*;

// GDS 1.0
using PFN_cuFileDriverOpen = CUfileError_t (*)();
using PFN_cuFileDriverClose = CUfileError_t (*)();  // cuFileDriverClose_v2 has the same signature
using PFN_cuFileDriverGetProperties = CUfileError_t (*)(CUfileDrvProps_t*);
using PFN_cuFileDriverSetPollMode = CUfileError_t (*)(bool, std::size_t);
using PFN_cuFileDriverSetMaxDirectIOSize = CUfileError_t (*)(std::size_t);
using PFN_cuFileDriverSetMaxCacheSize = CUfileError_t (*)(std::size_t);
using PFN_cuFileDriverSetMaxPinnedMemSize = CUfileError_t (*)(std::size_t);
using PFN_cuFileHandleRegister = CUfileError_t (*)(CUfileHandle_t*, CUfileDescr_t*);
using PFN_cuFileHandleDeregister = void (*)(CUfileHandle_t);
using PFN_cuFileBufRegister = CUfileError_t (*)(const void*, std::size_t, int);
using PFN_cuFileBufDeregister = CUfileError_t (*)(const void*);
using PFN_cuFileRead = ssize_t (*)(CUfileHandle_t, void*, std::size_t, off_t, off_t);
using PFN_cuFileWrite = ssize_t (*)(CUfileHandle_t, const void*, std::size_t, off_t, off_t);
// GDS 1.2
using PFN_cuFileBatchIOSetUp = CUfileError_t (*)(CUfileBatchHandle_t*, unsigned);
using PFN_cuFileBatchIOSubmit = CUfileError_t (*)(CUfileBatchHandle_t, unsigned, CUfileIOParams_t*, unsigned);
using PFN_cuFileBatchIOGetStatus = CUfileError_t (*)(CUfileBatchHandle_t, unsigned, unsigned*, CUfileIOEvents_t*,
                                                     struct ::timespec*);
using PFN_cuFileBatchIOCancel = CUfileError_t (*)(CUfileBatchHandle_t);
using PFN_cuFileBatchIODestroy = void (*)(CUfileBatchHandle_t);
// GDS 1.4
using PFN_cuFileUseCount = long (*)();
// GDS 1.7
using PFN_cuFileReadAsync = CUfileError_t (*)(CUfileHandle_t, void*, std::size_t*, off_t*, off_t*, ssize_t*, CUstream);
using PFN_cuFileWriteAsync = CUfileError_t (*)(CUfileHandle_t, void*, std::size_t*, off_t*, off_t*, ssize_t*, CUstream);
using PFN_cuFileStreamRegister = CUfileError_t (*)(CUstream, unsigned);
using PFN_cuFileStreamDeregister = CUfileError_t (*)(CUstream);
// GDS 1.8
using PFN_cuFileGetVersion = CUfileError_t (*)(int*);
// GDS 1.14
using PFN_cuFileGetParameterSizeT = CUfileError_t (*)(CUFileSizeTConfigParameter_t, std::size_t*);
using PFN_cuFileGetParameterBool = CUfileError_t (*)(CUFileBoolConfigParameter_t, bool*);
using PFN_cuFileGetParameterString = CUfileError_t (*)(CUFileStringConfigParameter_t, char*, int);
using PFN_cuFileSetParameterSizeT = CUfileError_t (*)(CUFileSizeTConfigParameter_t, std::size_t);
using PFN_cuFileSetParameterBool = CUfileError_t (*)(CUFileBoolConfigParameter_t, bool);
using PFN_cuFileSetParameterString = CUfileError_t (*)(CUFileStringConfigParameter_t, const char*);

// ---------------------------------------------------------------------------------------------
// The loaded library
// ---------------------------------------------------------------------------------------------

// libcufile, opened with dlopen(RTLD_NOW | RTLD_LOCAL), and its entry points.
//
// Required entry points (GDS 1.0) are non-null whenever loaded() is true; the others are null
// where the library predates them. Thread-safety: immutable after construction; the cuFile
// calls themselves are thread-safe per NVIDIA's documentation.
class CufileApi {
 public:
  // Where instance() looks: HBMIO_CUFILE_LIBRARY alone when it is set (an explicit choice that
  // fails must say so instead of silently loading another copy); otherwise "libcufile.so.0" (the
  // loader's search path, and a copy the process has loaded already), the CUDA toolkit's x86-64
  // target directory, and then an nvidia-cufile wheel in the Python environment this program or
  // library is installed in (or $VIRTUAL_ENV, $CONDA_PREFIX).
  static std::vector<std::string> default_candidates();

  // Loads the first of `candidates` that dlopen accepts and that has every required entry
  // point. Never throws for a missing library: the result says loaded() == false and
  // load_error() tells every path tried and why it failed. Tests call this directly (instance()
  // decides once per process).
  static std::unique_ptr<CufileApi> load(const std::vector<std::string>& candidates);

  // The process-wide library, loaded from default_candidates() on first use (thread-safe).
  // Never unloaded: see the comment in cufile_api.cpp.
  static CufileApi& instance();

  ~CufileApi();  // dlclose (the instance() object is never destroyed)
  CufileApi(const CufileApi&) = delete;
  CufileApi& operator=(const CufileApi&) = delete;

  bool loaded() const noexcept { return handle_ != nullptr; }
  const std::string& load_error() const noexcept { return load_error_; }  // empty when loaded
  const std::vector<std::string>& tried() const noexcept { return tried_; }
  const std::string& library_path() const noexcept { return library_path_; }  // resolved file
  // cuFileGetVersion(): major * 1000 + minor * 10 (1150 = 1.15); 0 when the library lacks it.
  int version() const noexcept { return version_; }
  std::string version_string() const;  // "1.15", or "unknown (before GDS 1.8)"

  // Entry points.
  PFN_cuFileDriverOpen driver_open = nullptr;
  PFN_cuFileDriverClose driver_close = nullptr;  // cuFileDriverClose_v2 where present
  PFN_cuFileDriverGetProperties driver_get_properties = nullptr;
  PFN_cuFileDriverSetPollMode driver_set_poll_mode = nullptr;
  PFN_cuFileDriverSetMaxDirectIOSize driver_set_max_direct_io_size = nullptr;
  PFN_cuFileDriverSetMaxCacheSize driver_set_max_cache_size = nullptr;
  PFN_cuFileDriverSetMaxPinnedMemSize driver_set_max_pinned_mem_size = nullptr;
  PFN_cuFileHandleRegister handle_register = nullptr;
  PFN_cuFileHandleDeregister handle_deregister = nullptr;
  PFN_cuFileBufRegister buf_register = nullptr;
  PFN_cuFileBufDeregister buf_deregister = nullptr;
  PFN_cuFileRead read = nullptr;
  PFN_cuFileWrite write = nullptr;
  // Optional.
  PFN_cuFileBatchIOSetUp batch_io_set_up = nullptr;
  PFN_cuFileBatchIOSubmit batch_io_submit = nullptr;
  PFN_cuFileBatchIOGetStatus batch_io_get_status = nullptr;
  PFN_cuFileBatchIOCancel batch_io_cancel = nullptr;
  PFN_cuFileBatchIODestroy batch_io_destroy = nullptr;
  PFN_cuFileUseCount use_count = nullptr;
  PFN_cuFileReadAsync read_async = nullptr;
  PFN_cuFileWriteAsync write_async = nullptr;
  PFN_cuFileStreamRegister stream_register = nullptr;
  PFN_cuFileStreamDeregister stream_deregister = nullptr;
  PFN_cuFileGetVersion get_version = nullptr;
  PFN_cuFileGetParameterSizeT get_parameter_size_t = nullptr;
  PFN_cuFileGetParameterBool get_parameter_bool = nullptr;
  PFN_cuFileGetParameterString get_parameter_string = nullptr;
  PFN_cuFileSetParameterSizeT set_parameter_size_t = nullptr;
  PFN_cuFileSetParameterBool set_parameter_bool = nullptr;
  PFN_cuFileSetParameterString set_parameter_string = nullptr;

 private:
  CufileApi() = default;
  bool resolve(void* handle, std::string& missing);  // fills the entry points from `handle`

  void* handle_ = nullptr;
  std::string load_error_;
  std::vector<std::string> tried_;
  std::string library_path_;
  int version_ = 0;
};

// A registered cuFile file handle: cuFileHandleDeregister on destruction. Move-only.
class FileHandle {
 public:
  FileHandle() = default;
  // Registers `fd` (an OPAQUE_FD descriptor). On failure returns the status and leaves `out`
  // empty; nothing to clean up.
  static CUfileError_t register_fd(const CufileApi& api, int fd, FileHandle& out) noexcept;
  ~FileHandle() { reset(); }
  FileHandle(FileHandle&& other) noexcept : api_(other.api_), handle_(other.handle_) { other.handle_ = nullptr; }
  FileHandle& operator=(FileHandle&& other) noexcept;
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;

  CUfileHandle_t get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  void reset() noexcept;

 private:
  const CufileApi* api_ = nullptr;
  CUfileHandle_t handle_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// The driver session
// ---------------------------------------------------------------------------------------------

// cuFileDriverOpen, done once per process and kept open until the process ends.
//
// Why never closed: closing from a static destructor or atexit handler runs after (or while)
// the CUDA runtime tears down its contexts, and cuFileDriverClose unpins GPU memory through
// those contexts; that ordering is not under our control and crashes or hangs at exit. The OS
// reclaims everything at process exit, and libcufile cleans up its own state then.
//
// Why failures are remembered: a failed open is not transient (no device, no library, bad
// cufile.json); retrying per request would repeat a slow initialisation and flood cufile.log.
class DriverSession {
 public:
  // The session, opening the driver on the first call (thread-safe). Never throws; check ok().
  // cuFileDriverOpen needs a current CUDA context: the caller's, when its thread has one;
  // otherwise `device` (the GPU the first request is for; 0 when unknown) is made current for
  // the open and the thread left as it was, so no process gets a context on a GPU it never used.
  static const DriverSession& acquire(int device = -1) noexcept;

  bool ok() const noexcept { return open_; }
  // Why the driver is not open: cufile_category() for a cuFile status, generic (ENOENT for a
  // missing library, ENODEV for no CUDA device) otherwise. Empty when ok().
  std::error_code error() const noexcept { return error_; }
  const std::string& reason() const noexcept { return reason_; }

  const CufileApi& api() const noexcept { return *api_; }
  bool has_properties() const noexcept { return has_properties_; }
  const CUfileDrvProps_t& properties() const noexcept { return properties_; }

  // Driver-wide capabilities, from the properties (and cuFileGetParameterBool where present).
  bool nvidia_fs() const noexcept;  // nvidia-fs kernel module present (version non-zero)
  bool pci_p2pdma() const noexcept { return p2pdma_; }
  bool allow_compat_mode() const noexcept;
  std::string nvidia_fs_version() const;  // "2.26"

 private:
  explicit DriverSession(int device);
  const CufileApi* api_ = nullptr;
  bool open_ = false;
  std::error_code error_;
  std::string reason_;
  bool has_properties_ = false;
  CUfileDrvProps_t properties_{};
  bool p2pdma_ = false;
};

}  // namespace hbmio::shim
