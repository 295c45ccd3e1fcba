// Storage: NVMe controllers (local and fabrics) and, for each PATH, its file system, mount
// options, block device, and whether O_DIRECT really works there.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"
#include "hbmio/file.hpp"
#include "io/cufile_verdict.hpp"
#include "io/engine_internal.hpp"

namespace hbmio::doctor {

namespace {

bool is_controller_name(std::string_view name) {
  // "nvme0" but not "nvme0n1", "nvme0c1n1" or "nvme-subsys0".
  if (!name.starts_with("nvme") || name.size() == 4) return false;
  return name.substr(4).find_first_not_of("0123456789") == std::string_view::npos;
}

bool is_namespace_name(std::string_view name) {
  return name.starts_with("nvme") && name.find('n', 4) != std::string_view::npos && !name.starts_with("nvme-");
}

std::string join(const std::vector<std::string>& items, std::string_view separator = ", ") {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : std::string(separator)) + item;
  return text;
}

}  // namespace

std::vector<NvmeController> find_nvme_controllers(const Root& root, const std::vector<PciDevice>& pci) {
  std::vector<NvmeController> controllers;
  for (const auto& name : root.list("sys/class/nvme")) {
    const std::string dir = "sys/class/nvme/" + name + "/";
    NvmeController controller{.name = name,
                              .transport = root.read_attribute(dir + "transport").value_or(""),
                              .address = root.read_attribute(dir + "address").value_or(""),
                              .subsysnqn = root.read_attribute(dir + "subsysnqn").value_or(""),
                              .state = root.read_attribute(dir + "state").value_or(""),
                              .model = root.read_attribute(dir + "model").value_or("")};
    for (const auto& entry : root.list(dir))
      if (is_namespace_name(entry)) controller.namespaces.push_back(entry);
    if (controller.transport == "pcie" || controller.transport.empty())
      if (const auto real = root.resolve("sys/class/nvme/" + name)) controller.pci = pci_device_above(root, *real);
    controllers.push_back(std::move(controller));
  }
  // Kernels before 4.x (and captures that kept only the PCI tree) have no /sys/class/nvme: the
  // PCI class 0x0108 (mass storage, NVM) still shows each controller.
  for (const auto& device : pci) {
    if (!device.class_code || (*device.class_code >> 8) != 0x0108) continue;
    const bool known = std::any_of(controllers.begin(), controllers.end(),
                                   [&](const NvmeController& c) { return c.pci && c.pci->address == device.address; });
    if (known) continue;
    NvmeController controller{.name = device.address, .transport = "pcie", .address = device.address, .pci = device};
    for (const auto* sub : {"/nvme", "/misc"})
      for (const auto& entry : root.list(device.sysfs_path + sub))
        if (is_controller_name(entry)) controller.name = entry;
    for (const auto& entry : root.list(device.sysfs_path + "/block"))
      if (is_namespace_name(entry)) controller.namespaces.push_back(entry);
    for (const auto& entry : root.list(device.sysfs_path + "/nvme/" + controller.name))
      if (is_namespace_name(entry)) controller.namespaces.push_back(entry);
    controllers.push_back(std::move(controller));
  }
  return controllers;
}

