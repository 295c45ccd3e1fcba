// The safetensors format layer: validation follows the reference reader (safetensors 0.8.0,
// `Metadata::validate` and `read_metadata`), checked rule by rule against it; see the header for
// where hbmio is deliberately stricter.
#include "hbmio/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <limits>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <set>
#include <tuple>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/positional_io.hpp"
#include "format/safetensors_paths.hpp"
#include "format/strict_json.hpp"
#include "hbmio/error.hpp"

namespace hbmio::safetensors {
namespace {

constexpr std::uint64_t kLengthPrefixSize = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kParseHeaderOp = "parse safetensors header";
constexpr std::string_view kParseIndexOp = "parse safetensors index";

struct DtypeSpec {
  Dtype dtype;
  std::string_view name;
  unsigned bits;
  // Position in the reference's `Dtype` enum (whose derived Ord its writer sorts by, descending).
  unsigned reference_rank;
};

// In hbmio's enum order, so kDtypes[static_cast<size_t>(d)].dtype == d (checked below).
constexpr std::array<DtypeSpec, 22> kDtypes{{
    {Dtype::BOOL, "BOOL", 8, 0},          {Dtype::U8, "U8", 8, 4},
    {Dtype::I8, "I8", 8, 5},              {Dtype::F8_E5M2, "F8_E5M2", 8, 6},
    {Dtype::F8_E4M3, "F8_E4M3", 8, 7},    {Dtype::F8_E8M0, "F8_E8M0", 8, 8},
    {Dtype::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8, 9}, {Dtype::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8, 10},
    {Dtype::I16, "I16", 16, 11},          {Dtype::U16, "U16", 16, 12},
    {Dtype::F16, "F16", 16, 13},          {Dtype::BF16, "BF16", 16, 14},
    {Dtype::I32, "I32", 32, 15},          {Dtype::U32, "U32", 32, 16},
    {Dtype::F32, "F32", 32, 17},          {Dtype::C64, "C64", 64, 18},
    {Dtype::F64, "F64", 64, 19},          {Dtype::I64, "I64", 64, 20},
    {Dtype::U64, "U64", 64, 21},          {Dtype::F4, "F4", 4, 1},
    {Dtype::F6_E2M3, "F6_E2M3", 6, 2},    {Dtype::F6_E3M2, "F6_E3M2", 6, 3},
}};

constexpr bool table_matches_enum() {
  for (std::size_t i = 0; i < kDtypes.size(); ++i)
    if (static_cast<std::size_t>(kDtypes[i].dtype) != i) return false;
  return true;
}
static_assert(table_matches_enum(), "kDtypes must list the dtypes in enum order");

const DtypeSpec& spec(Dtype dtype) noexcept { return kDtypes[static_cast<std::size_t>(dtype)]; }

std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// Names and found values are quoted from untrusted input: keep messages one readable line.
std::string quoted_excerpt(std::string_view text, std::size_t limit = 200) {
  std::string out;
  for (const char c : text.substr(0, limit)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
    } else {
      out += c;
    }
  }
  if (text.size() > limit) out += "...";
  return out;
}

// Error(EINVAL) with the detail "<rule>: <tensor>: <found>" (the tensor part only when there is one).
[[noreturn]] void refuse(std::string_view op, const std::string& path, std::uint64_t offset, std::string_view rule,
                         std::string_view tensor, const std::string& found) {
  std::string detail(rule);
  if (!tensor.empty()) detail += ": " + quoted_excerpt(tensor);
  detail += ": " + found;
  throw Error(errno_code(EINVAL), {.op = std::string(op), .path = path, .offset = offset}, detail);
}

std::string json_type_name(const nlohmann::json& value) { return value.type_name(); }

// --- header parsing -------------------------------------------------------------------------------

// The common header, scanned straight into TensorInfo: no JSON tree and no general JSON parser.
// It takes only the usual shape of a header: each tensor {"dtype": string, "shape": [unsigned...],
// "data_offsets": [unsigned, unsigned]}, once each, no other key, and an optional "__metadata__"
// of strings or null; strings without escapes or control characters, numbers as plain digits. At
// anything else (an escape, an unknown key, a wrong type, a duplicate, a nesting, a number with a
// sign, fraction or exponent, a value the checks refuse) it stops and says so, and the header is
// parsed again through the JSON tree (HeaderParser::parse), which either takes it or refuses it
// with the detailed message: the fast path changes no outcome, only the time of the common one.
// Why by hand: through nlohmann's SAX events its lexer was the floor, most of a many-tensor load
// from the resident cache's GPU copy (bench/RESULTS.md, "Restarts from the node's resident
// cache"); simdjson, many times faster again, is packaged as a shared library only, while hbmio's
// binaries need nothing installed but libc, libstdc++ and the driver. The subset is small enough
// to read in one sitting, and a test feeds both paths thousands of mutated headers (format_test.cpp).
class FastHeader {
 public:
  // Whether `text` was taken. On false `header` holds a partial result the caller discards.
  static bool parse(std::string_view text, Header& header) {
    // The checks parse_strict_json makes before it parses: text it refuses goes its way. Valid
    // UTF-8 throughout lets strings below take any byte from 0x20 up.
    if (format::first_invalid_utf8(text) || text.find('\0') != std::string_view::npos || text.substr(0, 3) == "\xEF\xBB\xBF")
      return false;
    FastHeader scan(text);
    if (!scan.header(header)) return false;
    // No tensor named twice (the tree's parse names the duplicate). Hashed: names share long
    // prefixes ("model.layers.12."), which a sort compares again and again.
    std::unordered_set<std::string_view> names;
    names.reserve(header.tensors.size());
    for (const TensorInfo& t : header.tensors)
      if (!names.insert(t.name).second) return false;
    return true;
  }

