#include "format/strict_json.hpp"

#include <set>
#include <vector>

namespace hbmio::format {
namespace {

// Thrown from inside StrictDomBuilder to stop the parse at the first refused key; caught in
// parse_strict_json and never leaves this file.
struct StopParse {
  JsonRefusal refusal;
};

// Length of the UTF-8 sequence starting at `lead` and the smallest valid second byte range
// (which is what rules out overlong forms and surrogates), or 0 for an invalid lead byte.
struct SequenceShape {
  unsigned length;
  unsigned char second_min, second_max;
};

SequenceShape sequence_shape(unsigned char lead) noexcept {
  if (lead < 0x80) return {1, 0, 0};
  if (lead >= 0xC2 && lead <= 0xDF) return {2, 0x80, 0xBF};
  if (lead == 0xE0) return {3, 0xA0, 0xBF};  // below A0: overlong
  if (lead == 0xED) return {3, 0x80, 0x9F};  // above 9F: UTF-16 surrogates
  if (lead >= 0xE1 && lead <= 0xEF) return {3, 0x80, 0xBF};
  if (lead == 0xF0) return {4, 0x90, 0xBF};  // below 90: overlong
  if (lead == 0xF4) return {4, 0x80, 0x8F};  // above 8F: past U+10FFFF
  if (lead >= 0xF1 && lead <= 0xF3) return {4, 0x80, 0xBF};
  return {0, 0, 0};
}

bool is_continuation(unsigned char byte) noexcept { return (byte & 0xC0) == 0x80; }

// nlohmann's own DOM builder, plus the two checks serde_json makes and nlohmann does not: no key
// twice in one object, and a nesting limit. Not nlohmann's callback parser: after each value that
// closes it walks the whole enclosing object looking for discarded entries, which is quadratic in
// the number of tensors (3,072 tensors: 40 ms; a 100 MB header of small entries: hours).
// sax_parse is a template over the handler type, so these non-virtual overloads are the ones called.
// json_sax_dom_parser is in nlohmann's detail namespace, stable from 3.10 to 3.12 (CMakeLists
// requires >= 3.10); the fuzz corpus and format tests check the behaviour on each build.
class StrictDomBuilder : public nlohmann::detail::json_sax_dom_parser<nlohmann::json> {
  using Base = nlohmann::detail::json_sax_dom_parser<nlohmann::json>;

 public:
  StrictDomBuilder(nlohmann::json& result, unsigned max_depth) : Base(result, /*allow_exceptions_=*/true), max_depth_(max_depth) {}

  bool start_object(std::size_t elements) {
    enter();
    seen_keys_.emplace_back();
    return Base::start_object(elements);
  }
  bool end_object() {
    seen_keys_.pop_back();
    --depth_;
    return Base::end_object();
  }
  bool start_array(std::size_t elements) {
    enter();
    return Base::start_array(elements);
  }
  bool end_array() {
    --depth_;
    return Base::end_array();
  }
  bool key(std::string& key) {
    if (seen_keys_.size() == 1) top_level_key_ = key;
    if (!seen_keys_.back().insert(key).second)
      throw StopParse{{"duplicate key", top_level_key_, "\"" + key + "\" appears twice", {}}};
    return Base::key(key);
  }
  const std::string& top_level_key() const noexcept { return top_level_key_; }

 private:
  void enter() {
    if (++depth_ > max_depth_)
      throw StopParse{{"JSON nested too deeply", top_level_key_, "more than " + std::to_string(max_depth_) + " levels", {}}};
  }

  unsigned max_depth_;
  unsigned depth_ = 0;  // open objects and arrays together
  std::vector<std::set<std::string>> seen_keys_;  // one set of keys per open object
  std::string top_level_key_;
};

}  // namespace

std::optional<std::size_t> first_invalid_utf8(std::string_view text) noexcept {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t i = 0;
  while (i < text.size()) {
    const SequenceShape shape = sequence_shape(bytes[i]);
    if (shape.length == 0 || shape.length > text.size() - i) return i;
    if (shape.length > 1) {
      if (bytes[i + 1] < shape.second_min || bytes[i + 1] > shape.second_max) return i;
      for (unsigned k = 2; k < shape.length; ++k)
        if (!is_continuation(bytes[i + k])) return i;
    }
    i += shape.length;
  }
  return std::nullopt;
}

std::optional<nlohmann::json> parse_strict_json(std::string_view text, unsigned max_depth, JsonRefusal& refusal) {
  if (const auto bad = first_invalid_utf8(text)) {
    refusal = {"invalid UTF-8", "", "invalid byte sequence", *bad};
    return std::nullopt;
  }
  // nlohmann's lexer takes a raw NUL byte for the end of input and ignores what follows, so
  // "{}\0<anything>" would parse; serde_json (the reference) refuses it, and a raw NUL is never
  // valid JSON (inside strings it must be escaped), so refuse it here with its position.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos) {
    refusal = {"invalid JSON", "", "NUL byte in the JSON text", nul};
    return std::nullopt;
  }
  // nlohmann skips a leading byte order mark; serde_json (the reference) does not, so neither do we.
  if (text.substr(0, 3) == "\xEF\xBB\xBF") {
    refusal = {"invalid JSON", "", "byte order mark before the JSON value", 0};
    return std::nullopt;
  }

  nlohmann::json result;
  StrictDomBuilder builder(result, max_depth);
  try {
    nlohmann::json::sax_parse(text.begin(), text.end(), &builder, nlohmann::json::input_format_t::json, /*strict=*/true,
                              /*ignore_comments=*/false);
    return result;
  } catch (const StopParse& stop) {
    refusal = stop.refusal;
  } catch (const nlohmann::json::parse_error& error) {
    // error.byte is 1-based: the byte at which the parser gave up.
    refusal = {"invalid JSON", builder.top_level_key(), error.what(), error.byte > 0 ? error.byte - 1 : 0};
  } catch (const nlohmann::json::exception& error) {
    // Not only parse_error: a number past double's range ("1e999") throws out_of_range (found by
    // fuzz/index_fuzzer; serde_json refuses such numbers too).
    refusal = {"invalid JSON", builder.top_level_key(), error.what(), {}};
  }
  return std::nullopt;
}

}  // namespace hbmio::format
