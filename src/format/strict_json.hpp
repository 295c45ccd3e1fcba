// JSON parsing for untrusted checkpoint headers and indexes: UTF-8 checked first, duplicate keys
// refused (nlohmann::json keeps the last one silently), nesting depth bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace hbmio::format {

// Why a text was refused. `position` is the byte offset in the text, when known; `key` names the
// top-level key (for a safetensors header: the tensor) the problem is under, when there is one.
struct JsonRefusal {
  std::string rule;
  std::string key;
  std::string found;
  std::optional<std::uint64_t> position;
};

// Byte offset of the first invalid UTF-8 sequence (overlong forms, surrogates and code points past
// U+10FFFF are invalid, as in Rust's str::from_utf8), or nullopt when `text` is valid UTF-8.
std::optional<std::size_t> first_invalid_utf8(std::string_view text) noexcept;

// Parses `text` as one JSON value. On success returns the value; otherwise fills `refusal` with one
// of the rules "invalid UTF-8", "invalid JSON", "duplicate key", "JSON nested too deeply" and
// returns nullopt. Never throws for bad input (only std::bad_alloc).
std::optional<nlohmann::json> parse_strict_json(std::string_view text, unsigned max_depth, JsonRefusal& refusal);

}  // namespace hbmio::format
