// BatchStream: one thread per stream plans each batch (which records of which shards, in which
// order), reads it through the engine into a free buffer of a fixed ring, and queues it for the
// caller. The engine does the parallel I/O (uring: every worker ring busy over the batch's ranges,
// bounce buffers copied to the GPU while the next chunks arrive); this thread only keeps it fed.
// Batches are read in groups (one engine request each, two in flight on two engines), and each
// batch is queued as soon as its own bytes have landed (the engine tells each read as it lands),
// in the stream's order: a group's first batch does not wait for its last.
//
//   caller: next() ──gives back the buffer it held──► free ring ──► stream thread: plan, read
//           ◄──────────────── ready queue ◄──────────────────────────────────────┘
//
// A device buffer given back is read into again only after the caller's CUDA stream has finished
// the work queued on it by then (an event recorded at next(), waited for by the stream thread).
#include "hbmio/stream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <iterator>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>

#include <sys/stat.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/executor.hpp"
#include "format/npy.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "io/engine_internal.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio {
namespace {

namespace st = safetensors;
using Clock = std::chrono::steady_clock;

__extension__ typedef unsigned __int128 u128;  // Lemire's bounded draw needs the high half of a 64x64 product

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Batches are read several at a time (one engine request), so that the engine's queue stays deep
// when each batch alone would be a few hundred KiB, and an engine request's start and drain are
// paid once per group rather than per batch; a group is at most this big, and at most half of the
// ring, so that two groups are in flight.
constexpr std::uint64_t kGroupBytes = 512ull << 20;
// Shard files kept open between batches; more are closed least recently used first (a whole
// shard's descriptors), and a shard opened again must still be the file its header came from.
constexpr std::size_t kOpenShards = 64;
// The ring holds read_ahead + 1 batch buffers: far more than a step can use, and a bound that keeps
// read_ahead + 1 from wrapping.
constexpr unsigned kMaxReadAhead = 4096;
constexpr std::size_t kSlotAlignment = 4096;

Error bad_option(const std::string& why) { return Error(errno_code(EINVAL), {.op = "open stream"}, why); }

std::string shape_text(const std::vector<std::uint64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Streams stop before this epoch (an endless one would count on from 0 after it).
constexpr std::uint64_t last_epoch = std::numeric_limits<std::uint64_t>::max();

// A reproducible sequence from (seed, epoch, what): splitmix64 steps. The same on every rank and
// every platform, which std::shuffle's distributions do not promise.
class Random {
 public:
  Random(std::uint64_t seed, std::uint64_t epoch, std::uint64_t what) : state_(mix(seed ^ mix(epoch ^ mix(what)))) {}
  std::uint64_t below(std::uint64_t n) {  // uniform in [0, n), Lemire's multiply-shift
    return static_cast<std::uint64_t>((static_cast<u128>(next()) * n) >> 64);
  }
  template <typename T>
  void shuffle(std::vector<T>& v) {  // Fisher-Yates
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }

 private:
  static std::uint64_t mix(std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t next() { return mix(state_++); }
  std::uint64_t state_;
};

// What fstat said of a shard when its header was read. A path opened again, and a descriptor
// kept open, must give the same file unchanged: a shard renamed over (another inode) or rewritten
// in place (np.save to the same path: the same inode, another size or mtime) would have its
// records read at the old header's offsets, as the old header's dtype. Not the ctime: it moves
// for what leaves the bytes alone (a rename over the path unlinks the file a descriptor still
// reads whole; chmod, a hard link), and a stream must not stop for those. A writer that puts the
// mtime back after changing the bytes in place is not seen.
struct ShardIdentity {
  std::uint64_t device = 0, inode = 0, size = 0;
  std::int64_t mtime_ns = 0;
  bool operator==(const ShardIdentity&) const = default;
};

ShardIdentity identity_of(const File& file) {
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) throw Error(errno_code(errno), {.op = "read shard", .path = file.path()}, "fstat");
  return {.device = static_cast<std::uint64_t>(st.st_dev), .inode = static_cast<std::uint64_t>(st.st_ino),
          .size = static_cast<std::uint64_t>(st.st_size),
          .mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec};
}

std::string identity_text(const ShardIdentity& id) {
  return fmt::format("device {}, inode {}, {} bytes, mtime {}.{:09}", id.device, id.inode, id.size, id.mtime_ns / 1'000'000'000,
                     id.mtime_ns % 1'000'000'000);
}

Error shard_changed(const std::string& path, const ShardIdentity& then, const ShardIdentity& now, const char* when) {
  return Error(errno_code(ESTALE), {.op = "read shard", .path = path},
               fmt::format("the file was replaced or changed {} ({} then; {} now): its records are not the ones the "
                           "stream planned; restart the stream",
                           when, identity_text(then), identity_text(now)));
}

struct Shard {
  std::string path;
  std::uint64_t records = 0;
  std::vector<std::uint64_t> field_offset;  // file offset of record 0 of each field
  ShardIdentity identity;                   // the file the header was read from
};

// A run of consecutive records of one shard, landing at consecutive positions of the batch.
struct Run {
  std::size_t shard = 0;
  std::uint64_t first = 0, count = 0, at = 0;
};

using Interval = std::pair<std::uint64_t, std::uint64_t>;  // [first, end) of positions in an epoch's order

// A rank's part of `total` records divided among `world` ranks: contiguous, in rank order; without
// drop_last the shares differ by one record at most (the first ranks one more), with it every rank
// gets the same whole batches (what DDP needs: as many steps on every rank) and the rest is dropped.
struct Part {
  std::uint64_t first = 0, records = 0, batches = 0;
};

Part part_of(std::uint64_t total, unsigned world, unsigned rank, std::uint64_t batch, bool drop_last) {
  const std::uint64_t base = total / world;
  const std::uint64_t extra = total % world;
  const std::uint64_t share = drop_last ? base : base + (rank < extra ? 1 : 0);
  const std::uint64_t batches = drop_last ? share / batch : share / batch + (share % batch != 0);  // no share + batch - 1: it wraps
  return {.first = drop_last ? rank * base : rank * base + std::min<std::uint64_t>(rank, extra),
          .records = drop_last ? batches * batch : share,
          .batches = batches};
}

// What an epoch divides among ranks: the whole of its order, or (an epoch resumed with another
// world) the pieces of it that no rank had delivered. Offsets into the pool count its records in order.
struct Split {
  std::vector<Interval> pool;              // non-empty, increasing, not touching
  std::vector<std::uint64_t> pool_starts;  // offset of each piece
  std::uint64_t records = 0;
  unsigned world = 1;
  std::uint64_t start_batch = 0;  // this rank's first batch to deliver (a resume with the same world)

  Split(std::vector<Interval> pieces, unsigned w) : world(w) {
    for (const Interval& piece : pieces) {
      if (piece.first == piece.second) continue;
      if (!pool.empty() && pool.back().second == piece.first) {
        pool.back().second = piece.second;
      } else {
        pool_starts.push_back(records);
        pool.push_back(piece);
      }
      records += piece.second - piece.first;
    }
  }
  // The position at pool offset `o`, and how many consecutive positions follow it in its piece.
  std::pair<std::uint64_t, std::uint64_t> locate(std::uint64_t o) const {
    const std::size_t j = static_cast<std::size_t>(std::upper_bound(pool_starts.begin(), pool_starts.end(), o) - pool_starts.begin() - 1);
    const std::uint64_t p = pool[j].first + (o - pool_starts[j]);
    return {p, pool[j].second - p};
  }
  // The pieces of pool offsets [lo, hi), appended to `out` (touching pieces merged).
  void pieces(std::uint64_t lo, std::uint64_t hi, std::vector<Interval>& out) const {
    while (lo < hi) {
      const auto [p, avail] = locate(lo);
      const std::uint64_t n = std::min(avail, hi - lo);
      if (!out.empty() && out.back().second == p) out.back().second += n;
      else out.emplace_back(p, p + n);
      lo += n;
    }
  }
};

struct BatchPlan {
  std::uint64_t epoch = 0, index = 0, records = 0;
  bool last_of_epoch = false;
  std::vector<Run> runs;
};

ShardFormat format_of(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".npy") return ShardFormat::npy;
  if (ext == ".safetensors") return ShardFormat::safetensors;
  return ShardFormat::raw;
}

const char* format_name(ShardFormat f) {
  switch (f) {
    case ShardFormat::npy: return ".npy";
    case ShardFormat::safetensors: return "safetensors";
    case ShardFormat::raw: return "raw";
    case ShardFormat::automatic: break;
  }
  return "automatic";
}

std::uint64_t record_bytes(st::Dtype dtype, const std::vector<std::uint64_t>& record_shape, const ErrorContext& context,
                           const std::string& name) {
  const auto bytes = st::tensor_byte_size(dtype, record_shape);
  if (bytes) return *bytes;
  // Either the bits overflow 64 bits (a header claiming a record no file holds) or a sub-byte
  // dtype's record does not end on a byte.
  std::uint64_t bits = st::bits_per_element(dtype);
  bool overflow = false;
  for (std::uint64_t d : record_shape) overflow = overflow || __builtin_mul_overflow(bits, d, &bits);
  throw Error(errno_code(EINVAL), context,
              fmt::format("a record of {}{} {} {}", name.empty() ? "" : name + ": ", st::to_string(dtype), shape_text(record_shape),
                          overflow ? "is more than 2^64 bytes: the header claims more than any file holds"
                                   : "is not a whole number of bytes"));
}

std::string fnv_hex(const std::string& text) {  // FNV-1a, 64 bits: the same everywhere
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return fmt::format("{:016x}", h);
}

std::string pool_text(const std::vector<Interval>& pool) {
  std::string out;
  for (const auto& [a, b] : pool) out += fmt::format("{}{}:{}", out.empty() ? "" : ",", a, b);
  return out.empty() ? "the whole epoch" : out;
}

Error state_mismatch(const std::string& why) { return Error(errno_code(EINVAL), {.op = "resume stream"}, "the stream state " + why); }

}  // namespace

struct BatchStream::State {
  std::vector<std::string> files;
  StreamOptions options;

