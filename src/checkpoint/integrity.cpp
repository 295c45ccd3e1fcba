#include "checkpoint/integrity.hpp"
#include "source/source.hpp"
#include "core/error_boundary.hpp"
#include "core/executor.hpp"
#include "core/positional_io.hpp"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"

namespace hbmio {
namespace detail {

bool has_checksums(const std::map<std::string, std::string>& metadata) {
  return metadata.contains(kChecksumAlgorithmKey);
}

namespace {

constexpr std::size_t kHashPiece = std::size_t{16} << 20;  // device memory is hashed through this much pinned memory

}  // namespace

// `staging` (pinned, kHashPiece bytes) is allocated on first use, for device memory only.
std::uint64_t xxh3_of(MemorySpan data, Buffer& staging) {
  if (data.kind() != MemoryKind::device) return XXH3_64bits(data.data, data.size);
  // Streaming over host pieces: checking a multi-GiB tensor needs no copy of its size.
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state) throw Error(errno_code(ENOMEM), {.op = "checksum"}, "XXH3_createState");
  XXH3_64bits_reset(state.get());
  if (staging.data() == nullptr) staging = Buffer::allocate({MemoryKind::pinned}, kHashPiece);
  for (std::size_t at = 0; at < data.size; at += kHashPiece) {
    const std::size_t n = std::min(kHashPiece, data.size - at);
    copy_memory(staging.span().subspan(0, n), data.subspan(at, n));
    XXH3_64bits_update(state.get(), staging.data(), n);
  }
  return XXH3_64bits_digest(state.get());
}

std::vector<std::uint64_t> xxh3_of_each(const std::vector<MemorySpan>& spans, unsigned max_threads) {
  std::vector<std::uint64_t> result(spans.size());
  std::atomic<std::size_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&] {
    Buffer staging;
    try {
      for (std::size_t i = next++; i < spans.size(); i = next++) result[i] = xxh3_of(spans[i], staging);
    } catch (...) {
      std::lock_guard lock(error_mutex);
      if (!error) error = std::current_exception();
      next = spans.size();
    }
  };
  const unsigned threads = static_cast<unsigned>(std::min<std::size_t>(
      {spans.size(), std::max(1u, std::thread::hardware_concurrency()), 16, max_threads != 0 ? max_threads : 16}));
  Executor::shared().run(threads, threads, [&](std::size_t) { work(); });
  if (error) std::rethrow_exception(error);
  return result;
}

std::string to_hex(std::uint64_t value) { return fmt::format("{:016x}", value); }

namespace {
// Where the 16 characters of the header checksum's value start, if the entry is there once. In
// JSON text a quote inside a string is always escaped, so this pattern (unescaped quotes around
// the key and the value) can only be the metadata entry itself.
std::optional<std::size_t> header_checksum_value(std::string_view json) {
  const std::string pattern = fmt::format("\"{}\":\"", kHeaderChecksumKey);
  const std::size_t at = json.find(pattern);
  if (at == std::string_view::npos || json.find(pattern, at + 1) != std::string_view::npos) return std::nullopt;
  const std::size_t value = at + pattern.size();
  if (value + 17 > json.size() || json[value + 16] != '"') return std::nullopt;
  return value;
}
}  // namespace

std::optional<std::uint64_t> header_checksum(std::string_view header) {
  const auto value = header_checksum_value(header);
  if (!value) return std::nullopt;
  std::string zeroed(header);
  zeroed.replace(*value, 16, 16, '0');
  return XXH3_64bits(zeroed.data(), zeroed.size());
}

std::optional<std::string> check_header(const CheckpointFile& file) {
  const auto& metadata = file.header.metadata;
  const auto algorithm = metadata.find(kChecksumAlgorithmKey);
  if (algorithm != metadata.end() && algorithm->second != kChecksumAlgorithm && algorithm->second != kTensorsOnlyAlgorithm)
    return fmt::format("header of {}: unknown checksum algorithm \"{}\" (hbmio writes \"{}\")", file.path, algorithm->second,
                       kChecksumAlgorithm);
  const auto stored = metadata.find(kHeaderChecksumKey);
  if (stored == metadata.end()) {
    if (algorithm != metadata.end() && algorithm->second == kChecksumAlgorithm)
      return fmt::format("header of {}: its checksum entry \"{}\" is missing, though \"{}\" says it is there", file.path,
                         kHeaderChecksumKey, kChecksumAlgorithmKey);
    return std::nullopt;
  }
  // The header as stored: its length and the JSON text, read again (what was parsed is not the
  // bytes: parsing drops what it does not need).
  // Through the descriptor the header was parsed from: a file that took the name since is not it.
  std::string bytes(file.header.data_offset, '\0');
  const std::size_t got = read_host_bytes(file, 0, std::as_writable_bytes(std::span(bytes)), {.op = "verify", .path = file.path});
  if (got < bytes.size())
    throw Error(errno_code(EIO), {.op = "verify", .path = file.path, .offset = got, .length = bytes.size() - got},
                "file ends inside the header");
  const auto computed = header_checksum(bytes);
  if (!computed)
    return fmt::format("header of {}: its checksum entry is not in the form hbmio writes (was the header rewritten by "
                       "another tool?)", file.path);
  if (stored->second != to_hex(*computed))
    return fmt::format("header of {} (bytes 0 to {}): stored checksum {}, computed {}", file.path, file.header.data_offset,
                       stored->second, to_hex(*computed));
  return std::nullopt;
}

