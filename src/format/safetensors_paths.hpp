// The two ways a safetensors header is parsed (safetensors.cpp): a direct scan of the common
// shape, and the JSON tree for everything else. parse_header takes the first where it can;
// tests compare the two on the same texts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "hbmio/safetensors.hpp"

namespace hbmio::safetensors::detail {

// parse_header through the JSON tree only: the outcome parse_header must give for any text.
Header parse_header_through_tree(std::string_view json, std::uint64_t file_size, const std::string& path);

}  // namespace hbmio::safetensors::detail
