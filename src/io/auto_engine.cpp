// The auto backend: per request, the fastest path that works for that file and memory. What
// cuFile can do for a file is asked once per file and remembered.
//
// Order: cufile (only where it moves data by DMA: GDS or P2PDMA; its compatibility mode is a
// pread + copy that the uring pipeline beats), then uring, then posix. Every pass-over is
// recorded with its reason in Stats::note, so "why did it not use GDS?" has an answer.
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "io/cufile_verdict.hpp"
#include "io/engine_internal.hpp"

namespace hbmio::detail {
namespace {

class AutoEngine final : public Engine {
 public:
  AutoEngine(const Options& options, std::shared_ptr<FaultInjector> faults)
      : options_(options), faults_(std::move(faults)) {
    try {
      uring_ = make_uring_engine(options_, faults_);
    } catch (const Error& e) {
      uring_reason_ = e.detail();
    }
    posix_ = make_posix_engine(options_, faults_);
  }

  std::string_view name() const noexcept override { return "auto"; }

  Stats submit(const IoRequest& request) override {
    // A request without a file is refused here (EBADF) rather than dereferenced below; every
    // other check is the serving engine's, whose name the error then carries.
    if (request.file == nullptr) validate_request(request, name());
    std::string reasons;
    if (request.memory.kind() == MemoryKind::device && request.memory.size > 0) {
      const int device = request.memory.location.device;
      const CufileVerdict verdict = verdict_for(*request.file, device);
      if (verdict.usable && verdict.direct) {
        if (Engine* cufile = cufile_engine(device)) {
          Stats stats = cufile->submit(request);
          stats.note = fmt::format("auto: cufile ({})", verdict.mode);
          return stats;
        }
        reasons += "cufile: " + cufile_reason_ + "; ";
      } else {
        reasons += "cufile: " + (verdict.usable ? verdict.mode + ", no faster than uring" : verdict.reason) + "; ";
      }
    } else {
      reasons += "cufile: moves device memory only; ";
    }
    return fallback({&request, 1}, reasons);
  }

  // A batch goes whole to uring (or posix) unless one of its requests would go to cufile by DMA;
  // then each request takes its own path.
  Stats submit_batch(std::span<const IoRequest> requests) override {
    for (const IoRequest& request : requests)
      if (request.file == nullptr) validate_request(request, name());  // EBADF, not a crash below
    bool device = false;
    const File* checked = nullptr;  // requests of one file come in runs: ask cuFile once per run
    std::string reason;  // the first file's, for the note
    for (const IoRequest& request : requests) {
      if (request.memory.kind() != MemoryKind::device || request.memory.size == 0 || request.file == checked) continue;
      device = true;
      checked = request.file;
      const int gpu = request.memory.location.device;
      const CufileVerdict verdict = verdict_for(*request.file, gpu);
      if (verdict.usable && verdict.direct && cufile_engine(gpu) != nullptr) return Engine::submit_batch(requests);
      if (reason.empty())
        reason = !verdict.usable ? verdict.reason
                 : verdict.direct ? cufile_reason_  // DMA possible, but the cufile engine failed to start
                                  : verdict.mode + ", no faster than uring";
    }
    return fallback(requests, device ? "cufile: " + reason + "; " : "cufile: moves device memory only; ");
  }

 private:
  // cuFile's verdict, without opening its driver where sysfs already rules DMA out: the driver's
  // set-up would be paid by the first load only to learn that cuFile would pread + copy.
  // Decided once per file (device and inode) and kept: a lazy load asks thousands of times.
  CufileVerdict verdict_for(const File& file, int device) {
    const auto key = std::make_pair(file.identity().device, file.identity().inode);
    {
      std::lock_guard lock(mutex_);
      if (auto it = verdicts_.find(key); it != verdicts_.end()) return it->second;
    }
    CufileVerdict verdict;
    if (std::optional<std::string> why = cufile_dma_ruled_out(file)) verdict = {.reason = *why + " (cuFile not asked)"};
    else verdict = cufile_verdict(file, device);
    std::lock_guard lock(mutex_);
    if (verdicts_.size() >= kMaxVerdicts) verdicts_.clear();  // bounded: a long-lived engine meets many files
    verdicts_.emplace(key, verdict);
    return verdict;
  }

  Stats fallback(std::span<const IoRequest> requests, std::string reasons) {
    Engine& engine = uring_ ? *uring_ : *posix_;
    if (!uring_) reasons += "uring: " + uring_reason_ + "; ";
    Stats stats = engine.submit_batch(requests);
    stats.note = fmt::format("auto picked {} (passed over {}){}{}", engine.name(), reasons.substr(0, reasons.size() - 2),
                             stats.note.empty() ? "" : "; ", stats.note);
    return stats;
  }

  Engine* cufile_engine(int device) {
    std::lock_guard lock(mutex_);
    if (!cufile_ && cufile_reason_.empty()) {
      try {
        cufile_ = make_cufile_engine(options_, faults_, device);
      } catch (const Error& e) {
        cufile_reason_ = e.detail();
      }
    }
    return cufile_.get();
  }

  Options options_;
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<Engine> uring_, posix_, cufile_;
  std::string uring_reason_, cufile_reason_;
  static constexpr std::size_t kMaxVerdicts = 4096;
  std::map<std::pair<std::uint64_t, std::uint64_t>, CufileVerdict> verdicts_;  // by (device, inode)
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Engine> make_auto_engine(const Options& options, std::shared_ptr<FaultInjector> faults) {
  return std::make_unique<AutoEngine>(options, std::move(faults));
}

}  // namespace hbmio::detail