void check_nvme(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  if (inventory.nvme.empty()) {
    out.push_back(make_check("storage.nvme", kGroupStorage, CheckStatus::info,
                             "no NVMe controller (no /sys/class/nvme, no PCI class 0x0108)", "NVMe drives or NVMe-oF namespaces",
                             "GDS reads NVMe (local or over RDMA); other block devices run in compatibility mode"));
  }
  for (const auto& c : inventory.nvme) {
    std::string found = fmt::format("{}: transport {}", c.name, c.transport.empty() ? "unknown" : c.transport);
    if (!c.address.empty()) found += ", address " + c.address;
    if (c.pci && c.pci->address != c.address) found += ", PCI " + c.pci->address;
    if (c.pci && c.pci->numa_node) found += fmt::format(", NUMA node {}", *c.pci->numa_node);
    if (!c.model.empty()) found += ", model " + c.model;
    if (!c.state.empty()) found += ", state " + c.state;
    if (!c.subsysnqn.empty()) found += ", subsystem " + c.subsysnqn;
    if (c.pci && !c.pci->link.current_speed.empty() && c.pci->link.current_width)
      found += fmt::format(", link {} x{}", c.pci->link.current_speed, *c.pci->link.current_width);
    found += c.namespaces.empty() ? ", no namespaces" : ", namespaces " + join(c.namespaces);
    const std::string id = "storage.nvme:" + c.name;

    if (!c.state.empty() && c.state != "live") {
      out.push_back(make_check(id, kGroupStorage, CheckStatus::warn, found, "state live",
                               c.fabrics() ? "check the fabric path: nvme list-subsys; nvme connect again if it stays down"
                                           : "check the drive: nvme list; dmesg | grep nvme"));
    } else if (c.transport == "tcp") {
      out.push_back(make_check(id, kGroupStorage, CheckStatus::warn, found, "transport rdma",
                               "GDS moves NVMe-oF data by RDMA; over tcp cuFile runs in compatibility mode: "
                               "connect with nvme connect -t rdma where the target offers it"));
    } else if (c.transport == "pcie" || c.transport == "rdma") {
      out.push_back(make_check(id, kGroupStorage, CheckStatus::pass, found));
    } else {
      out.push_back(make_check(id, kGroupStorage, CheckStatus::info, found, "transport pcie or rdma",
                               "GDS supports local NVMe (pcie) and NVMe-oF over rdma"));
    }
  }
  if (root.exists("sys/class/nvme-fabrics/ctl"))
    out.push_back(make_check("storage.nvme_fabrics", kGroupStorage, CheckStatus::info,
                             "/sys/class/nvme-fabrics/ctl present: the nvme-fabrics module is loaded"));
}

std::optional<Mount> find_mount(const std::string& mountinfo, const std::string& path) {
  // mountinfo(5): id parent major:minor root mount-point options [optional...] - fstype source super-options
  const auto unescape = [](std::string text) {
    for (std::size_t at; (at = text.find('\\')) != std::string::npos && at + 3 < text.size();) {
      const char c = static_cast<char>(std::strtol(text.substr(at + 1, 3).c_str(), nullptr, 8));
      text.replace(at, 4, 1, c);
    }
    return text;
  };
  const auto covers = [](const std::string& mount_point, const std::string& p) {
    if (mount_point == "/") return true;
    return p == mount_point || (p.starts_with(mount_point) && p[mount_point.size()] == '/');
  };
  std::optional<Mount> best;
  std::istringstream lines(mountinfo);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string id, parent, device, mount_root, mount_point, options, field;
    if (!(fields >> id >> parent >> device >> mount_root >> mount_point >> options)) continue;
    while (fields >> field && field != "-") {
    }
    Mount mount{.mount_point = unescape(mount_point), .options = options};
    if (!(fields >> mount.fs_type >> mount.source)) continue;
    fields >> mount.super_options;
    if (std::sscanf(device.c_str(), "%u:%u", &mount.major, &mount.minor) != 2) continue;
    // The last matching mount wins among equals: later mounts hide earlier ones.
    if (covers(mount.mount_point, path) && (!best || mount.mount_point.size() >= best->mount_point.size())) best = mount;
  }
  return best;
}

