#include "hbmio/options.hpp"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio {
namespace {

Error bad_option(const std::string& name, const std::string& why) {
  return Error(errno_code(EINVAL), {.op = "configure"}, fmt::format("{}: {}", name, why));
}

template <typename Apply>
void from_env_var(const char* name, Apply apply) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return;
  try {
    apply(std::string(value));
  } catch (const Error& e) {
    throw bad_option(name, fmt::format("'{}' is not valid: {}", value, e.detail()));
  }
}

unsigned to_count(const std::string& text) {
  const auto n = parse_size(text);
  if (n > 1'000'000) throw Error(errno_code(EINVAL), {}, "too large");
  return static_cast<unsigned>(n);
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

Options Options::from_env(Options base) {
  from_env_var("HBMIO_CHUNK_SIZE", [&](const std::string& v) { base.chunk_size = parse_size(v); });
  from_env_var("HBMIO_BOUNCE_BUFFER_SIZE", [&](const std::string& v) { base.bounce_buffer_size = parse_size(v); });
  from_env_var("HBMIO_BOUNCE_BUFFERS", [&](const std::string& v) { base.bounce_buffers = to_count(v); });
  from_env_var("HBMIO_QUEUE_DEPTH", [&](const std::string& v) { base.queue_depth = to_count(v); });
  from_env_var("HBMIO_WORKERS", [&](const std::string& v) { base.workers = to_count(v); });
  from_env_var("HBMIO_DIRECT_IO", [&](const std::string& v) { base.direct_io = parse_direct_io(v); });
  base.validate();
  return base;
}

Options Options::from_env() { return from_env(Options{}); }

void Options::validate() const {
  constexpr std::size_t kAlign = 4096;
  if (bounce_buffer_size == 0 || bounce_buffer_size % kAlign != 0 || bounce_buffer_size > (std::size_t{1} << 30))
    throw bad_option("bounce_buffer_size", fmt::format("{} must be a non-zero multiple of 4 KiB, at most 1 GiB", bounce_buffer_size));
  if (chunk_size < bounce_buffer_size || chunk_size % bounce_buffer_size != 0)
    throw bad_option("chunk_size", fmt::format("{} must be a multiple of the bounce buffer size ({})", chunk_size, bounce_buffer_size));
  if (bounce_buffers == 0 || bounce_buffers > 1024) throw bad_option("bounce_buffers", "must be 1..1024");
  if (queue_depth == 0 || queue_depth > 4096) throw bad_option("queue_depth", "must be 1..4096");
  if (workers > 1024) throw bad_option("workers", "must be 0 (auto) .. 1024");
}

unsigned Options::resolved_workers() const noexcept {
  if (workers != 0) return workers;
  return std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
}

double Stats::gib_per_second() const noexcept {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / (1024.0 * 1024.0 * 1024.0) : 0.0;
}

void Stats::add_part(const Stats& part) noexcept {
  if (!part.backend.empty()) backend = part.backend;
  bytes += part.bytes;
  bytes_direct += part.bytes_direct;
  bytes_buffered += part.bytes_buffered;
  bounce_copies += part.bounce_copies;
  workers = std::max(workers, part.workers);
}

}  // namespace hbmio