  // Set once by the thread, before `scanned`.
  std::vector<StreamField> fields;
  std::vector<Shard> shards;
  std::uint64_t total_records = 0, records_per_rank = 0, batch_records = 0, batches_per_epoch = 0;
  std::string fingerprint, fields_text;
  // Where the epochs start: a resumed stream at options.resume's epoch, divided as `resumed` says
  // (or, when nothing of it was left, at the next epoch, whole).
  std::uint64_t first_epoch = 0;
  std::optional<Split> resumed;

  struct Slot {
    Buffer buffer;
    std::vector<std::size_t> field_offset;
    std::optional<cuda::Event> released;  // recorded on the caller's stream when given back
    int released_device = -1;             // the device `released` was made on
    bool event_pending = false;
  };
  struct Ready {
    Batch batch;
    int slot = -1;
    double read_seconds = 0;
  };
  // Batches whose bytes have landed wait here until every batch before them has (under the
  // mutex): the caller gets them in the stream's order. Numbered by the fill thread (next_number).
  std::map<std::uint64_t, Ready> landed_early;
  std::uint64_t next_number = 0, next_to_queue = 0;
  // A batch that could not be planned (its shard replaced) ends the stream: the batches after it,
  // though read, are never queued, and the caller gets the error once those before it are taken.
  std::uint64_t queue_end = UINT64_MAX;

  mutable std::mutex mutex;
  mutable std::condition_variable changed;  // waited on by const readers too (wait_scanned)
  bool scanned = false, finished = false;
  std::atomic<bool> stop{false};
  std::exception_ptr error;
  std::vector<Slot> slots;
  std::deque<int> free_slots;
  std::deque<Ready> ready;
  int held = -1;
  // The last batch next() returned (position()).
  bool delivered_any = false;
  std::uint64_t delivered_epoch = 0, delivered_index = 0;

  // Statistics, under the mutex.
  std::optional<Clock::time_point> first_call, epoch_started;
  StreamStats total_stats, epoch_stats;
  std::vector<StreamStats> epochs_done;

  bool filling = false;  // the fill job (run()) has not returned: close() waits for it

  void run() noexcept;
  void scan();
  // `first`: the first shard's fields, when this is a later shard (matched by name).
  Shard scan_one(const File& file, ShardFormat format, const std::vector<StreamField>* first, std::vector<StreamField>& fields_out) const;
  void plan_epoch(std::uint64_t number, const Split& split, const std::function<bool(BatchPlan&&)>& emit) const;
  void resume_from(const StreamPosition& position);
  // A group of batches being read: one engine request, in flight on the pool; each batch queued
  // for the caller as its last request lands (the engine tells the group, a LandedSink).
  struct Group final : LandedSink {
    State* state = nullptr;
    std::vector<IoRequest> requests;
    std::vector<Ready> done;                         // its batches, in order, until each lands
    std::vector<std::size_t> unlanded;               // per batch: its requests not landed yet (under the mutex)
    std::vector<std::size_t> batch_of;               // per request: its batch
    std::uint64_t first_number = 0;                  // the stream's number of done[0]
    Clock::time_point last_landed;                   // the read's start, then its last landing (under the mutex)
    std::vector<std::shared_ptr<const File>> files;  // what its requests read (trimmed from open_files meanwhile)
    std::vector<std::size_t> file_shards;            // per file: its shard
    std::exception_ptr failed;  // a shard that could not be opened: the batches before it are read first
    Stats read;  // what the engine did: which way it read each file, and where its time went (to the stream's stats)
    detail::Pending<void> reading;
    void landed(std::uint64_t request) noexcept override { state->landed(*this, batch_of[request]); }
  };
  std::unique_ptr<Group> start_group(std::vector<std::pair<int, BatchPlan>>& group, Engine& engine);
  void finish_group(Group& group);
  void landed(Group& group, std::size_t batch) noexcept;
  void check_shards(const Group& group, const char* when) const {
    for (std::size_t i = 0; i < group.files.size(); ++i) {
      const Shard& shard = shards[group.file_shards[i]];
      if (const ShardIdentity now = identity_of(*group.files[i]); now != shard.identity)
        throw shard_changed(shard.path, shard.identity, now, when);
    }
  }
  void queue_landed(Group& group, std::size_t batch) noexcept;
  int take_slot(bool wait);
  void wait_scanned(std::unique_lock<std::mutex>& lock) const;

