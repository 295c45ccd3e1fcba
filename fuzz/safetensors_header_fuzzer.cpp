// libFuzzer target for parse_header_length + parse_header (see fuzz/README.md).
//
// The input is parsed two ways:
//  1. as a whole safetensors file (8-byte length, header, data): the path read_header takes;
//  2. as bare header JSON, with a file size that fits no data (8 + size) and one that is huge:
//     the first reaches the trailing-bytes/size checks, the second the tiling and overflow checks
//     without the fuzzer having to guess a matching data buffer.
// Any header that parses must satisfy the documented invariants and survive a serialize -> parse
// round trip unchanged; a violation traps.
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include "fuzz_targets.hpp"
#include "hbmio/error.hpp"
#include "hbmio/safetensors.hpp"

namespace hbmio::fuzz {
namespace {

namespace st = hbmio::safetensors;
const std::string kPath = "fuzz-input";

void check(bool condition) {
  if (!condition) __builtin_trap();
}

void check_invariants(const st::Header& header, std::uint64_t file_size) {
  std::uint64_t covered = 0;
  for (const auto& tensor : header.tensors) {
    check(!tensor.name.empty() && tensor.begin == covered && tensor.begin <= tensor.end);
    check(st::tensor_byte_size(tensor.dtype, tensor.shape) == tensor.size());
    covered = tensor.end;
  }
  check(header.data_size == covered);
  check(header.data_offset == 8 + header.header_size);
  check(header.data_offset + header.data_size == file_size);
}

// serialize_header repacks in the given order: for a parsed header (already packed, in offset
// order) that must give the same tensors back, and a header that parses again.
void check_round_trip(const st::Header& header) {
  auto tensors = header.tensors;
  std::string bytes;
  try {
    bytes = st::serialize_header(tensors, header.metadata);
  } catch (const hbmio::Error&) {
    // Only the 100 MB limit may refuse what parsed (compact output is never longer, but padding adds up to 7).
    check(header.header_size + 7 > st::kMaxHeaderSize);
    return;
  }
  const std::uint64_t length = st::parse_header_length(reinterpret_cast<const std::byte*>(bytes.data()),
                                                       bytes.size() + header.data_size, kPath);
  const auto again = st::parse_header(std::string_view(bytes).substr(8, length), bytes.size() + header.data_size, kPath);
  check(again.tensors.size() == header.tensors.size() && again.metadata == header.metadata);
  for (std::size_t i = 0; i < again.tensors.size(); ++i) {
    const auto &a = again.tensors[i], &b = header.tensors[i];
    check(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.begin == b.begin && a.end == b.end);
  }
}

void parse_as_file(const std::uint8_t* data, std::size_t size) {
  try {
    const auto length = st::parse_header_length(reinterpret_cast<const std::byte*>(data), size, kPath);
    const std::string_view json(reinterpret_cast<const char*>(data) + 8, length);
    const auto header = st::parse_header(json, size, kPath);
    check_invariants(header, size);
    check_round_trip(header);
  } catch (const hbmio::Error&) {
  }
}

void parse_as_json(const std::uint8_t* data, std::size_t size, std::uint64_t file_size) {
  try {
    const auto header = st::parse_header(std::string_view(reinterpret_cast<const char*>(data), size), file_size, kPath);
    check_invariants(header, file_size);
    check_round_trip(header);
  } catch (const hbmio::Error&) {
  }
}

}  // namespace

int safetensors_header_one_input(const std::uint8_t* data, std::size_t size) {
  parse_as_file(data, size);
  parse_as_json(data, size, 8 + static_cast<std::uint64_t>(size));
  parse_as_json(data, size, std::numeric_limits<std::uint64_t>::max());
  return 0;
}

}  // namespace hbmio::fuzz

#ifndef HBMIO_FUZZ_NO_MAIN
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return hbmio::fuzz::safetensors_header_one_input(data, size);
}
#endif
