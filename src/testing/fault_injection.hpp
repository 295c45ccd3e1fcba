// Test support: seeded fault injection inside the backends (this layer is linked by tests only;
// production code sees only the FaultHook interface it implements, and passes none).
//
// An engine made with make_engine(name, options, injector) asks the injector about each of its
// calls that can fail: setup calls (ring creation, buffer registration, pinned allocation),
// each storage I/O completion, and each copy to or from the GPU. The injector can fail the
// N-th call, fail the I/O at a given file offset, turn completions into short transfers, or into
// -EAGAIN / -EINTR a number of times. log() lists what it did.
//
// Replaying: whether an I/O is cut short, and where, is decided from the seed and the I/O itself
// (its call name, file offset and length), not from the order of calls, so a seed replays the same
// cuts at the same bytes with any number of workers; so does fail_offset. fail_call counts calls
// over all threads: it replays exactly with one worker (Options::workers = 1), and with several it
// fails some call of the N-th rank, whichever thread makes it.
//
// SQLite-style use: for N = 1, 2, ... run an operation with fail_call = N until it succeeds;
// after each failure the error must be clear and nothing may leak.
#pragma once

#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/fault_hook.hpp"

namespace hbmio {

struct FaultPlan {
  std::uint64_t seed = 1;
  std::uint64_t fail_call = 0;       // fail the N-th call counted over all sites (1-based; 0: never)
  int fail_errno = 5;                // EIO
  double short_probability = 0;      // chance that an I/O completion is cut short
  unsigned eagain_count = 0;         // the first N I/O completions report -EAGAIN
  unsigned eintr_count = 0;          // then N report -EINTR
  std::uint64_t end_of_file_io = 0;  // the N-th storage I/O (1-based) finds the end of the file
  // Fail (with fail_errno, once) the first storage I/O whose range holds this file offset and
  // whose call name contains fail_what ("" matches any): a failure at a place, not at a rank.
  std::uint64_t fail_offset = kNoOffset;
  std::string fail_what{};
  static constexpr std::uint64_t kNoOffset = FaultHook::kNoOffset;
};

class FaultInjector final : public FaultHook {
 public:
  explicit FaultInjector(FaultPlan plan);

  // For setup and device copies: 0 to proceed, or a positive errno to fail with.
  int check(FaultSite site, const char* what) override;
  // For an I/O at file `offset` that moved `result` bytes (or -errno) of `requested`: the result
  // to act on. May return fewer bytes (short transfer), -EAGAIN, -EINTR or -fail_errno.
  long long on_io_result(long long result, std::uint64_t requested, const char* what,
                         std::uint64_t offset = FaultPlan::kNoOffset) override;

  std::uint64_t calls() const;           // calls seen so far
  bool fired() const;                    // whether fail_call was reached
  std::vector<std::string> log() const;  // one line per injected fault

 private:
  mutable std::mutex mutex_;
  FaultPlan plan_;
  std::mt19937_64 random_;
  std::uint64_t calls_ = 0;
  std::uint64_t io_calls_ = 0;
  unsigned eagain_left_, eintr_left_;
  bool fired_ = false;
  bool offset_fired_ = false;
  std::vector<std::string> log_;
};

}  // namespace hbmio
