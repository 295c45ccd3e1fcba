// Background saves: the snapshot on the caller's thread, then on a thread of the library's pool the
// persist step that a blocking save runs (persist.hpp).
//
// Pinned staging streams: the caller copies each tensor, in file order, into 64 MiB blocks of the
// pinned pool and queues the pieces; the save's thread, started first, takes whatever is queued
// each time it is ready for more (so its writes begin with the first piece and overlap the rest
// of the snapshot), writes and hashes it and drops it, which returns its blocks to the pool. A state that fits the pool is copied at the speed of
// device-to-host copies and the call returns; a larger one waits for blocks as the writer frees
// them (the report's stalled_seconds). Device staging copies into one device buffer and persists
// from the copies.
#include "hbmio/async_save.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "checkpoint/background_saves.hpp"
#include "checkpoint/commit.hpp"
#include "checkpoint/persist.hpp"
#include "checkpoint/save_layout.hpp"
#include "checkpoint/staging.hpp"
#include "core/error_boundary.hpp"
#include "core/executor.hpp"
#include "hbmio/error.hpp"

namespace hbmio {

namespace detail {

struct AsyncSaveState {
  std::string path;    // as the caller gave it
  std::string target;  // what the save replaces: "one save per path" is one per target
  std::vector<TensorToSave> tensors;  // names, dtypes, shapes, sizes; data where staged on a device
  SaveOptions options;
  StagedStream stream;
  std::optional<Buffer> device_copy;  // Staging::device
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  // The writer's stop request (options.cancel points to it unless the caller gave one); cancel().
  std::atomic<bool> cancelled{false};

