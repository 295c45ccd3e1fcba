// Compile-time check that hbmio's own cuFile declarations (src/shim/cufile_api.hpp) match the
// real cufile.h: every size, member offset, enum value and entry-point signature. The shim is
// what libcufile is called through, so a mismatch here would be silent memory corruption at run
// time. If this file compiles, the ABI matches; main() then checks the error-name table.
//
// Built only where a cufile.h is found (CUDA toolkit or the nvidia-cufile wheel): see
// tests/cufile_tests.cmake.

// The shim first: cufile.h defines macros (cuFileDriverClose, CU_FILE_RDMA_REGISTER, ...) that
// must not reach our declarations; the shim avoids those names, and this order proves it.
#include "shim/cufile_api.hpp"

#include <cufile.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>

namespace shim = hbmio::shim;

// ---- sizes and offsets ------------------------------------------------------------------------

#define HBMIO_SAME_SIZE(type) static_assert(sizeof(shim::type) == sizeof(::type), "size of " #type)
#define HBMIO_SAME_ALIGN(type) static_assert(alignof(shim::type) == alignof(::type), "alignment of " #type)
#define HBMIO_SAME_OFFSET(type, member)                                                               \
  static_assert(offsetof(shim::type, member) == offsetof(::type, member), "offset of " #type "::" #member); \
  static_assert(sizeof(std::declval<shim::type&>().member) == sizeof(std::declval<::type&>().member),      \
                "size of " #type "::" #member)

HBMIO_SAME_SIZE(CUfileError_t);
HBMIO_SAME_ALIGN(CUfileError_t);
HBMIO_SAME_OFFSET(CUfileError_t, err);
HBMIO_SAME_OFFSET(CUfileError_t, cu_err);
static_assert(sizeof(shim::CUfileError_t) == 8);
static_assert(sizeof(shim::CUfileError_t::cu_err) == sizeof(::CUresult));  // an enum in cuda.h

HBMIO_SAME_SIZE(CUfileDrvProps_t);
HBMIO_SAME_ALIGN(CUfileDrvProps_t);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.major_version);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.minor_version);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.poll_thresh_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.max_direct_io_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.dstatusflags);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, nvfs.dcontrolflags);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, fflags);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, max_device_cache_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, per_buffer_cache_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, max_device_pinned_mem_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, max_batch_io_size);
HBMIO_SAME_OFFSET(CUfileDrvProps_t, max_batch_io_timeout_msecs);
static_assert(sizeof(shim::CUfileDrvProps_t) == 56);

HBMIO_SAME_SIZE(CUfileDescr_t);
HBMIO_SAME_ALIGN(CUfileDescr_t);
HBMIO_SAME_OFFSET(CUfileDescr_t, type);
HBMIO_SAME_OFFSET(CUfileDescr_t, handle);
HBMIO_SAME_OFFSET(CUfileDescr_t, handle.fd);
HBMIO_SAME_OFFSET(CUfileDescr_t, handle.handle);
HBMIO_SAME_OFFSET(CUfileDescr_t, fs_ops);
static_assert(sizeof(shim::CUfileDescr_t) == 24);

HBMIO_SAME_SIZE(CUfileIOParams_t);
HBMIO_SAME_ALIGN(CUfileIOParams_t);
HBMIO_SAME_OFFSET(CUfileIOParams_t, mode);
HBMIO_SAME_OFFSET(CUfileIOParams_t, u);
HBMIO_SAME_OFFSET(CUfileIOParams_t, u.batch.devPtr_base);
HBMIO_SAME_OFFSET(CUfileIOParams_t, u.batch.file_offset);
HBMIO_SAME_OFFSET(CUfileIOParams_t, u.batch.devPtr_offset);
HBMIO_SAME_OFFSET(CUfileIOParams_t, u.batch.size);
HBMIO_SAME_OFFSET(CUfileIOParams_t, fh);
HBMIO_SAME_OFFSET(CUfileIOParams_t, opcode);
HBMIO_SAME_OFFSET(CUfileIOParams_t, cookie);
static_assert(sizeof(shim::CUfileIOParams_t) == 64);

