// The library's one loop around pread(2) and pwrite(2). Every plain positional transfer goes
// through it, so they all follow one policy: a short transfer is resumed where it stopped, EINTR
// is retried, EAGAIN is retried at most kMaxRetries times in a row (a descriptor that keeps saying
// it would block is a fault, not a wait), an error names the byte where it happened, and a write
// that moves nothing is ENOSPC. (The io_uring and cuFile pipelines apply the same policy to their
// own completions.)
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>

#include "hbmio/error.hpp"

namespace hbmio {
class FaultHook;
}

namespace hbmio::detail {

inline constexpr unsigned kMaxRetries = 1000;  // consecutive EAGAIN on one transfer

// What a caller may add to a transfer; all optional.
struct PositionalIo {
  FaultHook* faults = nullptr;                        // sees each call's result (tests)
  const char* what = nullptr;                         // the call, in errors and the injector's log
  const std::atomic<bool>* cancel = nullptr;          // checked before each call: Error(ECANCELED)
  std::atomic<std::uint64_t>* progress = nullptr;     // bytes moved are added as they move
};

// Reads into `data` from `offset` until it is full or the file ends; returns the bytes read
// (fewer than data.size() only at the end of the file). Throws Error naming `context`'s op and
// path with the offset and length of what was left.
std::size_t read_fully(int fd, std::span<std::byte> data, std::uint64_t offset, const ErrorContext& context,
                       const PositionalIo& io = {});

// read_fully(), and a file that ends first is Error(EIO) "file ended at byte N".
void read_exactly(int fd, std::span<std::byte> data, std::uint64_t offset, const ErrorContext& context,
                  const PositionalIo& io = {});

// Writes all of `data` at `offset`.
void write_fully(int fd, std::span<const std::byte> data, std::uint64_t offset, const ErrorContext& context,
                 const PositionalIo& io = {});

}  // namespace hbmio::detail
