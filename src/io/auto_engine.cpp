// The auto backend: per request, the fastest path that works for that file and memory, as
// choose_auto() (io/cufile_verdict.hpp) decides it, once per file. `hbmio doctor` reports the
// same function's answer. Every pass-over is recorded with its reason in Stats::note, so "why did
// it not use GDS?" has an answer.
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
  AutoEngine(const Options& options, std::shared_ptr<FaultHook> faults)
      : options_(options), faults_(std::move(faults)) {
    uring_status_ = {.name = "uring", .available = true, .detail = {}};
    try {
      uring_ = make_uring_engine(options_, faults_);
    } catch (const Error& e) {
      uring_status_ = {.name = "uring", .available = false, .detail = e.detail()};
    }
    posix_ = make_posix_engine(options_, faults_);
  }

  std::string_view name() const noexcept override { return "auto"; }

  Stats submit(const IoRequest& request) override {
    // A request without a file is refused here (EBADF) rather than dereferenced below; every
    // other check is the serving engine's, whose name the error then carries.
    if (request.file == nullptr) validate_request(request, name());
    if (request.memory.kind() != MemoryKind::device || request.memory.size == 0)
      return fallback({&request, 1}, host_reasons(), {});
    const int device = request.memory.location.device;
    const AutoChoice choice = choice_for(*request.file, device);
    if (choice.backend == "cufile") {
      if (Engine* cufile = cufile_engine(device)) {
        Stats stats = cufile->submit(request);
        stats.note = fmt::format("auto: cufile ({})", choice.cufile_mode);
        for (TransferPath& path : stats.paths) path.reason = "auto chose cufile, which moves this file by DMA; " + path.reason;
        return stats;
      }
      const std::string why = "cufile: " + cufile_reason_;
      return fallback({&request, 1}, why, {{request.file->path(), why}});
    }
    return fallback({&request, 1}, choice.passed_over, {{request.file->path(), choice.passed_over}});
  }

  // A batch goes whole to uring (or posix) unless one of its requests would go to cufile by DMA;
  // then each request takes its own path.
  Stats submit_batch(std::span<const IoRequest> requests) override {
    for (const IoRequest& request : requests)
      if (request.file == nullptr) validate_request(request, name());  // EBADF, not a crash below
    bool device = false;
    const File* checked = nullptr;  // requests of one file come in runs: ask once per run
    std::string reasons;            // the first file's, for the note
    std::map<std::string, std::string> passed_over;  // each file's, for its TransferPath
    for (const IoRequest& request : requests) {
      if (request.memory.kind() != MemoryKind::device || request.memory.size == 0 || request.file == checked) continue;
      device = true;
      checked = request.file;
      const int gpu = request.memory.location.device;
      const AutoChoice choice = choice_for(*request.file, gpu);
      if (choice.backend == "cufile" && cufile_engine(gpu) != nullptr) return Engine::submit_batch(requests);
      const std::string why = choice.backend == "cufile" ? "cufile: " + cufile_reason_ : choice.passed_over;
      if (reasons.empty()) reasons = why;
      passed_over.emplace(request.file->path(), why);
    }
    return fallback(requests, device ? reasons : host_reasons(), passed_over);
  }

 private:
  // choose_auto() for this file, asked once per file (device and inode) and kept: a lazy load asks
  // thousands of times.
  AutoChoice choice_for(const File& file, int device) {
    const auto key = std::make_pair(file.identity().device, file.identity().inode);
    {
      std::lock_guard lock(mutex_);
      if (auto it = choices_.find(key); it != choices_.end()) return it->second;
    }
    AutoChoice choice = choose_auto(file, device, uring_status_);
    std::lock_guard lock(mutex_);
    if (choices_.size() >= kMaxChoices) choices_.clear();  // bounded: a long-lived engine meets many files
    choices_.emplace(key, choice);
    return choice;
  }

  // Host memory never goes through cuFile, so a host load names only what it could have used.
  std::string host_reasons() const { return uring_ ? std::string() : "uring: " + uring_status_.detail; }

  // `passed_over`: by file path, what auto passed over for that file's device memory; a file not
  // in it was moved to or from host memory.
  Stats fallback(std::span<const IoRequest> requests, const std::string& reasons,
                 const std::map<std::string, std::string>& passed_over) {
    Engine& engine = uring_ ? *uring_ : *posix_;
    Stats stats = engine.submit_batch(requests);
    stats.note = fmt::format("auto picked {}{}{}{}", engine.name(), reasons.empty() ? "" : " (passed over " + reasons + ")",
                             stats.note.empty() ? "" : "; ", stats.note);
    for (TransferPath& path : stats.paths) {
      const auto found = passed_over.find(path.file);
      std::string why;
      if (found != passed_over.end()) why = "GPU memory, and it passed over " + found->second;
      else why = "host memory, which cuFile does not move" + (uring_ ? std::string() : "; uring: " + uring_status_.detail);
      path.reason = fmt::format("auto chose {}: {}; {}", engine.name(), why, path.reason);
    }
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
  std::shared_ptr<FaultHook> faults_;
  std::unique_ptr<Engine> uring_, posix_, cufile_;
  BackendStatus uring_status_;
  std::string cufile_reason_;
  static constexpr std::size_t kMaxChoices = 4096;
  std::map<std::pair<std::uint64_t, std::uint64_t>, AutoChoice> choices_;  // by (device, inode)
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Engine> make_auto_engine(const Options& options, std::shared_ptr<FaultHook> faults) {
  return std::make_unique<AutoEngine>(options, std::move(faults));
}

}  // namespace hbmio::detail
