// The machine a measurement ran on (hbmio/doctor.hpp): its facts through the platform layer
// (procfs and sysfs under a root, every read returning nothing on error) and the library's CUDA
// and file queries.
#include "hbmio/doctor.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>

#include <fmt/format.h>

#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "platform/sysfs.hpp"

namespace hbmio {
namespace {

// The value of the first "key: value" line of a procfs text, e.g. "model name" of /proc/cpuinfo.
std::string procfs_value(const std::string& text, const std::string& key) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.starts_with(key) && line.find(':') != std::string::npos) return platform::attribute_value(line.substr(line.find(':') + 1));
  return {};
}

// The block device under `path` and its model. A file system on a real device has
// /sys/dev/block/MAJ:MIN, whose uevent names it (DEVNAME); for the rest (overlay, tmpfs, NFS) the
// mount's source in /proc/self/mountinfo says what it is.
void describe_device(const platform::Root& root, const std::string& path, Machine& machine) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  const std::string dev = fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  if (const auto place = root.resolve("sys/dev/block/" + dev)) {
    std::istringstream uevent(root.read_file(*place + "/uevent").value_or(""));
    for (std::string line; std::getline(uevent, line);)
      if (line.starts_with("DEVNAME=")) machine.device = "/dev/" + line.substr(8);
    // A partition's model is its parent disk's.
    const std::string disk = root.exists(*place + "/partition") ? platform::parent_of(*place) : *place;
    machine.device_model = root.read_attribute(disk + "/device/model").value_or("");
  }
  if (machine.device.empty()) {
    // mountinfo: "36 35 98:0 /root /mnt rw,noatime shared:1 - ext4 /dev/sda1 rw"
    std::istringstream mountinfo(root.read_file("proc/self/mountinfo").value_or(""));
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

Machine describe_machine(const std::string& path, int device) {
  const platform::Root root("/");
  Machine m;
  if (std::string model = procfs_value(root.read_file("proc/cpuinfo").value_or(""), "model name"); !model.empty())
    m.cpu_model = std::move(model);
  m.cpus = static_cast<unsigned>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  m.memory_bytes = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  // What uname(2) reports as sysname and release: "Linux 6.8.0-45-generic".
  const auto type = root.read_attribute("proc/sys/kernel/ostype");
  const auto release = root.read_attribute("proc/sys/kernel/osrelease");
  if (type && release) m.kernel = *type + " " + *release;
  m.gpu = cuda_device_count() > 0;
  if (m.gpu) m.gpu_name = cuda_device_name(device);
  else m.gpu_reason = cuda_unavailable_reason();
  m.file_system = file_system_type(path);
  describe_device(root, path, m);
  return m;
}

}  // namespace hbmio
