#include "format/strict_json.hpp"

#include <cstdint>
#include <cstring>
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

// A DOM builder for nlohmann's SAX parser, with the two checks serde_json makes and nlohmann does
// not: no key twice in one object (found by the object's own map: an insertion that inserts
// nothing), and a nesting limit. Ours rather than nlohmann's json_sax_dom_parser, whose object
// state is private: deriving from it and keeping a set of seen keys per object cost a third of a
// 3,072-tensor header's parse. Not nlohmann's callback parser either: after each value that closes
// it walks the whole enclosing object, which is quadratic in the number of tensors.
// sax_parse is a template over the handler type, so these non-virtual members are the ones called.
class StrictDomBuilder {
  using json = nlohmann::json;

 public:
  StrictDomBuilder(json& root, unsigned max_depth) : root_(root), max_depth_(max_depth) {}

  bool null() { return put(nullptr); }
  bool boolean(bool value) { return put(value); }
  bool number_integer(json::number_integer_t value) { return put(value); }
  bool number_unsigned(json::number_unsigned_t value) { return put(value); }
  bool number_float(json::number_float_t value, const std::string&) { return put(value); }
  bool string(json::string_t& value) { return put(std::move(value)); }
  bool binary(json::binary_t& value) { return put(json::binary(std::move(value))); }

  bool start_object(std::size_t) {
    enter();
    put(json::value_t::object);
    return true;
  }
  bool key(json::string_t& key) {
    if (stack_.size() == 1) top_level_key_ = key;
    auto [it, inserted] = stack_.back()->get_ref<json::object_t&>().emplace(key, nullptr);
    if (!inserted) throw StopParse{{"duplicate key", top_level_key_, "\"" + key + "\" appears twice", {}}};
    element_ = &it->second;
    return true;
  }
  bool end_object() {
    leave();
    return true;
  }
  bool start_array(std::size_t) {
    enter();
    put(json::value_t::array);
    return true;
  }
  bool end_array() {
    leave();
    return true;
  }
  // Rethrown as its own type, as nlohmann's DOM builder does: the caller reads a parse_error's byte.
  [[noreturn]] bool parse_error(std::size_t, const std::string&, const json::exception& error) {
    switch (error.id / 100) {
      case 1: throw *static_cast<const json::parse_error*>(&error);
      case 2: throw *static_cast<const json::invalid_iterator*>(&error);
      case 3: throw *static_cast<const json::type_error*>(&error);
      case 4: throw *static_cast<const json::out_of_range*>(&error);
      default: throw *static_cast<const json::other_error*>(&error);
    }
  }

  const std::string& top_level_key() const noexcept { return top_level_key_; }

 private:
  // Places a value: the root, the next element of the open array, or the member whose key came
  // last. Objects and arrays stay open (on the stack) until their end. Pointers into an array
  // stay valid while they are on the stack: nothing is appended to an array while a value
  // inside it is open.
  bool put(json&& value) {
    json* slot = nullptr;
    if (stack_.empty()) {
      root_ = std::move(value);
      slot = &root_;
    } else if (stack_.back()->is_array()) {
      auto& array = stack_.back()->get_ref<json::array_t&>();
      array.push_back(std::move(value));
      slot = &array.back();
    } else {
      *element_ = std::move(value);
      slot = element_;
    }
    if (slot->is_object() || slot->is_array()) stack_.push_back(slot);
    return true;
  }
  void enter() {
    if (++depth_ > max_depth_)
      throw StopParse{{"JSON nested too deeply", top_level_key_, "more than " + std::to_string(max_depth_) + " levels", {}}};
  }
  void leave() {
    stack_.pop_back();
    --depth_;
  }

  json& root_;
  unsigned max_depth_;
  unsigned depth_ = 0;         // open objects and arrays together
  std::vector<json*> stack_;   // the open objects and arrays, innermost last
  json* element_ = nullptr;    // the member of the innermost object whose key came last
  std::string top_level_key_;
};

}  // namespace

std::optional<std::size_t> first_invalid_utf8(std::string_view text) noexcept {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t i = 0;
  while (i < text.size()) {
    // Eight ASCII bytes at a time: a header is almost all ASCII, and this check runs over all of it
    // before every parse.
    if (std::uint64_t eight = 0; text.size() - i >= 8 && (std::memcpy(&eight, bytes + i, 8), (eight & 0x8080808080808080ULL) == 0)) {
      i += 8;
      continue;
    }
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
// nlohmann's messages start with its own id ("[json.exception.parse_error.101] "): the user is
// told what is wrong with the file, not which exception class said so.
static std::string without_id(const char* what) {
  std::string_view text(what);
  if (text.starts_with("[json.exception.")) {
    if (const auto end = text.find("] "); end != std::string_view::npos) text.remove_prefix(end + 2);
  }
  return std::string(text);
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
    refusal = {"invalid JSON", builder.top_level_key(), without_id(error.what()), error.byte > 0 ? error.byte - 1 : 0};
  } catch (const nlohmann::json::exception& error) {
    // Not only parse_error: a number past double's range ("1e999") throws out_of_range (found by
    // fuzz/index_fuzzer; serde_json refuses such numbers too).
    refusal = {"invalid JSON", builder.top_level_key(), without_id(error.what()), {}};
  }
  return std::nullopt;
}

}  // namespace hbmio::format
