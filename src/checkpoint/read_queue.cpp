// ReadQueue: a read-ahead's reader. The queue holds no thread of its own: while batches wait, one
// job of the library's pool reads them in order, and it leaves the pool when the queue is empty.
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"

namespace hbmio {

struct ReadQueue::State {
  std::shared_ptr<const OpenedCheckpoint> checkpoint;  // alive while a read may run
  EnginePool::Lease engine;
  std::function<void(const Stats&)> on_read;

  struct Batch {
    std::vector<TensorRead> reads;
    bool done = false;
    std::exception_ptr error;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::uint64_t, Batch> batches;  // map nodes stay put: the reader reads one unlocked
  std::deque<std::uint64_t> queue;         // batches not started yet, in order
  std::uint64_t next_id = 0;
  bool reading = false;  // a job of the pool is reading (or about to): the destructor waits for it
  bool stop = false;

  // The pool's job: reads queued batches until none is left, or the queue is destroyed.
  void drain() {
    std::unique_lock lock(mutex);
    while (!stop && !queue.empty()) {
      const std::uint64_t id = queue.front();
      queue.pop_front();
      Batch& batch = batches.at(id);  // only wait() erases it, once done
      lock.unlock();
      std::exception_ptr error;
      try {
        const Stats stats = checkpoint->read(batch.reads, *engine);
        if (on_read) on_read(stats);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      batch.error = error;
      batch.done = true;
      changed.notify_all();
    }
    reading = false;
    changed.notify_all();
  }
};

ReadQueue::ReadQueue(std::shared_ptr<const OpenedCheckpoint> checkpoint, std::string_view backend,
                     std::function<void(const Stats&)> on_read)
    : state_(std::make_shared<State>()) {
  state_->checkpoint = std::move(checkpoint);
  state_->engine = EnginePool::shared().acquire(backend);
  state_->on_read = std::move(on_read);
}

ReadQueue::~ReadQueue() {
  std::unique_lock lock(state_->mutex);
  state_->stop = true;
  state_->changed.wait(lock, [&] { return !state_->reading; });
}

const OpenedCheckpoint& ReadQueue::checkpoint() const noexcept { return *state_->checkpoint; }

std::uint64_t ReadQueue::push(std::vector<TensorRead> reads) {
  std::lock_guard lock(state_->mutex);
  const std::uint64_t id = state_->next_id++;
  state_->batches.emplace(id, State::Batch{.reads = std::move(reads)});
  state_->queue.push_back(id);
  if (!state_->reading) {
    try {
      detail::Executor::shared().post([state = state_] { state->drain(); });
    } catch (...) {
      state_->queue.pop_back();
      state_->batches.erase(id);
      throw;
    }
    state_->reading = true;
  }
  return id;
}

void ReadQueue::wait(std::uint64_t id) {
  std::unique_lock lock(state_->mutex);
  const auto it = state_->batches.find(id);
  if (it == state_->batches.end())
    throw Error(errno_code(EINVAL), {.op = "read ahead", .path = state_->checkpoint->path()},
                fmt::format("no batch {} is queued (each batch is waited for once)", id));
  state_->changed.wait(lock, [&] { return it->second.done; });
  const std::exception_ptr error = it->second.error;
  state_->batches.erase(it);
  if (error) std::rethrow_exception(error);
}

}  // namespace hbmio