 private:
  explicit FastHeader(std::string_view text) : p_(text.data()), end_(text.data() + text.size()) {}

  void skip_space() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  // The next non-space character is `c`: consumed.
  bool next_is(char c) {
    skip_space();
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  // A string with no escape and no control character: its bytes between the quotes.
  bool string(std::string_view& out) {
    if (!next_is('"')) return false;
    const char* begin = p_;
    while (p_ < end_ && *p_ != '"') {
      if (*p_ == '\\' || static_cast<unsigned char>(*p_) < 0x20) return false;
      ++p_;
    }
    if (p_ == end_) return false;
    out = {begin, static_cast<std::size_t>(p_ - begin)};
    ++p_;
    return true;
  }
  // An unsigned integer as plain digits (no sign, fraction or exponent; "0" alone or no leading
  // zero), within 64 bits.
  bool number(std::uint64_t& out) {
    skip_space();
    const char* begin = p_;
    std::uint64_t value = 0;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
      if (__builtin_mul_overflow(value, 10, &value) || __builtin_add_overflow(value, static_cast<unsigned>(*p_ - '0'), &value))
        return false;
      ++p_;
    }
    if (p_ == begin || (*begin == '0' && p_ - begin > 1)) return false;
    if (p_ < end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) return false;
    out = value;
    return true;
  }
  // [n, ...] into `out`, at most `most` numbers.
  bool numbers(std::vector<std::uint64_t>& out, std::size_t most) {
    if (!next_is('[')) return false;
    if (next_is(']')) return true;
    do {
      std::uint64_t n = 0;
      if (out.size() == most || !number(n)) return false;
      out.push_back(n);
    } while (next_is(','));
    return next_is(']');
  }

  bool header(Header& header) {
    if (!next_is('{')) return false;
    bool seen_metadata = false;
    if (!next_is('}')) {
      do {
        std::string_view key;
        if (!string(key) || !next_is(':')) return false;
        if (key == kMetadataKey) {
          if (seen_metadata || !metadata(header)) return false;
          seen_metadata = true;
        } else if (key.empty() || !tensor(key, header)) {
          return false;
        }
      } while (next_is(','));
      if (!next_is('}')) return false;
    }
    skip_space();
    return p_ == end_;
  }

  // null, or {"key": "value", ...} with no key twice.
  bool metadata(Header& header) {
    skip_space();
    if (end_ - p_ >= 4 && std::string_view(p_, 4) == "null") {
      p_ += 4;
      return true;
    }
    if (!next_is('{')) return false;
    header.has_metadata = true;
    if (next_is('}')) return true;
    do {
      std::string_view key, value;
      if (!string(key) || !next_is(':') || !string(value)) return false;
      // Keys in order (as hbmio and the reference write them: one checksum per tensor, thousands
      // of keys sharing a long prefix) go in at the end with one comparison, not a walk down the tree.
      if (!header.metadata.empty() && std::prev(header.metadata.end())->first < key)
        header.metadata.emplace_hint(header.metadata.end(), key, value);
      else if (!header.metadata.emplace(key, value).second)
        return false;
    } while (next_is(','));
    return next_is('}');
  }

