// The progress line (hbmio/progress.hpp), drawn by a job on the process's pool.
#include "hbmio/progress.hpp"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "hbmio/options.hpp"

namespace hbmio {

struct ProgressLine::State {
  State(std::string label_, std::uint64_t total_, const std::atomic<std::uint64_t>& done_, Ending ending_, Writer write_)
      : label(std::move(label_)), total(total_), done(done_), ending(ending_), write(std::move(write_)) {}

  std::string label;
  std::uint64_t total;
  const std::atomic<std::uint64_t>& done;
  Ending ending;
  Writer write;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::mutex mutex;
  std::condition_variable changed;
  bool stopping = false;
  bool shown = false;
  std::optional<detail::Pending<void>> job;

  void draw() {
    const double seconds = std::max(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1e-9);
    const std::uint64_t now = done.load();
    const double percent = total > 0 ? 100.0 * static_cast<double>(now) / static_cast<double>(total) : 100.0;
    put(fmt::format("\r{}{} / {}  ({:.0f}%)  {:.2f} GiB/s   ", label.empty() ? "" : label + "  ", format_size(now),
                    format_size(total), percent, static_cast<double>(now) / seconds / (1 << 30)));
    shown = true;
  }

  void put(const std::string& text) {
    if (write) {
      write(text);
    } else {
      std::fputs(text.c_str(), stderr);
      std::fflush(stderr);
    }
  }

  // Draws outside the lock: a writer may block (Python's takes the GIL), and stop() must be able
  // to say "stop" meanwhile.
  void run() {
    std::unique_lock lock(mutex);
    while (!changed.wait_for(lock, std::chrono::milliseconds(200), [&] { return stopping; })) {
      lock.unlock();
      draw();
      lock.lock();
    }
  }
};

ProgressLine::ProgressLine(std::string label, std::uint64_t total, const std::atomic<std::uint64_t>& done, Ending ending, Writer write)
    : state_(std::make_unique<State>(std::move(label), total, done, ending, std::move(write))) {
  State* state = state_.get();
  state->job.emplace(detail::Executor::shared().start([state] { state->run(); }));
}

ProgressLine::~ProgressLine() { stop(); }

void ProgressLine::stop() noexcept {
  if (!state_ || !state_->job) return;
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->changed.notify_all();
  try {
    state_->job->get();
  } catch (...) {  // a writer that threw ended the drawing
  }
  state_->job.reset();
  try {
    if (state_->ending == Ending::keep) {
      state_->draw();
      state_->put("\n");
    } else if (state_->shown) {
      state_->put("\r\033[K");
    }
  } catch (...) {  // a writer that threw: nothing more to draw
  }
}

bool ProgressLine::wanted(std::uint64_t total) { return total > 0 && ::isatty(STDERR_FILENO); }

}  // namespace hbmio