  mutable std::mutex mutex;
  std::condition_variable finished_cv;
  bool finished = false;
  bool observed = false;  // the error (if any) reached someone through wait()
  bool blocking = false;  // a blocking save's turn (BlockingSaveTurn): its caller sees its error
  std::optional<Stats> stats;
  std::exception_ptr error;
  AsyncSaveReport report;
};

namespace {

// Saves in flight, and failed ones whose error nobody has seen, by target.
struct Registry {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, std::shared_ptr<AsyncSaveState>> by_target;
};
Registry* current_registry = nullptr;  // never destroyed: saves may finish during static destruction
std::vector<std::string> inherited_at_fork;  // set in a child of fork() (see saves_inherited_at_fork)

// fork() while saves are in flight: the child has only the forking thread, so the writers of those
// saves do not exist there. Left registered, the child's exit handler (wait_for_all_saves) and any
// save of the same path would wait for them forever. The registry's lock and every registered
// save's are held across fork(), so the child sees them consistent and may take them again; the
// child then gets an empty registry, and each inherited save that had not finished is marked
// failed (ECHILD) there, so a handle to it in the child raises instead of waiting.
void before_fork() {
  current_registry->mutex.lock();
  for (auto& [target, state] : current_registry->by_target) state->mutex.lock();
}
void after_fork_in_parent() {
  for (auto& [target, state] : current_registry->by_target) state->mutex.unlock();
  current_registry->mutex.unlock();
}
void after_fork_in_child() {
  Registry* inherited = current_registry;
  inherited_at_fork.clear();
  for (auto& [target, state] : inherited->by_target) {
    if (!state->finished) {
      if (!state->blocking) inherited_at_fork.push_back(state->path);
      state->error = std::make_exception_ptr(
          Error(errno_code(ECHILD), {.op = "save", .path = state->path},
                "this process is a child forked while the save was in flight; the save goes on in the parent only"));
      state->observed = true;  // the parent reports its own saves: the child says nothing at exit
      state->finished = true;
    }
    state->mutex.unlock();
  }
  inherited->by_target.clear();
  inherited->mutex.unlock();
  // A fresh registry all the same: the old condition variable may have had waiters (threads the
  // child does not have) registered in it.
  current_registry = new Registry();
}

Registry& registry() {
  static std::once_flag made;
  std::call_once(made, [] {
    current_registry = new Registry();
    ::pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
  });
  return *current_registry;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void finish(const std::shared_ptr<AsyncSaveState>& state, std::optional<Stats> stats, std::exception_ptr error) {
  state->device_copy.reset();  // device staging goes back at once
  {
    std::lock_guard lock(state->mutex);
    if (stats) state->report.paths = stats->paths;
    state->stats = std::move(stats);
    state->error = error;
    state->report.persist_seconds = seconds_since(state->started);
    state->finished = true;
  }
  state->finished_cv.notify_all();
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    const auto it = r.by_target.find(state->target);
    // A failed save stays until its error is seen (wait(), or the next save of the path).
    if (it != r.by_target.end() && it->second == state && !error) r.by_target.erase(it);
  }
  r.changed.notify_all();
}

// The save a thread of the pool is persisting (wait_for_background_saves_of never waits for it).
thread_local const AsyncSaveState* persisting = nullptr;

// The save's thread: the persist step over the snapshot.
void persist_snapshot(std::shared_ptr<AsyncSaveState> state) {
  struct Persisting {
    explicit Persisting(const AsyncSaveState* s) { persisting = s; }
    ~Persisting() { persisting = nullptr; }
    Persisting(const Persisting&) = delete;
    Persisting& operator=(const Persisting&) = delete;
  } marked(state.get());
  try {
    Stats stats = persist(state->path, state->tensors, state->options, state->device_copy ? nullptr : &state->stream);
    finish(state, std::move(stats), nullptr);
  } catch (...) {
    state->stream.fail();  // a snapshot still copying stops
    finish(state, std::nullopt, std::current_exception());
  }
}

// Waits for a save of the same target still in flight, then registers `state` as the one in
// flight, under the same lock (two saves waiting for one must not both start); throws the error
// of one that failed unseen. Returns the seconds waited.
double take_turn(const std::shared_ptr<AsyncSaveState>& state, bool wait_if_busy, const std::atomic<bool>* cancel) {
  const std::string& target = state->target;
  const std::string& path = state->path;
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto it = r.by_target.find(target);
    if (it == r.by_target.end()) {
      r.by_target.emplace(target, state);
      return seconds_since(start);
    }
    const std::shared_ptr<AsyncSaveState> earlier = it->second;
    std::unique_lock state_lock(earlier->mutex);
    if (earlier->finished) {
      r.by_target.erase(it);
      if (earlier->error && !earlier->observed) {
        earlier->observed = true;
        try {
          std::rethrow_exception(earlier->error);
        } catch (const Error& e) {
          throw Error(e.code(), {.op = "save", .path = path},
                      fmt::format("an earlier background save of this path failed and was never waited for: {}; "
                                  "this save was not started",
                                  e.what()));
        }
      }
      continue;
    }
    // Named as the caller would know it: a blocking save on another thread holds its turn too.
    const char* const earlier_kind = earlier->blocking ? "blocking" : "background";
    state_lock.unlock();
    if (!wait_if_busy)
      throw Error(errno_code(EBUSY), {.op = "save", .path = path},
                  fmt::format("a {} save of this path is still in flight", earlier_kind));
    if (cancel == nullptr) {
      r.changed.wait(lock);
      continue;
    }
    // A stop request is a flag, not a notification: look at it every few milliseconds.
    r.changed.wait_for(lock, std::chrono::milliseconds(5));
    if (cancel->load())
      throw Error(errno_code(ECANCELED), {.op = "save", .path = path},
                  fmt::format("stopped while waiting for an earlier {} save of this path; this save was not started",
                              earlier_kind));
  }
}

}  // namespace

BlockingSaveTurn::BlockingSaveTurn(const std::string& target, const std::string& path, const std::atomic<bool>* cancel)
    : state_(std::make_shared<AsyncSaveState>()) {
  state_->target = target;
  state_->path = path;
  state_->blocking = true;
  state_->observed = true;
  take_turn(state_, true, cancel);
}

BlockingSaveTurn::~BlockingSaveTurn() {
  {
    std::lock_guard lock(state_->mutex);
    state_->finished = true;
  }
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    const auto it = r.by_target.find(state_->target);
    if (it != r.by_target.end() && it->second == state_) r.by_target.erase(it);
  }
  r.changed.notify_all();
}

