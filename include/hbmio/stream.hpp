// A stream of training batches: records of tensor shards read from storage into host or GPU
// memory ahead of the step that uses them.
//
// A shard is a file of records: a .npy array (records along its first dimension), a safetensors
// file (the chosen tensors, records along each one's first dimension: e.g. input_ids and labels
// side by side) or raw fixed-size records (dtype and record shape given). Every shard of a stream
// has the same fields (names, dtypes, record shapes); shards may hold any number of records.
//
// Each epoch orders the records (shards shuffled, then records shuffled within a window, both
// from the seed and the epoch: every rank computes the same order), gives each rank its own
// contiguous part of that order (every record read once per epoch across ranks) and cuts the
// part into batches. The stream's fill (a job of the library's pool) reads the next `read_ahead`
// batches into a fixed ring of batch buffers while the caller works on the current one, a group of
// batches per engine request, two requests in flight on two leased engines (one on a caller's
// `engine`): a group is read while the one before it drains.
//
//   hbmio::BatchStream stream(files, {.device = MemoryLocation::parse("cuda:0"), .batch_records = 4096});
//   while (auto batch = stream.next()) train_step(batch->fields[0]);   // valid until the next call
//
// A stream resumes exactly: position() after any batch says where this rank is (the epoch, the part
// of the epoch's record order being divided, among how many ranks, and how many batches this rank
// delivered of its part); a stream opened with it as `resume` delivers exactly the records not
// delivered yet, in the same order on every rank when the world is the same, and, with another
// world, divides the records no rank delivered among the new ranks (each read once, none repeated).
//
// Errors (a missing file, a shard that is not a whole number of records, a shard whose dtype or
// record shape differs from the first one's, a read failure) are hbmio::Error naming the file and
// byte, thrown by the next() that asks for the batch they stop; batches before it are delivered.
// A shard is read from the file its header was read from: the first 64 keep that descriptor; any
// other, opened again by path, must be the same file unchanged (device, inode, size, mtime), else
// the read throws Error(ESTALE) naming it as replaced.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hbmio/engine.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "hbmio/safetensors.hpp"

namespace hbmio {

enum class ShardFormat { automatic, npy, safetensors, raw };  // automatic: .npy, .safetensors, else raw

// Where a stream is in its epochs: small (no record lists), the same on every rank that delivered as
// many batches (what ranks in lockstep save), and checked against the stream it resumes.
struct StreamPosition {
  std::uint64_t epoch = 0;  // the epoch in progress
  // The part of the epoch's record order divided among ranks: intervals [first, end) of positions
  // in it, in order. Empty: the whole epoch (a resumed epoch with another world divides what is left).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> pool;
  unsigned world = 1;  // ranks the pool is divided among (by the rules of StreamOptions::drop_last)
  // Batches delivered (returned by next()) from each rank's part of the pool: one per rank of
  // `world`, or one for all of them (ranks in lockstep: a rank with fewer batches delivered all).
  std::vector<std::uint64_t> batches{0};
  // Where ranks are in different epochs (without drop_last a rank with one batch fewer goes on into
  // the next epoch while the others finish theirs): each rank's epoch, one per rank of `world`, with
  // `batches` then counting each rank's batches of its own epoch (a rank past `epoch` delivered all
  // of its part of it, and its later epochs are whole). Empty: every rank is in `epoch`. Such a
  // position resumes on as many ranks as it was saved on only (an Error otherwise).
  std::vector<std::uint64_t> epochs;
  // What the position belongs to, checked on resume (an error naming the mismatch). fingerprint
  // and fields are checked when not empty, batch_records when not 0; the rest always.
  std::string fingerprint;  // BatchStream::fingerprint(): the shards' names, sizes and headers
  std::string fields;       // BatchStream::fields_text(): every field's name, dtype and record shape
  std::uint64_t batch_records = 0, seed = 0, shuffle_window = 0;
  bool shuffle = false, drop_last = false;
};

struct StreamOptions {
  ShardFormat format = ShardFormat::automatic;
  // safetensors: the tensors to read from every shard (default: all of them, in name order).
  std::vector<std::string> tensors;
  // raw shards: one record's dtype and shape (required for raw, refused otherwise).
  std::optional<safetensors::Dtype> raw_dtype;
  std::vector<std::uint64_t> raw_record_shape;