  // {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}, each once, in any order.
  bool tensor(std::string_view name, Header& header) {
    if (!next_is('{')) return false;
    TensorInfo t{.name = std::string(name)};
    unsigned seen = 0;
    std::vector<std::uint64_t> offsets;
    do {
      std::string_view key;
      if (!string(key) || !next_is(':')) return false;
      const unsigned bit = key == "dtype" ? 1u : key == "shape" ? 2u : key == "data_offsets" ? 4u : 0u;
      if (bit == 0 || (seen & bit) != 0) return false;
      seen |= bit;
      if (bit == 1) {
        std::string_view text;
        if (!string(text)) return false;
        const std::optional<Dtype> dtype = parse_dtype(text);
        if (!dtype) return false;
        t.dtype = *dtype;
      } else if (bit == 2) {
        if (!numbers(t.shape, std::numeric_limits<std::size_t>::max())) return false;
      } else if (!numbers(offsets, 2) || offsets.size() != 2) {
        return false;
      }
    } while (next_is(','));
    if (!next_is('}') || seen != 7) return false;
    t.begin = offsets[0];
    t.end = offsets[1];
    if (!size_matches_shape(t)) return false;
    header.tensors.push_back(std::move(t));
    return true;
  }

  // The checks HeaderParser::check_size_matches_shape makes, as a yes or no.
  static bool size_matches_shape(const TensorInfo& t) {
    if (t.begin > t.end) return false;
    std::uint64_t bits = bits_per_element(t.dtype);
    for (const std::uint64_t dim : t.shape)
      if (__builtin_mul_overflow(bits, dim, &bits)) return false;
    return bits % 8 == 0 && bits / 8 == t.size();
  }

  const char* p_;
  const char* end_;
};

class HeaderParser {
 public:
  HeaderParser(std::string_view json, std::uint64_t file_size, const std::string& path)
      : json_(json), file_size_(file_size), path_(path) {}

  Header parse(bool fast = true) {
    Header header;
    if (!fast || !FastHeader::parse(json_, header)) {
      header = Header();
      const nlohmann::json root = parse_json();
      if (!root.is_object()) fail("header not a JSON object", "", "found " + json_type_name(root));
      for (const auto& [name, entry] : root.items()) {
        if (name == kMetadataKey) {
          header.metadata = parse_metadata(entry);
          header.has_metadata = !entry.is_null();
        } else
          header.tensors.push_back(parse_tensor(name, entry));
      }
    }
    header.header_size = json_.size();
    sort_by_offset(header.tensors);
    header.data_size = check_tiling(header.tensors);
    header.data_offset = kLengthPrefixSize + header.header_size;
    check_file_size(header);
    return header;
  }

 private:
  [[noreturn]] void fail(std::string_view rule, std::string_view tensor, const std::string& found,
                         std::uint64_t offset = 0) const {
    refuse(kParseHeaderOp, path_, offset, rule, tensor, found);
  }

  nlohmann::json parse_json() const {
    format::JsonRefusal refusal;
    auto root = format::parse_strict_json(json_, kMaxJsonDepth, refusal);
    if (!root) {
      const std::uint64_t offset = refusal.position ? kLengthPrefixSize + *refusal.position : 0;
      fail(refusal.rule, refusal.key, refusal.found, offset);
    }
    return std::move(*root);
  }

  // The reference accepts "__metadata__": null as "no metadata".
  std::map<std::string, std::string> parse_metadata(const nlohmann::json& entry) const {
    std::map<std::string, std::string> metadata;
    if (entry.is_null()) return metadata;
    if (!entry.is_object()) fail("__metadata__ not a string -> string map", "", "found " + json_type_name(entry));
    for (const auto& [key, value] : entry.items()) {
      if (!value.is_string())
        fail("__metadata__ not a string -> string map", "", "value of \"" + quoted_excerpt(key) + "\" is " + json_type_name(value));
      metadata.emplace(key, value.get<std::string>());
    }
    return metadata;
  }

