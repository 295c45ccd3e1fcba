#include "core/worker_threads.hpp"

#include <chrono>
#include <system_error>
#include <utility>

#include "hbmio/error.hpp"

namespace hbmio::detail {
namespace {

// How long a thread spins on a hand-off before it sleeps. A few of a small request's transfer
// times; an idle engine's threads stop spinning this long after their last task.
// Measured with bench/micro/request_overhead.cpp on the 2-core development VM, 64 KiB warm reads:
// a caller that sleeps at once took 30.6 us per request, one that spins 10 us 29.1 us, 50 us 21.8 us.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kCallerSpin = std::chrono::microseconds(50);

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits until `value` differs from `old` and returns the new value: spins up to `spin`, then sleeps.
std::uint32_t wait_for_change(const std::atomic<std::uint32_t>& value, std::uint32_t old,
                              std::chrono::nanoseconds spin) {
  std::uint32_t now = value.load(std::memory_order_acquire);
  if (now != old) return now;
  const auto until = std::chrono::steady_clock::now() + spin;
  for (unsigned i = 0; now == old; ++i) {
    cpu_relax();
    now = value.load(std::memory_order_acquire);
    if (now == old && i % 64 == 63 && std::chrono::steady_clock::now() > until) {
      value.wait(old, std::memory_order_acquire);
      now = value.load(std::memory_order_acquire);
    }
  }
  return now;
}

}  // namespace

WorkerThreads::WorkerThreads(unsigned capacity, std::string name) : capacity_(capacity), name_(std::move(name)) {
  seats_.reserve(capacity_);
}

WorkerThreads::~WorkerThreads() {
  stopping_.store(true, std::memory_order_release);
  for (auto& seat : seats_) {
    seat->ticket.fetch_add(1, std::memory_order_release);
    seat->ticket.notify_one();
  }
  seats_.clear();  // joins
}

void WorkerThreads::start_threads(unsigned count) {
  while (seats_.size() < count) {
    auto seat = std::make_unique<Seat>();
    const auto index = static_cast<unsigned>(seats_.size());
    try {
      seat->thread = std::jthread([this, index, s = seat.get()] { serve(*s, index); });
    } catch (const std::system_error& e) {
      throw Error(e.code(), {.op = "start " + name_ + " thread " + std::to_string(index + 1)}, thread_limit_message(e));
    }
    seats_.push_back(std::move(seat));
  }
}

void WorkerThreads::run(unsigned count, const std::function<void(unsigned)>& task) {
  if (count == 0) return;
  if (count > capacity_) count = capacity_;
  start_threads(count);
  error_ = nullptr;
  task_ = &task;
  remaining_.store(count, std::memory_order_relaxed);
  for (unsigned i = 0; i < count; ++i) {
    seats_[i]->ticket.fetch_add(1, std::memory_order_release);
    seats_[i]->ticket.notify_one();
  }
  for (std::uint32_t left = remaining_.load(std::memory_order_acquire); left != 0;) {
    // remaining_ only falls; wait_for_change returns once it moved, then check again.
    left = wait_for_change(remaining_, left, kCallerSpin);
  }
  task_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void WorkerThreads::serve(Seat& seat, unsigned index) {
  std::uint32_t seen = 0;
  for (;;) {
    seen = wait_for_change(seat.ticket, seen, kSpin);
    if (stopping_.load(std::memory_order_acquire)) return;
    try {
      (*task_)(index);
    } catch (...) {
      std::lock_guard lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
  }
}

}  // namespace hbmio::detail
