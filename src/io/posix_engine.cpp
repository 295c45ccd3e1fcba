// The posix backend: the article's baseline row, kept deliberately plain.
//
// One thread; pread()/pwrite() through the page cache; for device memory, one pageable host
// buffer and a blocking cudaMemcpy per chunk (no pinning, no overlap). This is what a first
// implementation does, and what the other backends are measured against: do not optimise it.
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "io/engine_internal.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio::detail {
namespace {

class PosixEngine final : public Engine {
 public:
  PosixEngine(const Options& options, std::shared_ptr<FaultInjector> faults)
      : chunk_size_(options.chunk_size), faults_(std::move(faults)) {}

  std::string_view name() const noexcept override { return "posix"; }

  Stats submit(const IoRequest& request) override {
    std::lock_guard lock(mutex_);
    validate_request(request, name());
    TransferTimer timer;
    Stats stats{.backend = "posix", .workers = 1};
    const MemorySpan memory = request.memory;
    if (memory.kind() == MemoryKind::device) {
      cuda::set_device(memory.location.device, context_of(request, name()));
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
      transfer_all(request, request.offset, memory.data, memory.size);
    }
    stats.bytes = stats.bytes_buffered = memory.size;
    timer.finish(stats);
    return stats;
  }

 private:
  // pread/pwrite until all n bytes moved: short transfers continue, EINTR/EAGAIN retry.
  void transfer_all(const IoRequest& request, std::uint64_t offset, std::byte* data, std::size_t n) {
    std::size_t done = 0;
    while (done < n) {
      if (request.cancel != nullptr && request.cancel->load(std::memory_order_relaxed))
        throw Error(errno_code(ECANCELED), at(request, offset + done, n - done), "stopped on request");
      const auto pos = static_cast<off_t>(offset + done);
      ssize_t r = request.op == IoOp::read ? ::pread(request.file->fd(), data + done, n - done, pos)
                                           : ::pwrite(request.file->fd(), data + done, n - done, pos);
      const long long result = inject_io(faults_.get(), r < 0 ? -errno : r, n - done, op_name(request.op));
      if (result == -EINTR || result == -EAGAIN) continue;
      if (result < 0) throw Error(errno_code(static_cast<int>(-result)), at(request, offset + done, n - done));
      if (result == 0)
        throw Error(errno_code(request.op == IoOp::read ? EIO : ENOSPC), at(request, offset + done, n - done),
                    request.op == IoOp::read
                        ? fmt::format("file ended at byte {} (did it shrink during the read?)", offset + done)
                        : std::string("write made no progress"));
      if (request.progress) *request.progress += static_cast<std::uint64_t>(result);
      done += static_cast<std::size_t>(result);
    }
  }

  void copy(const IoRequest& request, std::byte* dst, const std::byte* src, std::size_t n) {
    const ErrorContext context = context_of(request, name());
    if (const int err = inject(faults_.get(), FaultSite::device_copy, "cudaMemcpy"))
      throw Error(errno_code(err), context, "cudaMemcpy (injected)");
    cuda::memcpy_sync(dst, src, n, context);
  }

  ErrorContext at(const IoRequest& request, std::uint64_t offset, std::uint64_t length) const {
    ErrorContext context = context_of(request, name());
    context.offset = offset;
    context.length = length;
    return context;
  }

  std::size_t chunk_size_;
  std::shared_ptr<FaultInjector> faults_;
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Engine> make_posix_engine(const Options& options, std::shared_ptr<FaultInjector> faults) {
  return std::make_unique<PosixEngine>(options, std::move(faults));
}

}  // namespace hbmio::detail
