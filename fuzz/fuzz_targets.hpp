// The fuzz targets as plain functions, so that tests/fuzz_replay_test.cpp can replay the corpus
// and the regressions with g++ (no libFuzzer). Each returns 0; a bug aborts or throws something
// other than hbmio::Error.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hbmio::fuzz {

int safetensors_header_one_input(const std::uint8_t* data, std::size_t size);
int index_one_input(const std::uint8_t* data, std::size_t size);

}  // namespace hbmio::fuzz