namespace {

// The whole disk behind a block device number and what kind it is, following md/dm members.
void describe_block_device(const Root& root, const Inventory& inventory, unsigned major, unsigned minor, PathFacts& facts,
                           std::vector<Check>& out) {
  const std::string id = "storage.block_device:" + facts.path;
  if (major == 0) {
    facts.block_kind = "none";
    out.push_back(make_check(id, kGroupStorage, CheckStatus::info,
                             fmt::format("no block device ({}: memory or network file system)", facts.fs_type),
                             "a file system on NVMe", "GDS reads files on NVMe-backed ext4/xfs (or its supported network file systems)"));
    return;
  }
  auto real = root.resolve(fmt::format("sys/dev/block/{}:{}", major, minor));
  if (!real) {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::info, fmt::format("block device {}:{} not in sysfs", major, minor)));
    return;
  }
  if (root.exists(*real + "/partition")) real = parent_of(*real);  // nvme0n1p2 -> nvme0n1
  facts.block_device = name_of(*real);
  const std::string& disk = facts.block_device;

  // Controllers behind an NVMe namespace: its parent (nvme/nvme0/nvme0n1) or, with native
  // multipath, every controller of its subsystem (nvme-subsystem/nvme-subsys0/nvme0n1).
  const auto controllers_of = [&](const std::string& disk_path) {
    std::vector<std::string> names;
    const std::string parent = parent_of(disk_path);
    if (name_of(parent).starts_with("nvme-subsys")) {
      for (const auto& entry : root.list(parent))
        if (is_controller_name(entry)) names.push_back(entry);
    } else if (is_controller_name(name_of(parent))) {
      names.push_back(name_of(parent));
    }
    return names;
  };

  std::string detail;
  if (root.list(*real + "/slaves").empty()) facts.disks.push_back(*real);
  if (disk.starts_with("nvme")) {
    facts.block_kind = "NVMe";
    facts.nvme_controllers = controllers_of(*real);
  } else if (disk.starts_with("vd")) {
    facts.block_kind = "virtio-blk";
  } else if (disk.starts_with("loop")) {
    facts.block_kind = "loop";
    detail = "backing file " + root.read_attribute(*real + "/loop/backing_file").value_or("unknown");
  } else if (disk.starts_with("md") || disk.starts_with("dm-")) {
    facts.block_kind = disk.starts_with("md") ? "md RAID" : "device-mapper";
    // What a stacked device is: md's level, device-mapper's target from its uuid prefix.
    const auto describe = [&](const std::string& dir, const std::string& name) {
      if (name.starts_with("md")) {
        const std::string level = root.read_attribute(dir + "/md/level").value_or("");
        if (facts.md_level.empty()) facts.md_level = level;
        return level.empty() ? name : fmt::format("{} ({})", name, level);
      }
      const std::string uuid = root.read_attribute(dir + "/dm/uuid").value_or("");
      const std::string kind = uuid.starts_with("LVM-") ? "LVM" : uuid.starts_with("CRYPT-") ? "dm-crypt" : uuid.starts_with("mpath-") ? "dm-multipath" : "device-mapper";
      if (facts.dm_kind.empty()) facts.dm_kind = kind;
      const std::string dm_name = root.read_attribute(dir + "/dm/name").value_or("");
      return fmt::format("{} ({}{}{})", name, kind, dm_name.empty() ? "" : " ", dm_name);
    };
    if (disk.starts_with("md")) {
      detail = root.read_attribute(*real + "/md/level").value_or("");
    } else {
      const std::string text = describe(*real, disk);  // "dm-0 (LVM vg0-data)": the part in brackets
      detail = text.substr(disk.size() + 2, text.size() - disk.size() - 3);
    }
    std::vector<std::string> members;
    // The stack, level by level, down to the disks (dm over md over NVMe); a few levels at most.
    std::vector<std::string> level{*real}, layer_text{describe(*real, disk)};
    bool all_nvme = true, any_disk = false;
    for (int depth = 0; depth < 4 && !level.empty(); ++depth) {
      std::vector<std::string> next, names;
      for (const auto& dir : level)
        for (const auto& slave : root.list(dir + "/slaves")) {
          if (depth == 0) members.push_back(slave);
          auto member = root.resolve(dir + "/slaves/" + slave);
          if (!member) continue;
          if (root.exists(*member + "/partition")) member = parent_of(*member);
          const std::string name = name_of(*member);
          if (!root.list(*member + "/slaves").empty()) {
            next.push_back(*member);
            names.push_back(describe(*member, name));
          } else {
            any_disk = true;
            all_nvme = all_nvme && name.starts_with("nvme");
            facts.disks.push_back(*member);
            names.push_back(name);
            for (auto& c : controllers_of(*member)) facts.nvme_controllers.push_back(std::move(c));
          }
        }
      if (!names.empty()) layer_text.push_back(join(names));
      level = std::move(next);
    }
    facts.all_members_nvme = any_disk && all_nvme;
    facts.layers = join(layer_text, " > ");
    detail += (detail.empty() ? "" : ", ") + std::string("members ") + (members.empty() ? "unknown" : join(members));
  } else if (disk.starts_with("sd")) {
    facts.block_kind = "SCSI/SATA";
  } else {
    facts.block_kind = "other";
  }
  if (facts.block_kind == "NVMe" || facts.block_kind == "md RAID" || facts.block_kind == "device-mapper")
    for (const auto& name : facts.nvme_controllers)
      for (const auto& c : inventory.nvme)
        if (c.name == name) detail += fmt::format("{}controller {} ({})", detail.empty() ? "" : ", ", name, c.transport);

  const std::string found = fmt::format("{} ({}{}{})", disk, facts.block_kind, detail.empty() ? "" : ", ", detail);
  if (facts.block_kind == "NVMe") {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::pass, found));
  } else if (!facts.nvme_controllers.empty()) {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::info, found, "NVMe",
                             "GDS supports md RAID 0 over NVMe; other layouts run in compatibility mode"));
  } else {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::info, found, "NVMe (local, or NVMe-oF over RDMA)",
                             "cuFile can move data by DMA only from NVMe; here it would use compatibility mode"));
  }
}

