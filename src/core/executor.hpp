// The process's threads for work that is not an engine's: background persists, hashing, remote
// transfers, multi-location loads, a stream's fill, closing replaced files. Engines keep their own
// threads (WorkerThreads), which hold per-thread rings and streams; everything else runs here, so
// that one place names, bounds and stops the library's threads.
//
// Two ways in:
//  - post(job): runs `job` on a pool thread. An idle thread takes it, else a new one starts while
//    the pool is below its bound, else it waits in a queue. For work that outlives
//    the call that starts it (a background save's persist, a stream's fill).
//  - run(count, width, task): task(0) ... task(count - 1) on the caller's thread and up to
//    width - 1 pool threads at once; returns when all have returned. The caller takes tasks too,
//    so a run finishes even when every pool thread is busy (a run inside a posted job cannot wait
//    for threads that never come), and a helper that starts late finds nothing left to do.
//
//  - start(fn): post() for a job whose result the caller takes later: returns a Pending, whose
//    get() waits and returns fn's result or rethrows its exception, and whose destructor waits
//    too (as std::async's future does), so the job never outlives what it references.
//
// Threads are named "hbmio-pool" (what `top -H` and debuggers show), never retire (idle ones cost
// a sleeping thread's stack), and are joined by shutdown(), which Python's exit handler calls after
// the background saves and streams are done and before the CUDA runtime goes. A child of fork()
// gets a fresh, empty pool: the parent's threads do not exist there.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <type_traits>
#include <thread>
#include <vector>

namespace hbmio::detail {

template <typename T>
class Pending;

class Executor {
 public:
  // Most threads the pool starts: far above what any load or save uses at once, low enough that a
  // runaway caller meets queued jobs rather than the system's thread limit.
  static constexpr unsigned kMaxThreads = 256;

  // The process's pool (made on first use, never destroyed: work may still finish during static
  // destruction in programs that do not call shutdown()).
  static Executor& shared();

  // `max_threads`: the bound (tests make small pools; the shared one has kMaxThreads).
  explicit Executor(unsigned max_threads = kMaxThreads) : max_threads_(std::max(max_threads, 1u)) {}
  ~Executor() { shutdown(); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `job`; a pool thread runs it. A job must not throw: it reports its own errors (what it
  // throws ends the process, as a throwing std::thread does). Throws Error(EAGAIN) naming the limit
  // when no thread exists and none can be started.
  void post(std::function<void()> job);

  template <typename F>
  Pending<std::invoke_result_t<F&>> start(F fn) {
    auto task = std::make_shared<std::packaged_task<std::invoke_result_t<F&>()>>(std::move(fn));
    auto future = task->get_future();
    post([task] { (*task)(); });
    return Pending<std::invoke_result_t<F&>>(std::move(future));
  }

  // Runs task(i) for every i < count, on the caller's thread and up to width - 1 pool threads
  // (width 0: as many as there are tasks), and waits for all. After a task throws, tasks not yet
  // started are skipped; the first exception is rethrown once every started task has returned.
  void run(std::size_t count, unsigned width, const std::function<void(std::size_t)>& task);

  // Waits for every queued and running job, then joins the threads. The pool starts threads again
  // if work comes later.
  void shutdown();

  // Threads started and not joined (for tests).
  std::size_t threads() const;

 private:
  void serve();

  const unsigned max_threads_;
  mutable std::mutex mutex_;
  std::condition_variable work_;  // a job was queued, or shutdown() began
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  unsigned idle_ = 0;      // threads waiting for a job
  bool stopping_ = false;  // shutdown() in progress: threads exit once the queue is empty
};

// What start() returns: the job's result, waited for by get() or by the destructor.
template <typename T>
class Pending {
 public:
  Pending() = default;
  explicit Pending(std::future<T> future) : future_(std::move(future)) {}
  Pending(Pending&&) noexcept = default;
  Pending& operator=(Pending&& other) noexcept {
    wait();
    future_ = std::move(other.future_);
    return *this;
  }
  ~Pending() { wait(); }

  bool valid() const noexcept { return future_.valid(); }
  T get() { return future_.get(); }
  void wait() const noexcept {
    if (future_.valid()) future_.wait();
  }
  // Waits up to `timeout`; true once the job has returned.
  bool wait_for(std::chrono::milliseconds timeout) const {
    return !future_.valid() || future_.wait_for(timeout) == std::future_status::ready;
  }

 private:
  std::future<T> future_;
};

}  // namespace hbmio::detail
