// What the loads of one location (load.cpp), of several (load_checkpoint_multi) and of many
// processes (nccl_load.cpp) share.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"

namespace hbmio::detail {

// A friend of LoadedCheckpoint.
struct LoadAccess {
  // Loads `files` (open_checkpoint(path)) per `options`. With `read_only`, the layout holds every
  // picked tensor but only those named there are read (the others are filled in by the caller:
  // a replicated load reads each byte once and copies the rest between devices); no verify then.
  static LoadedCheckpoint load(const std::string& path, const LoadOptions& options, const std::vector<CheckpointFile>& files,
                               const std::set<std::string>* read_only);
  static void verify(LoadedCheckpoint& result, const std::vector<CheckpointFile>& files);
  static void adopt(LoadedCheckpoint& result, Buffer buffer) { result.buffers_.push_back(std::move(buffer)); }
  static Stats& stats(LoadedCheckpoint& result) { return result.stats_; }
};

// Splits tensors of these sizes (file order) into `n` contiguous runs of about equal bytes and
// returns each tensor's run. Contiguous runs keep every reader's reads large.
std::vector<std::size_t> contiguous_runs(const std::vector<std::uint64_t>& sizes, std::size_t n);

}  // namespace hbmio::detail
