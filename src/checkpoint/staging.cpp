#include "checkpoint/staging.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>

namespace hbmio::detail {

namespace {
// A quarter of physical memory, at most 64 GiB: room for the state of one GPU of most jobs, while
// leaving the host the rest (async saves that pinned all of it made training nodes swap).
std::uint64_t default_capacity() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  const std::uint64_t physical = pages > 0 && page > 0 ? std::uint64_t(pages) * std::uint64_t(page) : std::uint64_t{16} << 30;
  return std::min<std::uint64_t>(physical / 4, std::uint64_t{64} << 30);
}
std::uint64_t whole_blocks(std::uint64_t bytes) {
  const std::uint64_t block = StagingPool::kBlockBytes;
  return std::max<std::uint64_t>(block, (bytes + block - 1) / block * block);
}
}  // namespace

StagingPool::StagingPool() : capacity_(whole_blocks(default_capacity())) {}

namespace {
StagingPool* shared_pool = nullptr;  // set once; replaced in a child of fork()
}  // namespace

StagingPool& StagingPool::shared() {
  static std::once_flag made;
  std::call_once(made, [] {
    shared_pool = new StagingPool();  // leaked on purpose: see the header
    // In the child the parent's pool is left as it is (leaked): its mutex may have been held by a
    // thread that the child does not have, and its blocks are lent to saves that go on in the
    // parent only. The child handler runs with one thread, so the plain store is safe.
    ::pthread_atfork(nullptr, nullptr, [] { shared_pool = new StagingPool(); });
  });
  return *shared_pool;
}

void StagingPool::set_capacity(std::uint64_t bytes) {
  if (bytes == 0) return;
  std::vector<Buffer> drop;  // freed outside the lock (unregistering takes time)
  {
    std::lock_guard lock(mutex_);
    capacity_ = whole_blocks(bytes);
    while (allocated_ > capacity_ && !free_.empty()) {
      drop.push_back(std::move(free_.back()));
      free_.pop_back();
      allocated_ -= kBlockBytes;
    }
  }
  returned_.notify_all();
}

std::shared_ptr<Buffer> StagingPool::lend(Buffer block) {
  Buffer* raw = nullptr;
  try {
    raw = new Buffer(std::move(block));
  } catch (...) {
    take_back(std::move(block));  // not moved from: operator new failed first
    throw;
  }
  // (Should making the shared_ptr fail, it calls the deleter: the block goes back.)
  return std::shared_ptr<Buffer>(raw, [this](Buffer* b) {
    take_back(std::move(*b));
    delete b;
  });
}

void StagingPool::take_back(Buffer block) {
  {
    std::lock_guard lock(mutex_);
    in_use_ -= kBlockBytes;
    if (allocated_ <= capacity_) {
      free_.push_back(std::move(block));
    } else {
      allocated_ -= kBlockBytes;  // the capacity shrank while it was lent: the block goes
    }
  }
  returned_.notify_all();
}

StagingPoolStats StagingPool::stats() const {
  std::lock_guard lock(mutex_);
  return {.capacity = capacity_, .allocated = allocated_, .in_use = in_use_};
}

void StagedStream::push(StagedPiece piece) {
  {
    std::lock_guard lock(mutex_);
    if (failed_) return;  // nobody will write it: its block goes back now
    queue_.push_back(std::move(piece));
  }
  changed_.notify_one();
}

void StagedStream::fail() {
  std::deque<StagedPiece> dropped;  // blocks returned outside the lock
  std::lock_guard lock(mutex_);
  failed_ = true;
  dropped.swap(queue_);
}

void StagedStream::finish() {
  {
    std::lock_guard lock(mutex_);
    finished_ = true;
  }
  changed_.notify_all();
}

void StagedStream::abandon() {
  {
    std::lock_guard lock(mutex_);
    finished_ = abandoned_ = true;
  }
  changed_.notify_all();
}

bool StagedStream::abandoned() const {
  std::lock_guard lock(mutex_);
  return abandoned_;
}

std::vector<StagedPiece> StagedStream::take(std::uint64_t max_bytes) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !queue_.empty() || finished_; });
  std::vector<StagedPiece> out;
  std::uint64_t bytes = 0;
  while (!queue_.empty() && (out.empty() || bytes + queue_.front().memory.size <= max_bytes)) {
    bytes += queue_.front().memory.size;
    out.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return out;
}

}  // namespace hbmio::detail
