// Reads the machine's facts from procfs, sysfs and uname, and the library's CUDA and file queries.
#include "bench_machine.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace hbmio::cli {
namespace {

std::string trim(std::string text) {
  const auto first = text.find_first_not_of(" \t\n");
  const auto last = text.find_last_not_of(" \t\n");
  return first == std::string::npos ? "" : text.substr(first, last - first + 1);
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return trim(text.str());
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) return trim(line.substr(line.find(':') + 1));
  return "unknown";
}

// The block device under `path` and its model. A file system on a real device has
// /sys/dev/block/MAJ:MIN, whose uevent names it (DEVNAME); for the rest (overlay, tmpfs, NFS) the
// mount's source in /proc/self/mountinfo says what it is.
void describe_device(const std::string& path, Machine& machine) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  const std::string dev = fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  std::error_code ec;
  const auto sys = std::filesystem::canonical("/sys/dev/block/" + dev, ec);
  if (!ec) {
    std::ifstream uevent(sys / "uevent");
    for (std::string line; std::getline(uevent, line);)
      if (line.rfind("DEVNAME=", 0) == 0) machine.device = "/dev/" + line.substr(8);
    // A partition's model is its parent disk's.
    const auto disk = std::filesystem::exists(sys / "partition") ? sys.parent_path() : sys;
    machine.device_model = read_text_file(disk / "device" / "model");
  }
  if (machine.device.empty()) {
    // mountinfo: "36 35 98:0 /root /mnt rw,noatime shared:1 - ext4 /dev/sda1 rw"
    std::ifstream mountinfo("/proc/self/mountinfo");
    for (std::string line; std::getline(mountinfo, line);) {
      std::istringstream fields(line);
      std::string id, parent, majmin;
      fields >> id >> parent >> majmin;
      const auto dash = line.find(" - ");
      if (majmin != dev || dash == std::string::npos) continue;
      std::istringstream tail(line.substr(dash + 3));
      std::string type, source;
      tail >> type >> source;
      machine.device = source;
      break;
    }
  }
  if (machine.device.empty()) machine.device = "device " + dev;
}

}  // namespace

Machine describe_machine(const std::string& file_path, const MemoryLocation& into) {
  Machine m;
  m.cpu_model = cpu_model();
  m.cpus = static_cast<unsigned>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  m.memory_bytes = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  utsname u{};
  if (::uname(&u) == 0) m.kernel = fmt::format("{} {}", u.sysname, u.release);
  m.gpu = cuda_device_count() > 0;
  if (m.gpu) m.gpu_name = cuda_device_name(into.kind == MemoryKind::device ? into.device : 0);
  else m.gpu_reason = cuda_unavailable_reason();
  m.file_system = file_system_type(file_path);
  describe_device(file_path, m);
  return m;
}

}  // namespace hbmio::cli
