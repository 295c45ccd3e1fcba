// The local-file source (source.hpp): reads through an engine, told per piece as it lands.
#include "source/source.hpp"

#include <fcntl.h>
#include <sys/resource.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "core/positional_io.hpp"

namespace fs = std::filesystem;

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

// At most as many threads check pieces at once as hash a load in one pass (xxh3_of_each): each
// may hold a pinned staging buffer for device memory.
unsigned landed_width(std::size_t pieces) {
  return static_cast<unsigned>(std::min<std::size_t>({pieces, std::max(1u, std::thread::hardware_concurrency()), 16}));
}

namespace {

// Bytes of a read that one landed call covers, with `landed`: a large read (a whole file of tensors
// back to back) is told in pieces, so that its tensors are checked on several threads at once.
constexpr std::uint64_t kLandedPiece = std::uint64_t{64} << 20;

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

}  // namespace

bool LocalFiles::serves(const CheckpointFile& file, const RangeRead&, const ReadRangesOptions&) const { return file.remote == nullptr; }

// One engine batch, unless the files to open again exceed the bound. With `landed`, reads are cut
// in pieces of kLandedPiece, each told as the engine lands it (PieceSink), while the rest of the
// batch is still being read.
Stats LocalFiles::read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
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
  // Bytes read from the resident cache's copy are that file's, the way they took the cache's.
  for (TransferPath& path : total.paths) {
    if (!path.file.ends_with(cache_detail::kCopySuffix)) continue;
    path.file.resize(path.file.size() - cache_detail::kCopySuffix.size());
    path.path = DataPath::cache_host;
    path.reason = fmt::format("the resident cache held the same file (device, inode, size, times) in shared host memory; {}", path.reason);
  }
  return total;
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

namespace hbmio {

// The one place a CheckpointFile is opened again (checkpoint.hpp).
std::shared_ptr<const File> CheckpointFile::open() const {
  if (remote)
    throw Error(errno_code(ENOTSUP), {.op = "open", .path = path}, "an object at a URL is read with read_remote, not opened as a file");
  if (file) return file;
  const int dir_fd = directory ? directory->fd() : AT_FDCWD;
  const std::string name = directory ? fs::path(path).filename().string() : path;
  auto opened = std::make_shared<const File>(File::open_at(dir_fd, name, path, OpenMode::read));
  if (opened->identity() != identity)
    throw Error(errno_code(ESTALE), {.op = "open", .path = path},
                "another file has taken this name since the checkpoint's headers were read (the checkpoint was "
                "replaced while being read): open it again");
  return opened;
}

}  // namespace hbmio
