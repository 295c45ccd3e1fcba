// What the loads of one location (load.cpp), of several (load_locations) and of many processes
// (nccl_load.cpp) share.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"

namespace hbmio::detail {

// open_checkpoint for an s3:// or http(s):// URL (remote_open.cpp).
std::vector<CheckpointFile> open_remote_checkpoint(const std::string& url, const RemoteOptions& options);

// A sharded checkpoint, local or remote: `files` holds one opened shard per index.shards, in that
// order. Keeps in each shard only the tensors the index assigns to it, then checks that every
// tensor the index names is in its shard (Error EINVAL, in `context`, naming the first missing).
void keep_indexed_tensors(std::vector<CheckpointFile>& files, const safetensors::ShardIndex& index, const ErrorContext& context);

// The request's files: LoadRequest::files where given (Error EINVAL when empty), else `opened`,
// filled by open_checkpoint.
const std::vector<CheckpointFile>& files_of(const LoadRequest& request, std::vector<CheckpointFile>& opened);
// The tensors a load of `files` takes per `options`, in the order it reads them, and where each
// lands in the single allocation.
std::vector<PlannedTensor> plan_tensors(const std::string& path, const std::vector<CheckpointFile>& files, const LoadOptions& options);
// plan_load over `world` ranks (nccl_load.cpp).
LoadPlan plan_ranks(const std::string& path, const std::vector<CheckpointFile>& files, const LoadOptions& options, int world,
                    Placement placement, const std::map<std::string, int>& shard_map);
// load() with LoadRequest::locations (load.cpp) and with LoadRequest::nccl_comm (nccl_load.cpp).
LoadResult load_locations(const LoadRequest& request);
LoadResult load_nccl(const LoadRequest& request);

// A friend of LoadedCheckpoint.
struct LoadAccess {
  // Loads `files` (open_checkpoint(path)) per `options`. With `read_only`, the layout holds every
  // picked tensor but only those named there are read (the others are filled in by the caller:
  // a replicated load reads each byte once and copies the rest between devices); no verify then.
  static LoadedCheckpoint load(const std::string& path, const LoadOptions& options, const std::vector<CheckpointFile>& files,
                               const std::set<std::string>* read_only);
  // strict: a file without checksums is an Error(Errc::no_checksums); else it is named in
  // result.unverified_files() and its tensors are left unchecked.
  // `already`: per tensor, nonzero where its checksum was checked already (as it streamed in);
  // given, the headers are taken as checked too (check_headers, before the load).
  static void verify(LoadedCheckpoint& result, const std::vector<CheckpointFile>& files, bool strict,
                     const std::vector<char>* already = nullptr);
  static void adopt(LoadedCheckpoint& result, Buffer buffer) { result.buffers_.push_back(std::move(buffer)); }
  static Stats& stats(LoadedCheckpoint& result) { return result.stats_; }
};

// Throws Error(Errc::no_checksums) naming the first file without hbmio checksums.
void require_checksums(const std::vector<CheckpointFile>& files);
// Throws Error(Errc::verify_failed) at the first file with checksums whose header does not match
// its own (check_header).
void check_headers(const std::vector<CheckpointFile>& files);

// Splits tensors of these sizes (file order) into `n` contiguous runs of about equal bytes and
// returns each tensor's run. Contiguous runs keep every reader's reads large.
std::vector<std::size_t> contiguous_runs(const std::vector<std::uint64_t>& sizes, std::size_t n);

// How a load divides a plan (plan_tensors) among n readers (locations or ranks).
struct RunSplit {
  std::vector<std::size_t> reader;  // per tensor of the plan
  // Per reader, the byte range [first, second) of the layout its tensors occupy; first >= second
  // when it has none. A range is one piece of the layout only for contiguous runs (no shard_map).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> range;
};

// Contiguous runs (contiguous_runs), then the tensors `shard_map` names go to the reader it gives.
// A reader out of range or a name the plan lacks is an Error (EINVAL, ENOENT) in `context`;
// `reader_word` ("location", "rank") names the readers in it.
template <typename Index>
RunSplit split_runs(const std::vector<PlannedTensor>& plan, std::size_t n, const std::map<std::string, Index>& shard_map,
                    const ErrorContext& context, std::string_view reader_word) {
  std::vector<std::uint64_t> sizes;
  for (const auto& t : plan) sizes.push_back(t.size);
  RunSplit split{contiguous_runs(sizes, n), std::vector<std::pair<std::uint64_t, std::uint64_t>>(n, {UINT64_MAX, 0})};
  std::size_t mapped = 0;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto it = shard_map.find(plan[i].name);
    if (it == shard_map.end()) continue;
    if (std::cmp_less(it->second, 0) || std::cmp_greater_equal(it->second, n))
      throw Error(errno_code(EINVAL), context,
                  fmt::format("shard_map sends tensor '{}' to {} {}, but there are {}", it->first, reader_word, it->second, n));
    split.reader[i] = static_cast<std::size_t>(it->second);
    ++mapped;
  }
  if (mapped != shard_map.size())
    for (const auto& entry : shard_map)
      if (std::none_of(plan.begin(), plan.end(), [&](const PlannedTensor& t) { return t.name == entry.first; }))
        throw Error(errno_code(EINVAL), context, fmt::format("shard_map names tensor '{}', which the load does not hold", entry.first));
  for (std::size_t i = 0; i < plan.size(); ++i) {
    auto& [begin, end] = split.range[split.reader[i]];
    begin = std::min(begin, plan[i].memory_offset);
    end = std::max(end, plan[i].memory_offset + plan[i].size);
  }
  return split;
}

}  // namespace hbmio::detail
