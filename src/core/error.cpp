#include "hbmio/error.hpp"

#include <fmt/format.h>

namespace hbmio {
namespace {

// "read of /data/x.bin [offset 4096, length 1.00 MiB] via uring: Input/output error (detail)"
std::string describe(const std::error_code& code, const ErrorContext& c, const std::string& detail) {
  std::string text = c.op.empty() ? std::string("hbmio") : c.op;
  if (!c.path.empty()) text += fmt::format(" of {}", shown_path(c.path));
  // A length of 0 is "not about a range" (parse errors name a position only).
  if (c.length != 0) text += fmt::format(" [offset {}, length {}]", c.offset, c.length);
  else if (c.offset != 0) text += fmt::format(" [offset {}]", c.offset);
  if (!c.backend.empty()) text += fmt::format(" via {}", c.backend);
  text += ": " + code.message();
  if (!detail.empty()) text += " (" + detail + ")";
  return text;
}

class HbmioCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "hbmio"; }
  std::string message(int value) const override {
    switch (static_cast<Errc>(value)) {
      case Errc::verify_failed: return "verification failed";
      case Errc::no_checksums: return "nothing to verify against";
    }
    return "hbmio error " + std::to_string(value);
  }
  // So that code comparing with errno values still matches: EIO for a failed verification (the
  // data read is not the data written), ENODATA for a missing checksum.
  std::error_condition default_error_condition(int value) const noexcept override {
    switch (static_cast<Errc>(value)) {
      case Errc::verify_failed: return std::errc::io_error;
      case Errc::no_checksums: return std::errc::no_message_available;
    }
    return {value, *this};
  }
};

}  // namespace

const std::error_category& hbmio_category() noexcept {
  static const HbmioCategory category;
  return category;
}

std::string shown_path(std::string_view path) {
  if (!path.starts_with("s3://") && !path.starts_with("http://") && !path.starts_with("https://")) return std::string(path);
  const std::string_view u = path.substr(0, path.find_first_of("?#"));
  const std::size_t host = u.find("://") + 3;
  const std::size_t at = u.substr(0, u.find('/', host)).rfind('@');
  if (at != std::string_view::npos && at >= host) return std::string(u.substr(0, host)) + std::string(u.substr(at + 1));
  return std::string(u);
}

Error::Error(std::error_code code, ErrorContext context, const std::string& detail)
    : std::system_error(code),
      message_(describe(code, context, detail)),
      context_(std::move(context)),
      detail_(detail) {
  context_.path = shown_path(context_.path);
}

std::string thread_limit_message(const std::system_error& e) {
  return std::string("could not start a thread (") + e.what() +
         "): the process or its user is at a limit on threads (ulimit -u, the cgroup's pids.max) or memory";
}

}  // namespace hbmio