  // Open shard files, least recently used last (used by the thread only). The first kOpenShards
  // are the descriptors their headers were read through; any other is opened again by path and
  // checked against the shard's identity.
  std::list<std::pair<std::size_t, std::shared_ptr<const File>>> open_files;
  std::shared_ptr<const File> file_of(std::size_t shard);
};

namespace {

void check_options(const std::vector<std::string>& files, const StreamOptions& o) {
  if (files.empty()) throw bad_option("no shard files given");
  if ((o.batch_records == 0) == (o.batch_bytes == 0)) throw bad_option("give a batch size: batch_records or batch_bytes (one of them)");
  if (o.read_ahead == 0 || o.read_ahead > kMaxReadAhead)
    throw bad_option(fmt::format("read_ahead must be 1 to {} batches, not {}", kMaxReadAhead, o.read_ahead));
  if (o.world == 0 || o.rank >= o.world) throw bad_option(fmt::format("rank {} is not in a world of {}", o.rank, o.world));
  const bool raw_asked = o.raw_dtype.has_value();
  if (o.format == ShardFormat::raw && !raw_asked) throw bad_option("raw shards need the record's dtype (and shape)");
  if (o.format != ShardFormat::raw && o.format != ShardFormat::automatic && raw_asked)
    throw bad_option(fmt::format("a record dtype is for raw shards, not {} ones", format_name(o.format)));
  if (!o.tensors.empty() && o.format != ShardFormat::safetensors && o.format != ShardFormat::automatic)
    throw bad_option("tensor names are for safetensors shards");
  if (o.resume) {
    const StreamPosition& r = *o.resume;
    if (r.seed != o.seed) throw state_mismatch(fmt::format("is of seed {}; this stream's is {}", r.seed, o.seed));
    if (r.shuffle != o.shuffle) throw state_mismatch(fmt::format("is of shuffle={}; this stream's is shuffle={}", r.shuffle, o.shuffle));
    if (r.drop_last != o.drop_last)
      throw state_mismatch(fmt::format("is of drop_last={}; this stream's is drop_last={}", r.drop_last, o.drop_last));
    if (r.shuffle_window != o.shuffle_window)
      throw state_mismatch(fmt::format("is of shuffle_window {}; this stream's is {}", r.shuffle_window, o.shuffle_window));
    if (o.batch_records != 0 && r.batch_records != 0 && r.batch_records != o.batch_records)
      throw state_mismatch(fmt::format("is of batches of {} records; this stream's are {}", r.batch_records, o.batch_records));
    if (r.world == 0) throw state_mismatch("is of a world of 0 ranks");
    if (r.batches.size() != 1 && r.batches.size() != r.world)
      throw state_mismatch(fmt::format("gives the batches of {} ranks for a world of {} (give one for all, or one per rank)",
                                       r.batches.size(), r.world));
  }
}

}  // namespace

BatchStream::BatchStream(std::vector<std::string> files, StreamOptions options) : state_(std::make_shared<State>()) {
  check_options(files, options);
  state_->files = std::move(files);
  state_->options = std::move(options);
  state_->filling = true;
  // close() waits for `filling` to fall, under the mutex; the job's last touch of the state is the
  // unlock after it, so the state (and its buffers) may go as soon as close() returns.
  detail::Executor::shared().post([state = state_.get()] {
    state->run();
    std::lock_guard lock(state->mutex);
    state->filling = false;
    state->changed.notify_all();
  });
}

BatchStream::~BatchStream() { close(); }

void BatchStream::close() noexcept {
  if (!state_) return;
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
    state_->finished = true;
  }
  state_->changed.notify_all();
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return !state_->filling; });
  state_->ready.clear();
}

void BatchStream::State::wait_scanned(std::unique_lock<std::mutex>& lock) const {
  changed.wait(lock, [&] { return scanned || error || stop; });
  if (!scanned) {
    if (error) std::rethrow_exception(error);
    throw Error(errno_code(ECANCELED), {.op = "stream"}, "the stream was closed");
  }
}

const std::vector<StreamField>& BatchStream::fields() {
  std::unique_lock lock(state_->mutex);
  state_->wait_scanned(lock);
  return state_->fields;
}

std::uint64_t BatchStream::records_per_epoch() {
  std::unique_lock lock(state_->mutex);
  state_->wait_scanned(lock);
  return state_->records_per_rank;
}

std::uint64_t BatchStream::batch_records() {
  std::unique_lock lock(state_->mutex);
  state_->wait_scanned(lock);
  return state_->batch_records;
}

std::string BatchStream::fingerprint() {
  std::unique_lock lock(state_->mutex);
  state_->wait_scanned(lock);
  return state_->fingerprint;
}

std::string BatchStream::fields_text() {
  std::unique_lock lock(state_->mutex);
  state_->wait_scanned(lock);
  return state_->fields_text;
}