namespace {

// The keys under which a save of what a load opens at `path` is registered (save_key of
// final_target): the path itself, and the directory holding it (a sharded save's target, when its
// index or a shard is opened). A path that cannot be followed gives none.
void add_save_keys(const std::string& path, std::vector<std::string>& keys) {
  try {
    const std::filesystem::path target = followed_target(path, {.op = "load", .path = path});
    keys.push_back(save_key(target));
    if (target.has_parent_path() && target.parent_path() != target.root_path())
      keys.push_back(save_key(followed_target(target.parent_path().string(), {.op = "load", .path = path})));
  } catch (const std::exception&) {
    // A link loop or an unreadable link: no save could have taken that name as its target either.
  }
}

}  // namespace

bool wait_for_background_saves_of(const std::vector<std::string>& paths) {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mutex);
    if (r.by_target.empty()) return false;  // the common case: no file system calls
  }
  std::vector<std::string> keys;
  for (const std::string& path : paths) add_save_keys(path, keys);
  bool waited = false;
  std::unique_lock lock(r.mutex);
  for (;;) {
    bool in_flight = false;
    for (const std::string& key : keys) {
      const auto it = r.by_target.find(key);
      if (it == r.by_target.end() || it->second.get() == persisting) continue;
      std::lock_guard state_lock(it->second->mutex);
      in_flight = in_flight || (!it->second->blocking && !it->second->finished);
    }
    if (!in_flight) return waited;
    waited = true;
    r.changed.wait(lock);
  }
}

namespace {

// The device all device tensors are on, if they are all on one and there is no host tensor.
std::optional<int> one_device(const std::vector<TensorToSave>& tensors) {
  std::optional<int> device;
  for (const auto& t : tensors) {
    if (t.data.size == 0) continue;
    if (t.data.kind() != MemoryKind::device) return std::nullopt;
    if (device && *device != t.data.location.device) return std::nullopt;
    device = t.data.location.device;
  }
  return device;
}

bool stop_requested(const std::atomic<bool>* cancel) { return cancel != nullptr && cancel->load(std::memory_order_relaxed); }

[[noreturn]] void throw_stopped(const AsyncSaveState& state) {
  throw Error(errno_code(ECANCELED), {.op = "save", .path = state.path},
              "stopped during its snapshot (a stop request: Ctrl-C); nothing was published and the previous file is untouched");
}

// Staging::device: one buffer, each tensor at a 256-byte boundary, filled by device copies.
bool stage_on_device(AsyncSaveState& state, const std::vector<TensorToSave>& tensors, const std::atomic<bool>* cancel) {
  const std::optional<int> device = one_device(tensors);
  if (!device) return false;
  std::uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += (t.data.size + 255) / 256 * 256;
  try {
    state.device_copy.emplace(Buffer::allocate({MemoryKind::device, *device}, std::max<std::uint64_t>(bytes, 256)));
  } catch (const Error&) {
    return false;  // no room: pinned staging instead, as documented
  }
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (stop_requested(cancel)) throw_stopped(state);
    const MemorySpan into = state.device_copy->span().subspan(at, tensors[i].data.size);
    if (into.size > 0) copy_memory(into, tensors[i].data);
    state.tensors[i].data = into;
    at += (tensors[i].data.size + 255) / 256 * 256;
  }
  state.report.staged_bytes = bytes;
  state.report.staging = Staging::device;
  return true;
}

