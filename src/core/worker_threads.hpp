// The threads an engine owns for its whole life: its execution context.
//
// run(count, task) calls task(0) ... task(count - 1) at once and returns when all have returned.
// The caller's thread runs task(0); the engine's thread i runs task(i) for i >= 1, always the same
// thread for the same index, so what a task keeps per index (an io_uring set up for a single
// issuer, a CUDA stream, the device made current) stays with one thread. Threads are started on
// first need, up to capacity - 1, and joined by the destructor. A task(0) that touches CUDA holds
// a cuda::DeviceGuard: the caller's current device is the caller's.
//
// Why the caller takes a share: a lazy load asks for small tensors one after another, and most of
// those jobs are one piece. Handing such a job to a thread and waiting for it made each small read
// several times slower on a busy 2-core machine (the waiting caller held the core the worker
// needed), while the caller doing it costs nothing extra (bench/RESULTS.md, "Per-request overhead").
//
// Why threads spin a little before sleeping: a futex wake costs about what copying 64 KiB does. A
// worker that finished yields the CPU for up to 50 us waiting for the next task, and the caller
// waits for the others the same way, before either sleeps. Long transfers sleep as before.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hbmio::detail {

class WorkerThreads {
 public:
  // `capacity`: most tasks of one run (the caller's included); `name`: what errors call the
  // threads ("uring worker").
  WorkerThreads(unsigned capacity, std::string name);
  ~WorkerThreads();
  WorkerThreads(const WorkerThreads&) = delete;
  WorkerThreads& operator=(const WorkerThreads&) = delete;

  unsigned capacity() const noexcept { return capacity_; }

  // Runs task(0) here and task(i), 0 < i < count, on thread i (count is capped at capacity), and
  // waits for all.
  // If tasks throw, the first exception is rethrown after every task has returned. Throws
  // Error(EAGAIN) naming the thread limit when a thread cannot be started. One run at a time:
  // callers serialise (engines hold their request mutex).
  void run(unsigned count, const std::function<void(unsigned)>& task);

 private:
  struct alignas(64) Seat {
    std::atomic<std::uint32_t> ticket{0};  // bumped by run() to hand this thread a task
    std::jthread thread;
  };
  void serve(Seat& seat, unsigned index);
  void start_threads(unsigned count);

  const unsigned capacity_;
  const std::string name_;
  std::vector<std::unique_ptr<Seat>> seats_;
  const std::function<void(unsigned)>* task_ = nullptr;
  std::atomic<std::uint32_t> remaining_{0};  // tasks of the current run not yet returned
  std::atomic<bool> stopping_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace hbmio::detail
