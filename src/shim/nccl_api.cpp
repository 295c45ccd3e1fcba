#include "shim/nccl_api.hpp"

#include <dlfcn.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hbmio/error.hpp"
#include "shim/dl.hpp"

namespace hbmio::shim {
namespace {

template <class Fn>
Fn symbol(void* handle, const char* name) {
  // POSIX guarantees a dlsym() result can be converted to a function pointer.
  auto fn = reinterpret_cast<Fn>(::dlsym(handle, name));
  if (fn == nullptr) throw Error(errno_code(ENOSYS), {.op = "load NCCL"}, fmt::format("the library has no {}", name));
  return fn;
}

NcclApi load() {
  // The copy the caller's communicator came from, already in the process, first.
  std::vector<std::string> failures;
  void* handle = open_library("libnccl.so.2", "HBMIO_NCCL_LIBRARY", failures);
  if (handle == nullptr)
    throw Error(errno_code(ENOENT), {.op = "load NCCL"},
                fmt::format("no NCCL library ({}); set HBMIO_NCCL_LIBRARY to libnccl.so.2", fmt::join(failures, "; ")));
  NcclApi api;
  api.comm_count = symbol<NcclApi::CommCount>(handle, "ncclCommCount");
  api.comm_user_rank = symbol<NcclApi::CommUserRank>(handle, "ncclCommUserRank");
  api.broadcast = symbol<NcclApi::Broadcast>(handle, "ncclBroadcast");
  api.all_reduce = symbol<NcclApi::AllReduce>(handle, "ncclAllReduce");
  api.group_start = symbol<NcclApi::GroupStart>(handle, "ncclGroupStart");
  api.group_end = symbol<NcclApi::GroupEnd>(handle, "ncclGroupEnd");
  api.get_error_string = symbol<NcclApi::GetErrorString>(handle, "ncclGetErrorString");
  api.comm_cu_device = symbol<NcclApi::CommCuDevice>(handle, "ncclCommCuDevice");
  api.comm_get_async_error = symbol<NcclApi::CommGetAsyncError>(handle, "ncclCommGetAsyncError");
  api.get_unique_id = symbol<NcclApi::GetUniqueId>(handle, "ncclGetUniqueId");
  api.comm_init_rank = symbol<NcclApi::CommInitRank>(handle, "ncclCommInitRank");
  api.comm_destroy = symbol<NcclApi::CommDestroy>(handle, "ncclCommDestroy");
  api.library = loaded_file(handle, "libnccl.so.2");
  // The handle stays open for the process's life: the caller's communicator outlives any load.
  return api;
}

}  // namespace

const NcclApi& nccl_api() {
  // Not a function-local static initialised by load(): a failed load must be retried (the
  // program may load torch's NCCL later), and the error thrown each time.
  static std::mutex mutex;
  static std::unique_ptr<NcclApi> api;
  std::lock_guard lock(mutex);
  if (!api) api = std::make_unique<NcclApi>(load());
  return *api;
}

void nccl_check(ncclComm_t comm, ncclResult_t result, const char* call) {
  while (result == ncclInProgress && comm != nullptr)
    if (nccl_api().comm_get_async_error(comm, &result) != ncclSuccess) break;
  if (result == ncclSuccess) return;
  const char* text = nccl_api().get_error_string(result);
  throw Error(errno_code(EIO), {.op = call}, fmt::format("NCCL error {}: {}", static_cast<int>(result), text ? text : "?"));
}

}  // namespace hbmio::shim
