#include "format/npy.hpp"

#include <cctype>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "hbmio/error.hpp"

namespace hbmio::format {
namespace {

namespace st = safetensors;

constexpr char kMagic[] = "\x93NUMPY";

[[noreturn]] void refuse(const std::string& path, std::uint64_t byte, const std::string& why, int err = EINVAL) {
  throw Error(errno_code(err), {.op = "read .npy header", .path = path, .offset = byte}, why);
}

// The dict literal numpy writes: {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// Values are a string, True/False, or a tuple of integers; nothing else occurs in a valid header.
struct Value {
  std::string text;                  // a string's contents, or "True"/"False"
  std::vector<std::uint64_t> tuple;  // a tuple's integers
  bool is_tuple = false;
};

class DictParser {
 public:
  DictParser(std::string_view text, std::uint64_t base, const std::string& path) : text_(text), base_(base), path_(path) {}

  std::map<std::string, Value> parse() {
    std::map<std::string, Value> out;
    expect('{');
    while (true) {
      skip_space();
      if (peek() == '}') break;
      const std::uint64_t at = pos_;
      std::string key = string_literal();
      expect(':');
      Value value = this->value();
      if (!out.emplace(key, std::move(value)).second) fail(at, fmt::format("key '{}' appears twice", key));
      skip_space();
      if (peek() == ',') ++pos_;
      else if (peek() != '}') fail(pos_, "expected ',' or '}' in the header dict");
    }
    ++pos_;
    skip_space();
    if (pos_ != text_.size()) fail(pos_, "text after the header dict");
    return out;
  }

 private:
  [[noreturn]] void fail(std::uint64_t at, const std::string& why) const { refuse(path_, base_ + at, why); }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void expect(char c) {
    skip_space();
    if (peek() != c) fail(pos_, fmt::format("expected '{}'", c));
    ++pos_;
  }
  std::string string_literal() {
    skip_space();
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail(pos_, "expected a quoted string");
    const std::size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) fail(pos_, "unterminated string");
    std::string s(text_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return s;
  }
  std::uint64_t integer() {
    skip_space();
    const std::size_t start = pos_;
    std::uint64_t n = 0;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      const std::uint64_t digit = static_cast<std::uint64_t>(text_[pos_] - '0');
      if (n > (UINT64_MAX - digit) / 10) fail(start, "dimension too large");
      n = n * 10 + digit;
      ++pos_;
    }
    if (pos_ == start) fail(start, "expected a non-negative integer");
    if (peek() == 'L') ++pos_;  // Python 2's long suffix, which old numpy wrote
    return n;
  }
  Value value() {
    skip_space();
    Value v;
    const char c = peek();
    if (c == '\'' || c == '"') {
      v.text = string_literal();
    } else if (c == '(') {
      v.is_tuple = true;
      ++pos_;
      while (true) {
        skip_space();
        if (peek() == ')') break;
        v.tuple.push_back(integer());
        skip_space();
        if (peek() == ',') ++pos_;
        else if (peek() != ')') fail(pos_, "expected ',' or ')' in the shape");
      }
      ++pos_;
    } else if (text_.substr(pos_, 4) == "True") {
      v.text = "True";
      pos_ += 4;
    } else if (text_.substr(pos_, 5) == "False") {
      v.text = "False";
      pos_ += 5;
    } else if (c == '[') {
      refuse(path_, base_ + pos_, "a structured dtype (a list of fields) cannot be streamed as records", ENOTSUP);
    } else {
      fail(pos_, "expected a string, True, False or a tuple");
    }
    return v;
  }

