// What every backend shares: request checks, timing, and the factory.
#include <sys/resource.h>

#include <fmt/format.h>

#include "hbmio/config.hpp"
#include "hbmio/engine.hpp"
#include "io/engine_internal.hpp"
#include "memory/cuda_runtime.hpp"

namespace hbmio {

namespace detail {

const char* op_name(IoOp op) noexcept { return op == IoOp::read ? "read" : "write"; }

ErrorContext context_of(const IoRequest& request, std::string_view backend) {
  return {.op = op_name(request.op),
          .path = request.file ? request.file->path() : std::string(),
          .offset = request.offset,
          .length = request.memory.size,
          .backend = std::string(backend)};
}

void validate_request(const IoRequest& request, std::string_view backend) {
  const ErrorContext context = context_of(request, backend);
  if (request.file == nullptr || request.file->fd() < 0) throw Error(errno_code(EBADF), context, "no open file");
  if (request.op == IoOp::read && !request.file->readable())
    throw Error(errno_code(EBADF), context, "file is open for writing only");
  if (request.op == IoOp::write && !request.file->writable())
    throw Error(errno_code(EBADF), context, "file is open for reading only");
  if (request.op == IoOp::write && request.landed != nullptr)
    throw Error(errno_code(EINVAL), context, "a write names a LandedSink: only reads are told as they land");
  const std::uint64_t length = request.memory.size;
  if (request.offset > static_cast<std::uint64_t>(INT64_MAX) || length > static_cast<std::uint64_t>(INT64_MAX) - request.offset)
    throw Error(errno_code(EOVERFLOW), context, "offset + length overflows a file offset");
  if (length == 0) return;
  if (request.memory.data == nullptr) throw Error(errno_code(EFAULT), context, "memory span has no data pointer");
  if (request.op == IoOp::read && request.offset + length > request.file->size_at_open()) {
    const std::uint64_t size = request.file->size();  // it may have grown since it was opened
    if (request.offset + length > size)
      throw Error(errno_code(EINVAL), context,
                  fmt::format("range ends at byte {}, past the end of the file ({} bytes)", request.offset + length, size));
  }
  if (request.memory.kind() == MemoryKind::device)
    cuda::check_device_pointer(request.memory.data, request.memory.location.device, context);
}

void validate_batch(std::span<const IoRequest> requests, std::string_view backend) {
  for (const IoRequest& request : requests) {
    if (request.op != requests.front().op)
      throw Error(errno_code(EINVAL), context_of(request, backend), "a batch mixes reads and writes");
    validate_request(request, backend);
  }
}

TransferTimer::TransferTimer() : start_(std::chrono::steady_clock::now()), cpu_start_(process_cpu_seconds()) {}

void TransferTimer::finish(Stats& stats) const {
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  stats.cpu_seconds = process_cpu_seconds() - cpu_start_;
}

}  // namespace detail

double process_cpu_seconds() noexcept {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

Stats Engine::read(const File& file, std::uint64_t offset, MemorySpan destination) {
  return submit({.op = IoOp::read, .file = &file, .offset = offset, .memory = destination});
}

Stats Engine::write(const File& file, std::uint64_t offset, MemorySpan source) {
  return submit({.op = IoOp::write, .file = &file, .offset = offset, .memory = source});
}

Stats Engine::submit_batch(std::span<const IoRequest> requests) {
  detail::validate_batch(requests, name());
  detail::TransferTimer timer;
  Stats total;
  for (const IoRequest& request : requests) {
    const Stats s = submit(request);
    total.add_part(s);
    if (total.note.empty()) total.note = s.note;
  }
  if (total.backend.empty()) total.backend = std::string(name());
  timer.finish(total);
  return total;
}

std::future<Stats> Engine::submit_async(IoRequest request) {
  // std::async's future waits for the transfer when dropped: a caller that drops it on an error
  // path does not leave the transfer writing into memory it frees.
  return std::async(std::launch::async, [this, request] { return submit(request); });
}

std::vector<std::string> backend_names() { return {"posix", "uring", "cufile", "auto"}; }

std::unique_ptr<Engine> make_engine(std::string_view backend, const Options& options) {
  return detail::make_engine_with_faults(backend, options, nullptr);
}

std::unique_ptr<Engine> detail::make_engine_with_faults(std::string_view backend, const Options& options,
                                                        std::shared_ptr<FaultHook> faults) {
  if (backend.empty()) return make_engine_with_faults(configured_backend(), options, std::move(faults));
  options.validate();
  if (backend == "posix") return detail::make_posix_engine(options, std::move(faults));
  if (backend == "uring") return detail::make_uring_engine(options, std::move(faults));
  if (backend == "cufile") return detail::make_cufile_engine(options, std::move(faults));
  if (backend == "auto") return detail::make_auto_engine(options, std::move(faults));
  throw Error(errno_code(EINVAL), {.op = "open backend", .backend = std::string(backend)},
              "unknown backend: use posix, uring, cufile or auto");
}

std::vector<BackendStatus> probe_backends(const Options& options) {
  std::vector<BackendStatus> result;
  result.push_back({"posix", true, "pread/pwrite, one thread; device memory through a pageable buffer + cudaMemcpy"});
  result.push_back(detail::probe_uring());
  result.push_back(detail::probe_cufile());
  // What auto will do. Whether cufile runs by DMA depends on the file (its file system and
  // device), so that part is decided per request; `hbmio doctor PATH` answers it for a path.
  const bool uring = result[1].available, cufile = result[2].available;
  const std::string fallback = uring ? "uring" : "posix";
  result.push_back({"auto", true,
                    fmt::format("host memory: {}; device memory: {}", fallback,
                                cufile ? "cufile where it runs GDS/P2PDMA for the file, else " + fallback
                                       : fallback + " (cufile unavailable)")});
  (void)options;
  return result;
}

}  // namespace hbmio