// How many requests the block layer queues per NVMe disk under the PATH: queue/nr_requests, with
// the I/O scheduler that set it and the hardware queues. NVIDIA's gds-diag asks for 1024 or more;
// the nvme driver keeps one tag of each hardware queue back, so its full default depth
// (io_queue_depth 1024) reads 1023, which counts as full here.
void check_queue_depth(const Root& root, const PathFacts& facts, std::vector<Check>& out) {
  constexpr long long kWanted = 1023;
  std::vector<std::string> parts, low, unknown;
  for (const auto& disk : facts.disks) {
    const std::string name = name_of(disk);
    if (!name.starts_with("nvme")) continue;
    const auto requests = root.read_integer(disk + "/queue/nr_requests");
    // "[none] mq-deadline": the bracketed one is in use.
    const std::string schedulers = root.read_attribute(disk + "/queue/scheduler").value_or("");
    std::string scheduler;
    if (const auto open = schedulers.find('['); open != std::string::npos)
      scheduler = schedulers.substr(open + 1, schedulers.find(']', open) - open - 1);
    const auto hardware_queues = root.list(disk + "/mq").size();
    if (!requests) {
      unknown.push_back(name);
      parts.push_back(name + ": nr_requests unreadable");
      continue;
    }
    std::string part = fmt::format("{}: nr_requests {}", name, *requests);
    if (!scheduler.empty()) part += ", scheduler " + scheduler;
    if (hardware_queues > 0) part += fmt::format(", {} hardware queues", hardware_queues);
    parts.push_back(part);
    if (*requests < kWanted) low.push_back(name);
  }
  if (parts.empty()) return;  // no NVMe below this PATH: nothing of cuFile's to queue
  const std::string id = "storage.queue_depth:" + facts.path;
  std::string found;
  for (const auto& p : parts) found += (found.empty() ? "" : "; ") + p;
  found += " (/sys/block/<disk>/queue/nr_requests)";
  if (!low.empty()) {
    std::string fix;
    for (const auto& name : low)
      fix += fmt::format("{}echo none > /sys/block/{}/queue/scheduler; echo 1023 > /sys/block/{}/queue/nr_requests", fix.empty() ? "" : "; ", name, name);
    fix += " (as root; a scheduler such as mq-deadline caps the queue lower; keep it across boots with a udev rule: "
           "ACTION==\"add|change\", KERNEL==\"nvme*n*\", ATTR{queue/scheduler}=\"none\", ATTR{queue/nr_requests}=\"1023\")";
    out.push_back(make_check(id, kGroupStorage, CheckStatus::warn, found + ": a shorter queue than NVIDIA's gds-diag asks for (1024)",
                             "nr_requests of 1023 or more (the nvme driver's full queue)", fix));
  } else if (!unknown.empty()) {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::info, found));
  } else {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::pass, found));
  }
}

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// Opens `file` with O_DIRECT and reads its first 4 KiB into 4 KiB-aligned memory: the only way to
// know that O_DIRECT works is to do it (some FUSE file systems accept the flag and fail the read).
std::string try_direct_read(const std::string& file, int& error) {
  // O_NONBLOCK: a FIFO's open would wait for a writer (it is refused below, as any non-file is).
  const int fd = ::open(file.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    error = errno;
    return fmt::format("open with O_DIRECT: {}", std::strerror(error));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    error = EINVAL;
    ::close(fd);
    return "not a regular file: nothing to read with O_DIRECT";
  }
  std::unique_ptr<void, FreeDeleter> buffer(std::aligned_alloc(4096, 4096));
  ssize_t got;
  do got = ::pread(fd, buffer.get(), 4096, 0); while (got < 0 && errno == EINTR);
  error = got < 0 ? errno : 0;
  ::close(fd);
  if (got < 0) return fmt::format("aligned 4 KiB pread with O_DIRECT: {}", std::strerror(error));
  return fmt::format("aligned 4 KiB pread with O_DIRECT returned {} bytes", got);
}

