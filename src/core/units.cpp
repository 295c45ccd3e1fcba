#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "hbmio/error.hpp"
#include "hbmio/options.hpp"
#include "hbmio/version.hpp"

namespace hbmio {

std::uint64_t parse_size(const std::string& text) {
  auto fail = [&] {
    return Error(errno_code(EINVAL), {.op = "parse size"},
                 fmt::format("'{}' is not a size: use bytes or a suffix K, M, G, T (binary, e.g. 4MiB)", text));
  };
  // Digits with an optional fraction, then the suffix: std::stod alone would also take hex
  // ("0x100"), exponents ("1e3"), signs and leading spaces, none of which a size means.
  std::size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) ++digits;
  if (digits == 0 || std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(digits), '.') > 1) throw fail();
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text.substr(0, digits), &pos);
  } catch (const std::exception&) {
    throw fail();
  }
  if (!(value >= 0) || std::isinf(value)) throw fail();
  if (pos != digits) throw fail();
  std::string suffix = text.substr(pos);
  for (auto& ch : suffix) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  int shift = 0;
  if (suffix.empty() || suffix == "b") shift = 0;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib") shift = 10;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib") shift = 20;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib") shift = 30;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib") shift = 40;
  else throw fail();
  const double bytes = std::ldexp(value, shift);
  if (bytes >= 18446744073709551615.0 || bytes != std::floor(bytes)) throw fail();
  return static_cast<std::uint64_t>(bytes);
}

std::string format_size(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", value, units[unit]);
}

std::string version() { return HBMIO_VERSION; }

}  // namespace hbmio
