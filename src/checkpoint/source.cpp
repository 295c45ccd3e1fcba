// Reads of a checkpoint's files, local or at a URL (source.hpp).
#include "checkpoint/source.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "cache/client.hpp"
#include "core/executor.hpp"
#include "core/positional_io.hpp"
#include "hbmio/config.hpp"

namespace hbmio::detail {

// Each file held open holds two descriptors (buffered and O_DIRECT): a sixteenth of the soft
// RLIMIT_NOFILE in files, for open_checkpoint's and for a read's reopened ones each, leaves three
// quarters of the limit to the engine's rings (one per worker) and the caller's own files. A
// 40-shard load under `ulimit -n 16` failed when every shard was held.
std::size_t open_file_bound() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 256;
  return std::clamp<std::size_t>(static_cast<std::size_t>(limit.rlim_cur / 16), 1, 256);
}

namespace {

// Bytes of a read that one landed call covers, with `landed`: a large read (a whole file of tensors
// back to back) is told in pieces, so that its tensors are checked on several threads at once.
constexpr std::uint64_t kLandedPiece = std::uint64_t{64} << 20;

// At most as many threads check pieces at once as hash a load in one pass (xxh3_of_each): each
// may hold a pinned staging buffer for device memory.
unsigned landed_width(std::size_t pieces) {
  return static_cast<unsigned>(std::min<std::size_t>({pieces, std::max(1u, std::thread::hardware_concurrency()), 16}));
}

// Tells ReadRangesOptions::landed of each piece as the engine lands it (LandedSink): right on the
// engine's thread where the caller says landed is quick, else on up to `width` pool jobs, which
// take the landed pieces in turn (checking a piece must not hold up the reads). A throw from
// landed is kept and rethrown by finish(), which waits for every piece told.
class PieceSink final : public LandedSink {
 public:
  struct Piece {
    std::size_t read;
    std::uint64_t at, length;
  };

  // `pieces`: how many will be added (the jobs' list is reserved for as many: see landed()).
  PieceSink(const ReadRangesOptions& options, unsigned width, std::size_t pieces)
      : options_(options), width_(std::max(width, 1u)), stop_(options.cancel != nullptr ? options.cancel : &own_stop_) {
    jobs_.reserve(pieces);
  }
  ~PieceSink() { finish_noexcept(); }  // the jobs reference `options` and the caller's memory
  PieceSink(const PieceSink&) = delete;
  PieceSink& operator=(const PieceSink&) = delete;

  std::uint64_t add(const Piece& piece) {
    std::lock_guard lock(mutex_);
    pieces_.push_back(piece);
    return pieces_.size() - 1;
  }

  void landed(std::uint64_t tag) noexcept override {
    std::unique_lock lock(mutex_);
    const Piece piece = pieces_[tag];
    if (options_.landed_quick) {
      lock.unlock();
      tell(piece);
      return;
    }
    try {
      landed_.push_back(piece);
    } catch (...) {  // no memory to queue it: the read fails with that
      if (!error_) error_ = std::current_exception();
      *stop_ = true;
      return;
    }
    if (active_ == width_) return;  // a job takes it when it is done with its own
    ++active_;
    try {
      // At most one job per piece: reserved, so that adding it cannot throw once the job exists
      // (a Pending dropped here would run drain() on this thread, which holds the mutex).
      jobs_.push_back(Executor::shared().start([this] { drain(); }));
    } catch (...) {
      --active_;  // finish() tells what no job took
    }
  }

