// Where a checkpoint's bytes are read from: ONE interface, ReadSource ("read these ranges of these
// objects into these destinations, tell me as each lands"), with three implementations, each in a
// file of its own:
//   LocalFiles      local files, through an engine (posix | uring | cufile | auto)   local_files.cpp
//   RemoteObjects   objects at URLs, by ranged GETs over the remote workers         remote_objects.cpp
//   ResidentDma     files the node's resident cache holds, DMA'd by its server       resident_cache.cpp
// read_ranges (read_ranges.cpp) hands each read to the first source that serves it. The layers
// above (loads, the tensor-at-a-time walk, the verify passes) plan their reads as (file, offset,
// memory) and never ask which kind a file is: this layer is the only one that looks at
// CheckpointFile::remote.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cache/client.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"

namespace hbmio::detail {

// Bytes [offset, offset + into.size) of files[file] into `into` (any memory kind).
struct RangeRead {
  std::size_t file = 0;
  std::uint64_t offset = 0;
  MemorySpan into{};
};

// The resident cache's copies of a checkpoint's local files, where `use` (and HBMIO_CACHE) asks
// for the cache and it holds them unchanged; files past open_checkpoint's bound on open files and
// objects at URLs are not asked for. `warning`: why the cache could not help (printed on stderr
// once per process and reason too).
struct ResidentCopies {
  std::vector<std::shared_ptr<const File>> files;  // parallel to the checkpoint's files; null: read the file
  std::size_t held = 0;
  std::string socket;
  std::string warning;
};

struct ReadRangesOptions {
  // The engine for local files, asked for only when there are some (a load from a URL leases none).
  std::function<Engine&()> engine;
  // For objects at URLs; null: the options each object was opened with.
  const RemoteOptions* remote = nullptr;
  std::atomic<std::uint64_t>* progress = nullptr;  // bytes in place so far
  // Told that bytes [at, at + length) of reads[read] are in place (GPU copies done) while later
  // bytes are still being read: objects at URLs per part as it arrives, on the remote workers;
  // local files per piece of a read (up to 64 MiB) as the engine lands it (LandedSink), on up to
  // 16 pool threads at once, or on the engine's own threads with `landed_quick`. A throw from it
  // stops the reads at their next chunk and fails the call with that exception.
  LandedFunction landed;
  // `landed` is quick (a count, a waiter woken) and may run on the engine's threads, in the read.
  bool landed_quick = false;
  // Once set, local reads not started yet stop and the call throws Error(ECANCELED) (objects at
  // URLs are read to the end). The read sets it too when a landed call throws: a flag of this
  // call's own, not one shared with later calls.
  std::atomic<bool>* cancel = nullptr;
  // The resident cache's copies of `files` (resident_copies), or null: reads of a file it holds go
  // to its copy; those into GPU memory are DMA'd by the cache's server from its pinned copy where
  // it can (else read from the copy through the engine).
  const ResidentCopies* resident = nullptr;
};

// One kind of place bytes are read from.
class ReadSource {
 public:
  virtual ~ReadSource() = default;
  // Whether this source reads `read` (a non-empty read of `file`) in a call with `options`.
  virtual bool serves(const CheckpointFile& file, const RangeRead& read, const ReadRangesOptions& options) const = 0;
  // Reads reads[k] for each k of `which` (each one this source serves), at once where it can;
  // options.landed is told with k, an index into `reads`. Returns the Stats of those reads, whose
  // note says what was done.
  virtual Stats read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
                     const ReadRangesOptions& options) = 0;
};

// Local files, through options.engine(): one engine batch, unless the files to open again exceed
// open_file_bound (see read). A file the resident cache holds (options.resident) is read from the
// cache's copy, the same bytes in shared host memory.
class LocalFiles final : public ReadSource {
 public:
  bool serves(const CheckpointFile& file, const RangeRead& read, const ReadRangesOptions& options) const override;
  Stats read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
             const ReadRangesOptions& options) override;
};