  TensorInfo parse_tensor(const std::string& name, const nlohmann::json& entry) const {
    if (name.empty()) fail("empty tensor name", "", "a tensor entry has the name \"\"");
    if (!entry.is_object()) fail("tensor entry not an object", name, "found " + json_type_name(entry));
    TensorInfo tensor;
    tensor.name = name;
    tensor.dtype = parse_dtype_field(name, field(name, entry, "dtype"));
    tensor.shape = parse_shape(name, field(name, entry, "shape"));
    std::tie(tensor.begin, tensor.end) = parse_offsets(name, field(name, entry, "data_offsets"));
    check_size_matches_shape(tensor);
    return tensor;
  }

  // Unknown keys are ignored, as the reference does (serde without deny_unknown_fields).
  const nlohmann::json& field(const std::string& name, const nlohmann::json& entry, const char* key) const {
    const auto it = entry.find(key);
    if (it == entry.end()) fail("missing field", name, std::string("no \"") + key + "\"");
    return *it;
  }

  Dtype parse_dtype_field(const std::string& name, const nlohmann::json& value) const {
    if (!value.is_string()) fail("unknown dtype", name, "dtype is " + json_type_name(value));
    const auto& text = value.get_ref<const std::string&>();
    const auto dtype = safetensors::parse_dtype(text);
    if (!dtype) fail("unknown dtype", name, "\"" + quoted_excerpt(text) + "\"");
    return *dtype;
  }

  // A JSON integer in [0, 2^64). nlohmann stores larger integers as floats, so they fail too.
  static std::optional<std::uint64_t> as_u64(const nlohmann::json& value) {
    if (!value.is_number_unsigned()) return std::nullopt;
    return value.get<std::uint64_t>();
  }

  std::vector<std::uint64_t> parse_shape(const std::string& name, const nlohmann::json& value) const {
    if (!value.is_array()) fail("invalid shape", name, "shape is " + json_type_name(value));
    std::vector<std::uint64_t> shape;
    shape.reserve(value.size());  // bounded by the JSON text, which is bounded by the file
    for (const auto& dim : value) {
      const auto size = as_u64(dim);
      if (!size) fail("invalid shape", name, "dimension " + dim.dump() + " is not an integer in [0, 2^64)");
      shape.push_back(*size);
    }
    return shape;
  }

  std::pair<std::uint64_t, std::uint64_t> parse_offsets(const std::string& name, const nlohmann::json& value) const {
    if (!value.is_array() || value.size() != 2)
      fail("invalid data_offsets", name, "expected [begin, end], found " + quoted_excerpt(value.dump()));
    const auto begin = as_u64(value[0]);
    const auto end = as_u64(value[1]);
    if (!begin || !end)
      fail("invalid data_offsets", name, "offsets must be integers in [0, 2^64), found " + quoted_excerpt(value.dump()));
    if (*begin > *end)
      fail("invalid data_offsets", name, "begin " + std::to_string(*begin) + " > end " + std::to_string(*end));
    return {*begin, *end};
  }

  void check_size_matches_shape(const TensorInfo& tensor) const {
    const auto elements = product(tensor.shape);
    const auto bits = elements ? checked_mul(*elements, bits_per_element(tensor.dtype)) : std::nullopt;
    if (!bits) fail("shape product overflows", tensor.name, "product(shape) * dtype bits exceeds 2^64");
    if (*bits % 8 != 0)
      fail("sub-byte tensor not byte aligned", tensor.name,
           std::to_string(*bits) + " bits of " + std::string(to_string(tensor.dtype)) + " do not end on a byte");
    if (*bits / 8 != tensor.size())
      fail("shape/size mismatch", tensor.name,
           "shape needs " + std::to_string(*bits / 8) + " bytes, data_offsets give " + std::to_string(tensor.size()));
  }

  static std::optional<std::uint64_t> product(const std::vector<std::uint64_t>& shape) {
    std::uint64_t elements = 1;
    for (const auto dim : shape) {
      const auto next = checked_mul(elements, dim);
      if (!next) return std::nullopt;
      elements = *next;
    }
    return elements;
  }

  // As the reference: by (begin, end); the name breaks ties between empty tensors deterministically.
  static void sort_by_offset(std::vector<TensorInfo>& tensors) {
    std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
  }