// A 4 KiB file made in `directory` for the trials, removed again by the destructor.
class ProbeFile {
 public:
  explicit ProbeFile(const std::string& directory) {
    std::string name = directory + "/.hbmio-doctor-XXXXXX";
    const int fd = ::mkstemp(name.data());
    if (fd < 0) {
      error_ = fmt::format("cannot create a probe file in {}: {}", directory, std::strerror(errno));
      return;
    }
    const std::string block(4096, 'h');
    const bool written = ::write(fd, block.data(), block.size()) == static_cast<ssize_t>(block.size());
    const int write_errno = errno;
    ::close(fd);
    path_ = name;
    if (!written) error_ = fmt::format("cannot write the probe file {}: {}", name, std::strerror(write_errno));
  }
  ~ProbeFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  ProbeFile(const ProbeFile&) = delete;
  ProbeFile& operator=(const ProbeFile&) = delete;
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_, error_;
};

// A regular file of at least one block directly in `directory`, or "" (for a directory the
// probe file cannot be created in).
std::string a_file_in(const std::string& directory) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec))
    if (entry.is_regular_file(ec) && entry.file_size(ec) >= 4096) return entry.path().string();
  return {};
}

void check_direct_io_and_cufile(const std::string& path, bool is_directory, PathFacts& facts, std::vector<Check>& out) {
  const std::string id = "storage.o_direct:" + path;
  std::unique_ptr<ProbeFile> probe;
  std::string target = path;
  if (is_directory) {
    probe = std::make_unique<ProbeFile>(path);
    if (probe->error().empty()) {
      target = probe->path();
    } else if (const std::string existing = a_file_in(path); !existing.empty()) {
      target = existing;  // read-only directory (a mounted dataset): an O_DIRECT read of a file there tells the same
    } else {
      out.push_back(make_check(id, kGroupStorage, CheckStatus::info, probe->error() + ", and it holds no file to read instead",
                               "a writable directory, or name a file in it", "give a file on the same file system: hbmio doctor FILE"));
      return;
    }
  }
  int error = 0;
  const std::string trial = try_direct_read(target, error);
  facts.direct_io_tried = true;
  facts.direct_io_works = error == 0;

  std::string alignment = "statx DIOALIGN not checked";
  try {
    const File file = File::open(target, OpenMode::read);
    const DirectIoInfo& info = file.direct_io();
    alignment = info.supported ? fmt::format("statx DIOALIGN: memory {} B, offset {} B", info.memory_alignment, info.offset_alignment)
                               : "statx/O_DIRECT: " + info.reason;
    const detail::CufileVerdict verdict = detail::cufile_verdict(file);
    facts.verdict_tried = true;
    facts.cufile_usable = verdict.usable;
    facts.cufile_direct = verdict.direct;
    facts.cufile_mode = verdict.mode;
    facts.cufile_reason = verdict.reason;
    // auto's decision from the same answer, not a second registration with cuFile: where sysfs
    // rules DMA out, auto does not ask cuFile, so its verdict is that ruling.
    detail::CufileVerdict auto_verdict;
    if (std::optional<std::string> why = detail::cufile_dma_ruled_out(file)) auto_verdict.reason = *why + " (cuFile not asked)";
    else auto_verdict = verdict;
    const detail::AutoChoice choice = detail::choose_auto(auto_verdict, detail::probe_uring());
    facts.auto_backend = choice.backend;
    facts.auto_passed_over = choice.passed_over;
  } catch (const std::exception& e) {
    alignment = e.what();
    facts.cufile_reason = e.what();
  }
  std::string on;  // what was read, when a directory was given
  if (is_directory)
    on = probe->error().empty() ? " (on a probe file, removed again)" : fmt::format(" (on {}: the directory is read-only)", target);
  const std::string found = fmt::format("{}{}; {}", trial, on, alignment);
  if (facts.direct_io_works) {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::pass, found));
  } else if (error == EINVAL || error == EOPNOTSUPP) {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::warn, found, "O_DIRECT reads",
                             fmt::format("{} refuses O_DIRECT: reads go through the page cache and GDS cannot run; "
                                         "put the data on ext4 or xfs", facts.fs_type)));
  } else {
    out.push_back(make_check(id, kGroupStorage, CheckStatus::fail, found, "O_DIRECT reads",
                             "the read failed: check the device (dmesg) and the file's permissions"));
  }
}

}  // namespace

