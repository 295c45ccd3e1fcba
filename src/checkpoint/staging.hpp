// The staging of a background save: a pool of page-locked blocks kept between saves, and the
// stream of tensor pieces from the snapshot (the caller's thread, copying out of its tensors) to
// the writer (the save's thread, writing and hashing them).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/async_save.hpp"
#include "hbmio/memory.hpp"

namespace hbmio::detail {

// Pinned host memory in blocks of kBlockBytes, allocated on demand up to a capacity and kept
// after use: registering memory with CUDA costs about as much as copying into it, so a pool that
// lives across saves makes every save after the first pay only the copy. A block lent out is
// never handed to anyone else until its last user drops it (a reused staging buffer still being
// written corrupts checkpoints), which shared ownership makes structural.
class StagingPool {
 public:
  static constexpr std::size_t kBlockBytes = std::size_t{64} << 20;

  // The process's pool (never destroyed: saves may finish during static destruction). A child of
  // fork() gets a fresh one: the parent's may have blocks lent to saves whose threads the child
  // does not have, which would never come back (a small pool would then wait for them forever).
  static StagingPool& shared();

  // Sets the capacity (rounded up to a whole block, at least one); frees blocks above it that
  // nobody uses. 0 leaves it as it is.
  void set_capacity(std::uint64_t bytes);
  // A free block, waiting while all `capacity` bytes are in use. Returns null once `give_up()`
  // reads true (checked every few milliseconds while waiting).
  template <class GiveUp>
  std::shared_ptr<Buffer> acquire(GiveUp give_up);
  StagingPoolStats stats() const;

 private:
  StagingPool();
  // Wraps a block counted in in_use_ for lending; called without mutex_ (if making the shared_ptr
  // fails, its deleter, take_back, takes the lock).
  std::shared_ptr<Buffer> lend(Buffer block);
  void take_back(Buffer block);

  mutable std::mutex mutex_;
  std::condition_variable returned_;
  std::uint64_t capacity_;
  std::uint64_t allocated_ = 0;
  std::uint64_t in_use_ = 0;
  std::vector<Buffer> free_;
};

// The grid of the engines' direct writes (uring_plan.hpp's kSlotAlignment): a background save
// stages each byte at the same offset modulo this in its block as in its file (staged_files in
// persist.hpp), and the writer's rounds end on it.
inline constexpr std::uint64_t kStagingGrid = 4096;

// Bytes [offset, offset + memory.size) of one tensor, in staging memory held by `block`.
struct StagedPiece {
  std::string_view tensor;  // the tensor's name, owned by the save
  std::uint64_t offset = 0;
  MemorySpan memory;
  std::shared_ptr<Buffer> block;  // the staging block stays lent while a piece of it is alive
};

// Single producer (the snapshot), single consumer (the writer of the save's files, which takes the
// pieces of each file in turn: the snapshot walks the tensors in file order).
class StagedStream {
 public:
  void push(StagedPiece piece);
  void finish();                       // the snapshot is complete
  void abandon();                      // the snapshot stopped early (its error goes to the caller)
  void fail();                         // the writer stopped: queued pieces are dropped, the snapshot stops
  bool failed() const { return failed_.load(); }
  // Waits for pieces and takes those queued, in order: the first whatever its size, then more while
  // the total stays within `max_bytes`. Empty when the snapshot finished (or was abandoned) and
  // everything was taken.
  std::vector<StagedPiece> take(std::uint64_t max_bytes);
  bool abandoned() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<StagedPiece> queue_;
  bool finished_ = false;
  bool abandoned_ = false;
  std::atomic<bool> failed_{false};
};

template <class GiveUp>
std::shared_ptr<Buffer> StagingPool::acquire(GiveUp give_up) {
  std::unique_lock lock(mutex_);
  for (;;) {
    if (!free_.empty()) {
      Buffer block = std::move(free_.back());
      free_.pop_back();
      in_use_ += kBlockBytes;
      lock.unlock();
      return lend(std::move(block));
    }
    if (allocated_ + kBlockBytes <= capacity_) {
      // Counted first: another thread must not allocate past the capacity meanwhile.
      allocated_ += kBlockBytes;
      in_use_ += kBlockBytes;
      lock.unlock();
      Buffer block;
      try {
        block = Buffer::allocate({MemoryKind::pinned}, kBlockBytes);
      } catch (...) {
        lock.lock();
        allocated_ -= kBlockBytes;
        in_use_ -= kBlockBytes;
        throw;
      }
      return lend(std::move(block));
    }
    if (give_up()) return nullptr;
    returned_.wait_for(lock, std::chrono::milliseconds(5));
  }
}

}  // namespace hbmio::detail
