// Per-tensor checksums: XXH3-64 of each tensor's bytes, stored as 16 hex digits in the file's
// __metadata__ under "hbmio.xxh3.<tensor name>", so the file stays readable by every safetensors
// reader and the check needs nothing but the file.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/memory.hpp"

namespace hbmio {
struct CheckpointFile;
}

namespace hbmio::detail {

inline constexpr const char* kChecksumAlgorithmKey = "hbmio.checksum";
// Its value in files hbmio writes: XXH3-64 of each tensor and of the header. Files written before
// the header had a checksum say "xxh3-64" (tensors only) and still verify.
inline constexpr const char* kChecksumAlgorithm = "xxh3-64+header";
inline constexpr const char* kTensorsOnlyAlgorithm = "xxh3-64";
// The header's own checksum, beside the tensors': XXH3-64 of the header as stored (its 8-byte
// length and the JSON text, padding included) with this entry's value written as 16 zeros. The tensor checksums cannot see a
// flipped byte in the metadata or a name; this can. Outside "hbmio.xxh3." so no tensor name
// can collide with it.
inline constexpr const char* kHeaderChecksumKey = "hbmio.header_xxh3";

bool has_checksums(const std::map<std::string, std::string>& metadata);
// XXH3-64 of each span, of any memory kind (device memory is copied to the host piece by piece),
// on several threads (one tensor per thread at a time): a checkpoint of many tensors hashes at
// memory speed rather than one core's XXH3 rate. One thread per core, at most 16 and at most
// `max_threads` (0: no further limit).
std::vector<std::uint64_t> xxh3_of_each(const std::vector<MemorySpan>& spans, unsigned max_threads = 0);
// XXH3-64 of one span on the calling thread; device memory goes through `staging` (pinned,
// allocated on first use and kept by the caller for the next span: registering pinned memory
// costs more than hashing a tensor).
std::uint64_t xxh3_of(MemorySpan data, Buffer& staging);
std::string to_hex(std::uint64_t value);
// The checksum of a header (the file's first 8 + N bytes) as defined at kHeaderChecksumKey, or
// nullopt when it does not hold that entry exactly once as `"hbmio.header_xxh3":"<16 characters>"` (hbmio writes
// it compactly; a header rewritten by another tool may not keep it so).
std::optional<std::uint64_t> header_checksum(std::string_view header);
// nullopt when the header of `file` (read again from disk) matches its stored header checksum, or
// has none and needs none (no checksums, or the tensors-only algorithm); else the message naming
// the file and the header's bytes. A damaged name of either entry is caught: the algorithm
// then calls for a header checksum that is missing, or the header checksum sees the damage.
std::optional<std::string> check_header(const CheckpointFile& file);
// Fills in the entry of a header serialized with to_hex(0) as its value. Same size before and after.
void seal_header(std::string& header);
// nullopt when the stored checksum of `tensor` equals `computed`, else the message naming the
// tensor, file and offset (also when the file has checksums but none for this tensor).
std::optional<std::string> check_tensor(const std::map<std::string, std::string>& metadata, const std::string& tensor,
                                        const std::string& file, std::uint64_t offset, std::uint64_t computed);

}  // namespace hbmio::detail
