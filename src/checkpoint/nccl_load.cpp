// Distributed loads over the caller's NCCL communicator (load() with LoadRequest::nccl_comm): each rank reads
// one contiguous run of the checkpoint; for replicate, every run is then broadcast from its reader.
//
// The order of events is what keeps a failure from hanging the other ranks: every rank reaches
// the one all-reduce of step 2 whatever happened in step 1, and nothing else collective happens
// before it. After it, every rank knows whether all succeeded and whether all planned the same
// layout; only then do broadcasts start, and every rank issues the same ones.
#include <algorithm>
#include <cerrno>
#include <exception>
#include <memory>
#include <new>
#include <set>

#include <fmt/format.h>
#include <xxhash.h>

#include "checkpoint/load_internal.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "io/engine_internal.hpp"
#include "memory/cuda_runtime.hpp"
#include "shim/nccl_api.hpp"

namespace hbmio {

LoadPlan detail::plan_ranks(const std::string& path, const std::vector<CheckpointFile>& files, const LoadOptions& options, int world,
                            Placement placement, const std::map<std::string, int>& shard_map) {
  const bool replicate = placement == Placement::replicate;
  const ErrorContext context{.op = fmt::format("plan a distributed load over {} ranks", world), .path = path};
  if (world < 1) throw Error(errno_code(EINVAL), context, "a group has at least one rank");
  LoadPlan out;
  LoadOptions layout = options;
  layout.layout = TensorLayout::single_allocation;
  layout.destination = {};
  out.tensors = detail::plan_tensors(path, files, layout);
  out.bytes = out.tensors.empty() ? 0 : out.tensors.back().memory_offset + out.tensors.back().size;
  const std::map<std::string, int> no_map;
  const detail::RunSplit split =
      detail::split_runs(out.tensors, static_cast<std::size_t>(world), replicate ? no_map : shard_map, context, "rank");
  out.reader.assign(split.reader.begin(), split.reader.end());
  out.range = split.range;
  // What every rank must agree on: the options that decide what happens after the agreement, the
  // layout and who reads what. Hashed field by field, not formatted: every plan_load computes it,
  // a Python load of thousands of tensors included.
  const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owned(XXH3_createState(), &XXH3_freeState);
  if (!owned) throw std::bad_alloc();
  XXH3_state_t* state = owned.get();
  const auto hash = [state](const void* data, std::size_t size) { XXH3_64bits_update(state, data, size); };
  const auto number = [&](std::uint64_t v) { hash(&v, sizeof v); };
  XXH3_64bits_reset(state);
  number(replicate);
  number(options.verify);
  number(options.require_checksums);
  for (std::size_t i = 0; i < out.tensors.size(); ++i) {
    const PlannedTensor& t = out.tensors[i];
    number(t.name.size());
    hash(t.name.data(), t.name.size());
    number(static_cast<std::uint64_t>(t.dtype));
    number(t.shape.size());
    for (const std::uint64_t n : t.shape) number(n);
    number(t.size);
    number(t.memory_offset);
    number(static_cast<std::uint64_t>(out.reader[i]));
  }
  out.digest = XXH3_64bits_digest(state);
  return out;
}

LoadResult detail::load_nccl(const LoadRequest& request) {
  detail::TransferTimer timer;
  const std::string& path = request.path;
  const LoadOptions& load = request.options;
  const shim::NcclApi& nccl = shim::nccl_api();
  const auto comm = static_cast<shim::ncclComm_t>(request.nccl_comm);
  LoadResult result;
  result.locations.resize(1);
  LoadedCheckpoint& mine_loaded = result.locations.front();
  int device = -1;
  shim::nccl_check(comm, nccl.comm_user_rank(comm, &result.rank), "ncclCommUserRank");
  shim::nccl_check(comm, nccl.comm_count(comm, &result.world), "ncclCommCount");
  shim::nccl_check(comm, nccl.comm_cu_device(comm, &device), "ncclCommCuDevice");
  const int rank = result.rank, world = result.world;
  const ErrorContext context{.op = fmt::format("distributed load (rank {} of {})", rank, world), .path = path};
  const bool replicate = request.placement == Placement::replicate;

  // CUDA set-up on the communicator's GPU. This is the one part whose failure stays local (and
  // leaves the other ranks waiting in step 2): without a stream and the agreement buffer a rank
  // cannot take part. Everything that depends on the caller's options or files comes after.
  const cuda::DeviceGuard guard(device, context);
  cuda::Stream stream(device, context);
  Buffer agreement = Buffer::allocate({MemoryKind::device, device}, 3 * sizeof(std::uint64_t));

  // 1. Plan and read this rank's part. Any failure is kept for step 2.
  std::exception_ptr failure;
  std::vector<CheckpointFile> opened;
  const std::vector<CheckpointFile>* files = nullptr;
  std::vector<PlannedTensor> plan;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  // per rank, of the layout
  std::byte* base = nullptr;  // replicate: this rank's copy of the whole layout
  std::uint64_t digest = 0;
  try {
    const MemoryLocation into = load.into;
    if (into.kind != MemoryKind::device || into.device != device)
      throw Error(errno_code(EINVAL), context,
                  fmt::format("LoadOptions::into is {}, but this rank's communicator is on cuda:{}", into.to_string(), device));
    files = &detail::files_of(request, opened);
    // Found here, before any read, so every rank stops alike.
    if (replicate && load.verify && load.require_checksums) detail::require_checksums(*files);
    LoadOptions layout = load;
    layout.layout = TensorLayout::single_allocation;
    layout.destination = {};
    LoadPlan distributed = detail::plan_ranks(path, *files, layout, world, request.placement, request.shard_map);
    plan = std::move(distributed.tensors);
    ranges = std::move(distributed.range);
    digest = distributed.digest;

    std::set<std::string> mine;
    for (std::size_t i = 0; i < plan.size(); ++i)
      if (distributed.reader[i] == rank) mine.insert(plan[i].name);
    if (replicate) {
      const std::uint64_t size = plan.empty() ? 0 : plan.back().memory_offset + plan.back().size;
      Buffer whole = Buffer::allocate(into, std::max<std::uint64_t>(size, 1));
      base = whole.data();
      layout.destination = whole.span();
      mine_loaded = detail::LoadAccess::load(path, layout, *files, &mine);
      detail::LoadAccess::adopt(mine_loaded, std::move(whole));  // the memory stays where it is
    } else if (!mine.empty()) {
      layout.names.assign(mine.begin(), mine.end());
      mine_loaded = detail::LoadAccess::load(path, layout, *files, nullptr);
    }
    result.bytes_from_storage = mine_loaded.stats().bytes;
  } catch (...) {
    failure = std::current_exception();
  }

  // 2. Agreement, one all-reduce (MAX) of: the highest failing rank + 1 (0: none); the layout's
  // digest and its complement (every digest is equal exactly when max(d) == ~max(~d)).
  std::uint64_t state[3] = {failure ? static_cast<std::uint64_t>(rank) + 1 : 0, digest, ~digest};
  // All on one stream: the copy in, the all-reduce and the copy out run in that order.
  stream.copy_to_device_async(agreement.data(), state, sizeof(state), context);
  shim::nccl_check(comm, nccl.all_reduce(agreement.data(), agreement.data(), 3, shim::ncclUint64, shim::ncclMax, comm, stream.handle()),
                   "ncclAllReduce");
  stream.copy_to_host_async(state, agreement.data(), sizeof(state), context);
  stream.synchronize(context);
  if (failure) std::rethrow_exception(failure);
  if (state[0] != 0)
    throw Error(errno_code(EIO), context, fmt::format("rank {} failed to load its part (its own error says why); nothing was exchanged", state[0] - 1));
  if (state[1] != ~state[2])
    throw Error(errno_code(EINVAL), context, "the ranks see different checkpoints or options (tensor names, dtypes, shapes or shard maps differ)");

  // 3. Replicate: every run from its reader to all, in one group so the broadcasts overlap.
  if (replicate && !plan.empty()) {
    // One group, so the broadcasts of all runs proceed together. Every rank issues the same
    // broadcasts (same plan, agreed above); an enqueue error here is not agreed on, and leaves
    // the other ranks to NCCL's own error handling (NCCL_TIMEOUT, ncclCommAbort by the caller).
    shim::nccl_check(comm, nccl.group_start(), "ncclGroupStart");
    for (int src = 0; src < world; ++src) {
      const auto [begin, end] = ranges[static_cast<std::size_t>(src)];
      if (begin >= end) continue;
      const shim::ncclResult_t r = nccl.broadcast(base + begin, base + begin, end - begin, shim::ncclUint8, src, comm, stream.handle());
      if (r != shim::ncclSuccess && r != shim::ncclInProgress) {
        (void)nccl.group_end();
        shim::nccl_check(comm, r, "ncclBroadcast");
      }
      if (src != rank) result.bytes_between += end - begin;
    }
    shim::nccl_check(comm, nccl.group_end(), "ncclGroupEnd");
    stream.synchronize(context);
    if (load.verify) detail::LoadAccess::verify(mine_loaded, *files, load.require_checksums);
  }
  Stats total;
  timer.finish(total);
  result.seconds = total.seconds;
  return result;
}

}  // namespace hbmio
