// Bytes landing in GPU memory through pinned host memory: a ring of slots, each copied to the
// device asynchronously and written again only once its copy is done. It is the pattern of every
// path that brings bytes from storage or the network into GPU memory without GDS: the uring
// workers' bounce buffers (src/io/uring_engine.cpp) and the remote client's landings
// (src/remote/remote.cpp). Staging through pinned memory is what makes the copy asynchronous
// (pageable memory would make cudaMemcpyAsync wait), and a ring of a few slots lets the next
// read fill one slot while the previous one's copy runs, without a pinned buffer as large as
// the transfer.
//
// The copies run in order on the ring's one stream, so the oldest finishes first. Not
// thread-safe: each worker owns its ring.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <vector>

#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio::detail {

class StagingRing {
 public:
  StagingRing() = default;
  // `count` slots of `slot_bytes` each, in one allocation of `kind`: pinned where the slots feed
  // copies to a GPU; host where they only stage host memory (pinning would create a CUDA context
  // for a transfer that never touches a GPU).
  StagingRing(MemoryKind kind, std::size_t count, std::size_t slot_bytes);
  StagingRing(StagingRing&&) noexcept = default;
  // Waits for this ring's copies before its memory goes (member-wise assignment would free the
  // memory before the stream is done with it).
  StagingRing& operator=(StagingRing&& other) noexcept;
  ~StagingRing() = default;  // the stream (declared after the memory) is synchronized before it is freed

  bool valid() const noexcept { return memory_.data() != nullptr; }
  std::size_t count() const noexcept { return free_.size(); }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  std::byte* data(int slot) const noexcept { return memory_.data() + static_cast<std::size_t>(slot) * slot_bytes_; }
  // The slots' memory (one allocation), e.g. to register with io_uring as fixed buffers.
  const Buffer& memory() const noexcept { return memory_; }

  // Copies go to `device`: its stream and the slots' events are made here the first time, or
  // again when the device changes. Needs pinned slots.
  void use_device(int device, const ErrorContext& context);
  // The stream copies run on (valid after use_device): a caller's own copies on it stay in order
  // with the ring's.
  cuda::Stream& stream() noexcept { return stream_; }

  // A free slot, now the caller's; -1 when every slot is in use or being copied.
  int acquire() noexcept;
  // Gives back a slot whose bytes need no copy.
  void release(int slot) noexcept { free_[static_cast<std::size_t>(slot)] = true; }
  // Queues the copy of the slot's bytes [offset, offset + size) to device memory at `to`; the
  // slot stays taken until reclaim_oldest finds its copy done.
  void copy_to_device(int slot, std::size_t offset, void* to, std::size_t size, const ErrorContext& context);

  bool copying() const noexcept { return !copying_.empty(); }
  // Whether the oldest queued copy is done (false when none is queued).
  bool oldest_done(const ErrorContext& context);
  // Waits for the oldest queued copy, frees its slot and returns it. Polls for up to `poll` before
  // sleeping in the driver: a small copy is done within microseconds, and waking from the
  // driver's blocking wait (cuda::Event blocks rather than spins) costs more than that.
  int reclaim_oldest(std::chrono::microseconds poll, const ErrorContext& context);
  // After a failure: lets every queued copy finish and frees every slot. Never throws.
  void reset() noexcept;

 private:
  Buffer memory_;
  std::size_t slot_bytes_ = 0;
  std::vector<bool> free_;          // per slot
  std::vector<cuda::Event> copied_;  // per slot: fires when its copy is done
  cuda::Stream stream_;
  std::deque<int> copying_;         // slots whose copy is queued, oldest first
};

}  // namespace hbmio::detail