StreamPosition BatchStream::position() {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  s.wait_scanned(lock);
  const StreamOptions& o = s.options;
  StreamPosition p{.world = o.world, .fingerprint = s.fingerprint, .fields = s.fields_text, .batch_records = s.batch_records,
                   .seed = o.seed, .shuffle_window = o.shuffle_window, .shuffle = o.shuffle, .drop_last = o.drop_last};
  // The resumed epoch's pool as a position gives it: empty where it is the whole epoch.
  const auto resumed_pool = [&] {
    const bool whole = s.resumed->pool.size() == 1 && s.resumed->pool[0] == Interval{0, s.total_records};
    return whole ? std::vector<Interval>{} : s.resumed->pool;
  };
  if (!s.delivered_any) {
    if (o.resume && o.resume->world == o.world) {  // nothing delivered since: where it resumed, as given
      p.epoch = o.resume->epoch;
      p.pool = o.resume->pool;
      p.world = o.resume->world;
      p.batches = o.resume->batches;
      p.epochs = o.resume->epochs;
    } else if (o.resume) {
      // Resumed on another number of ranks, nothing delivered since: the same moment in this
      // world's terms (what is left of the epoch, divided among these ranks, none of it delivered),
      // so that it merges with the states of ranks that did deliver since.
      p.epoch = s.first_epoch;
      if (s.resumed) p.pool = resumed_pool();
    }
    return p;
  }
  p.epoch = s.delivered_epoch;
  p.batches = {s.delivered_index + 1};  // a resumed part's batch indices continue from where it resumed
  if (s.resumed && s.delivered_epoch == s.first_epoch) {
    p.world = s.resumed->world;
    p.pool = resumed_pool();
  }
  return p;
}

StreamStats BatchStream::stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->total_stats;
}

std::vector<StreamStats> BatchStream::epoch_stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->epochs_done;
}

std::optional<Batch> BatchStream::next(void* cuda_stream) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  const Clock::time_point called = Clock::now();
  if (!s.first_call) s.first_call = called;
  if (s.held >= 0) {
    State::Slot& slot = s.slots[static_cast<std::size_t>(s.held)];
    // The caller's kernels may still be reading the batch, or, for pinned batches, a copy of it
    // to a GPU (batch.to("cuda", non_blocking=True)) may not have run yet: the thread waits for
    // this event, recorded on the caller's stream (of the batches' GPU; for pinned ones, of the
    // device current here), before reading into the buffer again.
    const int event_device = s.options.device.kind == MemoryKind::device ? s.options.device.device
                             : s.options.device.kind == MemoryKind::pinned ? cuda::current_device()  // -1: no CUDA used here
                                                                           : -1;
    if (event_device >= 0) {
      const ErrorContext context{.op = "give back a stream batch"};
      if (slot.released && slot.released_device != event_device) slot.released.reset();  // made on another device
      cuda::DeviceGuard guard(event_device, context);
      slot.released_device = event_device;
      if (!slot.released) slot.released.emplace(context);
      slot.released->record(cuda_stream, context);
      slot.event_pending = true;
    }
    s.free_slots.push_back(s.held);
    s.held = -1;
    s.changed.notify_all();
  }
  s.changed.wait(lock, [&] { return !s.ready.empty() || s.error || s.finished; });
  const Clock::time_point now = Clock::now();
  const double waited = seconds_between(called, now);
  s.total_stats.wait_seconds += waited;
  s.epoch_stats.wait_seconds += waited;
  if (s.ready.empty()) {
    if (s.error) std::rethrow_exception(s.error);
    return std::nullopt;
  }
  State::Ready r = std::move(s.ready.front());
  s.ready.pop_front();
  s.held = r.slot;
  s.delivered_any = true;
  s.delivered_epoch = r.batch.epoch;
  s.delivered_index = r.batch.index;
  std::uint64_t bytes = 0;
  for (const auto& f : r.batch.fields) bytes += f.size;
  for (StreamStats* st : {&s.total_stats, &s.epoch_stats}) {
    ++st->batches;
    st->records += r.batch.records;
    st->bytes += bytes;
    st->read_seconds += r.read_seconds;
  }
  if (!s.epoch_started) s.epoch_started = called;
  s.total_stats.seconds = seconds_between(*s.first_call, now);
  s.epoch_stats.seconds = seconds_between(*s.epoch_started, now);
  if (r.batch.last_of_epoch) {
    s.epoch_started.reset();
    s.epoch_stats.epoch = r.batch.epoch;
    s.epochs_done.push_back(s.epoch_stats);
    s.epoch_stats = {};
    s.total_stats.epoch = r.batch.epoch + 1;
  }
  return std::move(r.batch);
}

// ---- the stream's thread ----

void BatchStream::State::run() noexcept {
  try {
    // The batches' device is current on this pool thread while the stream fills (events), and
    // what was current before comes back for the pool's next job.
    std::optional<cuda::DeviceGuard> device;
    if (options.device.kind == MemoryKind::device) device.emplace(options.device.device, ErrorContext{.op = "stream"});
    scan();
    // Two groups in flight, on two engines, when the stream leases its own: an engine request
    // ends with its workers draining one by one, and a group's batches are read while the one
    // before drains rather than after it. A caller's engine serves one request at a time: one group.
    // The two share the configured workers: with a full set each, twice as many threads as cores
    // copied from the page cache, and each group's last workers waited for a core to start on
    // (bench/RESULTS.md, "Batch streams").
    std::vector<detail::EngineInUse> engines;
    const unsigned workers = Options::from_env().resolved_workers();
    engines.emplace_back(options.engine, options.backend, std::nullopt, nullptr, options.engine ? 0 : (workers + 1) / 2);
    if (options.engine == nullptr) engines.emplace_back(nullptr, options.backend, std::nullopt, nullptr, std::max(1u, workers / 2));
    std::deque<std::unique_ptr<Group>> in_flight;  // oldest first: delivered in this order
    std::size_t groups = 0;
    const auto finish_oldest = [&] {
      std::unique_ptr<Group> oldest = std::move(in_flight.front());
      in_flight.pop_front();
      finish_group(*oldest);
    };
    std::vector<std::pair<int, BatchPlan>> group;
    std::uint64_t group_bytes = 0;
    std::uint64_t record_total = 0;
    for (const auto& f : fields) record_total += f.record_bytes;
    const std::uint64_t group_target =
        std::max<std::uint64_t>(1, std::min<std::uint64_t>(kGroupBytes, options.read_ahead * batch_records * record_total / 2));
    const auto flush = [&] {
      if (!group.empty()) {
        in_flight.push_back(start_group(group, *engines[groups++ % engines.size()].get()));
        // The next group goes to the engine of the oldest: it must be done by then.
        if (in_flight.size() == engines.size()) finish_oldest();
      }
      group.clear();
      group_bytes = 0;
    };
    const auto deliver_all = [&] {
      flush();
      while (!in_flight.empty()) finish_oldest();
    };
    const auto emit = [&](BatchPlan&& plan) {
      // A buffer for this batch: when none is free, read what is gathered first (the caller never
      // waits on a batch held back for company), then let the oldest group finish (the caller
      // gives buffers back as it takes the batches that landed), and wait for the caller only when
      // nothing is being read.
      int slot = take_slot(false);
      while (slot < 0) {
        flush();
        if (in_flight.empty()) {
          slot = take_slot(true);
          if (slot < 0) return false;  // stopping
          break;
        }
        finish_oldest();
        slot = take_slot(false);
      }
      group_bytes += plan.records * record_total;
      group.emplace_back(slot, std::move(plan));
      if (group_bytes >= group_target) flush();
      return !stop;
    };
    const Split whole({{0, total_records}}, options.world);
    // (An endless stream stops before epoch 2^64-1: the count would wrap to 0 after it.)
    for (std::uint64_t e = first_epoch; (options.epochs == 0 || e < options.epochs) && e < last_epoch && !stop; ++e) {
      if (resumed && e == first_epoch) {
        plan_epoch(e, *resumed, emit);
        continue;
      }
      plan_epoch(e, whole, emit);
      if (batches_per_epoch == 0) break;  // an endless stream of nothing ends at once
    }
    if (!stop) deliver_all();
    // On a throw, a group still in flight is waited for as in_flight goes (Pending's destructor),
    // before the engines: declared after them.
  } catch (...) {
    std::lock_guard lock(mutex);
    if (!stop) error = std::current_exception();
  }
  {
    std::lock_guard lock(mutex);
    finished = true;
  }
  changed.notify_all();
  open_files.clear();
}

