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

NcclApi load_nccl() {
  // The copy the caller's communicator came from, already in the process, first.
  std::vector<std::string> failures;
  void* handle = open_library("libnccl.so.2", "HBMIO_NCCL_LIBRARY", failures);
  if (handle == nullptr)
    throw Error(errno_code(ENOENT), {.op = "load NCCL"},
                fmt::format("no NCCL library ({}); set HBMIO_NCCL_LIBRARY to libnccl.so.2", fmt::join(failures, "; ")));
  NcclApi api;
  api.comm_count = required_symbol<NcclApi::CommCount>(handle, "ncclCommCount", "load NCCL");
  api.comm_user_rank = required_symbol<NcclApi::CommUserRank>(handle, "ncclCommUserRank", "load NCCL");
  api.broadcast = required_symbol<NcclApi::Broadcast>(handle, "ncclBroadcast", "load NCCL");
  api.all_reduce = required_symbol<NcclApi::AllReduce>(handle, "ncclAllReduce", "load NCCL");
  api.group_start = required_symbol<NcclApi::GroupStart>(handle, "ncclGroupStart", "load NCCL");
  api.group_end = required_symbol<NcclApi::GroupEnd>(handle, "ncclGroupEnd", "load NCCL");
  api.get_error_string = required_symbol<NcclApi::GetErrorString>(handle, "ncclGetErrorString", "load NCCL");
  api.comm_cu_device = required_symbol<NcclApi::CommCuDevice>(handle, "ncclCommCuDevice", "load NCCL");
  api.comm_get_async_error = required_symbol<NcclApi::CommGetAsyncError>(handle, "ncclCommGetAsyncError", "load NCCL");
  api.get_unique_id = required_symbol<NcclApi::GetUniqueId>(handle, "ncclGetUniqueId", "load NCCL");
  api.comm_init_rank = required_symbol<NcclApi::CommInitRank>(handle, "ncclCommInitRank", "load NCCL");
  api.comm_destroy = required_symbol<NcclApi::CommDestroy>(handle, "ncclCommDestroy", "load NCCL");
  api.library = loaded_file(handle, "libnccl.so.2");
  // The handle stays open for the process's life: the caller's communicator outlives any load.
  return api;
}

}  // namespace

const NcclApi& nccl_api() {
  // Not a function-local static initialised by load_nccl(): a failed load must be retried (the
  // program may load torch's NCCL later), and the error thrown each time.
  static std::mutex mutex;
  static std::unique_ptr<NcclApi> api;
  std::lock_guard lock(mutex);
  if (!api) api = std::make_unique<NcclApi>(load_nccl());
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