void seal_header(std::string& header) {
  const auto value = header_checksum_value(header);
  if (!value || header.compare(*value, 16, to_hex(0)) != 0)
    throw Error(errno_code(EPROTO), {.op = "save"}, "the header has no header checksum placeholder to fill in");
  header.replace(*value, 16, to_hex(*header_checksum(header)));
}

std::optional<std::string> check_tensor(const std::map<std::string, std::string>& metadata, const std::string& tensor,
                                        const std::string& file, std::uint64_t offset, std::uint64_t computed) {
  const auto it = metadata.find(kChecksumPrefix + tensor);
  if (it == metadata.end())
    return fmt::format("tensor '{}' in {} starting at byte {} has no stored checksum", tensor, file, offset);
  if (it->second != to_hex(computed))
    return fmt::format("tensor '{}' in {} starting at byte {}: stored checksum {}, computed {}", tensor, file, offset, it->second,
                       to_hex(computed));
  return std::nullopt;
}

}  // namespace detail

std::string xxh3_hex(const std::byte* data, std::size_t size) { return detail::to_hex(XXH3_64bits(data, size)); }

namespace {
VerifyResult verify_unguarded(const std::string& path);
}

VerifyResult verify_checkpoint(const std::string& path) {
  return detail::errors_as_hbmio({.op = "verify", .path = path}, [&] { return verify_unguarded(path); });
}

namespace {
VerifyResult verify_unguarded(const std::string& path) {
  VerifyResult result;
  const std::vector<CheckpointFile> files = open_checkpoint(path);
  // Headers first, every file's: when one is damaged, what it says about its tensors (and even
  // whether it has checksums) cannot be trusted.
  for (const auto& file : files) {
    if (auto bad = detail::check_header(file)) {
      result.first_bad = *bad;
      return result;
    }
    result.headers_checked += file.header.metadata.contains(detail::kHeaderChecksumKey) ? 1 : 0;
  }
  const auto without = std::find_if(files.begin(), files.end(), [](const CheckpointFile& f) { return !detail::has_checksums(f.header.metadata); });
  result.has_checksums = without == files.end();
  if (!result.has_checksums) {
    // Some shards with checksums and some without is not "a checkpoint without checksums": one
    // was replaced, or a rewrite stopped part way. Name it.
    if (std::any_of(files.begin(), files.end(), [](const CheckpointFile& f) { return detail::has_checksums(f.header.metadata); }))
      result.first_bad = fmt::format("{} holds no hbmio checksums, though other files of this checkpoint do "
                                     "(add them with `hbmio ckpt checksum`)",
                                     without->path);
    return result;
  }
  // Hashes the bytes on disk with plain reads, one tensor at a time, in 16 MiB pieces.
  std::vector<std::byte> piece(std::size_t{16} << 20);
  for (const auto& named : files) {
    // Through the file whose header was checked (an object at a URL: the version its header came from).
    const CheckpointFile file = detail::held_open(named);
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
    for (const auto& t : file.header.tensors) {
      XXH3_64bits_reset(state.get());
      const std::uint64_t start = file.header.data_offset + t.begin;
      for (std::uint64_t at = 0; at < t.size();) {
        const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), t.size() - at));
        const std::size_t got = detail::read_host_bytes(file, start + at, {piece.data(), n}, {.op = "verify", .path = file.path});
        if (got < n)
          throw Error(errno_code(EIO), {.op = "verify", .path = file.path, .offset = start + at + got, .length = n - got},
                      fmt::format("file ends inside tensor '{}'", t.name));
        XXH3_64bits_update(state.get(), piece.data(), n);
        at += n;
      }
      ++result.tensors_checked;
      if (auto bad = detail::check_tensor(file.header.metadata, t.name, file.path, start, XXH3_64bits_digest(state.get()))) {
        result.first_bad = *bad;
        return result;
      }
    }
  }
  return result;
}
}  // namespace

}  // namespace hbmio
