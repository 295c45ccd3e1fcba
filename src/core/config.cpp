// The one place hbmio reads its environment variables (see hbmio/config.hpp): the table of every
// HBMIO_* variable, and the readers that turn each into the option it sets. A variable is read
// through its row of the table, so none can be read without being listed, and the same row's
// `accepted` text is what an invalid value's error quotes. docs/configuration.md shows this
// table; tests/config_test.cpp fails when the two differ.
#include "hbmio/config.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>

#include <unistd.h>
#include <stdexcept>

#include <fmt/format.h>

#include "hbmio/cache.hpp"
#include "hbmio/error.hpp"
#include "hbmio/options.hpp"

namespace hbmio {
namespace {

constexpr std::array kVariables = {
    ConfigVariable{"HBMIO_BACKEND", "auto", "posix | uring | cufile | auto",
                   "the engine of a call that names none: make_engine(\"\"), an empty LoadOptions / SaveOptions / "
                   "StreamOptions::backend, the command's --backend, Python's backend=None"},
    ConfigVariable{"HBMIO_CHUNK_SIZE", "16MiB", "a multiple of HBMIO_BOUNCE_BUFFER_SIZE, at most 1TiB",
                   "Options::chunk_size: the unit of work handed to a worker"},
    ConfigVariable{"HBMIO_BOUNCE_BUFFER_SIZE", "8MiB", "4KiB..1GiB, a multiple of 4KiB",
                   "Options::bounce_buffer_size: one O_DIRECT I/O and one copy (page-cache pieces: at most 2MiB)"},
    ConfigVariable{"HBMIO_BOUNCE_BUFFERS", "4", "1..1024", "Options::bounce_buffers: pinned slots per worker"},
    ConfigVariable{"HBMIO_QUEUE_DEPTH", "8", "1..4096", "Options::queue_depth: I/Os in flight per worker ring"},
    ConfigVariable{"HBMIO_WORKERS", "0", "0..1024 (0: min(cores, 16))", "Options::workers: the threads of an engine (a stream's two engines take half each)"},
    ConfigVariable{"HBMIO_DIRECT_IO", "auto", "on | off | auto",
                   "Options::direct_io: O_DIRECT always, never, or for the ranges not in the page cache"},
    ConfigVariable{"HBMIO_REMOTE_CONNECTIONS", "16", "1..1024",
                   "RemoteOptions::connections: GETs (or uploaded parts) in flight, one connection each"},
    ConfigVariable{"HBMIO_REMOTE_PART_SIZE", "0", "0, or 4KiB..1TiB",
                   "RemoteOptions::part_size: bytes per ranged GET or uploaded part (0: chosen per transfer)"},
    ConfigVariable{"HBMIO_REMOTE_ATTEMPTS", "5", "1..100", "RemoteOptions::max_attempts: tries of each part, the first included"},
    ConfigVariable{"HBMIO_REMOTE_MIN_RATE", "256KiB", "1KiB..1TiB (per second)",
                   "RemoteOptions::min_rate_bytes_per_second: the slowest rate a request may average before it is retried"},
    ConfigVariable{"HBMIO_REMOTE_STALL_TIMEOUT", "30", "1..3600 (seconds)",
                   "RemoteOptions::stall_timeout_seconds: how long a transfer may stay below 1 KiB/s"},
    ConfigVariable{"HBMIO_READAHEAD", "1GiB", "0..1TiB (0: off)",
                   "bytes of tensors Python's hbmio.open reads ahead of a walk (readahead=None)"},
    ConfigVariable{"HBMIO_CACHE", "(off)", "a path",
                   "the Unix socket of the node's resident cache (hbmio cache serve) that loads ask first"},
    ConfigVariable{"HBMIO_CACHE_ADD", "off", "on | off",
                   "loads ask the resident cache to take in the files it does not hold (LoadOptions::cache add)"},
    ConfigVariable{"HBMIO_CUFILE_LIBRARY", "(search)", "a path",
                   "the libcufile to load, instead of searching the loaded libraries, CUDA and Python's nvidia-cufile wheels"},
    ConfigVariable{"HBMIO_CURL_LIBRARY", "libcurl.so.4", "a path", "the libcurl to load for URLs, where none is loaded already"},
    ConfigVariable{"HBMIO_NCCL_LIBRARY", "libnccl.so.2", "a path", "the NCCL to load for multi-GPU loads, where none is loaded already"},
};

constexpr std::uint64_t kTiB = std::uint64_t{1} << 40;

const ConfigVariable& variable(std::string_view name) {
  const auto it = std::find_if(kVariables.begin(), kVariables.end(), [&](const ConfigVariable& v) { return v.name == name; });
  // A programming error, not a user's: every variable read must have its row (and its docs).
  if (it == kVariables.end()) throw std::logic_error(fmt::format("{} is not in the table of src/core/config.cpp", name));
  return *it;
}

// The value of `var`; "" where it is unset or empty (an empty variable counts as unset).
std::string value_of(const ConfigVariable& var) {
  const char* value = std::getenv(std::string(var.name).c_str());
  return value != nullptr ? std::string(value) : std::string();
}

[[noreturn]] void invalid(const ConfigVariable& var, const std::string& value, std::string_view why) {
  throw Error(errno_code(EINVAL), {.op = "configure"},
              fmt::format("{}='{}' is not valid: {}; accepted: {}", var.name, value, why, var.accepted));
}

// Where `name` is set, calls parse(value); a value it refuses (an Error, or false from the range
// check) becomes one error naming the variable, its value and what the variable accepts.
template <typename Parse>
void apply(std::string_view name, Parse&& parse) {
  const ConfigVariable& var = variable(name);
  const std::string value = value_of(var);
  if (value.empty()) return;
  bool in_range = false;
  try {
    in_range = parse(value);
  } catch (const Error& e) {
    invalid(var, value, e.detail());
  }
  if (!in_range) invalid(var, value, "out of range");
}

// A size or count within [low, high] into `field`: true when it is.
template <typename T>
auto in(T& field, std::uint64_t low, std::uint64_t high) {
  return [&field, low, high](const std::string& text) {
    const std::uint64_t n = parse_size(text);
    if (n < low || n > high) return false;
    field = static_cast<T>(n);
    return true;
  };
}

}  // namespace

std::span<const ConfigVariable> config_variables() noexcept { return kVariables; }

Options Options::from_env(Options base) {
  apply("HBMIO_CHUNK_SIZE", in(base.chunk_size, 1, kTiB));
  apply("HBMIO_BOUNCE_BUFFER_SIZE", in(base.bounce_buffer_size, 4096, std::uint64_t{1} << 30));
  apply("HBMIO_BOUNCE_BUFFERS", in(base.bounce_buffers, 1, 1024));
  apply("HBMIO_QUEUE_DEPTH", in(base.queue_depth, 1, 4096));
  apply("HBMIO_WORKERS", in(base.workers, 0, 1024));
  apply("HBMIO_DIRECT_IO", [&](const std::string& v) {
    base.direct_io = parse_direct_io(v);
    return true;
  });
  base.validate();  // what no single variable decides: the chunk a multiple of the bounce buffer
  return base;
}

Options Options::from_env() { return from_env(Options{}); }

RemoteOptions RemoteOptions::from_env() {
  RemoteOptions o;
  apply("HBMIO_REMOTE_CONNECTIONS", in(o.connections, 1, 1024));
  apply("HBMIO_REMOTE_PART_SIZE", [&](const std::string& v) {
    const std::uint64_t n = parse_size(v);
    if (n != 0 && (n < 4096 || n > kTiB)) return false;
    o.part_size = n;
    return true;
  });
  apply("HBMIO_REMOTE_ATTEMPTS", in(o.max_attempts, 1, 100));
  apply("HBMIO_REMOTE_MIN_RATE", in(o.min_rate_bytes_per_second, 1024, kTiB));
  apply("HBMIO_REMOTE_STALL_TIMEOUT", [&](const std::string& v) {
    char* end = nullptr;
    const double seconds = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0') throw Error(errno_code(EINVAL), {}, "not a number of seconds");
    if (!(seconds >= 1 && seconds <= 3600)) return false;
    o.stall_timeout_seconds = seconds;
    return true;
  });
  return o;
}

std::string configured_backend() {
  const ConfigVariable& var = variable("HBMIO_BACKEND");
  const std::string value = value_of(var);
  if (value.empty()) return "auto";
  for (const char* name : {"posix", "uring", "cufile", "auto"})
    if (value == name) return value;
  invalid(var, value, "unknown backend");
}

std::uint64_t configured_readahead() {
  std::uint64_t bytes = std::uint64_t{1} << 30;
  apply("HBMIO_READAHEAD", in(bytes, 0, kTiB));
  return bytes;
}

std::string configured_cache_socket() { return value_of(variable("HBMIO_CACHE")); }

std::string default_cache_socket() {
  // Not an HBMIO_* variable: the desktop's per-user runtime directory, where there is one.
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR"); runtime != nullptr && *runtime == '/')
    return fmt::format("{}/hbmio-cache.sock", runtime);
  return fmt::format("/tmp/hbmio-cache-{}.sock", ::getuid());
}

bool configured_cache_add() {
  const ConfigVariable& var = variable("HBMIO_CACHE_ADD");
  const std::string value = value_of(var);
  if (value.empty() || value == "off" || value == "0") return false;
  if (value == "on" || value == "1") return true;
  invalid(var, value, "neither on nor off");
}

std::string configured_library(std::string_view name) {
  if (name != "HBMIO_CUFILE_LIBRARY" && name != "HBMIO_CURL_LIBRARY" && name != "HBMIO_NCCL_LIBRARY")
    throw std::logic_error(fmt::format("{} names no library", name));
  return value_of(variable(name));
}

}  // namespace hbmio