// Staging::pinned: the caller's tensors in file order, into pool blocks back to back (a block
// holds the end of one tensor and the start of the next), each piece queued once copied. Each
// file's first byte goes where its block offset and its file offset agree modulo kStagingGrid
// (a gap of less than that before it), so that the rest of the file agrees too, across blocks
// (whose size is a multiple of the grid): the writer's direct writes then go straight from the
// blocks (persist.hpp, staged_files). Returns the seconds spent waiting for blocks. Stops early
// when the writer failed; throws ECANCELED once `cancel` reads true (checked before each piece
// and while waiting for a block).
double stage_in_pool(AsyncSaveState& state, const std::vector<TensorToSave>& tensors, const std::atomic<bool>* cancel) {
  StagingPool& pool = StagingPool::shared();
  const std::vector<StagedFile> files = staged_files(tensors, state.options);
  std::size_t next_file = 0;
  std::uint64_t file_left = 0;  // bytes of the file being staged not yet copied
  double waited = 0;
  std::shared_ptr<Buffer> block;
  std::size_t used = 0;
  for (const std::size_t i : file_order(tensors)) {
    const TensorToSave& t = tensors[i];
    for (std::uint64_t at = 0; at < t.data.size;) {
      if (state.stream.failed()) return waited;  // the writer stopped: nothing more is written
      if (stop_requested(cancel)) throw_stopped(state);
      std::optional<std::size_t> phase;  // set at a file's first byte: where in the grid it goes
      if (file_left == 0) {
        while (next_file < files.size() && files[next_file].bytes == 0) ++next_file;
        if (next_file < files.size()) {
          file_left = files[next_file].bytes;
          phase = static_cast<std::size_t>(files[next_file].data_start % kStagingGrid);
          ++next_file;
          if (block) used = std::min(block->size(), static_cast<std::size_t>((used + kStagingGrid - *phase - 1) / kStagingGrid * kStagingGrid + *phase));
        }
      }
      if (!block || used == block->size()) {
        block.reset();
        const auto start = std::chrono::steady_clock::now();
        block = pool.acquire([&] { return state.stream.failed() || stop_requested(cancel); });
        waited += seconds_since(start);
        if (stop_requested(cancel)) throw_stopped(state);
        if (!block) return waited;
        used = phase.value_or(0);
      }
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block->size() - used, t.data.size - at));
      const MemorySpan into = block->span().subspan(used, n);
      copy_memory(into, t.data.subspan(static_cast<std::size_t>(at), n));
      state.stream.push({.tensor = state.tensors[i].name, .offset = at, .memory = into, .block = block});
      state.report.staged_bytes += n;
      used += n;
      at += n;
      file_left -= std::min<std::uint64_t>(file_left, n);
    }
  }
  return waited;
}

}  // namespace
}  // namespace detail

SaveInProgress save_checkpoint_async(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options,
                                     const AsyncSaveOptions& async) {
  return detail::errors_as_hbmio({.op = "save", .path = path}, [&] {
    const auto start = std::chrono::steady_clock::now();
    auto state = std::make_shared<detail::AsyncSaveState>();
    state->path = path;
    state->target = detail::check_save(path, tensors, options);
    state->options = options;
    if (state->options.cancel == nullptr) state->options.cancel = &state->cancelled;  // cancel()
    state->tensors = tensors;
    for (auto& t : state->tensors) t.data = {nullptr, t.data.size, {MemoryKind::host}};  // sizes only, until staged

    double stalled = detail::take_turn(state, async.wait_if_busy, async.cancel);
    // From here the path is this save's: every way out must finish() it, or later saves of the
    // path (and the exit handler) would wait for it forever.
    const auto give_up = [&state](std::exception_ptr error) {
      detail::finish(state, std::nullopt, error);
      std::lock_guard lock(state->mutex);
      state->observed = true;  // the caller gets the error now, from this call
    };
    bool on_device = false;
    try {
      on_device = async.staging == Staging::device && detail::stage_on_device(*state, tensors, async.cancel);
      if (on_device) detail::Executor::shared().post([state] { detail::persist_snapshot(state); });
    } catch (...) {
      give_up(std::current_exception());
      throw;
    }
    if (!on_device) {
      detail::StagingPool::shared().set_capacity(async.pool_bytes);
      state->report.staging = Staging::pinned;
      // The writer starts first and drains the pool while the snapshot fills it.
      try {
        detail::Executor::shared().post([state] { detail::persist_snapshot(state); });
      } catch (...) {
        give_up(std::current_exception());
        throw;
      }
      try {
        stalled += detail::stage_in_pool(*state, tensors, async.cancel);
        state->stream.finish();
      } catch (...) {
        state->stream.abandon();  // the writer stops with nothing published; the caller gets this error
        SaveInProgress(state).wait_for(std::chrono::hours(24));
        std::lock_guard lock(state->mutex);
        state->observed = true;
        throw;
      }
    }
    state->report.snapshot_seconds = detail::seconds_since(start);
    state->report.stalled_seconds = stalled;
    return SaveInProgress(state);
  });
}