HBMIO_SAME_SIZE(CUfileIOEvents_t);
HBMIO_SAME_ALIGN(CUfileIOEvents_t);
HBMIO_SAME_OFFSET(CUfileIOEvents_t, cookie);
HBMIO_SAME_OFFSET(CUfileIOEvents_t, status);
HBMIO_SAME_OFFSET(CUfileIOEvents_t, ret);
static_assert(sizeof(shim::CUfileIOEvents_t) == 24);

static_assert(std::is_same_v<shim::CUfileHandle_t, ::CUfileHandle_t>);
static_assert(std::is_same_v<shim::CUfileBatchHandle_t, ::CUfileBatchHandle_t>);
static_assert(std::is_same_v<shim::CUstream, ::CUstream>);

// Every enum used in a struct or a signature must have the C enum's size.
HBMIO_SAME_SIZE(CUfileOpError);
HBMIO_SAME_SIZE(CUfileDriverStatusFlags_t);
HBMIO_SAME_SIZE(CUfileDriverControlFlags_t);
HBMIO_SAME_SIZE(CUfileFeatureFlags_t);
HBMIO_SAME_SIZE(CUfileOpcode_t);
HBMIO_SAME_SIZE(CUfileStatus_t);
HBMIO_SAME_SIZE(CUfileBatchMode_t);
HBMIO_SAME_SIZE(CUFileSizeTConfigParameter_t);
HBMIO_SAME_SIZE(CUFileBoolConfigParameter_t);
HBMIO_SAME_SIZE(CUFileStringConfigParameter_t);
static_assert(sizeof(shim::CUfileFileHandleType) == sizeof(enum ::CUfileFileHandleType));

// ---- enum values ------------------------------------------------------------------------------

#define HBMIO_SAME_VALUE(name) static_assert(static_cast<long>(shim::name) == static_cast<long>(::name), #name)

static_assert(shim::kCufileOpBaseError == CUFILEOP_BASE_ERR);

// Every CUfileOpError, generated from the header's own X-macro list so that a code added to a
// future cufile.h is checked too: it fails to compile here until the shim declares it.
#define CUFILE_OP(code, name, string) HBMIO_SAME_VALUE(name);
CUFILEOP_STATUS_ENTRIES
#undef CUFILE_OP

// The reverse direction, checked in main(): the shim's name table (cufile_api.cpp) knows every
// code of the header, by the header's name.
namespace {
struct HeaderCode {
  int code;
  const char* name;
};
constexpr HeaderCode kHeaderCodes[] = {
#define CUFILE_OP(code, name, string) {code, #name},
    CUFILEOP_STATUS_ENTRIES
#undef CUFILE_OP
};
}  // namespace

HBMIO_SAME_VALUE(CU_FILE_LUSTRE_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_WEKAFS_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_NFS_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_GPFS_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_NVME_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_NVMEOF_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_SCSI_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_SCALEFLUX_CSD_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_NVMESH_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_BEEGFS_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_NVME_P2P_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_SCATEFS_SUPPORTED);

HBMIO_SAME_VALUE(CU_FILE_USE_POLL_MODE);
HBMIO_SAME_VALUE(CU_FILE_ALLOW_COMPAT_MODE);

HBMIO_SAME_VALUE(CU_FILE_DYN_ROUTING_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_BATCH_IO_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_STREAMS_SUPPORTED);
HBMIO_SAME_VALUE(CU_FILE_PARALLEL_IO_SUPPORTED);

HBMIO_SAME_VALUE(CU_FILE_HANDLE_TYPE_OPAQUE_FD);
HBMIO_SAME_VALUE(CU_FILE_HANDLE_TYPE_OPAQUE_WIN32);
HBMIO_SAME_VALUE(CU_FILE_HANDLE_TYPE_USERSPACE_FS);

HBMIO_SAME_VALUE(CUFILE_READ);
HBMIO_SAME_VALUE(CUFILE_WRITE);
HBMIO_SAME_VALUE(CUFILE_WAITING);
HBMIO_SAME_VALUE(CUFILE_PENDING);
HBMIO_SAME_VALUE(CUFILE_INVALID);
HBMIO_SAME_VALUE(CUFILE_CANCELED);
HBMIO_SAME_VALUE(CUFILE_COMPLETE);
HBMIO_SAME_VALUE(CUFILE_TIMEOUT);
HBMIO_SAME_VALUE(CUFILE_FAILED);
HBMIO_SAME_VALUE(CUFILE_BATCH);