  MemoryLocation device{};        // where batches land: host, pinned or cuda:N
  std::uint64_t batch_records = 0;  // records per batch (more than a rank's records: one batch); or
  std::uint64_t batch_bytes = 0;    // bytes per batch (all fields), rounded down to whole records
  unsigned read_ahead = 2;          // batches read ahead of the one the caller holds (1 to 4096)
  bool drop_last = false;  // drop each rank's last, partial batch, and give every rank as many records
  std::uint64_t epochs = 1;  // 0: until closed
  bool shuffle = false;
  std::uint64_t seed = 0;
  // Records are shuffled within windows of this many consecutive records of the shuffled shard
  // order (0: 16 batches). A window is one permutation; memory: 8 bytes per record of it.
  std::uint64_t shuffle_window = 0;
  unsigned rank = 0, world = 1;

  // Continue from this position (BatchStream::position() of this stream or of any rank of one over
  // the same shards with the same options; another world divides what is left of its epoch).
  std::optional<StreamPosition> resume;

  std::string backend;       // "": configured_backend() (HBMIO_BACKEND, else auto)
  // The caller's engine (kept for the stream's life; one request at a time); else two are leased,
  // half the configured workers each.
  Engine* engine = nullptr;
};

// One array of every batch: a tensor of the safetensors shards, or the .npy/raw array ("").
struct StreamField {
  std::string name;
  safetensors::Dtype dtype = safetensors::Dtype::U8;
  std::vector<std::uint64_t> record_shape;
  std::uint64_t record_bytes = 0;
};

struct Batch {
  std::uint64_t epoch = 0;
  std::uint64_t index = 0;    // within this rank's epoch
  std::uint64_t records = 0;  // <= batch_records (the last batch of an epoch may be short)
  bool last_of_epoch = false;
  std::vector<MemorySpan> fields;  // one per StreamField: records x record_bytes, in stream order
};

struct StreamStats {
  std::uint64_t epoch = 0;  // epochs completed (with epoch_stats: the epoch described)
  std::uint64_t batches = 0, records = 0, bytes = 0;
  double seconds = 0;       // from the first next() to the last batch delivered
  double read_seconds = 0;  // the stream's thread inside the engine
  double wait_seconds = 0;  // the caller inside next(), waiting for data: the number to tune
  // Per shard, the way its bytes moved and why (as Stats::paths), summed over the groups read so
  // far: a group's paths count once its whole read is done, so they may trail `bytes` a little
  // (and equal it once the stream has ended). stats() only: an epoch's (epoch_stats) has none, as
  // a group of batches may span two epochs.
  std::vector<TransferPath> paths;
  // The engine requests behind the batches (stats() only, as `paths`): how many groups of batches
  // were read as one request, their summed wall time, and of it (Stats) the workers' waking, the
  // requests' tails and the time blocked on copies to the GPU: where a stream below the page
  // cache's rate loses it.
  std::uint64_t groups = 0;
  double group_seconds = 0, wake_seconds = 0, drain_seconds = 0, copy_wait_seconds = 0;
  double records_per_second() const noexcept { return seconds > 0 ? static_cast<double>(records) / seconds : 0; }
  double gib_per_second() const noexcept { return seconds > 0 ? static_cast<double>(bytes) / seconds / (1u << 30) : 0; }
};

class BatchStream {
 public:
  // Starts the stream's thread, which opens the shards and reads their headers first; their
  // errors are thrown by next(). Throws Error(EINVAL) here only for options that cannot work
  // (no files, no batch size, rank >= world, raw without a dtype, ...).
  BatchStream(std::vector<std::string> files, StreamOptions options);
  ~BatchStream();  // close()
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  // The next batch, or nullopt after the last epoch. Blocks until it is read. The batch's memory
  // stays valid until the next call of next() or close(): the buffer then goes back to the ring
  // and is read into again. For device memory, pass the CUDA stream (cudaStream_t) that uses the
  // batch: its buffer is reused only after the work queued there by then has finished (without
  // one, the legacy default stream is waited for).
  std::optional<Batch> next(void* cuda_stream = nullptr);

  // The shards' fields (waits for the headers; throws their error).
  const std::vector<StreamField>& fields();
  // Records this rank gets per epoch (waits for the headers).
  std::uint64_t records_per_epoch();
  std::uint64_t batch_records();  // records of a full batch (waits for the headers)

  // Where this rank is: after the batches next() returned (the one the caller holds included).
  // Waits for the headers.
  StreamPosition position();
  std::string fingerprint();  // of the shards' names, sizes and headers (waits for them)
  std::string fields_text();  // "name:F32[5];..." (waits for the headers)

  StreamStats stats() const;                    // the whole stream so far
  std::vector<StreamStats> epoch_stats() const;  // one per completed epoch

  // Stops the thread (what is in flight completes first) and frees the ring. Idempotent.
  void close() noexcept;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace hbmio
