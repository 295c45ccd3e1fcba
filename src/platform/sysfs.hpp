// The platform layer: reading a sysfs/procfs tree under a settable root, so recorded trees from
// other machines can be checked (and tested) exactly like the live one. Used by the engines (what
// a file's block device is, for auto's choice) and by the doctor alike; it depends on nothing of
// hbmio's but the standard library.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hbmio::platform {

// A directory that stands for "/" of the machine being checked. Paths given to it are relative
// ("sys/class/nvme"); a leading '/' is ignored. Every read returns nothing on any error: a
// missing or unreadable file is something the checks report, never an exception.
class Root {
 public:
  explicit Root(std::filesystem::path base);

  const std::filesystem::path& base() const noexcept { return base_; }
  // True for "/": the machine itself, where live probes (O_DIRECT, cuFile, CUDA) make sense.
  bool is_live() const noexcept { return live_; }

  std::filesystem::path path(std::string_view relative) const;
  bool exists(std::string_view relative) const;
  bool is_directory(std::string_view relative) const;

  // The whole file (at most `limit` bytes), as bytes.
  std::optional<std::string> read_file(std::string_view relative, std::size_t limit = 1 << 20) const;
  // A sysfs attribute: the first line, cut at the first NUL (recorded trees pad files with NULs
  // to the page size), with surrounding white space removed.
  std::optional<std::string> read_attribute(std::string_view relative) const;
  // An attribute parsed as an integer (decimal, or hex with 0x); nothing when absent or garbled.
  std::optional<long long> read_integer(std::string_view relative) const;

  // Names in a directory, sorted; empty when it is missing.
  std::vector<std::string> list(std::string_view relative) const;

  // Where `relative` really lives after following symlinks, relative to the root
  // ("sys/devices/pci0000:00/0000:00:01.5/0000:06:00.0"). Nothing when it does not exist or its
  // links lead outside the root (an absolute link in a recorded tree).
  std::optional<std::string> resolve(std::string_view relative) const;

 private:
  std::filesystem::path base_;
  std::filesystem::path canonical_base_;
  bool live_ = false;
};

// Trims white space and cuts at the first NUL or newline: the value of a sysfs attribute.
std::string attribute_value(std::string_view raw);

// Parent directory of a relative path ("a/b/c" -> "a/b"; "a" -> "").
std::string parent_of(std::string_view relative);
// Last component ("a/b/c" -> "c").
std::string name_of(std::string_view relative);

}  // namespace hbmio::platform
