#include "platform/sysfs.hpp"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <system_error>

namespace hbmio::platform {

namespace fs = std::filesystem;

namespace {
std::string_view without_leading_slashes(std::string_view relative) {
  while (!relative.empty() && relative.front() == '/') relative.remove_prefix(1);
  return relative;
}
}  // namespace

Root::Root(fs::path base) : base_(base.empty() ? fs::path("/") : std::move(base)) {
  std::error_code ec;
  canonical_base_ = fs::weakly_canonical(base_, ec);
  if (ec) canonical_base_ = base_;
  live_ = canonical_base_ == fs::path("/");
}

fs::path Root::path(std::string_view relative) const {
  relative = without_leading_slashes(relative);
  return relative.empty() ? base_ : base_ / fs::path(relative);
}

bool Root::exists(std::string_view relative) const {
  std::error_code ec;
  return fs::exists(path(relative), ec);
}

bool Root::is_directory(std::string_view relative) const {
  std::error_code ec;
  return fs::is_directory(path(relative), ec);
}

std::optional<std::string> Root::read_file(std::string_view relative, std::size_t limit) const {
  std::ifstream in(path(relative), std::ios::binary);
  if (!in) return std::nullopt;
  std::string data;
  char chunk[4096];
  while (data.size() < limit && in.read(chunk, sizeof chunk).gcount() > 0) {
    data.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (!in) break;
  }
  // A read error (EIO, EACCES on read for some sysfs files) leaves badbit; treat as unreadable.
  if (in.bad()) return std::nullopt;
  if (data.size() > limit) data.resize(limit);
  return data;
}

std::string attribute_value(std::string_view raw) {
  const auto cut = raw.find_first_of(std::string_view("\0\n", 2));
  if (cut != std::string_view::npos) raw = raw.substr(0, cut);
  const auto first = raw.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const auto last = raw.find_last_not_of(" \t\r");
  return std::string(raw.substr(first, last - first + 1));
}

std::optional<std::string> Root::read_attribute(std::string_view relative) const {
  auto raw = read_file(relative, 64 * 1024);
  if (!raw) return std::nullopt;
  return attribute_value(*raw);
}

std::optional<long long> Root::read_integer(std::string_view relative) const {
  const auto text = read_attribute(relative);
  if (!text || text->empty()) return std::nullopt;
  std::string_view digits = *text;
  bool negative = false;
  if (digits.front() == '-') {
    negative = true;
    digits.remove_prefix(1);
  }
  int radix = 10;
  if (digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X')) {
    radix = 16;
    digits.remove_prefix(2);
  }
  long long value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value, radix);
  if (error != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return negative ? -value : value;
}

std::vector<std::string> Root::list(std::string_view relative) const {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(path(relative), ec), end; !ec && it != end; it.increment(ec))
    names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::optional<std::string> Root::resolve(std::string_view relative) const {
  std::error_code ec;
  const fs::path real = fs::canonical(path(relative), ec);
  if (ec) return std::nullopt;
  const fs::path inside = real.lexically_relative(canonical_base_);
  if (inside.empty()) return std::nullopt;
  const std::string text = inside.generic_string();
  if (text == ".") return std::string();
  if (text.starts_with("..")) return std::nullopt;  // an absolute link that leaves a recorded tree
  return text;
}

std::string parent_of(std::string_view relative) {
  const auto slash = relative.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(relative.substr(0, slash));
}

std::string name_of(std::string_view relative) {
  const auto slash = relative.rfind('/');
  return std::string(slash == std::string_view::npos ? relative : relative.substr(slash + 1));
}

}  // namespace hbmio::platform