int BatchStream::State::take_slot(bool wait) {
  std::unique_lock lock(mutex);
  if (wait) changed.wait(lock, [&] { return !free_slots.empty() || stop; });
  if (stop || free_slots.empty()) return -1;
  const int slot = free_slots.front();
  free_slots.pop_front();
  return slot;
}

std::shared_ptr<const File> BatchStream::State::file_of(std::size_t shard) {
  for (auto it = open_files.begin(); it != open_files.end(); ++it)
    if (it->first == shard) {
      open_files.splice(open_files.begin(), open_files, it);
      return it->second;
    }
  // Opened again by path: it must be the file whose header planned the reads, else its bytes
  // would be read at that header's offsets as that header's dtype (garbage, with no error).
  const Shard& s = shards[shard];
  File file = File::open(s.path, OpenMode::read);
  const ShardIdentity now = identity_of(file);
  if (now != s.identity) throw shard_changed(s.path, s.identity, now, "after its header was read");
  open_files.emplace_front(shard, std::make_shared<const File>(std::move(file)));
  return open_files.front().second;
}

std::unique_ptr<BatchStream::State::Group> BatchStream::State::start_group(std::vector<std::pair<int, BatchPlan>>& group,
                                                                            Engine& engine) {
  auto g = std::make_unique<Group>();
  g->state = this;
  g->last_landed = Clock::now();
  // The caller's work still using a buffer given back (its step's kernels) is waited for by the
  // read, on the pool, not here: the group before this one is delivered meanwhile.
  std::vector<cuda::Event*> in_use;
  for (auto& [slot_index, plan] : group) {
    Slot& slot = slots[static_cast<std::size_t>(slot_index)];
    if (slot.event_pending) {
      in_use.push_back(&*slot.released);
      slot.event_pending = false;
    }
    Ready r{.batch = {.epoch = plan.epoch, .index = plan.index, .records = plan.records, .last_of_epoch = plan.last_of_epoch},
            .slot = slot_index};
    for (std::size_t f = 0; f < fields.size(); ++f)
      r.batch.fields.push_back(slot.buffer.span().subspan(slot.field_offset[f], plan.records * fields[f].record_bytes));
    const std::size_t planned = g->requests.size();
    try {
      for (const Run& run : plan.runs) {
        std::shared_ptr<const File> file = file_of(run.shard);
        for (std::size_t f = 0; f < fields.size(); ++f) {
          const std::uint64_t rb = fields[f].record_bytes;
          if (rb == 0) continue;
          g->requests.push_back({.op = IoOp::read, .file = file.get(), .offset = shards[run.shard].field_offset[f] + run.first * rb,
                                 .memory = r.batch.fields[f].subspan(run.at * rb, run.count * rb), .cancel = &stop,
                                 .landed = g.get(), .landed_tag = g->requests.size()});
          g->batch_of.push_back(g->done.size());
        }
        // Held once per run of runs from one shard (a shuffled batch has a run per record).
        if (g->files.empty() || g->files.back() != file) {
          g->files.push_back(std::move(file));
          g->file_shards.push_back(run.shard);
        }
      }
    } catch (const Error&) {
      // A shard that cannot be opened (or was replaced) stops this batch; the batches gathered
      // before it are read and delivered first, as a read error's would be.
      g->requests.resize(planned);
      g->batch_of.resize(planned);
      g->failed = std::current_exception();
      break;
    }
    g->unlanded.push_back(g->requests.size() - planned);
    g->done.push_back(std::move(r));
  }
  g->first_number = next_number;
  next_number += g->done.size();
  if (g->failed) {
    std::lock_guard lock(mutex);
    queue_end = std::min(queue_end, next_number);
  }
  {
    std::lock_guard lock(mutex);
    for (std::size_t b = 0; b < g->done.size(); ++b)
      if (g->unlanded[b] == 0) queue_landed(*g, b);  // nothing to read (records of no bytes)
  }
  while (open_files.size() > kOpenShards) open_files.pop_back();  // the group holds what it reads
  g->reading = detail::Executor::shared().start([this, &engine, group = g.get(), in_use = std::move(in_use)] {
    std::optional<cuda::DeviceGuard> device;  // as on the fill's thread (run())
    if (options.device.kind == MemoryKind::device) device.emplace(options.device.device, ErrorContext{.op = "stream"});
    for (cuda::Event* released : in_use) released->synchronize({.op = "wait for the caller's use of a stream batch"});
    {
      std::lock_guard lock(mutex);
      group->last_landed = Clock::now();
    }
    if (group->requests.empty()) return;
    // The shards as their headers were read, before and after the read (a descriptor kept open
    // sees a rewrite in place; see ShardIdentity): a change before fails the group's batches, one
    // during the read fails the stream at this group (batches of it may have been handed out).
    check_shards(*group, "after its header was read");
    group->read = engine.submit_batch(group->requests);
    check_shards(*group, "while its records were being read");
  });
  return g;
}

// Called by the engine as each request of a group lands: a batch whose last request it was is
// queued for the caller once every batch before it has been.
void BatchStream::State::landed(Group& g, std::size_t batch) noexcept {
  {
    std::lock_guard lock(mutex);
    if (g.unlanded[batch] == 0 || --g.unlanded[batch] > 0) return;  // a second tell of a batch is none
    queue_landed(g, batch);
  }
  changed.notify_all();
}