  // The tensors must cover [0, data_size) exactly, each starting where the previous one ended.
  // Returns data_size. Offsets in errors are file offsets (data_offset + begin) when they fit.
  std::uint64_t check_tiling(const std::vector<TensorInfo>& tensors) const {
    std::uint64_t covered = 0;
    for (const auto& tensor : tensors) {
      if (tensor.begin > covered)
        fail("gap in data buffer", tensor.name,
             "starts at " + std::to_string(tensor.begin) + ", the previous tensor ends at " + std::to_string(covered),
             file_offset(covered));
      if (tensor.begin < covered)
        fail("overlapping tensors", tensor.name,
             "starts at " + std::to_string(tensor.begin) + ", before the previous tensor ends at " + std::to_string(covered),
             file_offset(tensor.begin));
      covered = tensor.end;
    }
    return covered;
  }

  std::uint64_t file_offset(std::uint64_t data_position) const {
    const auto start = checked_add(kLengthPrefixSize, json_.size());
    return start ? checked_add(*start, data_position).value_or(0) : 0;
  }

  void check_file_size(const Header& header) const {
    const auto expected = checked_add(header.data_offset, header.data_size);
    const std::string last = header.tensors.empty() ? std::string() : header.tensors.back().name;
    if (!expected || *expected > file_size_)
      fail("data buffer past end of file", last,
           "8 + header " + std::to_string(header.header_size) + " + data " + std::to_string(header.data_size) +
               " bytes exceed the file's " + std::to_string(file_size_));
    if (*expected < file_size_)
      fail("trailing bytes after data buffer", last,
           std::to_string(file_size_ - *expected) + " bytes after the last tensor's end", *expected);
  }

  std::string_view json_;
  std::uint64_t file_size_;
  const std::string& path_;
};

// --- index parsing --------------------------------------------------------------------------------

// A shard must name a file next to the index: no directories, no way out of the checkpoint's
// directory (transformers #47176, accelerate #4070, diffusers #14175 followed such names).
std::optional<std::string> why_not_plain_file_name(std::string_view name) {
  if (name.empty()) return "empty shard name";
  if (name.find('\0') != std::string_view::npos) return "shard name contains NUL";
  if (name.front() == '/') return "shard name is an absolute path";
  if (name.find('/') != std::string_view::npos || name.find('\\') != std::string_view::npos)
    return "shard name contains a path separator";
  if (name == "." || name == "..") return "shard name is a directory reference";
  return std::nullopt;
}

ShardIndex parse_index_json(const nlohmann::json& root, const std::string& path) {
  const auto fail = [&](std::string_view rule, std::string_view tensor, const std::string& found) {
    refuse(kParseIndexOp, path, 0, rule, tensor, found);
  };
  if (!root.is_object()) fail("index not a JSON object", "", "found " + json_type_name(root));
  ShardIndex index;
  if (const auto metadata = root.find("metadata"); metadata != root.end() && !metadata->is_null()) {
    if (!metadata->is_object()) fail("index metadata not an object", "", "found " + json_type_name(*metadata));
    for (const auto& [key, value] : metadata->items()) index.metadata.emplace(key, value.dump());
  }
  const auto weight_map = root.find("weight_map");
  if (weight_map == root.end()) fail("index without weight_map", "", "no \"weight_map\" key");
  if (!weight_map->is_object()) fail("weight_map not an object", "", "found " + json_type_name(*weight_map));
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (tensor.empty()) fail("empty tensor name", "", "weight_map has the name \"\"");
    if (!shard.is_string()) fail("shard name not a string", tensor, "found " + json_type_name(shard));
    const auto& shard_name = shard.get_ref<const std::string&>();
    if (const auto why = why_not_plain_file_name(shard_name))
      fail("shard name not a plain file name", tensor, *why + ": \"" + quoted_excerpt(shard_name) + "\"");
    index.weight_map.emplace(tensor, shard_name);
    shards.insert(shard_name);
  }
  index.shards.assign(shards.begin(), shards.end());
  return index;
}

// --- file reading ---------------------------------------------------------------------------------

// Opens `path` read-only; a FIFO is refused first, since its open would wait for a writer.
int refuse_fifo(const std::string& path) {
  if (struct stat st {}; ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode))
    throw Error(errno_code(EINVAL), {.op = "open", .path = path}, "not a regular file");
  return ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
}