SaveInProgress::SaveInProgress(std::shared_ptr<detail::AsyncSaveState> state) : state_(std::move(state)) {}
SaveInProgress::SaveInProgress(SaveInProgress&&) noexcept = default;
SaveInProgress& SaveInProgress::operator=(SaveInProgress&& other) noexcept {
  if (this != &other) {
    if (state_) wait_for(std::chrono::hours(24 * 365));
    state_ = std::move(other.state_);
  }
  return *this;
}
SaveInProgress::~SaveInProgress() {
  if (state_) wait_for(std::chrono::hours(24 * 365));
}

bool SaveInProgress::done() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  return state_->finished;
}

bool SaveInProgress::wait_for(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  std::unique_lock lock(state_->mutex);
  return state_->finished_cv.wait_for(lock, timeout, [&] { return state_->finished; });
}

Stats SaveInProgress::wait() {
  if (!state_) throw Error(errno_code(EINVAL), {.op = "save"}, "wait() on an empty SaveInProgress");
  std::unique_lock lock(state_->mutex);
  state_->finished_cv.wait(lock, [&] { return state_->finished; });
  if (state_->error) {
    state_->observed = true;
    std::rethrow_exception(state_->error);
  }
  return *state_->stats;
}

AsyncSaveReport SaveInProgress::report() const {
  if (!state_) return {};
  std::lock_guard lock(state_->mutex);
  return state_->report;
}

void SaveInProgress::cancel() noexcept {
  if (state_) state_->cancelled = true;
}

void SaveInProgress::detach() noexcept { state_.reset(); }

const std::string& SaveInProgress::path() const {
  static const std::string none;
  return state_ ? state_->path : none;
}

std::vector<std::string> wait_for_all_saves() {
  detail::Registry& r = detail::registry();
  std::vector<std::string> errors;
  std::unique_lock lock(r.mutex);
  for (;;) {
    bool in_flight = false;
    for (auto it = r.by_target.begin(); it != r.by_target.end();) {
      const std::shared_ptr<detail::AsyncSaveState> state = it->second;
      std::lock_guard state_lock(state->mutex);
      if (!state->finished) {
        in_flight = true;
        ++it;
        continue;
      }
      if (state->error && !state->observed) {
        state->observed = true;
        try {
          std::rethrow_exception(state->error);
        } catch (const std::exception& e) {
          errors.push_back(fmt::format("{}: {}", state->path, e.what()));
        }
      }
      it = r.by_target.erase(it);
    }
    if (!in_flight) return errors;
    r.changed.wait(lock);
  }
}

std::vector<std::string> saves_inherited_at_fork() {
  detail::registry();  // (the fork handlers are installed with the registry)
  return detail::inherited_at_fork;
}

StagingPoolStats staging_pool_stats() { return detail::StagingPool::shared().stats(); }

}  // namespace hbmio
