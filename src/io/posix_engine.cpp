// The posix backend: the article's baseline row, kept deliberately plain.
//
// One thread; pread()/pwrite() of a chunk at a time through the page cache; for device memory, one pageable host
// buffer and a blocking cudaMemcpy per chunk (no pinning, no overlap). This is what a first
// implementation does, and what the other backends are measured against: do not optimise it.
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/positional_io.hpp"
#include "io/engine_internal.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio::detail {
namespace {

class PosixEngine final : public Engine {
 public:
  PosixEngine(const Options& options, std::shared_ptr<FaultHook> faults)
      : chunk_size_(options.chunk_size), faults_(std::move(faults)) {}

  std::string_view name() const noexcept override { return "posix"; }

  Stats submit(const IoRequest& request) override {
    std::lock_guard lock(mutex_);
    validate_request(request, name());
    TransferTimer timer;
    Stats stats{.backend = "posix", .workers = 1};
    const MemorySpan memory = request.memory;
    if (memory.kind() == MemoryKind::device) {
      const cuda::DeviceGuard guard(memory.location.device, context_of(request, name()));
      // Pageable staging: allocated per request on purpose, like the naive loader it models.
      std::vector<std::byte> staging(std::min<std::size_t>(chunk_size_, memory.size));
      for (std::size_t done = 0; done < memory.size;) {
        const std::size_t n = std::min(staging.size(), memory.size - done);
        if (request.op == IoOp::read) {
          transfer_all(request, request.offset + done, staging.data(), n);
          copy(request, memory.data + done, staging.data(), n);
        } else {
          copy(request, staging.data(), memory.data + done, n);
          transfer_all(request, request.offset + done, staging.data(), n);
        }
        ++stats.bounce_copies;
        done += n;
      }
    } else {
      // In pieces of the chunk size, as a plain loader reads: one pread of gigabytes could be
      // neither stopped (IoRequest::cancel is looked at between calls) nor followed by a progress
      // bar until it returned.
      for (std::size_t done = 0; done < memory.size;) {
        const std::size_t n = std::min(chunk_size_, memory.size - done);
        transfer_all(request, request.offset + done, memory.data + done, n);
        done += n;
      }
    }
    stats.bytes = stats.bytes_buffered = memory.size;
    // The posix backend never uses O_DIRECT: it is the plain baseline, page cache and all.
    if (memory.size > 0)
      stats.paths.push_back({.file = request.file->path(),
                             .path = DataPath::posix,
                             .reason = memory.kind() == MemoryKind::device
                                           ? std::string(request.op == IoOp::read ? "pread through the page cache into a pageable buffer, then cudaMemcpy"
                                                                                  : "cudaMemcpy into a pageable buffer, then pwrite through the page cache")
                                           : std::string(request.op == IoOp::read ? "pread through the page cache" : "pwrite through the page cache"),
                             .bytes = memory.size});
    tell_landed(request);
    timer.finish(stats);
    return stats;
  }

 private:
  // The whole range, through the library's one pread/pwrite loop (short transfers resumed,
  // EINTR retried, EAGAIN bounded, a file that ends early an error).
  void transfer_all(const IoRequest& request, std::uint64_t offset, std::byte* data, std::size_t n) {
    const PositionalIo io{.faults = faults_.get(), .what = op_name(request.op), .cancel = request.cancel, .progress = request.progress};
    const ErrorContext context = context_of(request, name());
    if (request.op == IoOp::read) read_exactly(request.file->fd(), {data, n}, offset, context, io);
    else write_fully(request.file->fd(), {data, n}, offset, context, io);
  }

  void copy(const IoRequest& request, std::byte* dst, const std::byte* src, std::size_t n) {
    const ErrorContext context = context_of(request, name());
    if (const int err = inject(faults_.get(), FaultSite::device_copy, "cudaMemcpy"))
      throw Error(errno_code(err), context, "cudaMemcpy (injected)");
    cuda::memcpy_sync(dst, src, n, context);
  }

  std::size_t chunk_size_;
  std::shared_ptr<FaultHook> faults_;
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Engine> make_posix_engine(const Options& options, std::shared_ptr<FaultHook> faults) {
  return std::make_unique<PosixEngine>(options, std::move(faults));
}

}  // namespace hbmio::detail
