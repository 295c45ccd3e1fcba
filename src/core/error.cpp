#include "hbmio/error.hpp"

#include <algorithm>
#include <cctype>

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

namespace {

// The length of the URL scheme `text` starts with ("s3://", "http://", "https://" in any case), or 0.
std::size_t url_scheme(std::string_view text) {
  for (std::string_view scheme : {"s3://", "http://", "https://"})
    if (text.size() >= scheme.size() &&
        std::equal(scheme.begin(), scheme.end(), text.begin(), [](char a, char b) { return a == std::tolower(static_cast<unsigned char>(b)); }))
      return scheme.size();
  return 0;
}

}  // namespace

std::string shown_path(std::string_view path) {
  const std::size_t host = url_scheme(path);
  if (host == 0) return std::string(path);
  std::string_view rest = path.substr(host);
  // The user info ends at the last '@' of the authority. A password with an unescaped '/', '?' or
  // '#' (an AWS secret key may hold '/') moves where the authority seems to end, so every '@' is
  // looked at, last first: one with no '/' before it, or a ':' before its first '/', ends user info
  // (an object key's own '@', "s3://bucket/a@b", has neither; nor has "host:9000/key@v2", whose
  // ':' starts a port: digits only up to the '/').
  for (std::size_t at = rest.rfind('@'); at != std::string_view::npos; at = at == 0 ? std::string_view::npos : rest.rfind('@', at - 1)) {
    const std::string_view before = rest.substr(0, at);
    const std::size_t slash = before.find('/');
    const std::size_t colon = slash == std::string_view::npos ? before.find(':') : before.rfind(':', slash);
    const bool port = colon < slash && slash != std::string_view::npos &&
                      std::all_of(before.begin() + static_cast<std::ptrdiff_t>(colon) + 1, before.begin() + static_cast<std::ptrdiff_t>(slash),
                                  [](char c) { return c >= '0' && c <= '9'; });
    if (slash == std::string_view::npos || (colon < slash && !port)) {
      rest = rest.substr(at + 1);
      break;
    }
  }
  return std::string(path.substr(0, host)) + std::string(rest.substr(0, rest.find_first_of("?#")));
}

std::string without_url_secrets(std::string_view text) {
  std::string out;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t scheme = 0;
    const bool word_start = i == 0 || !std::isalnum(static_cast<unsigned char>(text[i - 1]));
    if (word_start) scheme = url_scheme(text.substr(i));
    if (scheme == 0) {
      out += text[i++];
      continue;
    }
    // The URL runs to the next blank or quote; closing punctuation at its end is the sentence's.
    std::size_t end = i;
    while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end])) && text[end] != '"' && text[end] != '\'' &&
           text[end] != '<' && text[end] != '>')
      ++end;
    std::size_t url_end = end;
    while (url_end > i + scheme && std::string_view(")],;.").find(text[url_end - 1]) != std::string_view::npos) --url_end;
    out += shown_path(text.substr(i, url_end - i));
    out += text.substr(url_end, end - url_end);
    i = end;
  }
  return out;
}

Error::Error(std::error_code code, ErrorContext context, const std::string& detail)
    : std::system_error(code),
      message_(without_url_secrets(describe(code, context, detail))),
      context_(std::move(context)),
      detail_(without_url_secrets(detail)) {
  context_.path = shown_path(context_.path);
}

std::string thread_limit_message(const std::system_error& e) {
  return std::string("could not start a thread (") + e.what() +
         "): the process or its user is at a limit on threads (ulimit -u, the cgroup's pids.max) or memory";
}

}  // namespace hbmio
