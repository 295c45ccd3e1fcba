#include "core/executor.hpp"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <system_error>
#include <utility>

#include "hbmio/error.hpp"
#include "hbmio/threads.hpp"

namespace hbmio::detail {
namespace {

Executor* shared_pool = nullptr;

// One run(): tasks are claimed by index from `next`, by the caller and by helpers. A helper holds
// the batch (not the caller's frame), and reads `task` only after claiming an index below
// `count`, which the caller waits for: a helper that starts after the caller returned claims
// nothing and touches nothing of the caller's.
struct Batch {
  std::size_t count = 0;
  const std::function<void(std::size_t)>* task = nullptr;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<std::size_t> done{0};  // tasks returned or skipped; the last one wakes the caller
  std::mutex mutex;                  // guards `error`, and the caller's sleep on `finished`
  std::condition_variable finished;
  std::exception_ptr error;

  void work() {
    for (std::size_t i = next++; i < count; i = next++) {
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          (*task)(i);
        } catch (...) {
          std::lock_guard lock(mutex);
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
      if (done.fetch_add(1) + 1 == count) {
        std::lock_guard lock(mutex);  // taken, so the caller cannot miss the wake between its check and its sleep
        finished.notify_all();
      }
    }
  }
};

}  // namespace

Executor& Executor::shared() {
  static const bool made = [] {
    shared_pool = new Executor();
    // The child of a fork has only the forking thread: the pool's threads, its queue and maybe a
    // held lock belong to the parent. The child starts with an empty pool (the old one is leaked:
    // its mutex may be locked forever there).
    ::pthread_atfork(nullptr, nullptr, [] { shared_pool = new Executor(); });
    return true;
  }();
  (void)made;
  return *shared_pool;
}

void Executor::post(std::function<void()> job) {
  std::unique_lock lock(mutex_);
  queue_.push_back(std::move(job));
  // An idle thread per queued job, or a new thread (the bound reached: the job waits its turn).
  if (idle_ >= queue_.size() || threads_.size() >= max_threads_) {
    work_.notify_one();
    return;
  }
  try {
    threads_.emplace_back([this] { serve(); });
  } catch (const std::system_error& e) {
    if (!threads_.empty()) return;  // a running thread takes the job when it is free
    queue_.pop_back();
    throw Error(e.code(), {.op = "start a hbmio-pool thread"}, thread_limit_message(e));
  }
}

void Executor::serve() {
  ::pthread_setname_np(::pthread_self(), "hbmio-pool");
  // Signals sent to the process go to the program's threads, not to the library's: a command that
  // blocks SIGINT to take it with sigtimedwait (run_interruptible) would otherwise see it end the
  // process on a pool thread started before. Faults raised by a job itself still reach it.
  sigset_t asynchronous;
  ::sigfillset(&asynchronous);
  for (const int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS}) ::sigdelset(&asynchronous, fault);
  ::pthread_sigmask(SIG_BLOCK, &asynchronous, nullptr);
  std::unique_lock lock(mutex_);
  for (;;) {
    ++idle_;
    work_.wait(lock, [this] { return !queue_.empty() || stopping_; });
    --idle_;
    if (queue_.empty()) return;  // stopping, and nothing left to run
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // what the job held goes before the next one is taken
    lock.lock();
  }
}

void Executor::run(std::size_t count, unsigned width, const std::function<void(std::size_t)>& task) {
  if (count == 0) return;
  auto batch = std::make_shared<Batch>();
  batch->count = count;
  batch->task = &task;
  const std::size_t helpers = std::min<std::size_t>(width == 0 ? count : width, count) - 1;
  for (std::size_t h = 0; h < helpers; ++h) {
    try {
      post([batch] { batch->work(); });
    } catch (const Error&) {
      break;  // no thread could start: the caller runs what is left
    }
  }
  batch->work();
  std::exception_ptr error;
  {
    std::unique_lock lock(batch->mutex);
    batch->finished.wait(lock, [&] { return batch->done.load() == count; });
    // Taken out of the batch: a helper that drops the batch later must not be the one that frees
    // the exception the caller is handling.
    error = std::exchange(batch->error, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void Executor::shutdown() {
  std::unique_lock lock(mutex_);
  stopping_ = true;
  work_.notify_all();
  // Jobs posted meanwhile may start threads; those stop too once the queue is empty.
  while (!threads_.empty()) {
    std::vector<std::thread> joining = std::exchange(threads_, {});
    lock.unlock();
    for (auto& thread : joining) thread.join();
    lock.lock();
  }
  stopping_ = false;
}

std::size_t Executor::threads() const {
  std::lock_guard lock(mutex_);
  return threads_.size();
}

}  // namespace hbmio::detail

namespace hbmio {

InterruptibleRun run_interruptible(const std::function<void(const std::atomic<bool>& stop)>& work,
                                   const std::function<bool()>& interrupted, std::chrono::milliseconds poll) {
  std::atomic<bool> stop{false};
  InterruptibleRun result;
  detail::Pending<void> done = detail::Executor::shared().start([&] { work(stop); });
  for (;;) {
    if (!result.interrupted && interrupted()) {
      result.interrupted = true;
      stop = true;
    }
    if (done.wait_for(poll)) break;
  }
  try {
    done.get();
  } catch (...) {
    result.error = std::current_exception();
  }
  return result;
}

}  // namespace hbmio
