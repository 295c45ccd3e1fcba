// Saves that do not stop the caller: the call copies the tensors out (the snapshot) into reused
// staging memory and returns; writing, checksums, fsync and the publishing rename run in the
// background with exactly the guarantees of save_checkpoint.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"

namespace hbmio {

enum class Staging {
  // Page-locked host memory from a pool kept between saves (StagingPool). The call returns once
  // every byte is in the pool; a state larger than the pool is snapshotted as the writer drains
  // it, and the call blocks for that long.
  pinned,
  // One device buffer per save on the tensors' device (device-to-device copies: the call blocks
  // for a few milliseconds), freed when the save is durable. Host tensors, or a device without the
  // room, fall back to `pinned` (the report says which was used).
  device,
};

struct AsyncSaveOptions {
  Staging staging = Staging::pinned;
  // The pinned pool's capacity in bytes; 0 keeps the pool's current one (at first use a quarter
  // of physical memory, at most 64 GiB). The pool keeps what it allocated between saves, up to
  // this capacity, and gives back what is above it.
  std::uint64_t pool_bytes = 0;
  // Another save of the same path still in flight: wait for it (true) or throw Error(EBUSY).
  bool wait_if_busy = true;
  // Optional: a stop request read during the call only (the snapshot, and the wait for an earlier
  // save of the path), so it need live only as long as the call. Once it reads true the call stops
  // between pieces of its copies (or while it waits for staging room), the save ends with nothing
  // published and the previous file untouched, and the call throws Error(ECANCELED). Ctrl-C during
  // a snapshot that blocks (a state larger than the pool) uses it; after the call, cancel() stops
  // the save.
  const std::atomic<bool>* cancel = nullptr;
};

// What a background save did, for the caller's log and the benchmark.
struct AsyncSaveReport {
  double snapshot_seconds = 0;   // the call: copying out of the caller's tensors (and waiting for room)
  double stalled_seconds = 0;    // of which waiting for staging room or for an earlier save of the path
  double persist_seconds = 0;    // from the call to durable (0 while in flight)
  std::uint64_t staged_bytes = 0;
  Staging staging = Staging::pinned;  // what was used (device falls back to pinned)
  // Per file, the path its bytes took and why (Stats::paths of the persist): empty until the save
  // is durable, and for a save that failed.
  std::vector<TransferPath> paths;
};

namespace detail {
struct AsyncSaveState;
}

// A save in flight. done() polls; wait() blocks until the save is durable and returns its Stats,
// or throws its error (every error of save_checkpoint, and the note that the previous checkpoint
// at the path is untouched). The destructor waits too: a save is never abandoned half-way. An
// error nobody asked for through wait() is thrown by the next save of the same path.
class SaveInProgress {
 public:
  SaveInProgress() = default;
  explicit SaveInProgress(std::shared_ptr<detail::AsyncSaveState> state);
  ~SaveInProgress();
  SaveInProgress(SaveInProgress&&) noexcept;
  SaveInProgress& operator=(SaveInProgress&&) noexcept;
  SaveInProgress(const SaveInProgress&) = delete;
  SaveInProgress& operator=(const SaveInProgress&) = delete;

  bool done() const;
  bool wait_for(std::chrono::milliseconds timeout) const;  // true when done
  Stats wait();
  AsyncSaveReport report() const;
  const std::string& path() const;
  // Asks the save to stop at its next safe point before it publishes, as SaveOptions::cancel does
  // (which, where the caller gave one, is the save's stop request instead: then this does
  // nothing). Returns at once; wait() then throws Error(ECANCELED) with the path as it was, or
  // returns if the save had published already.
  void cancel() noexcept;
  // Lets the save go on without this handle (the destructor then does not wait): it still runs
  // to the end, wait_for_all_saves() waits for it, and its error, if any, is thrown by the next
  // save of the path or returned by wait_for_all_saves().
  void detach() noexcept;

 private:
  std::shared_ptr<detail::AsyncSaveState> state_;
};

// save_checkpoint in the background (one file, or a sharded directory with max_shard_size). When
// it returns, the caller may change or free the tensors. Saves of one path, background or not,
// take turns in the order they were called: save_checkpoint waits for a background save of its
// path still in flight, so an older state never publishes after a newer one. options.engine, if set, must outlive the
// save; options.progress and options.cancel likewise. Errors found before anything is staged (bad
// names, sizes, a path that cannot be saved to) are thrown here.
SaveInProgress save_checkpoint_async(const std::string& path, const std::vector<TensorToSave>& tensors,
                                     const SaveOptions& options = {}, const AsyncSaveOptions& async = {});

// Waits for every background save of this process; returns the errors of those that failed and
// were never waited for, as "path: message" (for an exit handler to print).
std::vector<std::string> wait_for_all_saves();

// In a child of fork(): the background saves that were in flight in the parent when it forked, as
// "path" each (empty in the parent, and in a child of a parent that had none). The child has none
// of their threads, so it starts with no saves in flight, a fresh staging pool and a fresh engine
// pool: those saves go on in the parent only, and a handle to one of them that the child holds
// reports it as failed (ECHILD) instead of waiting for a thread that does not exist there.
std::vector<std::string> saves_inherited_at_fork();

// The pinned pool behind Staging::pinned, for reports and tests.
struct StagingPoolStats {
  std::uint64_t capacity = 0;   // bytes it may hold
  std::uint64_t allocated = 0;  // bytes it holds (in use or free)
  std::uint64_t in_use = 0;     // bytes lent to saves in flight
};
StagingPoolStats staging_pool_stats();

}  // namespace hbmio
