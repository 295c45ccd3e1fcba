// A progress line on stderr for a transfer that counts its bytes in an atomic counter (the
// `progress` of LoadOptions, SaveOptions, IoRequest): what the command shows on a terminal and
// Python's progress=True. The line is drawn by a job on the library's pool, so neither face starts
// a thread of its own to draw it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace hbmio {

class ProgressLine {
 public:
  // What stop() leaves: the command erases the line (its own output follows), Python keeps the
  // last line, drawn once more at the end, and ends it with a newline.
  enum class Ending { erase, keep };

  // Where the text goes: stderr where null; Python's sys.stderr for Python (a notebook's stderr is
  // not the process's). Called on a pool thread, and by stop() on the caller's.
  using Writer = std::function<void(const std::string& text)>;

  // Draws "\rLABEL  1.20 GiB / 4.00 GiB  (30%)  3.10 GiB/s" (without the label where it is empty)
  // every 200 ms from 200 ms on, until stop() or destruction: a short transfer shows nothing
  // until its end (and then only with Ending::keep). `done` must outlive the line.
  ProgressLine(std::string label, std::uint64_t total, const std::atomic<std::uint64_t>& done, Ending ending = Ending::erase,
               Writer write = {});
  ~ProgressLine();
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Stops drawing (waits for a draw under way) and ends the line as `ending` says. Idempotent.
  void stop() noexcept;

  // Whether the command shows a line at all: only where stderr is a terminal, so logs and pipes
  // stay clean (Python draws where progress=True asks).
  static bool wanted(std::uint64_t total);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace hbmio
