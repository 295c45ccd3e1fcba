// The safetensors format: header parsing and validation, serialisation, and Hugging Face sharded
// checkpoint indexes. Pure CPU, no I/O beyond what the functions say; a checkpoint is untrusted
// input, so every rule of the reference reader is checked before anything is sized from the file.
//
// File layout: 8-byte little-endian N; N bytes of UTF-8 JSON (the header); the data buffer.
// Header: tensor name -> {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to
// the data buffer), plus an optional "__metadata__" map of string -> string.
//
// Where the reference reader (safetensors 0.8.0) is lenient, hbmio is stricter on purpose and says
// so: duplicate keys anywhere (the reference keeps the last duplicate tensor or metadata key) and
// empty tensor names are refused. Like the reference, unknown keys in a tensor entry are ignored,
// and "__metadata__": null means no metadata. All functions are thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace hbmio::safetensors {

enum class Dtype {
  BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16,
  I32, U32, F32, C64, F64, I64, U64, F4, F6_E2M3, F6_E3M2
};

std::string_view to_string(Dtype dtype) noexcept;        // "BF16"
std::optional<Dtype> parse_dtype(std::string_view text);  // nullopt when unknown
// Size in bits of one element (4 for F4, 6 for F6_*, 8 for U8, 16 for BF16, ...).
unsigned bits_per_element(Dtype dtype) noexcept;
// Bytes of a tensor of `dtype` and `shape`: product(shape) * bits / 8, overflow-checked. nullopt on
// overflow, or when a sub-byte dtype's total bits are not a multiple of 8 (the reference refuses those).
std::optional<std::uint64_t> tensor_byte_size(Dtype dtype, std::span<const std::uint64_t> shape) noexcept;

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::U8;
  std::vector<std::uint64_t> shape;  // empty: a scalar
  std::uint64_t begin = 0, end = 0;  // byte range in the data buffer, end exclusive

  std::uint64_t size() const noexcept { return end - begin; }
};

// A parsed and validated header. `tensors` are in file order (ascending data offset).
struct Header {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when absent
  // Whether the header has a "__metadata__" entry that is not null: {} is an empty map that is
  // there (the reference's readers give {} for it, and None where there is none).
  bool has_metadata = false;
  std::uint64_t header_size = 0;                // N: the JSON's length in bytes
  std::uint64_t data_offset = 0;                // 8 + N: where the data buffer starts in the file
  std::uint64_t data_size = 0;                  // bytes of the data buffer

  const TensorInfo* find(std::string_view name) const noexcept;
};

// The largest header the reference reader accepts.
inline constexpr std::uint64_t kMaxHeaderSize = 100'000'000;
// The largest index file read_index() reads (real indexes are a few hundred KiB).
inline constexpr std::uint64_t kMaxIndexSize = 100'000'000;
// Deepest JSON nesting accepted (serde_json's recursion limit, which the reference reader inherits).
inline constexpr unsigned kMaxJsonDepth = 128;

// Reads the 8-byte length prefix. Throws Error (EINVAL, naming `path` and the rule) when the file is
// shorter than 8 bytes, or the length exceeds kMaxHeaderSize or the file.
std::uint64_t parse_header_length(const std::byte* prefix, std::uint64_t file_size, const std::string& path);

// Parses and validates the JSON header text (the N bytes after the prefix) of a file of
// `file_size` bytes. Checks every rule: UTF-8, a JSON object, no duplicate keys, known dtypes,
// shapes of non-negative integers, overflow-checked `product(shape) * bits / 8 == end - begin`,
// offsets that tile the data buffer from 0 with no gap or overlap, 8 + N + data == file size,
// `__metadata__` a string -> string map. Errors are Error(EINVAL) naming the file, the rule and the
// tensor. `path` is used in messages only.
Header parse_header(std::string_view json, std::uint64_t file_size, const std::string& path);

// Reads and validates the header of the file at `path` (two small reads). Throws Error.
Header read_header(const std::string& path);
// The same through an open descriptor (the caller's; `path` names it in messages): what is parsed
// is then the file the caller goes on reading, even if its name is given to another file meanwhile.
Header read_header(int fd, const std::string& path);

// The bytes that start a safetensors file for `tensors` (their begin/end are recomputed: packed
// back to back in the given order) and `metadata`: the 8-byte length, then the JSON header padded
// with spaces to a multiple of 8, as the reference writer does (compact JSON, "__metadata__" first
// when `metadata` is not empty, tensors in the given order). `tensors` is updated with the offsets.
// Throws Error(EINVAL) for an empty, duplicate or non-UTF-8 name, a name "__metadata__", a size that
// overflows or a sub-byte tensor not ending on a byte.
// The reference writer orders tensors by dtype, descending in ITS enum order (U64, I64, F64, C64,
// F32, U32, I32, BF16, F16, U16, I16, F8_*, I8, U8, F6_*, F4, BOOL: wider types first, which keeps
// every tensor aligned), then by name: order_like_reference() does that (stable).
// An empty `metadata` leaves the "__metadata__" entry out (the reference, given metadata=None),
// unless `empty` is EmptyMetadata::write: then the header holds "__metadata__":{} first, as the
// reference writes for metadata={} (and its readers give {} back for it, not None).
enum class EmptyMetadata { omit, write };
std::string serialize_header(std::vector<TensorInfo>& tensors, const std::map<std::string, std::string>& metadata,
                             EmptyMetadata empty = EmptyMetadata::omit);
void order_like_reference(std::vector<TensorInfo>& tensors);

// A Hugging Face sharded checkpoint index (`model.safetensors.index.json`).
struct ShardIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  std::map<std::string, std::string> metadata;    // "metadata", values as JSON text (e.g. total_size)
  std::vector<std::string> shards;                // distinct shard file names, sorted
};

// Parses an index. Shard names must be plain file names: anything with '/', '\\', "..", an absolute
// path, or an empty name is refused (Error EINVAL naming the entry). `path` is for messages.
ShardIndex parse_index(std::string_view json, const std::string& path);
ShardIndex read_index(const std::string& path);
ShardIndex read_index(int fd, const std::string& path);

}  // namespace hbmio::safetensors
