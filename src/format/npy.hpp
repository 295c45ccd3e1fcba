// NumPy's .npy header (format versions 1.0, 2.0 and 3.0): what a shard of training data holds
// and where its array starts. Only what a stream of records needs is accepted: a plain,
// C-ordered array of a dtype safetensors also has; anything else is refused by name.
//
// Hand-written rather than a library: the header is one Python dict literal of three known keys
// (numpy/lib/format.py writes it), and the C++ .npy readers around (cnpy, libnpy) assert or
// throw without saying which byte of which file was wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hbmio/safetensors.hpp"

namespace hbmio::format {

struct NpyHeader {
  safetensors::Dtype dtype = safetensors::Dtype::U8;
  std::string descr;                 // as written ("<f4")
  std::vector<std::uint64_t> shape;  // empty: a 0-d array
  std::uint64_t data_offset = 0;     // where the array's bytes start in the file
};

// Bytes of the fixed prefix: magic (6), version (2), header length (2 in 1.0, 4 in 2.0/3.0).
inline constexpr std::size_t kNpyPrefixSize = 12;

// The header's length from the first kNpyPrefixSize bytes (fewer when the file is shorter), so
// the caller can read the rest. Throws Error(EINVAL) naming `path` for a file that is not .npy.
std::uint64_t npy_header_end(std::span<const std::byte> prefix, const std::string& path);

// Parses the whole header (bytes [0, npy_header_end)). Throws Error(EINVAL) naming `path`, the
// byte and the rule for a malformed header; Error(ENOTSUP) for a valid array hbmio cannot
// stream (Fortran order, a structured or big-endian dtype, a dtype safetensors lacks).
NpyHeader parse_npy_header(std::span<const std::byte> header, const std::string& path);

}  // namespace hbmio::format