// A file descriptor read with pread: opened here (and closed at scope exit), or the caller's.
class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(const std::string& path) : path_(path), fd_(refuse_fifo(path)), owned_(true) {
    if (fd_ < 0) throw Error(errno_code(errno), {.op = "open", .path = path_});
  }
  ReadOnlyFile(int fd, const std::string& path) : path_(path), fd_(fd), owned_(false) {}
  ~ReadOnlyFile() {
    if (owned_) ::close(fd_);
  }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw Error(errno_code(errno), {.op = "stat", .path = path_});
    if (!S_ISREG(st.st_mode)) throw Error(errno_code(EINVAL), {.op = "open", .path = path_}, "not a regular file");
    return static_cast<std::uint64_t>(st.st_size);
  }

  // Reads exactly `length` bytes at `offset`, resuming short reads; a file that shrank is an error.
  void read_exactly(void* into, std::uint64_t length, std::uint64_t offset) const {
    hbmio::detail::read_exactly(fd_, {static_cast<std::byte*>(into), static_cast<std::size_t>(length)}, offset,
                         {.op = "read", .path = path_});
  }

 private:
  const std::string& path_;
  int fd_;
  bool owned_;
};

Header read_header_of(const ReadOnlyFile& file, const std::string& path) {
  const std::uint64_t file_size = file.size();
  std::array<std::byte, kLengthPrefixSize> prefix{};
  if (file_size >= kLengthPrefixSize) file.read_exactly(prefix.data(), prefix.size(), 0);
  // Validated against the real file size before the header buffer is allocated.
  const std::uint64_t header_size = parse_header_length(prefix.data(), file_size, path);
  std::string json(header_size, '\0');
  file.read_exactly(json.data(), header_size, kLengthPrefixSize);
  return parse_header(json, file_size, path);
}

ShardIndex read_index_of(const ReadOnlyFile& file, const std::string& path);

}  // namespace

std::string_view to_string(Dtype dtype) noexcept { return spec(dtype).name; }

std::optional<Dtype> parse_dtype(std::string_view text) {
  for (const auto& entry : kDtypes)
    if (entry.name == text) return entry.dtype;
  return std::nullopt;
}

unsigned bits_per_element(Dtype dtype) noexcept { return spec(dtype).bits; }

std::optional<std::uint64_t> tensor_byte_size(Dtype dtype, std::span<const std::uint64_t> shape) noexcept {
  std::optional<std::uint64_t> bits = bits_per_element(dtype);
  for (const auto dim : shape) bits = bits ? checked_mul(*bits, dim) : std::nullopt;
  if (!bits || *bits % 8 != 0) return std::nullopt;
  return *bits / 8;
}

const TensorInfo* Header::find(std::string_view name) const noexcept {
  const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const TensorInfo& t) { return t.name == name; });
  return it == tensors.end() ? nullptr : &*it;
}

std::uint64_t parse_header_length(const std::byte* prefix, std::uint64_t file_size, const std::string& path) {
  if (file_size < kLengthPrefixSize)
    refuse(kParseHeaderOp, path, 0, "not a safetensors file: file too short", "",
           std::to_string(file_size) + " bytes, a safetensors file has at least 8");
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | std::to_integer<std::uint64_t>(prefix[i]);  // little endian
  // Any other file read as a safetensors one lands here (its first 8 bytes as a huge length), so
  // the message says so first; the rule and the figures follow for a file that was meant to be one.
  if (length > kMaxHeaderSize)
    refuse(kParseHeaderOp, path, 0, "not a safetensors file: header too large", "",
           "length prefix " + std::to_string(length) + " exceeds " + std::to_string(kMaxHeaderSize));
  if (length > file_size - kLengthPrefixSize)
    refuse(kParseHeaderOp, path, 0, "header length past end of file", "",
           "8 + " + std::to_string(length) + " bytes exceed the file's " + std::to_string(file_size));
  return length;
}

Header parse_header(std::string_view json, std::uint64_t file_size, const std::string& path) {
  return HeaderParser(json, file_size, path).parse();
}

Header detail::parse_header_through_tree(std::string_view json, std::uint64_t file_size, const std::string& path) {
  return HeaderParser(json, file_size, path).parse(/*fast=*/false);
}

