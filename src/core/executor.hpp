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
//    too (as std::async's future does), so the job never outlives what it references. A job no
//    pool thread has taken yet when it is waited for runs on the waiting thread.
//
// Threads are named "hbmio-pool" (what `top -H` and debuggers show), never retire (idle ones cost
// a sleeping thread's stack), and are joined by shutdown(), which Python's exit handler calls after
// the background saves and streams are done and before the CUDA runtime goes. A child of fork()
// gets a fresh, empty pool: the parent's threads do not exist there.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
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
  Pending<std::invoke_result_t<F&>> start(F fn);

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
//
// Not std::packaged_task and std::future: their shared state holds the job's exception until the
// last of the two ends lets go of it, which may be the pool thread after the caller has handled the
// exception; ThreadSanitizer (with a libstdc++ it does not see into) then reports the pool thread
// freeing what the caller read. Here get() takes the result or the exception out of the state under
// its mutex: the pool thread never frees what the caller gets.
//
// A job not started yet when get(), wait() or the destructor comes is run right there, on the
// waiting thread (the pool's copy then finds it taken and returns): a wait never depends on a pool
// thread being free, so a job that waits for work it started (a stream's fill for its reads) cannot
// hang where the pool has no thread to spare (its bound, or a process limit on threads).
template <typename T>
class Pending {
  struct State {
    std::function<T()> job;
    std::atomic<bool> taken{false};  // by a pool thread or by a waiter: the job runs once
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
    std::conditional_t<std::is_void_v<T>, bool, std::optional<T>> value{};
    std::exception_ptr error;
  };

 public:
  Pending() = default;
  Pending(Pending&&) noexcept = default;
  Pending& operator=(Pending&& other) noexcept {
    wait();
    state_ = std::move(other.state_);
    return *this;
  }
  ~Pending() { wait(); }

  bool valid() const noexcept { return state_ != nullptr; }
  // The job's result, or its exception rethrown; once (the Pending is then no longer valid).
  T get() {
    if (!state_) throw std::logic_error("Pending::get() of no job, or of one taken already");
    std::shared_ptr<State> state = std::move(state_);
    run_here(*state);
    std::unique_lock lock(state->mutex);
    state->finished.wait(lock, [&] { return state->done; });
    if (std::exception_ptr error = std::exchange(state->error, nullptr)) std::rethrow_exception(error);
    if constexpr (!std::is_void_v<T>) {
      T result = std::move(*state->value);
      state->value.reset();
      return result;
    }
  }
  void wait() const noexcept {
    if (!state_) return;
    run_here(*state_);
    std::unique_lock lock(state_->mutex);
    state_->finished.wait(lock, [&] { return state_->done; });
  }
  // Waits up to `timeout` (without taking the job); true once the job has returned.
  bool wait_for(std::chrono::milliseconds timeout) const {
    if (!state_) return true;
    std::unique_lock lock(state_->mutex);
    return state_->finished.wait_for(lock, timeout, [&] { return state_->done; });
  }

 private:
  friend class Executor;
  explicit Pending(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // Runs the job and stores what it returned or threw, unless another thread took it first.
  static void run_here(State& state) noexcept {
    if (state.taken.exchange(true)) return;
    std::exception_ptr error;
    decltype(state.value) value{};
    try {
      if constexpr (std::is_void_v<T>) state.job();
      else value.emplace(state.job());
    } catch (...) {
      error = std::current_exception();
    }
    state.job = nullptr;  // what it holds goes here, on the thread that ran it
    std::lock_guard lock(state.mutex);
    state.value = std::move(value);
    state.error = std::move(error);
    state.done = true;
    state.finished.notify_all();
  }
  std::shared_ptr<State> state_;
};

template <typename F>
Pending<std::invoke_result_t<F&>> Executor::start(F fn) {
  using P = Pending<std::invoke_result_t<F&>>;
  auto state = std::make_shared<typename P::State>();
  // Shared, so that the job is copyable as std::function needs, whatever `fn` holds.
  state->job = [job = std::make_shared<F>(std::move(fn))] { return (*job)(); };
  post([state] { P::run_here(*state); });
  return P(std::move(state));
}

}  // namespace hbmio::detail
