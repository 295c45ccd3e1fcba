// Per-tensor checksums: XXH3-64 of each tensor's bytes, stored as 16 hex digits in the file's
// __metadata__ under "hbmio.xxh3.<tensor name>", so the file stays readable by every safetensors
// reader and the check needs nothing but the file.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hbmio/memory.hpp"

namespace hbmio::detail {

inline constexpr const char* kChecksumAlgorithmKey = "hbmio.checksum";  // value "xxh3-64"

bool has_checksums(const std::map<std::string, std::string>& metadata);
// XXH3-64 of each span, of any memory kind (device memory is copied to the host piece by piece),
// on several threads (one tensor per thread at a time): a checkpoint of many tensors hashes at
// memory speed rather than one core's XXH3 rate. One thread per core, at most 16 and at most
// `max_threads` (0: no further limit).
std::vector<std::uint64_t> xxh3_of_each(const std::vector<MemorySpan>& spans, unsigned max_threads = 0);
std::string to_hex(std::uint64_t value);
// nullopt when the stored checksum of `tensor` equals `computed`, else the message naming the
// tensor, file and offset (also when the file has checksums but none for this tensor).
std::optional<std::string> check_tensor(const std::map<std::string, std::string>& metadata, const std::string& tensor,
                                        const std::string& file, std::uint64_t offset, std::uint64_t computed);

}  // namespace hbmio::detail