Header read_header(const std::string& path) { return read_header_of(ReadOnlyFile(path), path); }
Header read_header(int fd, const std::string& path) { return read_header_of(ReadOnlyFile(fd, path), path); }

void order_like_reference(std::vector<TensorInfo>& tensors) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    const unsigned rank_a = spec(a.dtype).reference_rank, rank_b = spec(b.dtype).reference_rank;
    if (rank_a != rank_b) return rank_a > rank_b;
    return a.name < b.name;
  });
}

std::string serialize_header(std::vector<TensorInfo>& tensors, const std::map<std::string, std::string>& metadata,
                             EmptyMetadata empty) {
  constexpr std::string_view op = "serialize safetensors header";
  const auto fail = [&](std::string_view rule, std::string_view tensor, const std::string& found) {
    refuse(op, "", 0, rule, tensor, found);
  };
  // Written piece by piece (nlohmann's ordered_json finds keys linearly: quadratic for 100k tensors)
  // in the reference's compact layout: "__metadata__" first, then the tensors in the given order.
  std::string json = "{";
  const auto append_entry = [&json](const std::string& key, const nlohmann::ordered_json& value) {
    if (json.size() > 1) json += ',';
    json += nlohmann::json(key).dump() + ':' + value.dump();
  };
  if (!metadata.empty() || empty == EmptyMetadata::write) {
    nlohmann::ordered_json entries = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) {
      if (format::first_invalid_utf8(key) || format::first_invalid_utf8(value))
        fail("invalid UTF-8", "", "__metadata__ entry \"" + quoted_excerpt(key) + "\"");
      entries.push_back({key, value});  // keys are unique and sorted already (std::map)
    }
    append_entry(std::string(kMetadataKey), entries);
  }
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (auto& tensor : tensors) {
    if (tensor.name.empty()) fail("empty tensor name", "", "a tensor has the name \"\"");
    if (tensor.name == kMetadataKey) fail("reserved tensor name", tensor.name, "the name is reserved for metadata");
    if (format::first_invalid_utf8(tensor.name)) fail("invalid UTF-8", tensor.name, "the name is not UTF-8");
    if (!names.insert(tensor.name).second) fail("duplicate key", tensor.name, "two tensors have this name");
    const auto size = tensor_byte_size(tensor.dtype, tensor.shape);
    if (!size) fail("shape product overflows", tensor.name, "or a sub-byte tensor does not end on a byte");
    const auto end = checked_add(offset, *size);
    if (!end) fail("shape product overflows", tensor.name, "the data buffer would exceed 2^64 bytes");
    tensor.begin = offset;
    tensor.end = *end;
    offset = *end;
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry.push_back({"dtype", std::string(to_string(tensor.dtype))});
    entry.push_back({"shape", tensor.shape});
    entry.push_back({"data_offsets", {tensor.begin, tensor.end}});
    append_entry(tensor.name, entry);
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');  // the data buffer starts 8-byte aligned in the file
  if (json.size() > kMaxHeaderSize)
    fail("header too large", "", std::to_string(json.size()) + " bytes exceed " + std::to_string(kMaxHeaderSize));
  std::string out(kLengthPrefixSize, '\0');
  for (std::size_t i = 0; i < kLengthPrefixSize; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xFF);
  return out + json;
}

ShardIndex parse_index(std::string_view json, const std::string& path) {
  format::JsonRefusal refusal;
  const auto root = format::parse_strict_json(json, kMaxJsonDepth, refusal);
  if (!root) refuse(kParseIndexOp, path, refusal.position.value_or(0), refusal.rule, refusal.key, refusal.found);
  return parse_index_json(*root, path);
}

ShardIndex read_index(const std::string& path) { return read_index_of(ReadOnlyFile(path), path); }
ShardIndex read_index(int fd, const std::string& path) { return read_index_of(ReadOnlyFile(fd, path), path); }

namespace {
ShardIndex read_index_of(const ReadOnlyFile& file, const std::string& path) {
  const std::uint64_t size = file.size();
  if (size > kMaxIndexSize)
    refuse(kParseIndexOp, path, 0, "index too large", "",
           std::to_string(size) + " bytes exceed " + std::to_string(kMaxIndexSize));
  std::string json(size, '\0');
  file.read_exactly(json.data(), size, 0);
  return parse_index(json, path);
}
}  // namespace

}  // namespace hbmio::safetensors
