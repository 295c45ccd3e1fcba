// The persist step of a local save: the tensors' bytes written through the engine (hashed beside
// the writes), the sealed header, fsync, the publishing rename, the directory's fsync (commit.hpp).
// A blocking save (save_checkpoint) persists from the tensors' own memory once the path's
// background saves are done; a background save (save_checkpoint_async) persists on a pool thread
// from the snapshot it staged. Both run this one step, with the same guarantees.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"

namespace hbmio::detail {

class StagedStream;

// Writes `tensors` to `path` (a file, or with options.max_shard_size a sharded checkpoint's
// directory) crash-safely, as save_checkpoint documents. The bytes come from `staged` where given
// (a background save's snapshot, in file order; the tensors' spans then give only sizes), else
// from the tensors' own memory.
Stats persist(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options,
              StagedStream* staged);

// The files a save of `tensors` writes (one, or each shard of a sharded save, in order): where
// each one's tensor data starts (its header's size, as persist writes it before the checksums
// are known: placeholders of the same size) and how many tensor bytes it holds. A background
// save's snapshot lays its staging out by it: each staged byte then sits at the same offset
// modulo kStagingGrid in its pool block as in its file, so the writer's direct writes go
// straight from the staging, without a copy into the engine's bounce buffers. It must agree with
// persist_file; where it did not, those writes would only be bounced again (the bytes written are
// the same).
struct StagedFile {
  std::uint64_t data_start = 0;
  std::uint64_t bytes = 0;
};
std::vector<StagedFile> staged_files(const std::vector<TensorToSave>& tensors, const SaveOptions& options);

// The checks a save makes before touching the disk (names, sizes, what is at `path`, its
// directory), for a background save to throw them from its call; returns the path a save replaces
// (symbolic links followed), which keys "one save per path".
std::string check_save(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options);

}  // namespace hbmio::detail