// Under the mutex: batch `batch` of `g` is all in place.
void BatchStream::State::queue_landed(Group& g, std::size_t batch) noexcept {
  try {
    const Clock::time_point now = Clock::now();
    Ready& r = g.done[batch];
    r.read_seconds = std::max(0.0, seconds_between(g.last_landed, now));  // a group's batches sum to its read
    g.last_landed = std::max(g.last_landed, now);
    landed_early.emplace(g.first_number + batch, std::move(r));
    for (auto it = landed_early.begin(); it != landed_early.end() && it->first == next_to_queue && it->first < queue_end;
         it = landed_early.erase(it)) {
      ready.push_back(std::move(it->second));
      ++next_to_queue;
    }
  } catch (...) {  // no memory to queue it: the stream ends with that
    if (!error) error = std::current_exception();
    queue_end = std::min(queue_end, next_to_queue);
  }
}

// Waits for a group's read: its batches were queued as they landed.
void BatchStream::State::finish_group(Group& g) {
  try {
    g.reading.get();
  } catch (const Error& e) {
    if (stop && e.code().value() == ECANCELED) return;
    throw;
  }
  std::lock_guard lock(mutex);
  // The whole stream's only: a group may span two epochs, and finishes after its batches were
  // handed out (StreamStats::paths).
  for (const TransferPath& path : g.read.paths) add_path(total_stats.paths, path);
  if (!g.requests.empty()) {
    ++total_stats.groups;
    total_stats.group_seconds += g.read.seconds;
    total_stats.wake_seconds += g.read.wake_seconds;
    total_stats.drain_seconds += g.read.drain_seconds;
    total_stats.copy_wait_seconds += g.read.copy_wait_seconds;
  }
  if (g.failed) std::rethrow_exception(g.failed);
  for (std::size_t b = 0; b < g.unlanded.size(); ++b)
    if (g.unlanded[b] > 0)  // every batch after it would wait for it, and the caller for them
      throw Error(errno_code(EIO), {.op = "stream"},
                  fmt::format("batch {} of epoch {} was read but never told landed by the engine", g.done[b].batch.index,
                              g.done[b].batch.epoch));
}

Shard BatchStream::State::scan_one(const File& file, ShardFormat format, const std::vector<StreamField>* first,
                                   std::vector<StreamField>& out) const {
  const std::string& path = file.path();
  Shard shard{.path = path, .identity = identity_of(file)};
  const std::uint64_t size = shard.identity.size;
  ErrorContext context{.op = "read shard header", .path = path};
  if (format == ShardFormat::npy) {
    std::vector<std::byte> head(std::min<std::uint64_t>(size, format::kNpyPrefixSize));
    file.read_at(head, 0);
    const std::uint64_t end = format::npy_header_end(head, path);
    if (end > size) throw Error(errno_code(EINVAL), context, fmt::format("the file ends at byte {}, inside its .npy header ({} bytes)", size, end));
    head.resize(end);
    file.read_at(head, 0);
    const format::NpyHeader h = format::parse_npy_header(head, path);
    if (h.shape.empty()) throw Error(errno_code(EINVAL), context, "a 0-d array holds no records (its shape is ())");
    StreamField field{.dtype = h.dtype, .record_shape = {h.shape.begin() + 1, h.shape.end()}};
    field.record_bytes = record_bytes(h.dtype, field.record_shape, context, "");
    shard.records = h.shape[0];
    // Checked: a header may claim any shape, and a wrapped product would pass the size check.
    std::uint64_t expected = 0;
    if (__builtin_mul_overflow(shard.records, field.record_bytes, &expected) || __builtin_add_overflow(expected, h.data_offset, &expected))
      throw Error(errno_code(EINVAL), context,
                  fmt::format("the .npy header lies: it claims shape {} ({} records of {} bytes from byte {}), more than 2^64 bytes; "
                              "the file is {} bytes",
                              shape_text(h.shape), shard.records, field.record_bytes, h.data_offset, size));
    if (size != expected) {
      context.offset = std::min(size, expected);
      throw Error(errno_code(EINVAL), context,
                  size < expected ? fmt::format("the file ends at byte {}, inside record {} of the {} its header claims ({} bytes each, from "
                                                "byte {}, {} bytes in all): a partial record, or a header that claims too much",
                                                size, (size - h.data_offset) / std::max<std::uint64_t>(field.record_bytes, 1),
                                                shard.records, field.record_bytes, h.data_offset, expected)
                                  : fmt::format("{} bytes follow the array's end at byte {}", size - expected, expected));
    }
    shard.field_offset = {h.data_offset};
    out = {std::move(field)};
  } else if (format == ShardFormat::safetensors) {
    const st::Header h = st::read_header(file.fd(), path);
    std::vector<std::string> names = options.tensors;
    if (names.empty()) {
      for (const auto& t : h.tensors) names.push_back(t.name);
      std::sort(names.begin(), names.end());
      // Every tensor of every shard, so the shards must hold the same ones: fields go by name,
      // and a later shard with another set would have its tensors read as the first's others.
      if (first != nullptr) {
        std::vector<std::string> expected;
        for (const StreamField& f : *first) expected.push_back(f.name);
        if (names != expected) {
          std::vector<std::string> extra, missing;
          std::set_difference(names.begin(), names.end(), expected.begin(), expected.end(), std::back_inserter(extra));
          std::set_difference(expected.begin(), expected.end(), names.begin(), names.end(), std::back_inserter(missing));
          throw Error(errno_code(EINVAL), context,
                      fmt::format("its tensors are not the first shard's ({}):{}{}; name the fields every shard holds with tensors=",
                                  files.front(), extra.empty() ? "" : fmt::format(" it also has {}", fmt::join(extra, ", ")),
                                  missing.empty() ? "" : fmt::format(" it lacks {}", fmt::join(missing, ", "))));
        }
      }
    }
    out.clear();
    for (const std::string& name : names) {
      const st::TensorInfo* t = h.find(name);
      if (t == nullptr) throw Error(errno_code(ENOENT), context, fmt::format("the file has no tensor '{}'", name));
      context.offset = h.data_offset + t->begin;
      if (t->shape.empty()) throw Error(errno_code(EINVAL), context, fmt::format("tensor '{}' is a scalar: it holds no records", name));
      StreamField field{.name = name, .dtype = t->dtype, .record_shape = {t->shape.begin() + 1, t->shape.end()}};
      field.record_bytes = record_bytes(t->dtype, field.record_shape, context, name);
      if (out.empty()) shard.records = t->shape[0];
      else if (t->shape[0] != shard.records)
        throw Error(errno_code(EINVAL), context,
                    fmt::format("tensor '{}' has {} records (first dimension), tensor '{}' {}: the tensors of a shard must agree",
                                name, t->shape[0], out.front().name, shard.records));
      shard.field_offset.push_back(h.data_offset + t->begin);
      out.push_back(std::move(field));
    }
  } else {
    StreamField field{.dtype = *options.raw_dtype, .record_shape = options.raw_record_shape};
    field.record_bytes = record_bytes(field.dtype, field.record_shape, context, "");
    if (field.record_bytes == 0) throw Error(errno_code(EINVAL), context, "raw records of 0 bytes");
    if (size % field.record_bytes != 0) {
      context.offset = size - size % field.record_bytes;
      throw Error(errno_code(EINVAL), context,
                  fmt::format("{} bytes are not a whole number of {}-byte records ({} {}): a partial record of {} bytes starts at byte {}",
                              size, field.record_bytes, st::to_string(field.dtype), shape_text(field.record_shape),
                              size % field.record_bytes, context.offset));
    }
    shard.records = size / field.record_bytes;
    shard.field_offset = {0};
    out = {std::move(field)};
  }
  return shard;
}