  std::string_view text_;
  std::uint64_t base_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

// numpy's type string (without the byte order) -> the safetensors dtype of the same bytes.
std::optional<st::Dtype> dtype_of(std::string_view kind) {
  static const std::map<std::string_view, st::Dtype> table = {
      {"b1", st::Dtype::BOOL}, {"u1", st::Dtype::U8},  {"i1", st::Dtype::I8},  {"i2", st::Dtype::I16},
      {"u2", st::Dtype::U16},  {"f2", st::Dtype::F16}, {"i4", st::Dtype::I32}, {"u4", st::Dtype::U32},
      {"f4", st::Dtype::F32},  {"i8", st::Dtype::I64}, {"u8", st::Dtype::U64}, {"f8", st::Dtype::F64},
      {"c8", st::Dtype::C64},
  };
  const auto it = table.find(kind);
  return it == table.end() ? std::nullopt : std::optional(it->second);
}

}  // namespace

std::uint64_t npy_header_end(std::span<const std::byte> prefix, const std::string& path) {
  if (prefix.size() < 10 || std::memcmp(prefix.data(), kMagic, 6) != 0)
    refuse(path, 0, "not a .npy file (no \\x93NUMPY magic at byte 0)");
  const auto byte = [&](std::size_t i) { return static_cast<std::uint64_t>(std::to_integer<unsigned char>(prefix[i])); };
  const std::uint64_t major = byte(6);
  if (major == 1) return 10 + (byte(8) | byte(9) << 8);
  if (major == 2 || major == 3) {
    if (prefix.size() < 12) refuse(path, prefix.size(), "file ends inside the .npy prefix");
    return 12 + (byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24);
  }
  refuse(path, 6, fmt::format(".npy format version {}.{} is not one of 1.0, 2.0, 3.0", major, byte(7)), ENOTSUP);
}

NpyHeader parse_npy_header(std::span<const std::byte> header, const std::string& path) {
  NpyHeader out;
  out.data_offset = npy_header_end(header, path);
  if (header.size() < out.data_offset) refuse(path, header.size(), "file ends inside the .npy header");
  const std::uint64_t prefix = std::to_integer<unsigned char>(header[6]) == 1 ? 10 : 12;
  // Version 3.0 allows UTF-8 field names; neither version puts anything but ASCII in a plain
  // array's header, so a byte past 127 is refused by the parser's grammar like any stray byte.
  const std::string_view text(reinterpret_cast<const char*>(header.data()) + prefix, out.data_offset - prefix);
  const auto dict = DictParser(text, prefix, path).parse();
  for (const char* key : {"descr", "fortran_order", "shape"})
    if (!dict.contains(key)) refuse(path, prefix, fmt::format("the header has no '{}'", key));
  if (dict.size() != 3) refuse(path, prefix, "the header has keys other than descr, fortran_order and shape");
  const Value& descr = dict.at("descr");
  const Value& order = dict.at("fortran_order");
  const Value& shape = dict.at("shape");
  if (descr.is_tuple || descr.text.size() < 2) refuse(path, prefix, "'descr' is not a type string");
  if (order.is_tuple || (order.text != "True" && order.text != "False")) refuse(path, prefix, "'fortran_order' is not True or False");
  if (!shape.is_tuple) refuse(path, prefix, "'shape' is not a tuple");
  out.descr = descr.text;
  out.shape = shape.tuple;
  const char byte_order = out.descr[0];
  const std::string_view kind = std::string_view(out.descr).substr(1);
  const auto dtype = dtype_of(kind);
  if (!dtype) refuse(path, prefix, fmt::format("dtype '{}' has no safetensors counterpart (bool, ints, f2/f4/f8, c8 do)", out.descr), ENOTSUP);
  const bool one_byte = st::bits_per_element(*dtype) == 8;
  if (byte_order == '>' && !one_byte)
    refuse(path, prefix, fmt::format("dtype '{}' is big-endian; only little-endian arrays are streamed", out.descr), ENOTSUP);
  if (byte_order != '<' && byte_order != '|' && byte_order != '=' && byte_order != '>')
    refuse(path, prefix, fmt::format("'{}' is not a type string (byte order '{}')", out.descr, byte_order));
  std::uint64_t multi_dims = 0;
  for (std::uint64_t d : out.shape) multi_dims += d > 1;
  if (order.text == "True" && multi_dims > 1)
    refuse(path, prefix, "the array is in Fortran order; records need C order (np.ascontiguousarray before np.save)", ENOTSUP);
  out.dtype = *dtype;
  return out;
}

}  // namespace hbmio::format