HBMIO_SAME_VALUE(CUFILE_PARAM_PROFILE_STATS);
HBMIO_SAME_VALUE(CUFILE_PARAM_EXECUTION_MAX_IO_QUEUE_DEPTH);
HBMIO_SAME_VALUE(CUFILE_PARAM_EXECUTION_MAX_IO_THREADS);
HBMIO_SAME_VALUE(CUFILE_PARAM_EXECUTION_MIN_IO_THRESHOLD_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_EXECUTION_MAX_REQUEST_PARALLELISM);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_MAX_DIRECT_IO_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_MAX_DEVICE_CACHE_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_PER_BUFFER_CACHE_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE);
HBMIO_SAME_VALUE(CUFILE_PARAM_POLLTHRESHOLD_SIZE_KB);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_BATCH_IO_TIMEOUT_MS);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_USE_POLL_MODE);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_ALLOW_COMPAT_MODE);
HBMIO_SAME_VALUE(CUFILE_PARAM_FORCE_COMPAT_MODE);
HBMIO_SAME_VALUE(CUFILE_PARAM_FS_MISC_API_CHECK_AGGRESSIVE);
HBMIO_SAME_VALUE(CUFILE_PARAM_EXECUTION_PARALLEL_IO);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROFILE_NVTX);
HBMIO_SAME_VALUE(CUFILE_PARAM_PROPERTIES_ALLOW_SYSTEM_MEMORY);
HBMIO_SAME_VALUE(CUFILE_PARAM_USE_PCIP2PDMA);
HBMIO_SAME_VALUE(CUFILE_PARAM_PREFER_IO_URING);
HBMIO_SAME_VALUE(CUFILE_PARAM_FORCE_ODIRECT_MODE);
HBMIO_SAME_VALUE(CUFILE_PARAM_SKIP_TOPOLOGY_DETECTION);
HBMIO_SAME_VALUE(CUFILE_PARAM_STREAM_MEMOPS_BYPASS);
HBMIO_SAME_VALUE(CUFILE_PARAM_LOGGING_LEVEL);
HBMIO_SAME_VALUE(CUFILE_PARAM_ENV_LOGFILE_PATH);
HBMIO_SAME_VALUE(CUFILE_PARAM_LOG_DIR);

static_assert(shim::kBufRegisterRdma == CU_FILE_RDMA_REGISTER);
static_assert(shim::kBufRegisterRdmaRelaxedOrdering == CU_FILE_RDMA_RELAXED_ORDERING);
static_assert(shim::kStreamFixedBufOffset == CU_FILE_STREAM_FIXED_BUF_OFFSET);
static_assert(shim::kStreamFixedFileOffset == CU_FILE_STREAM_FIXED_FILE_OFFSET);
static_assert(shim::kStreamFixedFileSize == CU_FILE_STREAM_FIXED_FILE_SIZE);
static_assert(shim::kStreamPageAlignedInputs == CU_FILE_STREAM_PAGE_ALIGNED_INPUTS);

// ---- entry-point signatures -------------------------------------------------------------------

// Our signatures use our struct types, so they cannot be std::is_same as the header's. Map each
// shim type to its cufile.h twin, recursively through pointers, const and function types, and
// compare the mapped signature with decltype(&::cuFileXxx) exactly.
namespace {
template <class T> struct to_real { using type = T; };
template <class T> using to_real_t = typename to_real<T>::type;
template <class T> struct to_real<T*> { using type = to_real_t<T>*; };
template <class T> struct to_real<const T> { using type = const to_real_t<T>; };
template <class R, class... A> struct to_real<R (*)(A...)> { using type = to_real_t<R> (*)(to_real_t<A>...); };
#define HBMIO_MAPS_TO(shim_type, real_type) \
  template <> struct to_real<shim::shim_type> { using type = real_type; }
HBMIO_MAPS_TO(CUfileError_t, ::CUfileError_t);
HBMIO_MAPS_TO(CUfileDrvProps_t, ::CUfileDrvProps_t);
HBMIO_MAPS_TO(CUfileDescr_t, ::CUfileDescr_t);
HBMIO_MAPS_TO(CUfileIOParams_t, ::CUfileIOParams_t);
HBMIO_MAPS_TO(CUfileIOEvents_t, ::CUfileIOEvents_t);
HBMIO_MAPS_TO(CUfileOpError, ::CUfileOpError);
HBMIO_MAPS_TO(CUFileSizeTConfigParameter_t, ::CUFileSizeTConfigParameter_t);
HBMIO_MAPS_TO(CUFileBoolConfigParameter_t, ::CUFileBoolConfigParameter_t);
HBMIO_MAPS_TO(CUFileStringConfigParameter_t, ::CUFileStringConfigParameter_t);
#undef HBMIO_MAPS_TO

// The mapping itself must not be vacuous.
static_assert(std::is_same_v<to_real_t<const shim::CUfileDescr_t*>, const ::CUfileDescr_t*>);
static_assert(!std::is_same_v<to_real_t<shim::PFN_cuFileHandleRegister>, shim::PFN_cuFileHandleRegister>);
}  // namespace

