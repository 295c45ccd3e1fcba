// The threads an engine owns for its whole life: its execution context.
//
// run(count, task) calls task(0) ... task(count - 1), each on its own thread, and returns when
// all have returned. Thread i always serves index i, so what a task keeps per index (an io_uring
// set up for a single issuer, a CUDA stream, the device made current) stays with one thread, and
// the caller's thread is never used: its current CUDA device is never touched. Threads are
// started on first need, up to the size given, and joined by the destructor.
//
// Why spin before sleeping: a lazy load asks for small tensors back to back; a futex wake each
// way costs more than reading 64 KiB from the page cache. A worker that finished spins a short
// while for the next task, and the caller spins a short while for the result, before either
// sleeps (bench/RESULTS.md, "per-request overhead"). Long transfers sleep as before.
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
  // `capacity`: most threads ever started; `name`: what errors call them ("uring worker").
  WorkerThreads(unsigned capacity, std::string name);
  ~WorkerThreads();
  WorkerThreads(const WorkerThreads&) = delete;
  WorkerThreads& operator=(const WorkerThreads&) = delete;

  unsigned capacity() const noexcept { return capacity_; }

  // Runs task(i) for i in [0, count) on threads 0..count-1 (count <= capacity) and waits for all.
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