  // After the last batch: waits for every piece's landed call; rethrows the first throw.
  void finish() {
    std::vector<Pending<void>> jobs;
    {
      std::lock_guard lock(mutex_);
      jobs.swap(jobs_);
    }
    for (Pending<void>& job : jobs) job.get();  // drain() throws nothing
    std::deque<Piece> left;  // no job could be started for these: told here
    {
      std::lock_guard lock(mutex_);
      left.swap(landed_);
    }
    for (const Piece& piece : left) tell(piece);
    std::lock_guard lock(mutex_);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // The requests' `cancel`: the caller's (ReadRangesOptions::cancel) or the sink's own, set once a
  // landed call threw, so that the engine stops at its next chunk rather than read the rest of a
  // checkpoint that already failed its check.
  const std::atomic<bool>* stop() const noexcept { return stop_; }
  bool threw() {
    std::lock_guard lock(mutex_);
    return error_ != nullptr;
  }

 private:
  void finish_noexcept() noexcept {
    try {
      finish();
    } catch (...) {
    }
  }

  void drain() noexcept {
    std::unique_lock lock(mutex_);
    while (!landed_.empty()) {
      const Piece piece = landed_.front();
      landed_.pop_front();
      lock.unlock();
      tell(piece);
      lock.lock();
    }
    --active_;
  }

  void tell(const Piece& piece) noexcept {
    try {
      options_.landed(piece.read, piece.at, piece.length);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      *stop_ = true;
    }
  }

  const ReadRangesOptions& options_;
  const unsigned width_;
  std::mutex mutex_;
  std::deque<Piece> pieces_;  // by tag; a deque: a told piece is copied out under the mutex
  std::deque<Piece> landed_;  // told by the engine, not yet by a job
  std::vector<Pending<void>> jobs_;
  unsigned active_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> own_stop_{false};
  std::atomic<bool>* const stop_;
};

// The local reads, as engine batches: one, unless the files to open again exceed the bound. With
// `landed`, reads are cut in pieces of kLandedPiece, each told as the engine lands it (PieceSink),
// while the rest of the batch is still being read.
Stats read_local(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
                 const ReadRangesOptions& options) {
  Engine& engine = options.engine();
  Stats total;
  std::size_t batches = 0;
  std::vector<IoRequest> requests;
  std::vector<std::shared_ptr<const File>> reopened;
  std::optional<PieceSink> sink;
  if (options.landed) {
    std::size_t pieces = 0;
    for (const std::size_t i : which) pieces += static_cast<std::size_t>((reads[i].into.size + kLandedPiece - 1) / kLandedPiece);
    sink.emplace(options, landed_width(pieces), pieces);
  }
  const auto flush = [&] {
    if (requests.empty()) return;
    Stats part;
    try {
      part = engine.submit_batch(requests);
    } catch (...) {
      if (sink && sink->threw()) sink->finish();  // the check that stopped the reads is the error
      throw;
    }
    if (batches++ == 0) total = std::move(part);  // its note says what the engine did
    else total.add_part(part);
    requests.clear();
    reopened.clear();
  };
  const std::size_t bound = open_file_bound();
  std::size_t last_file = SIZE_MAX;
  const File* handle = nullptr;
  for (const std::size_t i : which) {
    const RangeRead& read = reads[i];
    const std::uint64_t piece = options.landed ? kLandedPiece : read.into.size;
    for (std::uint64_t at = 0; at < read.into.size; at += piece) {
      const std::uint64_t length = std::min<std::uint64_t>(piece, read.into.size - at);
      if (read.file != last_file) {
        last_file = read.file;
        if (options.resident && options.resident->files[read.file]) {
          handle = options.resident->files[read.file].get();
        } else if (files[read.file].file) {
          handle = files[read.file].file.get();
        } else {
          if (reopened.size() == bound) flush();
          reopened.push_back(files[read.file].open());
          handle = reopened.back().get();
        }
      }
      IoRequest request{.op = IoOp::read, .file = handle, .offset = read.offset + at,
                        .memory = read.into.subspan(at, static_cast<std::size_t>(length)), .progress = options.progress,
                        .cancel = options.cancel};
      if (sink) {
        request.landed = &*sink;
        request.landed_tag = sink->add({i, at, length});
        request.cancel = sink->stop();
      }
      requests.push_back(request);
    }
  }
  flush();
  if (sink) sink->finish();  // on a throw above, its destructor waits for the pieces told
  if (batches > 1)
    total.note = fmt::format("{} batches (the files were opened a bounded number at a time){}", batches,
                             total.note.empty() ? "" : "; " + total.note);
  return total;
}

// The reads of `local` that go into GPU memory from files the resident cache holds, DMA'd by the
// cache's server from its pinned copies (one request per GPU); the reads left for read_local are
// returned. Where the server cannot (no GPU on its side, memory CUDA IPC cannot share), none is
// taken and `note` says why: they are then read from the cache's copy through the engine.
std::vector<std::size_t> dma_from_cache(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads,
                                        const std::vector<std::size_t>& local, const ReadRangesOptions& options, Stats& stats,
                                        std::string& note) {
  const ResidentCopies& resident = *options.resident;
  std::vector<cache_detail::DeviceCopy> copies;
  std::vector<std::size_t> taken, rest;
  std::vector<int> fds;
  std::map<std::size_t, std::size_t> fd_of;  // file -> index into fds
  for (const std::size_t i : local) {
    const RangeRead& read = reads[i];
    if (!resident.files[read.file] || read.into.location.kind != MemoryKind::device) {
      rest.push_back(i);
      continue;
    }
    auto [it, added] = fd_of.emplace(read.file, fds.size());
    if (added) fds.push_back(files[read.file].file->fd());
    copies.push_back({it->second, read.offset, read.into.data, read.into.size, read.into.location.device});
    taken.push_back(i);
  }
  if (copies.empty()) return local;
  const auto start = std::chrono::steady_clock::now();
  const cache_detail::CopyOutcome outcome = cache_detail::copy_to_device(resident.socket, fds, copies);
  if (!outcome.failed.empty()) {
    note = fmt::format("the resident cache's server could not DMA into GPU memory ({}): read from its copy instead", outcome.failed);
    return local;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::uint64_t bytes = 0;
  for (const std::size_t i : taken) {
    const RangeRead& read = reads[i];
    bytes += read.into.size;
    const bool on_gpu = outcome.files_on_gpu.contains({read.into.location.device, fd_of.at(read.file)});
    stats.add_path({.file = files[read.file].path,
                    .path = on_gpu ? DataPath::cache_device : DataPath::cache_host,
                    .reason = on_gpu ? "the resident cache held the same file (device, inode, size, times) and a copy of it in this "
                                       "GPU's memory: its server copied it device to device"
                                     : "the resident cache held the same file (device, inode, size, times): its server DMA'd it from its "
                                       "pinned copy straight into GPU memory",
                    .bytes = read.into.size,
                    .bytes_direct = read.into.size});
  }
  stats.bytes += bytes;
  stats.bytes_direct += bytes;
  if (stats.backend.empty()) stats.backend = "cache";
  if (options.progress) *options.progress += bytes;
  // The server's share of the time, so that a slow hit says where it went.
  note = fmt::format("{} of GPU memory DMA'd by the resident cache's server in {:.3f} s ({} of it from its copy in the GPU's "
                     "memory; the server: {:.3f} s opening the destination's IPC handles, {:.3f} s copying)",
                     format_size(bytes), seconds, format_size(outcome.gpu_bytes), outcome.open_seconds, outcome.copy_seconds);
  if (options.landed)
    Executor::shared().run(taken.size(), landed_width(taken.size()), [&](std::size_t k) {
      options.landed(taken[k], 0, reads[taken[k]].into.size);
    });
  return rest;
}

}  // namespace

Stats read_ranges(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, const ReadRangesOptions& options) {
  std::vector<std::size_t> local;
  std::vector<std::size_t> remote_index;  // into `reads`, per remote read
  std::vector<RemoteRead> remote;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const RangeRead& read = reads[i];
    if (read.file >= files.size())
      throw Error(errno_code(EINVAL), {.op = "read"}, fmt::format("file index {} (the checkpoint holds {})", read.file, files.size()));
    if (read.into.size == 0) continue;
    if (const RemoteObject* object = files[read.file].remote.get()) {
      remote.push_back({object, read.offset, read.into});
      remote_index.push_back(i);
    } else {
      local.push_back(i);
    }
  }
  Stats total;
  std::string dma_note;
  if (options.resident && options.resident->held > 0) local = dma_from_cache(files, reads, local, options, total, dma_note);
  if (!local.empty()) {
    Stats part = read_local(files, reads, local, options);
    if (total.bytes == 0) total = std::move(part);
    else total.add_part(part);
  }
  // Bytes read from the resident cache's copy are that file's, the way they took the cache's.
  for (TransferPath& path : total.paths) {
    if (!path.file.ends_with(cache_detail::kCopySuffix)) continue;
    path.file.resize(path.file.size() - cache_detail::kCopySuffix.size());
    path.path = DataPath::cache_host;
    path.reason = fmt::format("the resident cache held the same file (device, inode, size, times) in shared host memory; {}", path.reason);
  }
  if (!remote.empty()) {
    LandedFunction landed;
    if (options.landed)
      landed = [&](std::size_t k, std::uint64_t at, std::uint64_t length) { options.landed(remote_index[k], at, length); };
    Stats part = read_remote(remote, options.remote ? *options.remote : remote.front().object->options(), options.progress, landed);
    if (total.bytes == 0) total = std::move(part);
    else total.add_part(part);
  }
  if (!dma_note.empty()) total.note = dma_note + (total.note.empty() ? "" : "; " + total.note);
  return total;
}

ResidentCopies resident_copies(const std::vector<CheckpointFile>& files, CacheUse use, const std::string& socket) {
  ResidentCopies out;
  out.files.resize(files.size());
  if (use == CacheUse::off) return out;
  bool add = use == CacheUse::add;
  out.socket = socket;
  if (use == CacheUse::configured) {
    if (out.socket.empty()) out.socket = configured_cache_socket();
    if (out.socket.empty()) return out;  // no cache configured
    add = configured_cache_add();
  }
  if (out.socket.empty()) out.socket = configured_cache_socket();
  if (out.socket.empty()) out.socket = default_cache_socket();
  std::vector<int> fds;
  std::vector<std::string> paths;
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < files.size(); ++i)
    if (files[i].file && !files[i].remote) {
      fds.push_back(files[i].file->fd());
      paths.push_back(files[i].path);
      which.push_back(i);
    }
  if (fds.empty()) return out;
  cache_detail::Lookup found = cache_detail::lookup(out.socket, fds, paths, add);
  for (std::size_t k = 0; k < which.size(); ++k)
    if (found.copies[k]) {
      out.files[which[k]] = std::move(found.copies[k]);
      ++out.held;
    }
  if (!found.warning.empty()) {
    out.warning = fmt::format("the resident cache could not help, files read instead: {}", found.warning);
    // Once per process and reason: a loop of loads against a stopped server says it once.
    static std::mutex said_mutex;
    static std::set<std::string> said;
    std::lock_guard lock(said_mutex);
    if (said.insert(found.warning).second) fmt::print(stderr, "hbmio: warning: {}\n", out.warning);
  }
  return out;
}

