// hbmio::Error: the one exception type of the library.
//
// Every failure that reaches a user carries what was being done (op), to which file (path),
// where (offset, length) and through which backend, plus the system's own message. errno,
// CUDA and cuFile codes are turned into an Error at one boundary each (see src/core/error.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <system_error>

namespace hbmio {

struct ErrorContext {
  std::string op;       // "read", "write", "open", "register buffer", ...
  std::string path;     // file the operation was about; empty when none
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::string backend;  // "posix", "uring", "cufile", "auto"; empty when not backend specific
};

// What output may show of a path: a URL (s3://, http://, https://) without its user info
// (user:password@), query (a presigned URL's X-Amz-Signature) and fragment; any other path as
// given. Every Error's path goes through it, and so does every path the command and Python print
// or put into JSON.
std::string shown_path(std::string_view path);
// `text` with shown_path() of every URL in it (a word starting s3://, http:// or https://, in any
// case): for messages that quote what they were given (a usage error, a server's redirect). Every
// Error's message and detail go through it.
std::string without_url_secrets(std::string_view text);

class Error : public std::system_error {
 public:
  // `detail` says what the code alone cannot (e.g. "file ended at byte 4096"). context.path is
  // kept as shown_path() of it.
  Error(std::error_code code, ErrorContext context, const std::string& detail = {});

  const ErrorContext& context() const noexcept { return context_; }
  const std::string& detail() const noexcept { return detail_; }
  // "read of /data/x.bin [offset 4096, length 1048576] via uring: Input/output error (detail)"
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;  // std::system_error's own what() would append the code's message twice
  ErrorContext context_;
  std::string detail_;
};

// Error categories for codes that are not errno values. The messages name the code
// (e.g. "cudaErrorNoDevice: no CUDA-capable device is detected", "CU_FILE_DRIVER_NOT_INITIALIZED").
const std::error_category& cuda_category() noexcept;
const std::error_category& cufile_category() noexcept;

// Conditions of hbmio's own that no errno value names: a failed verification is a finding about
// the data, and reads "verification failed", not "Input/output error" or "Bad message".
enum class Errc {
  verify_failed = 1,  // a checksum, a byte comparison or a header check did not match
  no_checksums = 2,   // verification was required and the file holds nothing to check against
};
const std::error_category& hbmio_category() noexcept;
inline std::error_code make_error_code(Errc e) noexcept { return {static_cast<int>(e), hbmio_category()}; }

// Shorthand for an errno value.
inline std::error_code errno_code(int err) noexcept { return {err, std::generic_category()}; }

// What to tell a user when a thread could not be started (std::thread throws std::system_error
// with EAGAIN, whose own text is only "Resource temporarily unavailable").
std::string thread_limit_message(const std::system_error& e);

}  // namespace hbmio