// Objects at URLs, every read at once over the remote workers' connections, each landed per part
// as it arrives (read_remote).
class RemoteObjects final : public ReadSource {
 public:
  bool serves(const CheckpointFile& file, const RangeRead& read, const ReadRangesOptions& options) const override;
  Stats read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
             const ReadRangesOptions& options) override;
};

// Reads into GPU memory of files the resident cache holds (options.resident), DMA'd by the
// cache's server from its pinned copy (or copied device to device from its copy in that GPU's
// memory), one request per call. Where the server cannot (no GPU on its side, memory CUDA IPC
// cannot share) the reads go to `fallback`, which reads them from the cache's copy, and the note
// says why.
class ResidentDma final : public ReadSource {
 public:
  explicit ResidentDma(ReadSource& fallback) : fallback_(fallback) {}
  bool serves(const CheckpointFile& file, const RangeRead& read, const ReadRangesOptions& options) const override;
  Stats read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
             const ReadRangesOptions& options) override;

 private:
  ReadSource& fallback_;
};

// How many threads at most tell a source's landed reads at once (see local_files.cpp).
unsigned landed_width(std::size_t pieces);

ResidentCopies resident_copies(const std::vector<CheckpointFile>& files, CacheUse use, const std::string& socket);

// The resident cache's copies of `files` in the memory of GPU `device`, mapped here
// (LoadOptions::share); objects at URLs and files past open_checkpoint's bound are not asked for.
struct SharedFiles {
  std::vector<std::optional<cache_detail::SharedCopy>> files;  // parallel to the checkpoint's files
  std::size_t held = 0;
  std::string socket;
  std::string why_not;  // the first file not shared and why ("" when all were)
  double ask_seconds = 0, map_seconds = 0;  // cache_detail::Shares'
};
// `wanted`: per file, whether to ask for it (a load of some tensors asks for their files only).
SharedFiles shared_copies(const std::vector<CheckpointFile>& files, const std::vector<bool>& wanted, CacheUse use, const std::string& socket,
                          int device);
// "; 3 of 17 files from the resident cache (host memory)" and the like, for a load's note.
std::string resident_note(const ResidentCopies& copies);

// Adds the read of bytes [offset, offset + into.size) of files[file] into `into` to `ranges`: joined
// to the last range where it continues that range both in the file and in memory and `same_allocation`
// says the two lie in one allocation (memory adjacent by address alone may be two allocations, which
// one copy into a GPU must not span: cudaErrorInvalidValue), so that many small tensors are read as
// one request. Returns whether it was joined. A read of no bytes adds nothing and returns false.
bool add_read(std::vector<RangeRead>& ranges, std::size_t file, std::uint64_t offset, MemorySpan into, bool same_allocation);

// Every read, each by the first source that serves it (ResidentDma, RemoteObjects, LocalFiles),
// at once where the source allows: the local reads as engine batches (the whole load one batch
// without `landed`; files that open_checkpoint did not keep open are opened again, a bounded number
// at a time, and checked to be the same files), the remote ones over the remote workers'
// connections. Returns the summed Stats, whose note says what was done.
Stats read_ranges(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, const ReadRangesOptions& options);

// Bytes [offset, offset + into.size()) of one file into host memory, with plain reads through the
// descriptor its header was read from (an object: the version its header came from). Returns how
// many bytes there were: fewer only where the file ends first. For headers and the verify passes.
std::size_t read_host_bytes(const CheckpointFile& file, std::uint64_t offset, std::span<std::byte> into, const ErrorContext& context);

// `file` with its descriptor held (opened again, and checked, where open_checkpoint did not keep
// it): for many read_host_bytes of one file.
CheckpointFile held_open(const CheckpointFile& file);

// How many files of one checkpoint stay open at once (open_checkpoint), and how many more a read
// opens again at a time (see its definition).
std::size_t open_file_bound();

}  // namespace hbmio::detail