SharedFiles shared_copies(const std::vector<CheckpointFile>& files, const std::vector<bool>& wanted, CacheUse use, const std::string& socket,
                          int device) {
  SharedFiles out;
  out.files.resize(files.size());
  if (use == CacheUse::off) throw Error(errno_code(EINVAL), {.op = "load", .path = files.front().path}, "share asks the resident cache, which the load turns off");
  // Asked for explicitly: the configured socket where there is one, else the default (as CacheUse::use).
  out.socket = socket;
  if (out.socket.empty()) out.socket = configured_cache_socket();
  if (out.socket.empty()) out.socket = default_cache_socket();
  std::vector<int> fds;
  std::vector<std::uint64_t> sizes;
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (!wanted[i]) continue;
    if (files[i].file && !files[i].remote) {
      fds.push_back(files[i].file->fd());
      sizes.push_back(files[i].file->size_at_open());
      which.push_back(i);
    } else if (out.why_not.empty()) {
      out.why_not = fmt::format("{}: {}", files[i].path, files[i].remote ? "an object at a URL" : "not held open by this load");
    }
  }
  if (fds.empty()) return out;
  cache_detail::Shares shares = cache_detail::share_from_device(out.socket, fds, sizes, device);
  out.ask_seconds = shares.ask_seconds;
  out.map_seconds = shares.map_seconds;
  for (std::size_t k = 0; k < which.size(); ++k) {
    if (shares.copies[k]) {
      out.files[which[k]] = std::move(shares.copies[k]);
      ++out.held;
    } else if (out.why_not.empty()) {
      out.why_not = fmt::format("{}: {}", files[which[k]].path, shares.reasons[k]);
    }
  }
  return out;
}

std::string resident_note(const ResidentCopies& copies) {
  if (!copies.warning.empty()) return "; " + copies.warning;
  if (copies.socket.empty()) return {};
  return fmt::format("; {} of {} file(s) from the resident cache at {}", copies.held, copies.files.size(), copies.socket);
}

std::size_t read_host_bytes(const CheckpointFile& file, std::uint64_t offset, std::span<std::byte> into, const ErrorContext& context) {
  if (file.remote) {
    // A ranged GET must lie within the object: what is past its end is not asked for.
    const std::uint64_t size = file.remote->size();
    const std::size_t n = offset >= size ? 0 : static_cast<std::size_t>(std::min<std::uint64_t>(into.size(), size - offset));
    if (n > 0) file.remote->read(offset, {into.data(), n, {}});
    return n;
  }
  const std::shared_ptr<const File> handle = file.open();
  return read_fully(handle->fd(), into, offset, context);
}

CheckpointFile held_open(const CheckpointFile& file) {
  CheckpointFile held = file;
  if (!held.remote && !held.file) held.file = file.open();
  return held;
}

}  // namespace hbmio::detail
