// libFuzzer target for parse_index (see fuzz/README.md): the input is the index file's text.
// An index that parses must only name plain shard files; a violation traps.
#include <set>
#include <string>
#include <string_view>

#include "fuzz_targets.hpp"
#include "hbmio/error.hpp"
#include "hbmio/safetensors.hpp"

namespace hbmio::fuzz {

int index_one_input(const std::uint8_t* data, std::size_t size) {
  try {
    const auto index = hbmio::safetensors::parse_index(std::string_view(reinterpret_cast<const char*>(data), size),
                                                       "fuzz-input");
    std::set<std::string> shards;
    for (const auto& [tensor, shard] : index.weight_map) {
      const bool plain = !tensor.empty() && !shard.empty() && shard != "." && shard != ".." &&
                         shard.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos;
      if (!plain) __builtin_trap();
      shards.insert(shard);
    }
    if (std::set<std::string>(index.shards.begin(), index.shards.end()) != shards || shards.size() != index.shards.size())
      __builtin_trap();
  } catch (const hbmio::Error&) {
  }
  return 0;
}

}  // namespace hbmio::fuzz

#ifndef HBMIO_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return hbmio::fuzz::index_one_input(data, size);
}
#endif
