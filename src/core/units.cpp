#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "hbmio/error.hpp"
#include "hbmio/options.hpp"
#include "hbmio/version.hpp"

namespace hbmio {

// One size syntax for the command line, the HBMIO_* variables and Python: digits (a fraction
// allowed) and a unit. KB, MB, GB, TB are decimal, as Hugging Face's max_shard_size and disk
// vendors read them; K, M, G, T and KiB, MiB, GiB, TiB are binary, as dd, fio and memory sizes
// are. "Gb" is refused: to Hugging Face it means gigabits, and a silent factor of 8 is worse than
// an error.
std::uint64_t parse_size(const std::string& text) {
  auto fail = [&](const std::string& why) {
    return Error(errno_code(EINVAL), {.op = "parse size"},
                 fmt::format("'{}' is not a size{}: use bytes, or a number with a unit: KB, MB, GB, TB (powers of 1000) or "
                             "K, M, G, T, KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB or 16MiB",
                             text, why));
  };
  // Digits with an optional fraction, then the unit: std::stod alone would also take hex
  // ("0x100"), exponents ("1e3"), signs and leading spaces, none of which a size means.
  std::size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) ++digits;
  if (digits == 0 || std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(digits), '.') > 1) throw fail("");
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text.substr(0, digits), &pos);
  } catch (const std::exception&) {
    throw fail("");
  }
  if (!(value >= 0) || std::isinf(value) || pos != digits) throw fail("");
  const std::string unit = text.substr(pos);
  if (unit.size() == 2 && unit[1] == 'b' && std::strchr("kKmMgGtT", unit[0]) != nullptr)
    throw fail(fmt::format(" ('{}' would be bits; write {}B for powers of 1000 or {}iB for powers of 1024)", unit,
                           static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0]))),
                           static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0])))));
  std::string lower = unit;
  for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static constexpr const char* kLetters = "kmgt";
  double multiplier = 0;
  if (lower.empty() || lower == "b") {
    multiplier = 1;
  } else if (const char* at = std::strchr(kLetters, lower[0]); at != nullptr && lower[0] != '\0') {
    const int power = static_cast<int>(at - kLetters) + 1;
    const std::string rest = lower.substr(1);
    if (rest.empty() || rest == "ib") multiplier = std::ldexp(1.0, 10 * power);
    else if (rest == "b") multiplier = std::pow(1000.0, power);
  }
  if (multiplier == 0) throw fail(fmt::format(" (unknown unit '{}')", unit));
  const double bytes = value * multiplier;
  if (bytes >= 18446744073709551615.0) throw fail(" (too large)");
  if (bytes != std::floor(bytes)) throw fail(" (not a whole number of bytes)");
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
