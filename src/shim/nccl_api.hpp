// hbmio's own declarations of the few NCCL entry points a distributed load uses, and their
// run-time loader.
//
// Why our own declarations and dlopen: NCCL belongs to the caller. A program that hands hbmio a
// communicator has made it with its own libnccl (PyTorch's, say), and hbmio must call that very
// library, not link or ship another. So the library is looked up at first use: the copy already
// loaded in the process (by its soname), else HBMIO_NCCL_LIBRARY, else the linker's search path.
// The values below follow nccl.h (NCCL 2.x, stable since 2.0; checked against the header of
// NCCL 2.32).
#pragma once

#include <cstddef>
#include <string>

namespace hbmio::shim {

struct ncclComm;  // opaque, as in nccl.h
using ncclComm_t = ncclComm*;

enum ncclResult_t : int { ncclSuccess = 0, ncclInProgress = 7 };
struct ncclUniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
enum ncclDataType_t : int { ncclUint8 = 1, ncclUint64 = 5 };
enum ncclRedOp_t : int { ncclMax = 2 };

// The entry points, resolved from one library. Function pointers are never null in a loaded API.
struct NcclApi {
  using CommCount = ncclResult_t (*)(ncclComm_t, int*);
  using CommUserRank = ncclResult_t (*)(ncclComm_t, int*);
  using Broadcast = ncclResult_t (*)(const void*, void*, std::size_t, ncclDataType_t, int, ncclComm_t, void* stream);
  using AllReduce = ncclResult_t (*)(const void*, void*, std::size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, void* stream);
  using GroupStart = ncclResult_t (*)();
  using GroupEnd = ncclResult_t (*)();
  using GetErrorString = const char* (*)(ncclResult_t);
  using CommCuDevice = ncclResult_t (*)(ncclComm_t, int*);
  using CommGetAsyncError = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
  // Tests make communicators: one process per rank.
  using GetUniqueId = ncclResult_t (*)(ncclUniqueId*);
  using CommInitRank = ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int);
  using CommDestroy = ncclResult_t (*)(ncclComm_t);

  CommCount comm_count = nullptr;
  CommUserRank comm_user_rank = nullptr;
  Broadcast broadcast = nullptr;
  AllReduce all_reduce = nullptr;
  GroupStart group_start = nullptr;
  GroupEnd group_end = nullptr;
  GetErrorString get_error_string = nullptr;
  CommCuDevice comm_cu_device = nullptr;
  CommGetAsyncError comm_get_async_error = nullptr;
  GetUniqueId get_unique_id = nullptr;
  CommInitRank comm_init_rank = nullptr;
  CommDestroy comm_destroy = nullptr;
  std::string library;  // the file the symbols came from
};

// The process's NCCL, loaded once. Throws Error(ENOENT) naming every place it looked when there is
// none, and Error(ENOSYS) naming the symbol when a library lacks one.
const NcclApi& nccl_api();

// Throws Error naming `call` and NCCL's own description of `result` unless it is ncclSuccess.
// ncclInProgress (a non-blocking communicator: the call is queued, not done) is waited out first,
// through ncclCommGetAsyncError, so nothing is freed under queued work.
void nccl_check(ncclComm_t comm, ncclResult_t result, const char* call);

}  // namespace hbmio::shim
