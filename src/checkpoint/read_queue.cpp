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
    std::size_t unlanded = 0;  // reads not yet in place, while its round is read
    bool done = false;
    std::exception_ptr error;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::uint64_t, Batch> batches;  // map nodes stay put: the reader reads them unlocked
  std::deque<std::uint64_t> queue;         // batches not started yet, in order
  std::uint64_t next_id = 0;
  bool reading = false;  // a job of the pool is reading (or about to): the destructor waits for it
  bool stop = false;
  std::atomic<bool>* cancel = nullptr;  // the read in flight's: the destructor stops its local reads

  // The pool's job: reads the queued batches, all of them as one round (one engine batch, each
  // batch done as its last read lands), until none is left or the queue is destroyed. A round
  // that fails is read again batch by batch for the batches it left unfinished, so that each
  // gets its own result: one bad tensor fails only the batch that asked for it.
  void drain() noexcept {
    std::unique_lock lock(mutex);
    while (!stop && !queue.empty()) {
      std::vector<std::uint64_t> round;
      try {
        round.assign(queue.begin(), queue.end());
        queue.clear();
        read_round(round, lock);
        std::vector<std::uint64_t> unfinished;
        for (const std::uint64_t id : round)
          if (const auto it = batches.find(id); it != batches.end() && !it->second.done) unfinished.push_back(id);
        if (unfinished.size() > 1)
          for (const std::uint64_t id : unfinished)
            if (!stop) read_round({id}, lock);
      } catch (...) {  // memory for a round's lists: its batches fail with that
        for (const std::uint64_t id : round)
          if (const auto it = batches.find(id); it != batches.end() && !it->second.done) {
            it->second.error = std::current_exception();
            it->second.done = true;
          }
      }
      // What is still unfinished failed (or was stopped): each batch keeps the error its last read gave.
      for (const std::uint64_t id : round)
        if (const auto it = batches.find(id); it != batches.end() && !it->second.done) it->second.done = true;
      changed.notify_all();
    }
    reading = false;
    changed.notify_all();
  }

  // Reads the batches `ids` (not done yet) as one engine batch; `lock` is held on entry and on
  // return. A batch is done as its last read lands (the round's last one after on_read); one that
  // does not land gets the read's error and stays not done for drain() to decide.
  void read_round(const std::vector<std::uint64_t>& ids, std::unique_lock<std::mutex>& lock) {
    std::vector<TensorRead> reads;
    std::vector<Batch*> batch_of;  // per read
    for (const std::uint64_t id : ids) {
      Batch& batch = batches.at(id);  // only wait() erases it, once done
      batch.unlanded = batch.reads.size();
      batch.error = nullptr;  // read again alone after its round failed: this read's result counts
      if (batch.reads.empty()) batch.done = true;
      try {  // a batch that asks for a range past a tensor fails alone, not its round
        for (const TensorRead& read : batch.reads) checkpoint->check(read);
      } catch (...) {
        batch.error = std::current_exception();
        batch.done = true;
        continue;
      }
      for (const TensorRead& read : batch.reads) {
        reads.push_back(read);
        batch_of.push_back(&batch);
      }
    }
    changed.notify_all();
    if (reads.empty()) return;
    std::atomic<bool> stopped{false};
    cancel = &stopped;
    lock.unlock();
    std::exception_ptr error;
    try {
      const OpenedCheckpoint::ReadOptions options{
          .landed =
              [&](std::size_t i) {
                std::lock_guard guard(mutex);
                // The round's last batch is done only after on_read has its Stats: a caller that
                // waited for every batch then finds them reported.
                if (--batch_of[i]->unlanded == 0 && batch_of[i] != batch_of.back()) {
                  batch_of[i]->done = true;
                  changed.notify_all();
                }
              },
          .cancel = &stopped};
      const Stats stats = checkpoint->read(reads, *engine, options);
      if (on_read) on_read(stats);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    cancel = nullptr;
    for (const std::uint64_t id : ids) {
      const auto it = batches.find(id);
      if (it == batches.end() || it->second.done) continue;
      if (it->second.unlanded == 0) {
        it->second.done = true;  // the round's last batch, all in place
      } else {
        it->second.error = error ? error
                                 : std::make_exception_ptr(Error(errno_code(EIO), {.op = "read ahead", .path = checkpoint->path()},
                                                                 "a read was never told landed"));
      }
    }
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
  if (state_->cancel != nullptr) *state_->cancel = true;
  state_->changed.wait(lock, [&] { return !state_->reading; });
}

const OpenedCheckpoint& ReadQueue::checkpoint() const noexcept { return *state_->checkpoint; }

std::uint64_t ReadQueue::push(std::vector<TensorRead> reads) {
  std::vector<std::vector<TensorRead>> one;
  one.push_back(std::move(reads));
  return push(std::move(one)).front();
}

std::vector<std::uint64_t> ReadQueue::push(std::vector<std::vector<TensorRead>> batches) {
  std::lock_guard lock(state_->mutex);
  std::vector<std::uint64_t> ids;
  for (std::vector<TensorRead>& reads : batches) {
    ids.push_back(state_->next_id++);
    state_->batches.emplace(ids.back(), State::Batch{.reads = std::move(reads)});
    state_->queue.push_back(ids.back());
  }
  if (!state_->reading && !ids.empty()) {
    try {
      detail::Executor::shared().post([state = state_] { state->drain(); });
    } catch (...) {
      for (const std::uint64_t id : ids) {
        state_->queue.pop_back();
        state_->batches.erase(id);
      }
      throw;
    }
    state_->reading = true;
  }
  return ids;
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