void BatchStream::State::scan() {
  std::vector<StreamField> first;
  std::vector<Shard> found;
  ShardFormat format = options.format == ShardFormat::automatic ? format_of(files.front()) : options.format;
  if (format == ShardFormat::raw && !options.raw_dtype)
    throw Error(errno_code(EINVAL), {.op = "open stream", .path = files.front()},
                "not a .npy or .safetensors file: raw records need their dtype (and shape)");
  if (format != ShardFormat::raw && options.raw_dtype)
    throw bad_option(fmt::format("a record dtype is for raw shards; {} is a {} file", files.front(), format_name(format)));
  for (const std::string& path : files) {
    if (stop) return;
    if (options.format == ShardFormat::automatic && format_of(path) != format)
      throw Error(errno_code(EINVAL), {.op = "open stream", .path = path},
                  fmt::format("a {} shard among {} shards ({} is the first)", format_name(format_of(path)), format_name(format), files.front()));
    std::vector<StreamField> these;
    File file = File::open(path, OpenMode::read);
    found.push_back(scan_one(file, format, found.empty() ? nullptr : &first, these));
    // The first shards keep the descriptor their header was read through: no path is opened
    // again for them, so nothing renamed over them later is read.
    if (open_files.size() < kOpenShards) open_files.emplace_back(found.size() - 1, std::make_shared<const File>(std::move(file)));
    if (found.size() == 1) {
      first = std::move(these);
      continue;
    }
    if (these.size() != first.size())  // scan_one matched the fields by name: never reached
      throw Error(errno_code(EINVAL), {.op = "read shard header", .path = path},
                  fmt::format("{} fields; the first shard ({}) has {}", these.size(), files.front(), first.size()));
    for (std::size_t f = 0; f < first.size(); ++f) {
      const StreamField& a = first[f];
      const StreamField& b = these[f];
      if (a.dtype != b.dtype || a.record_shape != b.record_shape)
        throw Error(errno_code(EINVAL), {.op = "read shard header", .path = path, .offset = found.back().field_offset[f]},
                    fmt::format("{}records are {} {}; the first shard's ({}) are {} {}", a.name.empty() ? "" : "tensor '" + a.name + "': ",
                                st::to_string(b.dtype), shape_text(b.record_shape), files.front(), st::to_string(a.dtype),
                                shape_text(a.record_shape)));
    }
  }
  std::uint64_t total = 0, record_total = 0;
  for (const Shard& s : found) total += s.records;
  for (const auto& f : first) record_total += f.record_bytes;
  std::uint64_t batch = options.batch_records;
  if (batch == 0) {
    if (record_total == 0) throw bad_option("batch_bytes cannot size batches of 0-byte records: give batch_records");
    batch = options.batch_bytes / record_total;
    if (batch == 0)
      throw bad_option(fmt::format("batch_bytes {} is less than one record ({} bytes)", options.batch_bytes, record_total));
  }
  const Part mine = part_of(total, options.world, options.rank, batch, options.drop_last);
  const std::uint64_t batches = mine.batches;
  const std::uint64_t per_rank = mine.records;

  // The shards' identity for a resume: their names (not directories: a copied dataset resumes),
  // sizes and headers, and the fields.
  std::string text;
  for (const auto& f : first) text += fmt::format("{}{}:{}{}", text.empty() ? "" : ";", f.name, st::to_string(f.dtype), shape_text(f.record_shape));
  std::string identity = fmt::format("{} shards;", found.size());
  for (const Shard& sh : found)
    identity += fmt::format("{}|{}|{}|{};", std::filesystem::path(sh.path).filename().string(), sh.identity.size, sh.records,
                            fmt::join(sh.field_offset, ","));
  {
    std::lock_guard lock(mutex);
    fields_text = text;
    fingerprint = fnv_hex(identity + text);
    shards = std::move(found);
    total_records = total;
    batch_records = batch;
  }
  std::uint64_t most = per_rank;
  if (options.resume) {
    resume_from(*options.resume);
    if (resumed) most = std::max(most, part_of(resumed->records, resumed->world, options.rank, batch, options.drop_last).records);
  }
  // No batch holds more than this rank's records: a batch size beyond them sizes the ring by them
  // (batch_records = 2^62 is one batch of everything, not 2^62 records' bytes that wrap).
  const std::uint64_t slot_records = std::min(batch, most);

  // The ring: the batch the caller holds plus read_ahead being read or waiting.
  std::vector<Slot> ring(options.read_ahead + 1);
  std::vector<std::size_t> offsets;
  std::size_t slot_bytes = 0;
  for (const auto& f : first) {
    offsets.push_back(slot_bytes);
    slot_bytes += (slot_records * f.record_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  }
  for (Slot& slot : ring) {
    slot.buffer = Buffer::allocate(options.device, std::max<std::size_t>(slot_bytes, 1));
    slot.field_offset = offsets;
  }
  std::lock_guard lock(mutex);
  fields = std::move(first);
  records_per_rank = per_rank;
  batches_per_epoch = batches;
  slots = std::move(ring);
  for (std::size_t i = 0; i < slots.size(); ++i) free_slots.push_back(static_cast<int>(i));
  scanned = true;
  changed.notify_all();
}

void BatchStream::State::resume_from(const StreamPosition& r) {
  // Checked here, where the shards are known; the options were checked at the constructor.
  if (!r.fields.empty() && r.fields != fields_text)
    throw state_mismatch(fmt::format("is of records {}; these shards' are {}", r.fields, fields_text));
  if (!r.fingerprint.empty() && r.fingerprint != fingerprint)
    throw state_mismatch(fmt::format("is from other shards (fingerprint {}; these {} shards' is {}): other files, sizes or headers",
                                     r.fingerprint, shards.size(), fingerprint));
  if (r.batch_records != 0 && r.batch_records != batch_records)
    throw state_mismatch(fmt::format("is of batches of {} records; this stream's are {}", r.batch_records, batch_records));
  if (r.epoch >= last_epoch) throw state_mismatch(fmt::format("is at epoch {}: streams stop before it", r.epoch));
  bool ahead = false;  // a rank in a later epoch than r.epoch
  if (!r.epochs.empty()) {
    if (r.epochs.size() != r.world || r.batches.size() != r.world)
      throw state_mismatch(fmt::format("gives the epochs of {} ranks and the batches of {} for a world of {}", r.epochs.size(),
                                       r.batches.size(), r.world));
    for (unsigned k = 0; k < r.world; ++k) {
      if (r.epochs[k] < r.epoch || r.epochs[k] == last_epoch)
        throw state_mismatch(fmt::format("puts rank {} in epoch {}, outside epochs {} to {}", k, r.epochs[k], r.epoch, last_epoch - 1));
      ahead = ahead || r.epochs[k] > r.epoch;
    }
  }
  if (ahead && r.world != options.world) {
    const auto k = static_cast<unsigned>(std::max_element(r.epochs.begin(), r.epochs.end()) - r.epochs.begin());
    throw state_mismatch(fmt::format(
        "was saved while ranks were in different epochs (rank {} in epoch {}, others in epoch {}): it resumes on the {} "
        "ranks it was saved on, not on {} (save it where every rank is in one epoch to change their number)",
        k, r.epochs[k], r.epoch, r.world, options.world));
  }
  std::uint64_t end = 0;
  for (const auto& [a, b] : r.pool)
    if (a >= b || a < end || b > total_records)
      throw state_mismatch(fmt::format("divides positions {} of an epoch of {} records: not increasing pieces inside it",
                                       pool_text(r.pool), total_records));
    else
      end = b;
  first_epoch = r.epoch;
  const Split old(r.pool.empty() ? std::vector<Interval>{{0, total_records}} : r.pool, r.world);
  // What no rank delivered: the rest of every rank's part, in rank order (positions in order).
  std::vector<Interval> left;
  std::uint64_t mine = 0;
  for (unsigned k = 0; k < r.world; ++k) {
    const Part part = part_of(old.records, r.world, k, batch_records, options.drop_last);
    const bool past = !r.epochs.empty() && r.epochs[k] > r.epoch;  // went on into a later epoch: delivered all of this one
    const std::uint64_t done = past ? part.batches : std::min(r.batches.size() == 1 ? r.batches[0] : r.batches[k], part.batches);
    if (k == options.rank) mine = done;
    old.pieces(part.first + (done == part.batches ? part.records : done * batch_records), part.first + part.records, left);
  }
  if (ahead && r.epochs[options.rank] > r.epoch) {
    // This rank (the same world: checked above) is in a later epoch, which is whole: its own part
    // of it from the batch it had come to (or the epoch after, where it had delivered all of it).
    first_epoch = r.epochs[options.rank];
    Split whole({{0, total_records}}, options.world);
    const std::uint64_t part = part_of(whole.records, options.world, options.rank, batch_records, options.drop_last).batches;
    if (r.batches[options.rank] >= part) {
      first_epoch += 1;
      return;
    }
    resumed.emplace(std::move(whole));
    resumed->start_batch = r.batches[options.rank];
    return;
  }
  if (left.empty()) {
    first_epoch = r.epoch + 1;  // the epoch was delivered whole: the next one, whole
    return;
  }
  if (r.world == options.world) {  // the same parts: every rank goes on with its own
    resumed.emplace(old);
    resumed->start_batch = mine;
  } else {  // another world: what is left, divided among the new ranks
    resumed.emplace(std::move(left), options.world);
  }
}

void BatchStream::State::plan_epoch(std::uint64_t number, const Split& split, const std::function<bool(BatchPlan&&)>& emit) const {
  // This epoch's shard order and where each shard starts in it.
  std::vector<std::size_t> order(shards.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (options.shuffle) Random(options.seed, number, 1).shuffle(order);
  std::vector<std::uint64_t> starts;
  std::uint64_t at = 0;
  for (std::size_t k : order) {
    starts.push_back(at);
    at += shards[k].records;
  }
  // 16 batches, saturating: a wrapped product would shrink the window to almost nothing.
  const std::uint64_t window = options.shuffle_window ? options.shuffle_window
                                                      : batch_records > UINT64_MAX / 16 ? UINT64_MAX : std::max<std::uint64_t>(16 * batch_records, 1);
  std::uint64_t window_index = UINT64_MAX;
  std::vector<std::uint64_t> permutation;
  // Position p of the epoch's order -> index into the shard order (windows shuffled in place).
  const auto record_at = [&](std::uint64_t p) {
    if (!options.shuffle) return p;
    const std::uint64_t w = p / window;
    if (w != window_index) {
      window_index = w;
      permutation.resize(std::min(window, total_records - w * window));
      for (std::uint64_t i = 0; i < permutation.size(); ++i) permutation[i] = i;
      Random(options.seed, number, 2 + w).shuffle(permutation);
    }
    return w * window + permutation[p - w * window];
  };
  // This rank's part of what the epoch divides (the pool: all of it, or what a resume left).
  const Part part = part_of(split.records, split.world, options.rank, batch_records, options.drop_last);
  for (std::uint64_t b = split.start_batch; b < part.batches; ++b) {
    BatchPlan plan{.epoch = number, .index = b, .last_of_epoch = b + 1 == part.batches};
    const std::uint64_t lo = b * batch_records;
    plan.records = std::min(batch_records, part.records - lo);
    for (std::uint64_t i = 0; i < plan.records;) {
      // A piece of the pool: consecutive positions.
      const auto [p, avail] = split.locate(part.first + lo + i);
      const std::uint64_t n = std::min(plan.records - i, avail);
      if (!options.shuffle) {
        // In order: one run per shard the piece crosses.
        for (std::uint64_t j = 0; j < n;) {
          const std::uint64_t q = p + j;
          const std::size_t k = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), q) - starts.begin() - 1);
          const std::uint64_t local = q - starts[k];
          const std::uint64_t m = std::min(n - j, shards[order[k]].records - local);
          plan.runs.push_back({.shard = order[k], .first = local, .count = m, .at = i + j});
          j += m;
        }
      } else {
        for (std::uint64_t j = 0; j < n; ++j) {
          const std::uint64_t q = record_at(p + j);
          const std::size_t k = static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), q) - starts.begin() - 1);
          const std::size_t shard = order[k];
          const std::uint64_t local = q - starts[k];
          if (!plan.runs.empty() && plan.runs.back().shard == shard && plan.runs.back().first + plan.runs.back().count == local)
            ++plan.runs.back().count;
          else
            plan.runs.push_back({.shard = shard, .first = local, .count = 1, .at = i + j});
        }
      }
      i += n;
    }
    if (!emit(std::move(plan))) return;
  }
}

}  // namespace hbmio
