// Shared pieces of the backends: request validation, timing, error construction, and the
// factory functions of each backend (make_engine() dispatches to these).
#pragma once

#include <sys/resource.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "core/fault_hook.hpp"

namespace hbmio::detail {

// make_engine() whose backend sees injected failures: the testing layer's FaultInjector
// (src/testing/fault_injection.hpp), which only tests link. Production code calls make_engine().
std::unique_ptr<Engine> make_engine_with_faults(std::string_view backend, const Options& options, std::shared_ptr<FaultHook> faults);

// Context for errors about `request` in `backend`.
ErrorContext context_of(const IoRequest& request, std::string_view backend);
const char* op_name(IoOp op) noexcept;

// Throws Error(EINVAL/EBADF/ENODEV...) when the request cannot be served: no file, a file not
// open for the operation, offset + length overflowing or (reads) past the end of the file, a
// null span, device memory without CUDA or not on the named device.
void validate_request(const IoRequest& request, std::string_view backend);

// validate_request() for each, and one op (all reads or all writes) across the batch.
void validate_batch(std::span<const IoRequest> requests, std::string_view backend);

// Tells the request's LandedSink, if it names one, that its bytes are in place.
inline void tell_landed(const IoRequest& request) noexcept {
  if (request.landed != nullptr) request.landed->landed(request.landed_tag);
}

// Wall and process CPU time over a transfer, written into Stats by finish().
class TransferTimer {
 public:
  TransferTimer();
  void finish(Stats& stats) const;

 private:
  std::chrono::steady_clock::time_point start_;
  double cpu_start_;
};

// Fault hook calls that tolerate a null hook (production's).
inline int inject(FaultHook* faults, FaultSite site, const char* what) {
  return faults ? faults->check(site, what) : 0;
}
inline long long inject_io(FaultHook* faults, long long result, std::uint64_t requested, const char* what,
                           std::uint64_t offset) {
  return faults ? faults->on_io_result(result, requested, what, offset) : result;
}

// Backend factories. Each throws Error(ENOTSUP) with the reason when it cannot run here.
std::unique_ptr<Engine> make_posix_engine(const Options& options, std::shared_ptr<FaultHook> faults);
std::unique_ptr<Engine> make_uring_engine(const Options& options, std::shared_ptr<FaultHook> faults);
// `device`: the GPU of the first transfer, if known (where the cuFile driver is opened when the
// calling thread has no CUDA context).
std::unique_ptr<Engine> make_cufile_engine(const Options& options, std::shared_ptr<FaultHook> faults, int device = -1);
std::unique_ptr<Engine> make_auto_engine(const Options& options, std::shared_ptr<FaultHook> faults);

// The engine a load or save runs on: the caller's (`given`), else one made for this use (`made`:
// a save's FileSystem may give one), else a private one where the caller set options (an engine of
// the shared pool has none), else one leased from EnginePool::shared() for the object's life
// (`pooled_workers`: the leased engine's worker count, 0 for the configured one).
class EngineInUse {
 public:
  EngineInUse(Engine* given, std::string_view backend, const std::optional<Options>& options,
              std::unique_ptr<Engine> made = nullptr, unsigned pooled_workers = 0)
      : engine_(given) {
    if (engine_ != nullptr) return;
    if (made) {
      own_ = std::move(made);
      engine_ = own_.get();
    } else if (options) {
      own_ = make_engine(backend, *options);
      engine_ = own_.get();
    } else {
      lease_ = EnginePool::shared().acquire(backend, pooled_workers);
      engine_ = lease_.get();
    }
  }
  Engine& operator*() const noexcept { return *engine_; }
  Engine* get() const noexcept { return engine_; }

 private:
  Engine* engine_;
  std::unique_ptr<Engine> own_;
  EnginePool::Lease lease_;
};

// Availability probes (no exceptions): what `hbmio backends` prints.
BackendStatus probe_uring();
BackendStatus probe_cufile();

}  // namespace hbmio::detail