PathFacts check_path(const Root& root, const Inventory& inventory, const std::string& path, std::vector<Check>& out) {
  PathFacts facts{.path = path};
  const std::string path_id = "storage.path:" + path;

  std::optional<Mount> mount;
  unsigned major = 0, minor = 0;
  bool have_device = false, is_directory = false;
  std::string lookup = path;  // what to look for in mountinfo
  if (root.is_live()) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      out.push_back(make_check(path_id, kGroupStorage, CheckStatus::fail, fmt::format("cannot stat {}: {}", path, std::strerror(errno)),
                               "an existing, readable file or directory", "check the path and its permissions"));
      return facts;
    }
    if (::access(path.c_str(), R_OK) != 0) {
      out.push_back(make_check(path_id, kGroupStorage, CheckStatus::fail, fmt::format("cannot read {}: {}", path, std::strerror(errno)),
                               "a readable file or directory", "check the permissions of the path"));
      return facts;
    }
    facts.exists = true;
    is_directory = S_ISDIR(st.st_mode);
    major = ::major(st.st_dev);
    minor = ::minor(st.st_dev);
    have_device = true;
    if (char* real = ::realpath(path.c_str(), nullptr)) {
      lookup = real;
      std::free(real);
    }
    facts.fs_type = file_system_type(path);
  } else {
    facts.exists = root.exists(path);
  }

  const auto mountinfo = root.read_file("proc/self/mountinfo");
  if (mountinfo) mount = find_mount(*mountinfo, lookup.starts_with('/') ? lookup : "/" + lookup);
  if (mount) {
    facts.mount_point = mount->mount_point;
    facts.mount_options = mount->options;
    if (facts.fs_type.empty() || facts.fs_type.starts_with("unknown")) facts.fs_type = mount->fs_type;  // wekafs: no magic known
    if (!have_device) {
      major = mount->major;
      minor = mount->minor;
      have_device = true;
    }
  }
  if (!root.is_live() && !mount) {
    out.push_back(make_check(path_id, kGroupStorage, CheckStatus::info,
                             fmt::format("{}: no proc/self/mountinfo entry in this tree", path), "",
                             "record /proc/self/mountinfo with the tree to judge paths"));
    return facts;
  }

  const std::string super = mount ? mount->super_options : "";
  facts.super_options = super;
  std::string found = fmt::format("{} on {}", facts.fs_type.empty() ? "unknown file system" : facts.fs_type,
                                  facts.mount_point.empty() ? "unknown mount point" : facts.mount_point);
  if (mount) found += fmt::format(" ({}, {}; source {})", mount->options, super, mount->source);
  const bool gds_file_system = facts.fs_type == "ext4" || facts.fs_type == "xfs";
  if (super.find("data=journal") != std::string::npos) {
    out.push_back(make_check("storage.filesystem:" + path, kGroupStorage, CheckStatus::warn, found, "ext4 data=ordered",
                             "GDS does not support ext4 data=journal: remount with data=ordered"));
  } else if (gds_file_system) {
    out.push_back(make_check("storage.filesystem:" + path, kGroupStorage, CheckStatus::pass, found));
  } else {
    out.push_back(make_check("storage.filesystem:" + path, kGroupStorage, CheckStatus::info, found,
                             "ext4 or xfs (or a network file system with a GDS client: NFS, Lustre, WekaFS, GPFS, BeeGFS)",
                             "GDS's local file systems are ext4 and xfs"));
  }
  if (have_device) describe_block_device(root, inventory, major, minor, facts, out);
  check_queue_depth(root, facts, out);

  if (!root.is_live()) {
    out.push_back(make_check("storage.o_direct:" + path, kGroupStorage, CheckStatus::info, kSkippedForRoot));
    return facts;
  }
  check_direct_io_and_cufile(path, is_directory, facts, out);
  return facts;
}

}  // namespace hbmio::doctor
