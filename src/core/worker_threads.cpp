#include "core/worker_threads.hpp"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <system_error>
#include <utility>

#include "hbmio/error.hpp"

namespace hbmio::detail {
namespace {

// How long a thread yields on a hand-off before it sleeps: a few small requests' transfer times.
constexpr auto kSpin = std::chrono::microseconds(50);

// Waits until `value` differs from `old` and returns the new value: yields for up to kSpin (a
// thread that yields lets a runnable worker have its core on a busy machine), then sleeps.
std::uint32_t wait_for_change(const std::atomic<std::uint32_t>& value, std::uint32_t old) {
  std::uint32_t now = value.load(std::memory_order_acquire);
  const auto until = std::chrono::steady_clock::now() + kSpin;
  while (now == old) {
    if (std::chrono::steady_clock::now() > until) {
      value.wait(old, std::memory_order_acquire);
    } else {
      std::this_thread::yield();
    }
    now = value.load(std::memory_order_acquire);
  }
  return now;
}

}  // namespace

WorkerThreads::WorkerThreads(unsigned capacity, std::string name) : capacity_(std::max(capacity, 1u)), name_(std::move(name)) {
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
  // Seat i serves index i + 1: index 0 is the caller's.
  while (seats_.size() + 1 < count) {
    auto seat = std::make_unique<Seat>();
    const auto index = static_cast<unsigned>(seats_.size());
    try {
      seat->thread = std::jthread([this, index, s = seat.get()] { serve(*s, index + 1); });
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
  remaining_.store(count - 1, std::memory_order_relaxed);
  for (unsigned i = 1; i < count; ++i) {
    seats_[i - 1]->ticket.fetch_add(1, std::memory_order_release);
    seats_[i - 1]->ticket.notify_one();
  }
  try {
    task(0);
  } catch (...) {
    std::lock_guard lock(error_mutex_);
    if (!error_) error_ = std::current_exception();
  }
  for (std::uint32_t left = remaining_.load(std::memory_order_acquire); left != 0;)
    left = wait_for_change(remaining_, left);  // remaining_ only falls
  task_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void WorkerThreads::serve(Seat& seat, unsigned index) {
  // Named for top, perf and debuggers: "hbmio-uring 3" (at most 15 characters).
  const std::string title = ("hbmio-" + name_.substr(0, name_.find(' ')) + " " + std::to_string(index)).substr(0, 15);
  ::pthread_setname_np(::pthread_self(), title.c_str());
  std::uint32_t seen = 0;
  for (;;) {
    seen = wait_for_change(seat.ticket, seen);
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