#define HBMIO_SAME_SIGNATURE(fn) \
  static_assert(std::is_same_v<to_real_t<shim::PFN_##fn>, decltype(&::fn)>, "signature of " #fn)

HBMIO_SAME_SIGNATURE(cuFileDriverOpen);
// cufile.h #defines cuFileDriverClose to cuFileDriverClose_v2, so this checks _v2, the symbol
// the shim resolves first; the old one has the same signature.
HBMIO_SAME_SIGNATURE(cuFileDriverClose);
static_assert(std::is_same_v<to_real_t<shim::PFN_cuFileDriverClose>, decltype(&::cuFileDriverClose_v2)>);
HBMIO_SAME_SIGNATURE(cuFileDriverGetProperties);
HBMIO_SAME_SIGNATURE(cuFileDriverSetPollMode);
HBMIO_SAME_SIGNATURE(cuFileDriverSetMaxDirectIOSize);
HBMIO_SAME_SIGNATURE(cuFileDriverSetMaxCacheSize);
HBMIO_SAME_SIGNATURE(cuFileDriverSetMaxPinnedMemSize);
HBMIO_SAME_SIGNATURE(cuFileHandleRegister);
HBMIO_SAME_SIGNATURE(cuFileHandleDeregister);
HBMIO_SAME_SIGNATURE(cuFileBufRegister);
HBMIO_SAME_SIGNATURE(cuFileBufDeregister);
HBMIO_SAME_SIGNATURE(cuFileRead);
HBMIO_SAME_SIGNATURE(cuFileWrite);
HBMIO_SAME_SIGNATURE(cuFileBatchIOSetUp);
HBMIO_SAME_SIGNATURE(cuFileBatchIOSubmit);
HBMIO_SAME_SIGNATURE(cuFileBatchIOGetStatus);
HBMIO_SAME_SIGNATURE(cuFileBatchIOCancel);
HBMIO_SAME_SIGNATURE(cuFileBatchIODestroy);
HBMIO_SAME_SIGNATURE(cuFileUseCount);
HBMIO_SAME_SIGNATURE(cuFileReadAsync);
HBMIO_SAME_SIGNATURE(cuFileWriteAsync);
HBMIO_SAME_SIGNATURE(cuFileStreamRegister);
HBMIO_SAME_SIGNATURE(cuFileStreamDeregister);
HBMIO_SAME_SIGNATURE(cuFileGetVersion);
HBMIO_SAME_SIGNATURE(cuFileGetParameterSizeT);
HBMIO_SAME_SIGNATURE(cuFileGetParameterBool);
HBMIO_SAME_SIGNATURE(cuFileGetParameterString);
HBMIO_SAME_SIGNATURE(cuFileSetParameterSizeT);
HBMIO_SAME_SIGNATURE(cuFileSetParameterBool);
HBMIO_SAME_SIGNATURE(cuFileSetParameterString);

int main() {
  // The static_asserts above are most of the test; what is left needs the library.
  int failures = 0;
  for (const HeaderCode& entry : kHeaderCodes) {
    const char* ours = shim::cufile_error_name(entry.code);
    if (ours == nullptr || std::strcmp(ours, entry.name) != 0) {
      std::fprintf(stderr, "cufile_error_name(%d) = %s, cufile.h says %s\n", entry.code, ours ? ours : "(null)", entry.name);
      ++failures;
    }
  }
  std::printf("cuFile ABI: layouts, enum values and signatures match cufile.h; %zu error names checked, %d wrong\n",
              std::size(kHeaderCodes), failures);
  return failures == 0 ? 0 : 1;
}
