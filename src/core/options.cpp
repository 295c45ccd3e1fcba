#include "hbmio/options.hpp"

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio {
namespace {

Error bad_option(const std::string& name, const std::string& why) {
  return Error(errno_code(EINVAL), {.op = "configure"}, fmt::format("{}: {}", name, why));
}

}  // namespace

std::string to_string(DirectIo mode) {
  switch (mode) {
    case DirectIo::off: return "off";
    case DirectIo::on: return "on";
    case DirectIo::automatic: return "auto";
  }
  return "?";
}

DirectIo parse_direct_io(const std::string& text) {
  if (text == "on" || text == "1" || text == "true") return DirectIo::on;
  if (text == "off" || text == "0" || text == "false") return DirectIo::off;
  if (text == "auto") return DirectIo::automatic;
  throw Error(errno_code(EINVAL), {.op = "configure"}, fmt::format("direct I/O mode '{}': use on, off or auto", text));
}

void Options::validate() const {
  constexpr std::size_t kAlign = 4096;
  if (bounce_buffer_size == 0 || bounce_buffer_size % kAlign != 0 || bounce_buffer_size > (std::size_t{1} << 30))
    throw bad_option("bounce_buffer_size (HBMIO_BOUNCE_BUFFER_SIZE)",
                     fmt::format("{} must be a non-zero multiple of 4 KiB, at most 1 GiB", bounce_buffer_size));
  if (chunk_size < bounce_buffer_size || chunk_size % bounce_buffer_size != 0)
    throw bad_option("chunk_size (HBMIO_CHUNK_SIZE)",
                     fmt::format("{} must be a multiple of the bounce buffer size ({}, HBMIO_BOUNCE_BUFFER_SIZE)", chunk_size,
                                 bounce_buffer_size));
  if (bounce_buffers == 0 || bounce_buffers > 1024)
    throw bad_option("bounce_buffers (HBMIO_BOUNCE_BUFFERS)", fmt::format("{} must be 1..1024", bounce_buffers));
  if (queue_depth == 0 || queue_depth > 4096)
    throw bad_option("queue_depth (HBMIO_QUEUE_DEPTH)", fmt::format("{} must be 1..4096", queue_depth));
  if (workers > 1024) throw bad_option("workers (HBMIO_WORKERS)", fmt::format("{} must be 0 (auto) .. 1024", workers));
}

unsigned Options::resolved_workers() const noexcept {
  if (workers != 0) return workers;
  return std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
}

std::uint64_t RemoteOptions::part_size_for(std::uint64_t bytes, std::uint64_t largest) const noexcept {
  if (part_size != 0) return part_size;
  constexpr std::uint64_t kMiB = 1u << 20;
  const std::uint64_t two_per_connection = bytes / (2 * std::max(1u, connections));
  return std::clamp<std::uint64_t>((two_per_connection + kMiB - 1) / kMiB * kMiB, 8 * kMiB, std::max(8 * kMiB, largest));
}

double Stats::gib_per_second() const noexcept {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / (1024.0 * 1024.0 * 1024.0) : 0.0;
}

void Stats::add_part(const Stats& part) {
  if (!part.backend.empty()) backend = part.backend;
  bytes += part.bytes;
  bytes_direct += part.bytes_direct;
  bytes_buffered += part.bytes_buffered;
  bounce_copies += part.bounce_copies;
  wake_seconds += part.wake_seconds;
  drain_seconds += part.drain_seconds;
  copy_wait_seconds += part.copy_wait_seconds;
  workers = std::max(workers, part.workers);
  for (const TransferPath& path : part.paths) add_path(path);
}

// Bounds the reason of a file met in many parts (a load opened a bounded number of files at a time).
constexpr std::size_t kMaxMergedReason = 1024;

void add_path(std::vector<TransferPath>& paths, const TransferPath& path) {
  // A linear search: a transfer touches a few files (a sharded checkpoint: tens); a stream over
  // thousands of shards finds the shard it reads now among the last entries.
  for (auto it = paths.rbegin(); it != paths.rend(); ++it)
    if (TransferPath& known = *it; known.path == path.path && known.file == path.file) {
      known.bytes += path.bytes;
      known.bytes_direct += path.bytes_direct;
      // A later part that went otherwise (a save's header after its tensors) adds its reason, once.
      if (known.reason.find(path.reason) == std::string::npos && known.reason.size() < kMaxMergedReason)
        known.reason += "; " + path.reason;
      return;
    }
  paths.push_back(path);
}

std::string_view to_string(DataPath path) noexcept {
  switch (path) {
    case DataPath::gds_nvidia_fs: return "gds-nvidia-fs";
    case DataPath::gds_p2pdma: return "gds-p2pdma";
    case DataPath::cufile_compat: return "cufile-compat";
    case DataPath::uring: return "uring";
    case DataPath::posix: return "posix";
    case DataPath::remote: return "remote";
    case DataPath::cache_host: return "cache-host";
    case DataPath::cache_device: return "cache-device";
    case DataPath::cache_shared: return "cache-shared";
  }
  return "?";
}

}  // namespace hbmio
