#include "core/positional_io.hpp"

#include <unistd.h>

#include <cerrno>
#include <string>

#include "core/fault_hook.hpp"

namespace hbmio::detail {
namespace {

ErrorContext at(const ErrorContext& context, std::uint64_t offset, std::uint64_t length) {
  ErrorContext c = context;
  c.offset = offset;
  c.length = length;
  return c;
}

// Moves up to data.size() bytes; stops early only where pread finds the end of the file.
template <bool kRead>
std::size_t transfer(int fd, std::byte* data, std::size_t size, std::uint64_t offset, const ErrorContext& context,
                     const PositionalIo& io) {
  const char* what = io.what != nullptr ? io.what : (kRead ? "pread" : "pwrite");
  std::size_t done = 0;
  unsigned retries = 0;
  while (done < size) {
    if (io.cancel != nullptr && io.cancel->load(std::memory_order_relaxed))
      throw Error(errno_code(ECANCELED), at(context, offset + done, size - done), "stopped on request");
    const auto pos = static_cast<off_t>(offset + done);
    const ssize_t r = kRead ? ::pread(fd, data + done, size - done, pos) : ::pwrite(fd, data + done, size - done, pos);
    long long result = r < 0 ? -static_cast<long long>(errno) : r;
    if (io.faults != nullptr) result = io.faults->on_io_result(result, size - done, what, offset + done);
    if (result == -EINTR) continue;
    if (result == -EAGAIN && ++retries <= kMaxRetries) continue;
    if (result < 0)
      throw Error(errno_code(static_cast<int>(-result)), at(context, offset + done, size - done),
                  result == -EAGAIN ? std::string(what) + " kept reporting EAGAIN" : std::string(what));
    if (result == 0) {
      if (kRead) break;  // the end of the file
      throw Error(errno_code(ENOSPC), at(context, offset + done, size - done), std::string(what) + " made no progress");
    }
    retries = 0;
    done += static_cast<std::size_t>(result);
    if (io.progress != nullptr) io.progress->fetch_add(static_cast<std::uint64_t>(result), std::memory_order_relaxed);
  }
  return done;
}

}  // namespace

std::size_t read_fully(int fd, std::span<std::byte> data, std::uint64_t offset, const ErrorContext& context,
                       const PositionalIo& io) {
  return transfer<true>(fd, data.data(), data.size(), offset, context, io);
}

void read_exactly(int fd, std::span<std::byte> data, std::uint64_t offset, const ErrorContext& context,
                  const PositionalIo& io) {
  const std::size_t got = read_fully(fd, data, offset, context, io);
  if (got < data.size())
    throw Error(errno_code(EIO), at(context, offset + got, data.size() - got),
                "file ended at byte " + std::to_string(offset + got) + " (did it shrink during the read?)");
}

void write_fully(int fd, std::span<const std::byte> data, std::uint64_t offset, const ErrorContext& context,
                 const PositionalIo& io) {
  transfer<false>(fd, const_cast<std::byte*>(data.data()), data.size(), offset, context, io);
}

}  // namespace hbmio::detail
