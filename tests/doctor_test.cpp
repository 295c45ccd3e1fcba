// hbmio doctor: recorded sysfs trees from real machines (../shared/fixtures/sysfs, and the
// project's own in tests/data/doctor, made by scripts/capture-sysfs.sh), trees built
// here for what no capture has (NVMe-oF rdma, GPU + NVMe + NIC under one switch, ACS, IOMMU,
// nvidia-fs, cufile.json), malformed trees, and the live machine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"
#include "hbmio/doctor.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/memory.hpp"

namespace fs = std::filesystem;
using hbmio::Check;
using hbmio::CheckStatus;
using namespace hbmio::doctor;

namespace {

fs::path test_dir() {
  const char* dir = std::getenv("HBMIO_TEST_DIR");
  return dir && *dir ? fs::path(dir) : fs::temp_directory_path();
}

const Check* find_check(const std::vector<Check>& checks, const std::string& id) {
  for (const auto& c : checks)
    if (c.id == id) return &c;
  return nullptr;
}

std::string dump(const std::vector<Check>& checks) {
  std::string text;
  for (const auto& c : checks) text += fmt::format("{} {} | {}\n", hbmio::to_string(c.status), c.id, c.found);
  return text;
}

// The recorded tree in the archive `source`, unpacked once per test run into the build
// directory under `name`. Returns the directory holding sys/ and proc/ (hwloc archives add a top
// directory), or an empty path with `why` set when it cannot be unpacked.
fs::path unpack_archive(const fs::path& source, const std::string& name, std::string& why) {
  static std::mutex mutex;
  static std::map<std::string, fs::path> unpacked;
  std::lock_guard lock(mutex);
  if (auto it = unpacked.find(source.string()); it != unpacked.end()) return it->second;
  if (!fs::exists(source)) {
    why = source.string() + " not found";
    return {};
  }
  fs::path into = test_dir() / "doctor-fixtures" / name;
  fs::remove_all(into);
  fs::create_directories(into);
  const std::string command = fmt::format("tar -xf '{}' -C '{}' 2>/dev/null", source.string(), into.string());
  if (std::system(command.c_str()) != 0 && !fs::exists(into / "sys")) {
    // Some archives carry entries tar warns about (hard links, odd modes); only an empty result is fatal.
    bool any = false;
    for (const auto& e : fs::directory_iterator(into)) any = any || e.exists();
    if (!any) {
      why = "cannot unpack " + source.string();
      return {};
    }
  }
  fs::path root = into;
  if (!fs::exists(root / "sys")) {
    for (const auto& entry : fs::directory_iterator(into))
      if (entry.is_directory() && fs::exists(entry.path() / "sys")) root = entry.path();
  }
  unpacked[source.string()] = root;
  return root;
}

// A capture from ../shared/fixtures/sysfs (`archive` relative to it); missing: `why` says so.
fs::path unpack_fixture(const std::string& archive, std::string& why) {
  const fs::path source = fs::path(HBMIO_FIXTURES) / "sysfs" / archive;
  if (!fs::exists(source)) {
    why = "fixture " + source.string() + " not found (set -DHBMIO_FIXTURES)";
    return {};
  }
  return unpack_archive(source, fs::path(archive).stem().stem().string(), why);
}

#define FIXTURE_ROOT(var, archive)                   \
  std::string var##_why;                             \
  const fs::path var = unpack_fixture(archive, var##_why); \
  if (var.empty()) GTEST_SKIP() << var##_why

// A tree written by a test, removed afterwards.
class Tree {
 public:
  Tree() {
    static int counter = 0;
    path_ = test_dir() / fmt::format("doctor-tree-{}-{}", ::getpid(), counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~Tree() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  void write(const std::string& relative, const std::string& content) const {
    fs::create_directories((path_ / relative).parent_path());
    std::ofstream(path_ / relative, std::ios::binary) << content;
  }
  void mkdir(const std::string& relative) const { fs::create_directories(path_ / relative); }
  void link(const std::string& relative, const std::string& target) const {
    fs::create_directories((path_ / relative).parent_path());
    fs::create_directory_symlink(target, path_ / relative);
  }
  // A PCI function at sys/devices/<device_path> with its /sys/bus/pci/devices link.
  void pci(const std::string& device_path, const std::string& vendor, const std::string& device, const std::string& class_code,
           int numa_node) const {
    const std::string dir = "sys/devices/" + device_path + "/";
    write(dir + "vendor", vendor + "\n");
    write(dir + "device", device + "\n");
    write(dir + "class", class_code + "\n");
    write(dir + "numa_node", std::to_string(numa_node) + "\n");
    const std::string address = fs::path(device_path).filename().string();
    link("sys/bus/pci/devices/" + address, "../../../devices/" + device_path);
  }
  void link_attributes(const std::string& device_path, const std::string& speed, int width) const {
    const std::string dir = "sys/devices/" + device_path + "/";
    write(dir + "current_link_speed", speed + "\n");
    write(dir + "max_link_speed", speed + "\n");
    write(dir + "current_link_width", std::to_string(width) + "\n");
    write(dir + "max_link_width", std::to_string(width) + "\n");
  }

 private:
  fs::path path_;
};

// Config space with one extended capability list: AER (id 1) at 0x100 -> `acs` at 0x140 (when
// given) with its control register.
std::string config_space(std::optional<unsigned> acs_control) {
  std::string config(4096, '\0');
  const auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) config[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  };
  put32(0x100, 0x0001u | (1u << 16) | ((acs_control ? 0x140u : 0u) << 20));
  if (acs_control) {
    put32(0x140, 0x000du | (1u << 16));
    put32(0x144, 0x005fu | (*acs_control << 16));
  }
  return config;
}

constexpr const char* kSwitch = "pci0000:00/0000:00:01.0/0000:01:00.0";  // root port -> switch upstream port
const std::string kGpuPath = std::string(kSwitch) + "/0000:02:00.0/0000:03:00.0";
const std::string kNvmePath = std::string(kSwitch) + "/0000:02:01.0/0000:04:00.0";
const std::string kNicPath = std::string(kSwitch) + "/0000:02:02.0/0000:05:00.0";
const std::string kRemoteNvmePath = "pci0000:80/0000:80:01.0/0000:81:00.0";

// A GDS-over-NVMe-oF server as the article describes it: GPU, NVMe and ConnectX under one PCIe
// switch, a second NVMe on the other socket, an NVMe-oF rdma controller, IOMMU pass-through,
// nvidia-fs and MOFED loaded, cufile.json with comments. ACS is on at the GPU's downstream port.
void build_gds_server(const Tree& t) {
  t.pci("pci0000:00/0000:00:01.0", "0x8086", "0x2030", "0x060400", 0);
  t.pci(kSwitch, "0x10b5", "0x9797", "0x060400", 0);
  t.write("sys/devices/" + std::string(kSwitch) + "/config", config_space(std::nullopt));
  for (const char* port : {"0000:02:00.0", "0000:02:01.0", "0000:02:02.0"})
    t.pci(std::string(kSwitch) + "/" + port, "0x10b5", "0x9797", "0x060400", 0);
  t.write("sys/devices/" + std::string(kSwitch) + "/0000:02:00.0/config", config_space(0x001d));  // SV + RR + CR + UF
  t.write("sys/devices/" + std::string(kSwitch) + "/0000:02:01.0/config", config_space(0x0000));
  t.write("sys/devices/" + std::string(kSwitch) + "/0000:02:02.0/config", std::string(64, '\0'));  // as a non-root user sees it

  t.pci(kGpuPath, "0x10de", "0x2335", "0x030200", 0);
  t.link_attributes(kGpuPath, "32.0 GT/s PCIe", 16);
  t.write("sys/devices/" + kGpuPath + "/resource",
          "0x00000000fa000000 0x00000000faffffff 0x0000000000040200\n"
          "0x0000038000000000 0x00000387ffffffff 0x000000000014220c\n");
  t.mkdir("sys/bus/pci/drivers/nvidia");
  t.link("sys/devices/" + kGpuPath + "/driver", "../../../../../../bus/pci/drivers/nvidia");
  t.write("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05\n");

  t.pci(kNvmePath, "0x144d", "0xa824", "0x010802", 0);
  t.link_attributes(kNvmePath, "16.0 GT/s PCIe", 4);
  t.pci(kNicPath, "0x15b3", "0x101d", "0x020700", 0);
  t.pci("pci0000:80/0000:80:01.0", "0x8086", "0x2030", "0x060400", 1);
  t.pci(kRemoteNvmePath, "0x144d", "0xa824", "0x010802", 1);

  const auto controller = [&](const std::string& name, const std::string& dir, const std::string& transport, const std::string& address) {
    t.write(dir + "/transport", transport + "\n");
    t.write(dir + "/address", address + "\n");
    t.write(dir + "/state", "live\n");
    t.write(dir + "/model", "Test Drive\n");
    t.write(dir + "/subsysnqn", "nqn.2024-01.test:" + name + "\n");
    t.mkdir(dir + "/" + name + "n1");
    t.link("sys/class/nvme/" + name, "../../" + dir.substr(4));
  };
  controller("nvme0", "sys/devices/" + kNvmePath + "/nvme/nvme0", "pcie", "0000:04:00.0");
  controller("nvme1", "sys/devices/" + kRemoteNvmePath + "/nvme/nvme1", "pcie", "0000:81:00.0");
  controller("nvme2", "sys/devices/virtual/nvme-fabrics/ctl/nvme2", "rdma", "traddr=192.168.10.5,trsvcid=4420,src_addr=192.168.10.2");
  t.mkdir("sys/class/nvme-fabrics/ctl");
  // /data lives on partition 1 of nvme0n1.
  t.write("sys/devices/" + kNvmePath + "/nvme/nvme0/nvme0n1/nvme0n1p1/partition", "1\n");
  t.link("sys/dev/block/259:1", "../../devices/" + kNvmePath + "/nvme/nvme0/nvme0n1/nvme0n1p1");
  t.write("proc/self/mountinfo",
          "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
          "25 22 259:1 / /data rw,noatime shared:2 - ext4 /dev/nvme0n1p1 rw,data=ordered\n");

  const std::string ib = "sys/devices/" + kNicPath + "/infiniband/mlx5_0";
  t.write(ib + "/ports/1/state", "4: ACTIVE\n");
  t.write(ib + "/ports/1/rate", "200 Gb/sec (4X HDR)\n");
  t.write(ib + "/ports/1/link_layer", "InfiniBand\n");
  t.link("sys/class/infiniband/mlx5_0", "../../devices/" + kNicPath + "/infiniband/mlx5_0");

  t.write("proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/vda intel_iommu=on iommu=pt quiet\n");
  t.mkdir("sys/kernel/iommu_groups/0");
  t.mkdir("sys/kernel/iommu_groups/1");
  t.write("proc/driver/nvidia-fs/version", "version: 2.26\n");
  t.write("proc/kallsyms", "ffffffff81000000 T _text\nffffffff82345678 d p2pdma_pgmap_ops\n");
  t.mkdir("run/udev/data");
  t.write("sys/module/nvidia_fs/version", "2.26.6\n");
  t.mkdir("sys/module/nvidia_peermem");
  t.mkdir("sys/module/nvme_rdma");
  t.mkdir("sys/module/nvme_fabrics");
  t.mkdir("sys/module/ib_core");
  t.mkdir("sys/module/mlx5_ib");
  t.mkdir("sys/module/mlx_compat");
  t.write("sys/module/mlx5_core/version", "24.10-1.1.4\n");
  t.write("etc/cufile.json",
          "// cufile.json as nvidia-gds ships it: comments allowed\n"
          "{\n"
          "  \"logging\": { \"dir\": \"http://not-a-comment//here\" }, // trailing comment\n"
          "  \"properties\": {\n"
          "    // \"allow_compat_mode\": false,\n"
          "    \"allow_compat_mode\": true,\n"
          "    \"use_pci_p2pdma\": false,\n"
          "    \"rdma_dev_addr_list\": [\"192.168.10.2\"]\n"
          "  }\n"
          "}\n");
}

PciDevice device_at(const std::string& path, std::optional<int> numa = 0) {
  return PciDevice{.address = fs::path(path).filename().string(), .sysfs_path = "sys/devices/" + path, .numa_node = numa};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Classification, like nvidia-smi topo
// ---------------------------------------------------------------------------------------------

TEST(DoctorTopology, ClassifiesPathsLikeNvidiaSmiTopo) {
  const auto gpu = device_at(kGpuPath);
  EXPECT_EQ(classify_pci_path(gpu, gpu), PciPathType::same);
  EXPECT_EQ(classify_pci_path(gpu, device_at(kNvmePath)), PciPathType::pix);  // one switch
  EXPECT_EQ(classify_pci_path(gpu, device_at(kNicPath)), PciPathType::pix);
  // A switch below the switch: two switches, no host bridge crossed.
  EXPECT_EQ(classify_pci_path(gpu, device_at(std::string(kSwitch) + "/0000:02:03.0/0000:06:00.0/0000:07:00.0/0000:08:00.0")),
            PciPathType::pxb);
  // Another root port of the same host bridge.
  EXPECT_EQ(classify_pci_path(gpu, device_at("pci0000:00/0000:00:02.0/0000:09:00.0")), PciPathType::phb);
  // Another host bridge, same socket; then the other socket.
  EXPECT_EQ(classify_pci_path(gpu, device_at("pci0000:40/0000:40:01.0/0000:41:00.0", 0)), PciPathType::node);
  EXPECT_EQ(classify_pci_path(gpu, device_at(kRemoteNvmePath, 1)), PciPathType::sys);
  // numa_node -1 everywhere (single-socket machines and VMs): not "across sockets".
  EXPECT_EQ(classify_pci_path(device_at(kGpuPath, std::nullopt), device_at(kRemoteNvmePath, std::nullopt)), PciPathType::node);
  // A tree without /sys/devices positions (plain directories under /sys/bus/pci/devices).
  EXPECT_EQ(classify_pci_path(PciDevice{.address = "0004:05:00.0", .sysfs_path = "sys/bus/pci/devices/0004:05:00.0"}, gpu),
            PciPathType::unknown);
  EXPECT_EQ(bridges_between(gpu, device_at(kNvmePath)), (std::vector<std::string>{"0000:01:00.0", "0000:02:00.0", "0000:02:01.0"}));
}

TEST(DoctorTopology, ParsesPciAddressesAndLinkRates) {
  EXPECT_TRUE(is_pci_address("0000:06:00.0"));
  EXPECT_TRUE(is_pci_address("10000:00:04.0"));  // 32-bit domain
  EXPECT_FALSE(is_pci_address("0000:06:00.8"));
  EXPECT_FALSE(is_pci_address("virtio1"));
  EXPECT_EQ(host_bridge_of("sys/devices/pci10000:00/10000:00:04.0/virtio2/block/vda"), "pci10000:00");
  EXPECT_EQ(pci_chain_of("sys/devices/pci0000:00/0000:00:02.0/virtio1/block/vda"), std::vector<std::string>{"0000:00:02.0"});
  EXPECT_NEAR(*pcie_gigabytes_per_second("16.0 GT/s PCIe", 4), 7.88, 0.01);
  EXPECT_NEAR(*pcie_gigabytes_per_second("2.5 GT/s", 1), 0.25, 0.001);
  EXPECT_FALSE(pcie_gigabytes_per_second("Unknown", 16));
  EXPECT_FALSE(pcie_gigabytes_per_second("8 GT/s", 0));
}

TEST(DoctorTopology, AcsFromConfigSpace) {
  EXPECT_EQ(parse_acs(config_space(0x001d)).kind, AcsState::Kind::enabled);
  EXPECT_EQ(parse_acs(config_space(0x001d)).control, 0x001du);
  EXPECT_EQ(parse_acs(config_space(0x0011)).kind, AcsState::Kind::disabled);  // SV + UF: no P2P redirect
  EXPECT_EQ(parse_acs(config_space(std::nullopt)).kind, AcsState::Kind::not_capable);
  EXPECT_EQ(parse_acs(std::string(64, '\0')).kind, AcsState::Kind::unreadable);
  EXPECT_EQ(parse_acs("").kind, AcsState::Kind::unreadable);
  // Garbage: a next pointer that loops back, and all ones.
  std::string looping(4096, '\0');
  looping[0x100] = 0x01;
  looping[0x102] = 0x00;
  looping[0x103] = 0x10;  // next = 0x100
  EXPECT_EQ(parse_acs(looping).kind, AcsState::Kind::not_capable);
  EXPECT_EQ(parse_acs(std::string(4096, '\xff')).kind, AcsState::Kind::not_capable);
}

// ---------------------------------------------------------------------------------------------
// A constructed GDS server
// ---------------------------------------------------------------------------------------------

TEST(DoctorConstructed, GdsServerWithNvmeOfAndOneSwitch) {
  Tree tree;
  build_gds_server(tree);
  // HBMIO_DOCTOR_KEEP_TREE=DIR keeps a copy, for `hbmio doctor --root DIR` by hand (the README's
  // NVMe-oF example is this tree).
  if (const char* keep = std::getenv("HBMIO_DOCTOR_KEEP_TREE"); keep && *keep)
    fs::copy(tree.path(), keep, fs::copy_options::recursive | fs::copy_options::copy_symlinks | fs::copy_options::overwrite_existing);
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  SCOPED_TRACE(dump(checks));
  const auto expect = [&](const std::string& id, CheckStatus status, const std::string& needle) {
    const Check* c = find_check(checks, id);
    ASSERT_NE(c, nullptr) << id;
    EXPECT_EQ(c->status, status) << id << ": " << c->found;
    EXPECT_NE(c->found.find(needle), std::string::npos) << id << ": " << c->found;
  };
  expect("gpu.device:0000:03:00.0", CheckStatus::pass, "BAR1 32 GiB");
  expect("gpu.device:0000:03:00.0", CheckStatus::pass, "driver nvidia");
  expect("gpu.link:0000:03:00.0", CheckStatus::pass, "32.0 GT/s PCIe x16");
  expect("gpu.driver", CheckStatus::pass, "580.95.05");
  expect("gpu.cuda", CheckStatus::info, "skipped: --root given");
  expect("storage.nvme:nvme0", CheckStatus::pass, "transport pcie");
  expect("storage.nvme:nvme2", CheckStatus::pass, "transport rdma, address traddr=192.168.10.5,trsvcid=4420");
  expect("storage.filesystem:/data", CheckStatus::pass, "ext4 on /data");
  expect("storage.block_device:/data", CheckStatus::pass, "nvme0n1 (NVMe, controller nvme0 (pcie))");
  expect("storage.o_direct:/data", CheckStatus::info, "skipped");
  expect("fabric.rdma:mlx5_0", CheckStatus::pass, "at 0000:05:00.0, NUMA node 0");
  expect("fabric.module:nvidia_fs", CheckStatus::pass, "version 2.26.6");
  expect("fabric.module:mlx5_core", CheckStatus::pass, "MOFED");
  expect("fabric.module:nvme_tcp", CheckStatus::info, "not loaded");
  expect("topology.path:0000:03:00.0-nvme0", CheckStatus::pass, ": PIX");
  expect("topology.path:0000:03:00.0-mlx5_0", CheckStatus::pass, ": PIX");
  expect("topology.path:0000:03:00.0-nvme1", CheckStatus::warn, ": SYS");
  expect("topology.acs:0000:02:00.0", CheckStatus::warn, "P2P request redirect");
  expect("topology.acs:0000:02:01.0", CheckStatus::pass, "no P2P redirect");
  expect("topology.acs:0000:01:00.0", CheckStatus::pass, "no ACS capability");
  expect("topology.acs:0000:02:02.0", CheckStatus::info, "only 64 bytes");
  expect("topology.iommu", CheckStatus::pass, "pass-through");
  expect("gds.libcufile", CheckStatus::info, "skipped");
  expect("gds.cufile_json", CheckStatus::pass, "allow_compat_mode true");
  expect("gds.cufile_json", CheckStatus::pass, "rdma_dev_addr_list [\"192.168.10.2\"]");
  expect("gds.nvidia_fs", CheckStatus::pass, "2.26");
  expect("gds.p2pdma", CheckStatus::pass, "p2pdma_pgmap_ops");
  expect("gds.udev", CheckStatus::pass, "/run/udev/data");
  expect("gds.verdict:/data", CheckStatus::info, "skipped");
  expect("summary.auto:/data", CheckStatus::info, "recorded tree");
  expect("summary.auto:/data", CheckStatus::info, "ceiling: 7.9 GB/s, the storage link nvme0 PCIe 16.0 GT/s PCIe x4");
  EXPECT_FALSE(hbmio::any_failed(checks));
  // Groups come out in checklist order.
  std::vector<std::string> groups;
  for (const auto& c : checks)
    if (groups.empty() || groups.back() != c.group) groups.push_back(c.group);
  EXPECT_EQ(groups, (std::vector<std::string>{"GPUs", "Storage", "Fabric", "Topology", "GDS", "Summary"}));
}

TEST(DoctorConstructed, WhatGoesWrong) {
  Tree tree;
  build_gds_server(tree);
  // IOMMU translating, nvidia-fs gone, a cufile.json that forces compatibility mode, a tcp controller.
  tree.write("proc/cmdline", "root=/dev/vda intel_iommu=on\n");
  fs::remove_all(tree.path() / "proc/driver/nvidia-fs");
  fs::remove_all(tree.path() / "sys/module/nvidia_fs");
  tree.write("proc/kallsyms", "ffffffff81000000 T _text\n");
  tree.write("etc/cufile.json", "{ \"properties\": { \"force_compat_mode\": true } }");
  tree.write("sys/devices/virtual/nvme-fabrics/ctl/nvme2/transport", "tcp\n");
  fs::remove_all(tree.path() / "run");
  const auto checks = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(checks));
  const auto status_of = [&](const std::string& id) {
    const Check* c = find_check(checks, id);
    return c ? c->status : CheckStatus::info;
  };
  EXPECT_EQ(status_of("topology.iommu"), CheckStatus::warn);
  EXPECT_NE(find_check(checks, "topology.iommu")->fix.find("iommu=pt"), std::string::npos);
  EXPECT_EQ(status_of("gds.nvidia_fs"), CheckStatus::warn);
  EXPECT_EQ(status_of("fabric.module:nvidia_fs"), CheckStatus::warn);
  EXPECT_EQ(status_of("gds.p2pdma"), CheckStatus::warn);
  EXPECT_EQ(status_of("gds.cufile_json"), CheckStatus::warn);
  EXPECT_EQ(status_of("storage.nvme:nvme2"), CheckStatus::warn);
  EXPECT_EQ(status_of("gds.udev"), CheckStatus::info);  // no /run in a recorded tree: unknown, not wrong
  EXPECT_NE(find_check(checks, "summary.paths"), nullptr);
  EXPECT_FALSE(hbmio::any_failed(checks));

  tree.write("etc/cufile.json", "{ \"properties\": { \"allow_compat_mode\": tru } }");
  const auto broken = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(find_check(broken, "gds.cufile_json")->status, CheckStatus::fail);
  EXPECT_TRUE(hbmio::any_failed(broken));
}

TEST(DoctorConstructed, MalformedTreeGivesWarningsNotCrashes) {
  Tree tree;
  build_gds_server(tree);
  tree.write("sys/devices/" + kGpuPath + "/numa_node", "garbage\n");
  tree.write("sys/devices/" + kGpuPath + "/class", "\0\0\0\0");
  tree.write("sys/devices/" + kNvmePath + "/current_link_width", "x\n");
  tree.write("sys/devices/" + kGpuPath + "/resource", "nonsense");
  tree.write("sys/devices/" + std::string(kSwitch) + "/0000:02:00.0/config", "\x01\x02");
  tree.write("proc/self/mountinfo", "garbage line\n\n1 2 3\n");
  tree.write("etc/cufile.json", std::string("\0\xff\xfe{", 4));
  tree.link("sys/class/nvme/nvme9", "../../devices/does/not/exist");
  tree.link("sys/class/infiniband/absolute", "/nonexistent/elsewhere");
  tree.write("sys/class/nvme/nvme0/state", "");
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data", "/missing"}});
  SCOPED_TRACE(dump(checks));
  for (const auto& c : checks) EXPECT_FALSE(c.id.starts_with("doctor.error")) << c.found;
  EXPECT_EQ(find_check(checks, "gds.cufile_json")->status, CheckStatus::fail);
  EXPECT_EQ(find_check(checks, "storage.path:/data")->status, CheckStatus::info);
}

// ---------------------------------------------------------------------------------------------
// GDS modes: P2PDMA beside nvidia-fs and compatibility mode
// ---------------------------------------------------------------------------------------------

namespace {

const Check& check_in(const std::vector<Check>& checks, const std::string& id) {
  static const Check none{};
  const Check* c = find_check(checks, id);
  EXPECT_NE(c, nullptr) << id;
  return c ? *c : none;
}

// The constructed server made ready for P2PDMA mode: nvidia-fs gone, its NVMe bound to the
// kernel's nvme driver, multipath off, the driver registry set, use_pci_p2pdma true.
void make_p2pdma_ready(const Tree& t) {
  fs::remove_all(t.path() / "proc/driver/nvidia-fs");
  fs::remove_all(t.path() / "sys/module/nvidia_fs");
  t.mkdir("sys/bus/pci/drivers/nvme");
  t.link("sys/devices/" + kNvmePath + "/driver", "../../../../../../bus/pci/drivers/nvme");
  t.write("sys/module/nvme_core/parameters/multipath", "N\n");
  t.write("proc/driver/nvidia/params", "ResmanDebugLevel: 4294967295\nRegistryDwords: \"RMForceStaticBar1=1;RmForceDisableIomapWC=1;\"\n");
  t.write("etc/cufile.json", "{ \"properties\": { \"use_pci_p2pdma\": true, \"allow_compat_mode\": true } }\n");
}

void build_p2pdma_server(const Tree& t) {
  build_gds_server(t);
  make_p2pdma_ready(t);
}

}  // namespace

TEST(DoctorModes, P2pdmaCapableKernelSelectedInCufileJson) {
  Tree tree;
  build_p2pdma_server(tree);
  const auto checks = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(checks));
  const Check& c = check_in(checks, "gds.p2pdma_mode");
  EXPECT_EQ(c.status, CheckStatus::pass) << c.found;
  for (const char* part : {"P2PDMA mode on", "kernel P2PDMA yes (p2pdma_pgmap_ops in /proc/kallsyms)", "GPU module yes (open 580.95.05)",
                           "NVMe yes (nvme0 bound to nvme, nvme1 bound to no driver, nvme_core multipath N)",
                           "driver registry yes", "use_pci_p2pdma true"})
    EXPECT_NE(c.found.find(part), std::string::npos) << part << " in " << c.found;

  // The kernel configuration is read too: /boot/config-<release> says y, kallsyms hidden.
  fs::remove(tree.path() / "proc/kallsyms");
  tree.write("proc/sys/kernel/osrelease", "6.8.0-test\n");
  tree.write("boot/config-6.8.0-test", "CONFIG_PCI=y\nCONFIG_PCI_P2PDMA=y\n");
  const auto from_config = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(from_config, "gds.p2pdma_mode").status, CheckStatus::pass);
  EXPECT_NE(check_in(from_config, "gds.p2pdma_mode").found.find("kernel P2PDMA yes (Linux 6.8.0-test, CONFIG_PCI_P2PDMA=y in /boot/config-6.8.0-test)"),
            std::string::npos);

  // ... and /proc/config.gz where no /boot config is.
  fs::remove(tree.path() / "boot/config-6.8.0-test");
  const std::string gz = (tree.path() / "proc/config.gz").string();
  ASSERT_EQ(std::system(fmt::format("printf 'CONFIG_PCI_P2PDMA=y\\n' | gzip -c > '{}'", gz).c_str()), 0);
  const auto from_gz = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_NE(check_in(from_gz, "gds.p2pdma_mode").found.find("CONFIG_PCI_P2PDMA=y in /proc/config.gz"), std::string::npos)
      << check_in(from_gz, "gds.p2pdma_mode").found;
}

TEST(DoctorModes, P2pdmaIncapableKernelSaysWhatIsMissing) {
  Tree tree;
  build_p2pdma_server(tree);
  tree.write("proc/kallsyms", "ffffffff81000000 T _text\n");
  tree.write("proc/sys/kernel/osrelease", "5.15.0-test\n");
  tree.write("boot/config-5.15.0-test", "CONFIG_PCI=y\n# CONFIG_PCI_P2PDMA is not set\n");
  tree.write("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n");
  tree.write("sys/module/nvme_core/parameters/multipath", "Y\n");
  tree.write("proc/driver/nvidia/params", "RegistryDwords: \"\"\n");
  const auto checks = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(checks));
  const Check& c = check_in(checks, "gds.p2pdma_mode");
  EXPECT_EQ(c.status, CheckStatus::warn);
  EXPECT_NE(c.found.find("selected but unavailable (compatibility mode instead)"), std::string::npos) << c.found;
  EXPECT_NE(c.found.find("kernel P2PDMA no (Linux 5.15.0-test, CONFIG_PCI_P2PDMA=n in /boot/config-5.15.0-test)"), std::string::npos) << c.found;
  EXPECT_NE(c.found.find("GPU module no (proprietary 550.54.14)"), std::string::npos) << c.found;
  EXPECT_NE(c.found.find("driver registry no (RegistryDwords empty)"), std::string::npos) << c.found;
  for (const char* fix : {"CONFIG_PCI_P2PDMA=y", "open GPU kernel modules, 565 or later", "nvme_core.multipath=N", "RMForceStaticBar1=1"})
    EXPECT_NE(c.fix.find(fix), std::string::npos) << fix << " in " << c.fix;
  EXPECT_EQ(c.fix.find("use_pci_p2pdma"), std::string::npos) << "already selected: " << c.fix;

  // Selected, unavailable, no nvidia-fs and compatibility mode forbidden: no mode is left.
  tree.write("etc/cufile.json", "{ \"properties\": { \"use_pci_p2pdma\": true, \"allow_compat_mode\": false } }\n");
  const auto stuck = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(stuck, "gds.p2pdma_mode").status, CheckStatus::fail) << check_in(stuck, "gds.p2pdma_mode").found;
  EXPECT_TRUE(hbmio::any_failed(stuck));

  // With nvidia-fs loaded the same machine is served by nvidia-fs: a warning, not a failure.
  tree.write("proc/driver/nvidia-fs/version", "version: 2.26\n");
  const auto with_nvfs = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(with_nvfs, "gds.p2pdma_mode").status, CheckStatus::warn);
  EXPECT_NE(check_in(with_nvfs, "gds.p2pdma_mode").found.find("(nvidia-fs instead)"), std::string::npos);
}

TEST(DoctorModes, P2pdmaOnTheCapturedMachines) {
  std::string why;
  const fs::path h200 = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "gpu-h200.tar.xz", "local-gpu-h200", why);
  ASSERT_FALSE(h200.empty()) << why;
  const auto checks = hbmio::run_doctor({.root = h200.string()});
  const Check& c = check_in(checks, "gds.p2pdma_mode");
  // The lent GPU machine: open 580 modules, but no P2PDMA kernel and no NVMe.
  EXPECT_EQ(c.status, CheckStatus::warn);
  EXPECT_NE(c.found.find("GPU module yes (open 580.159.04)"), std::string::npos) << c.found;
  EXPECT_NE(c.found.find("NVMe no (no local NVMe controller)"), std::string::npos) << c.found;
  EXPECT_NE(c.found.find("use_pci_p2pdma false"), std::string::npos) << c.found;

  const fs::path dev = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "dev-vm.tar.xz", "local-dev-vm", why);
  ASSERT_FALSE(dev.empty()) << why;
  const auto dev_checks = hbmio::run_doctor({.root = dev.string()});
  EXPECT_EQ(check_in(dev_checks, "gds.p2pdma_mode").status, CheckStatus::info);  // no GPU
}

TEST(DoctorModes, CufileJsonThatForbidsCompatibilityMode) {
  Tree tree;
  build_gds_server(tree);
  fs::remove_all(tree.path() / "proc/driver/nvidia-fs");
  tree.write("etc/cufile.json",
             "// forbids compatibility mode, with a misspelt key, a key of a later libcufile and values out of range\n"
             "{\n"
             "  \"logging\": { \"level\": \"VERBOSE\" },\n"
             "  \"execution\": { \"max_io_threads\": 0, \"parallel_io\": true },\n"
             "  \"properties\": {\n"
             "    \"allow_compat_mode\": false,\n"
             "    \"use_pci_p2pdma\": false,\n"
             "    \"allow_compat_mod\": true,\n"
             "    \"per_buffer_cache_size_kb\": 1000,\n"
             "    \"posix_pool_slab_size_kb\": [4, 1024],\n"
             "    \"posix_pool_slab_count\": [128, 64, 64]\n"
             "  },\n"
             "  \"block\": { \"nvme\": { \"use_pci_p2pdma\": true } },\n"
             "  \"fs\": { \"lustre\": { \"posix_gds_min_kb\": 16, \"mount_table\": { \"/lustre/a\": { \"rdma_dev_addr_list\": [] } } } },\n"
             "  \"denylist\": { \"mounts\": [\"/mnt/slow\"] }\n"
             "}\n");
  const auto checks = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(checks));
  const Check& forbid = check_in(checks, "gds.cufile_setting:properties.allow_compat_mode");
  EXPECT_EQ(forbid.status, CheckStatus::warn);  // no nvidia-fs, P2PDMA not selected: nothing left
  EXPECT_NE(forbid.found.find("forbids compatibility mode"), std::string::npos) << forbid.found;
  EXPECT_NE(forbid.found.find("no DMA mode is available here"), std::string::npos) << forbid.found;
  EXPECT_EQ(check_in(checks, "gds.cufile_setting:logging.level").status, CheckStatus::warn);
  EXPECT_NE(check_in(checks, "gds.cufile_setting:logging.level").found.find("\"VERBOSE\" is not one of NOTICE"), std::string::npos);
  EXPECT_NE(check_in(checks, "gds.cufile_setting:properties.per_buffer_cache_size_kb").found.find("1000 is not an integer from 1024 to 16384"),
            std::string::npos);
  EXPECT_NE(check_in(checks, "gds.cufile_setting:properties.posix_pool_slab_size_kb").found.find("2 entries, but the other posix_pool_slab list has 3"),
            std::string::npos);
  EXPECT_EQ(check_in(checks, "gds.cufile_setting:execution.max_io_threads").status, CheckStatus::info);
  EXPECT_NE(check_in(checks, "gds.cufile_setting:fs.lustre.posix_gds_min_kb").found.find("16 KiB or less on lustre"), std::string::npos);
  EXPECT_NE(check_in(checks, "gds.cufile_setting:denylist.mounts").found.find("/mnt/slow"), std::string::npos);
  EXPECT_EQ(find_check(checks, "gds.cufile_setting:properties.use_pci_p2pdma"), nullptr);  // false selects nothing
  const Check& audit = check_in(checks, "gds.cufile_audit");
  EXPECT_EQ(audit.status, CheckStatus::warn);
  EXPECT_NE(audit.found.find("unknown to libcufile (ignored): properties.allow_compat_mod"), std::string::npos) << audit.found;
  EXPECT_NE(audit.found.find("known only to later libcufile (ignored by 1.15): block.nvme.use_pci_p2pdma"), std::string::npos) << audit.found;
  EXPECT_EQ(audit.found.find("mount_table."), std::string::npos) << "a mount table's paths are not settings: " << audit.found;
  EXPECT_FALSE(hbmio::any_failed(checks));

  // With nvidia-fs loaded, forbidding compatibility mode is a choice, not a trap.
  tree.write("proc/driver/nvidia-fs/version", "version: 2.26\n");
  EXPECT_EQ(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gds.cufile_setting:properties.allow_compat_mode").status,
            CheckStatus::info);

  // Forcing compatibility mode, and a malformed file named by its line.
  tree.write("etc/cufile.json", "{ \"properties\": { \"force_compat_mode\": true } }\n");
  EXPECT_EQ(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gds.cufile_setting:properties.force_compat_mode").status,
            CheckStatus::warn);
  tree.write("etc/cufile.json", "{\n  // a comment keeps its line\n  \"properties\": {\n    \"allow_compat_mode\": tru\n  }\n}\n");
  const auto broken = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(broken, "gds.cufile_json").status, CheckStatus::fail);
  EXPECT_NE(check_in(broken, "gds.cufile_json").found.find("at line 4: `\"allow_compat_mode\": tru`"), std::string::npos)
      << check_in(broken, "gds.cufile_json").found;
  EXPECT_EQ(find_check(broken, "gds.cufile_audit"), nullptr);
}

TEST(DoctorModes, ShippedCufileJsonPassesTheAudit) {
  // The lent GPU machine's /etc/cufile.json is the one libcufile 1.15.1 ships: every key known.
  std::string why;
  const fs::path h200 = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "gpu-h200.tar.xz", "local-gpu-h200", why);
  ASSERT_FALSE(h200.empty()) << why;
  const auto checks = hbmio::run_doctor({.root = h200.string()});
  SCOPED_TRACE(dump(checks));
  const Check& audit = check_in(checks, "gds.cufile_audit");
  EXPECT_EQ(audit.status, CheckStatus::pass) << audit.found;
  EXPECT_NE(audit.found.find("0 out of range, 0 that force or forbid a path"), std::string::npos) << audit.found;
  for (const auto& c : checks) EXPECT_FALSE(c.id.starts_with("gds.cufile_setting:")) << c.id << ": " << c.found;
}

namespace {

// The constructed server seen from inside a Docker container: the GPU nodes passed in by the
// toolkit, nvidia-fs loaded on the host but its nodes not passed in, no udev database, no
// CAP_IPC_LOCK, and an image that carries its own (older) libcuda.
void build_container(const Tree& t) {
  build_gds_server(t);
  t.write(".dockerenv", "");
  t.write("proc/1/cgroup", "0::/system.slice/docker-4f1c2e.scope\n");
  for (const char* node : {"dev/nvidia0", "dev/nvidiactl", "dev/nvidia-uvm"}) t.write(node, "");
  fs::remove_all(t.path() / "run");
  t.write("proc/self/mountinfo",
          "500 400 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A\n"
          "501 500 0:51 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro\n"
          "502 500 259:1 /data /data rw,noatime - ext4 /dev/nvme0n1p1 rw,data=ordered\n");
  t.write("proc/self/status", "Name:\thbmio\nCapInh:\t0000000000000000\nCapPrm:\t00000000a80425fb\nCapEff:\t00000000a80425fb\n");
  t.write("proc/self/limits", "Limit                     Soft Limit           Hard Limit           Units\n"
                              "Max locked memory         8388608              8388608              bytes\n");
  t.write("usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15", "");
  t.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1", "");
}

}  // namespace

TEST(DoctorModes, ContainerWithoutNvidiaFsNodes) {
  Tree tree;
  build_container(tree);
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  SCOPED_TRACE(dump(checks));
  EXPECT_NE(check_in(checks, "gds.container").found.find("/.dockerenv (Docker); /proc/1/cgroup names docker"), std::string::npos);
  const Check& devices = check_in(checks, "gds.container_devices");
  EXPECT_EQ(devices.status, CheckStatus::warn);
  EXPECT_NE(devices.found.find("GPU nodes /dev/nvidia-uvm /dev/nvidia0 /dev/nvidiactl; nvidia-fs nodes none (module loaded on the host)"),
            std::string::npos) << devices.found;
  EXPECT_NE(devices.fix.find("--device /dev/nvidia-fs0"), std::string::npos) << devices.fix;
  EXPECT_NE(devices.fix.find("/dev/infiniband/rdma_cm"), std::string::npos) << devices.fix;  // NVMe-oF over RDMA is present
  const Check& mounts = check_in(checks, "gds.container_mounts");
  EXPECT_EQ(mounts.status, CheckStatus::warn);
  EXPECT_NE(mounts.found.find("/run/udev/data absent; /sys sysfs (ro)"), std::string::npos) << mounts.found;
  EXPECT_NE(mounts.fix.find("-v /run/udev:/run/udev:ro"), std::string::npos);
  const Check& caps = check_in(checks, "gds.container_capabilities");
  EXPECT_EQ(caps.status, CheckStatus::warn);
  EXPECT_NE(caps.found.find("CAP_IPC_LOCK no; Max locked memory 8388608 bytes"), std::string::npos) << caps.found;
  const Check& libs = check_in(checks, "gds.container_libraries");
  EXPECT_EQ(libs.status, CheckStatus::fail);  // libcuda 570 against the 580 module: CUDA cannot start
  EXPECT_NE(libs.found.find("kernel module 580.95.05; libcuda /usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15"), std::string::npos) << libs.found;
  EXPECT_NE(libs.found.find("libcufile /usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1"), std::string::npos) << libs.found;

  // Launched as it should be: nodes, udev, IPC_LOCK, the host's driver libraries.
  tree.write("dev/nvidia-fs0", "");
  tree.write("dev/nvidia-fs1", "");
  tree.write("dev/infiniband/rdma_cm", "");
  tree.write("dev/infiniband/uverbs0", "");
  tree.mkdir("run/udev/data");
  tree.write("proc/self/status", "CapEff:\t00000000a80465fb\n");
  fs::remove(tree.path() / "usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15");
  tree.write("usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05", "");
  const auto good = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(good));
  for (const char* id : {"gds.container_devices", "gds.container_mounts", "gds.container_capabilities", "gds.container_libraries"})
    EXPECT_EQ(check_in(good, id).status, CheckStatus::pass) << id << ": " << check_in(good, id).found;
  EXPECT_NE(check_in(good, "gds.container_capabilities").found.find("CAP_IPC_LOCK yes"), std::string::npos);

  // Outside a container: one line.
  Tree host;
  build_gds_server(host);
  const auto on_host = hbmio::run_doctor({.root = host.path().string()});
  EXPECT_EQ(check_in(on_host, "gds.container").found.substr(0, 20), "not in a container (");
  EXPECT_EQ(find_check(on_host, "gds.container_devices"), nullptr);
}

TEST(DoctorModes, WhichModeAFileUnderEachPathGets) {
  Tree tree;
  build_gds_server(tree);
  const std::string nvme0 = "sys/devices/" + kNvmePath + "/nvme/nvme0/nvme0n1";
  const std::string nvme1 = "sys/devices/" + kRemoteNvmePath + "/nvme/nvme1/nvme1n1";
  // md0: RAID 0 over both local NVMe drives; dm-0: an LVM volume on nvme0n1p1; dm-1: LVM over md0.
  tree.write("sys/devices/virtual/block/md0/md/level", "raid0\n");
  tree.link("sys/devices/virtual/block/md0/slaves/nvme0n1", "../../../../../" + nvme0.substr(4));
  tree.link("sys/devices/virtual/block/md0/slaves/nvme1n1", "../../../../../" + nvme1.substr(4));
  tree.link("sys/dev/block/9:0", "../../devices/virtual/block/md0");
  tree.write("sys/devices/virtual/block/dm-0/dm/name", "vg0-data\n");
  tree.write("sys/devices/virtual/block/dm-0/dm/uuid", "LVM-Xq2vQ9\n");
  tree.link("sys/devices/virtual/block/dm-0/slaves/nvme0n1p1", "../../../../../" + nvme0.substr(4) + "/nvme0n1p1");
  tree.link("sys/dev/block/253:0", "../../devices/virtual/block/dm-0");
  tree.write("sys/devices/virtual/block/dm-1/dm/name", "vg1-fast\n");
  tree.write("sys/devices/virtual/block/dm-1/dm/uuid", "LVM-Zz9\n");
  tree.link("sys/devices/virtual/block/dm-1/slaves/md0", "../../md0");
  tree.link("sys/dev/block/253:1", "../../devices/virtual/block/dm-1");
  tree.write("proc/self/mountinfo",
             "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
             "25 22 259:1 / /data rw,noatime shared:2 - ext4 /dev/nvme0n1p1 rw,data=ordered\n"
             "26 22 9:0 / /raid rw,noatime - xfs /dev/md0 rw,attr2\n"
             "27 22 253:0 / /lvm rw,noatime - ext4 /dev/mapper/vg0-data rw\n"
             "28 22 253:1 / /lvmraid rw,noatime - xfs /dev/mapper/vg1-fast rw\n"
             "29 22 0:40 / /nfsrdma rw,relatime - nfs4 10.0.0.1:/export rw,vers=4.2,proto=rdma,port=20049\n"
             "30 22 0:41 / /nfstcp rw,relatime - nfs4 10.0.0.1:/export rw,vers=4.2,proto=tcp\n"
             "31 22 0:42 / /lustre rw - lustre 10.0.0.2@o2ib:/fs rw,flock\n"
             "32 22 0:43 / /scratch rw - tmpfs tmpfs rw,size=1g\n"
             "33 22 0:44 / /journal rw - ext4 /dev/nvme0n1p1 rw,data=journal\n");
  const std::vector<std::string> paths = {"/data", "/raid", "/lvm", "/lvmraid", "/nfsrdma", "/nfstcp", "/lustre", "/scratch", "/journal"};
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = paths});
  SCOPED_TRACE(dump(checks));
  const auto expect = [&](const std::string& path, CheckStatus status, const std::string& start, const std::string& part = "") {
    const Check& c = check_in(checks, "gds.mode:" + path);
    EXPECT_EQ(c.status, status) << path << ": " << c.found;
    EXPECT_TRUE(c.found.starts_with(start)) << path << ": " << c.found;
    EXPECT_NE(c.found.find(part), std::string::npos) << path << ": " << c.found;
  };
  // nvidia-fs is loaded on this server.
  expect("/data", CheckStatus::pass, "nvidia-fs: ext4 on nvme0n1 (NVMe)");
  expect("/raid", CheckStatus::pass, "nvidia-fs: xfs on md0 (raid0) > nvme0n1, nvme1n1");
  expect("/lvm", CheckStatus::warn, "compatibility mode (through host memory): ext4 on dm-0 (LVM vg0-data) > nvme0n1",
         "cuFile does not move data by DMA through device-mapper (LVM)");
  EXPECT_NE(check_in(checks, "gds.mode:/lvm").fix.find("not on LVM"), std::string::npos);
  expect("/lvmraid", CheckStatus::warn, "compatibility mode (through host memory): xfs on dm-1 (LVM vg1-fast) > md0 (raid0) > nvme0n1, nvme1n1");
  expect("/nfsrdma", CheckStatus::pass, "nvidia-fs: nfs4 on /nfsrdma");
  expect("/nfstcp", CheckStatus::warn, "compatibility mode", "NFS over TCP");
  expect("/lustre", CheckStatus::pass, "nvidia-fs: lustre");
  expect("/scratch", CheckStatus::warn, "compatibility mode", "tmpfs has no GDS support");
  expect("/journal", CheckStatus::warn, "compatibility mode", "data=journal");
  EXPECT_NE(check_in(checks, "storage.block_device:/lvm").found.find("dm-0 (device-mapper, LVM vg0-data, members nvme0n1p1"), std::string::npos)
      << check_in(checks, "storage.block_device:/lvm").found;

  // Without nvidia-fs: NVMe goes through P2PDMA where it is ready; RAID and NVMe-oF cannot.
  make_p2pdma_ready(tree);
  const auto p2p = hbmio::run_doctor({.root = tree.path().string(), .paths = paths});
  SCOPED_TRACE(dump(p2p));
  EXPECT_TRUE(check_in(p2p, "gds.mode:/data").found.starts_with("P2PDMA: ext4 on nvme0n1")) << check_in(p2p, "gds.mode:/data").found;
  EXPECT_EQ(check_in(p2p, "gds.mode:/data").status, CheckStatus::pass);
  EXPECT_NE(check_in(p2p, "gds.mode:/raid").found.find("P2PDMA mode does not serve RAID"), std::string::npos);
  EXPECT_NE(check_in(p2p, "gds.mode:/lustre").found.find("Lustre needs nvidia-fs, which is not loaded"), std::string::npos);

  // Compatibility mode forbidden: files that cannot go by DMA are refused.
  tree.write("etc/cufile.json", "{ \"properties\": { \"allow_compat_mode\": false, \"use_pci_p2pdma\": true } }\n");
  const auto strict = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/lvm", "/data"}});
  EXPECT_TRUE(check_in(strict, "gds.mode:/lvm").found.starts_with("none: ")) << check_in(strict, "gds.mode:/lvm").found;
  EXPECT_NE(check_in(strict, "gds.mode:/lvm").found.find("cuFile refuses the file"), std::string::npos);
  EXPECT_TRUE(check_in(strict, "gds.mode:/data").found.starts_with("P2PDMA: "));

  // The development VM: no GPU, ext4 on virtio.
  std::string why;
  const fs::path dev = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "dev-vm.tar.xz", "local-dev-vm", why);
  ASSERT_FALSE(dev.empty()) << why;
  const auto vm = hbmio::run_doctor({.root = dev.string(), .paths = {"/var/tmp"}});
  const Check& c = check_in(vm, "gds.mode:/var/tmp");
  EXPECT_EQ(c.status, CheckStatus::info);
  EXPECT_NE(c.found.find("compatibility mode (through host memory): ext4 on vda (virtio-blk); vda (virtio-blk) is not NVMe"), std::string::npos) << c.found;
}

TEST(DoctorStorage, NvmeQueueDepthUnderEachPath) {
  Tree tree;
  build_gds_server(tree);
  const std::string nvme0 = "sys/devices/" + kNvmePath + "/nvme/nvme0/nvme0n1";
  const std::string nvme1 = "sys/devices/" + kRemoteNvmePath + "/nvme/nvme1/nvme1n1";
  tree.write(nvme0 + "/queue/nr_requests", "256\n");
  tree.write(nvme0 + "/queue/scheduler", "none [mq-deadline] kyber\n");
  for (int q = 0; q < 4; ++q) tree.mkdir(nvme0 + "/mq/" + std::to_string(q));
  tree.write(nvme1 + "/queue/nr_requests", "1023\n");
  tree.write(nvme1 + "/queue/scheduler", "[none] mq-deadline\n");
  tree.write("sys/devices/virtual/block/md0/md/level", "raid0\n");
  tree.link("sys/devices/virtual/block/md0/slaves/nvme0n1", "../../../../../" + nvme0.substr(4));
  tree.link("sys/devices/virtual/block/md0/slaves/nvme1n1", "../../../../../" + nvme1.substr(4));
  tree.link("sys/dev/block/9:0", "../../devices/virtual/block/md0");
  tree.write("proc/self/mountinfo",
             "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
             "25 22 259:1 / /data rw,noatime shared:2 - ext4 /dev/nvme0n1p1 rw,data=ordered\n"
             "26 22 9:0 / /raid rw,noatime - xfs /dev/md0 rw,attr2\n");
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data", "/raid", "/"}});
  SCOPED_TRACE(dump(checks));
  const Check& data = check_in(checks, "storage.queue_depth:/data");
  EXPECT_EQ(data.status, CheckStatus::warn);
  EXPECT_NE(data.found.find("nvme0n1: nr_requests 256, scheduler mq-deadline, 4 hardware queues"), std::string::npos) << data.found;
  EXPECT_NE(data.fix.find("echo none > /sys/block/nvme0n1/queue/scheduler; echo 1023 > /sys/block/nvme0n1/queue/nr_requests"),
            std::string::npos) << data.fix;
  // Every NVMe disk below the RAID is named; only the short one needs the fix.
  const Check& raid = check_in(checks, "storage.queue_depth:/raid");
  EXPECT_EQ(raid.status, CheckStatus::warn);
  EXPECT_NE(raid.found.find("nvme1n1: nr_requests 1023, scheduler none"), std::string::npos) << raid.found;
  EXPECT_EQ(raid.fix.find("nvme1n1"), std::string::npos) << raid.fix;
  // Not NVMe (vda): no line.
  EXPECT_EQ(find_check(checks, "storage.queue_depth:/"), nullptr);

  tree.write(nvme0 + "/queue/nr_requests", "1023\n");
  const auto fixed = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/raid"}});
  EXPECT_EQ(check_in(fixed, "storage.queue_depth:/raid").status, CheckStatus::pass) << check_in(fixed, "storage.queue_depth:/raid").found;
  fs::remove(tree.path() / nvme0 / "queue/nr_requests");
  const auto unknown = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  EXPECT_EQ(check_in(unknown, "storage.queue_depth:/data").status, CheckStatus::info);
  EXPECT_NE(check_in(unknown, "storage.queue_depth:/data").found.find("nvme0n1: nr_requests unreadable"), std::string::npos);
}

TEST(DoctorGpus, GraceCoherentGpuMemoryMode) {
  Tree tree;
  build_gds_server(tree);
  // An x86 server: no coherent-memory line at all.
  const auto x86 = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(find_check(x86, "gpu.cdmm"), nullptr);

  // A Grace Hopper: Neoverse V2 cores beside the GPU, the driver's parameter not readable yet.
  tree.write("proc/cpuinfo", "processor\t: 0\nBogoMIPS\t: 2000.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n");
  const auto unloaded = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(unloaded));
  const Check& none = check_in(unloaded, "gpu.cdmm");
  EXPECT_EQ(none.status, CheckStatus::warn);
  EXPECT_NE(none.found.find("Grace (Neoverse V2 cores (CPU part 0xd4f in /proc/cpuinfo) with an NVIDIA GPU)"), std::string::npos) << none.found;
  EXPECT_NE(none.found.find("the NVIDIA driver is not loaded"), std::string::npos) << none.found;

  tree.write("proc/driver/nvidia/params", "ResmanDebugLevel: 4294967295\nCoherentGPUMemoryMode: \"driver\"\n");
  const Check cdmm = check_in(hbmio::run_doctor({.root = tree.path().string()}), "gpu.cdmm");
  EXPECT_EQ(cdmm.status, CheckStatus::pass);
  EXPECT_NE(cdmm.found.find("CDMM (CoherentGPUMemoryMode=driver in /proc/driver/nvidia/params)"), std::string::npos) << cdmm.found;
  tree.write("proc/driver/nvidia/params", "CoherentGPUMemoryMode: numa\n");
  EXPECT_NE(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gpu.cdmm").found.find("NUMA mode"), std::string::npos);
  tree.write("proc/driver/nvidia/params", "CoherentGPUMemoryMode: \"\"\n");
  EXPECT_EQ(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gpu.cdmm").status, CheckStatus::info);
  tree.write("proc/driver/nvidia/params", "CoherentGPUMemoryMode: \"auto\"\n");
  EXPECT_EQ(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gpu.cdmm").status, CheckStatus::warn);

  // Named by its firmware instead of its cores.
  tree.write("proc/cpuinfo", "processor\t: 0\nCPU implementer\t: 0x41\n");
  tree.write("sys/class/dmi/id/product_name", "NVIDIA Grace Hopper x4 P4496\n");
  EXPECT_NE(check_in(hbmio::run_doctor({.root = tree.path().string()}), "gpu.cdmm").found.find("/sys/class/dmi/id/product_name"),
            std::string::npos);
}

// /proc/self/environ: each NAME=value followed by a NUL.
std::string environ_of(std::initializer_list<const char*> entries) {
  std::string text;
  for (const char* e : entries) (text += e) += '\0';
  return text;
}

TEST(DoctorModes, CufileEnvironmentOverrides) {
  Tree tree;
  build_gds_server(tree);
  fs::remove_all(tree.path() / "proc/driver/nvidia-fs");  // no DMA mode: forbidding compatibility leaves nothing
  const auto quiet = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(quiet, "gds.cufile_env").status, CheckStatus::info);
  EXPECT_NE(check_in(quiet, "gds.cufile_env").found.find("no CUFILE_* variable"), std::string::npos);

  // The capture's environment: a file named by CUFILE_ENV_PATH_JSON, compatibility mode forbidden,
  // a garbled boolean, a log level that does not exist, and a misspelt name.
  tree.write("proc/self/environ", environ_of({"PATH=/usr/bin", "CUFILE_ENV_PATH_JSON=/opt/app/cufile.json", "CUFILE_ALLOW_COMPAT_MODE=false",
                                               "CUFILE_USE_PCIP2PDMA=maybe", "CUFILE_LOGGING_LEVEL=VERBOSE", "CUFILE_FORCE_COMPAT=1"}));
  tree.write("opt/app/cufile.json", "{ \"properties\": { \"allow_compat_mode\": true, \"use_pci_p2pdma\": false } }\n");
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  SCOPED_TRACE(dump(checks));
  const Check& env = check_in(checks, "gds.cufile_env");
  EXPECT_EQ(env.status, CheckStatus::warn);
  for (const char* part : {"CUFILE_ALLOW_COMPAT_MODE=false (overrides properties.allow_compat_mode: true in /opt/app/cufile.json)",
                           "CUFILE_ENV_PATH_JSON=/opt/app/cufile.json (the cufile.json cuFile reads instead of /etc/cufile.json)",
                           "CUFILE_USE_PCIP2PDMA=maybe (not true, false, 1 or 0: properties.use_pci_p2pdma stays false",
                           "CUFILE_LOGGING_LEVEL=VERBOSE (not one of NOTICE", "CUFILE_FORCE_COMPAT=1 (not a variable the doctor knows",
                           "forbids compatibility mode and no DMA mode is available here"})
    EXPECT_NE(env.found.find(part), std::string::npos) << part << " in " << env.found;
  EXPECT_NE(env.fix.find("unset CUFILE_ALLOW_COMPAT_MODE"), std::string::npos) << env.fix;
  // The file it names is the one judged, and the override is what cuFile does with a file there.
  EXPECT_NE(check_in(checks, "gds.cufile_json").found.find("/opt/app/cufile.json: allow_compat_mode true"), std::string::npos)
      << check_in(checks, "gds.cufile_json").found;
  EXPECT_TRUE(check_in(checks, "gds.mode:/data").found.starts_with("none: ")) << check_in(checks, "gds.mode:/data").found;

  // Forcing compatibility mode through the environment.
  tree.write("proc/self/environ", environ_of({"CUFILE_FORCE_COMPAT_MODE=true"}));
  const auto forced = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  EXPECT_EQ(check_in(forced, "gds.cufile_env").status, CheckStatus::warn);
  EXPECT_NE(check_in(forced, "gds.mode:/data").found.find("force_compat_mode is true"), std::string::npos) << check_in(forced, "gds.mode:/data").found;
}

TEST(DoctorModes, KernelLogErrors) {
  Tree tree;
  build_gds_server(tree);
  const auto none = hbmio::run_doctor({.root = tree.path().string()});
  EXPECT_EQ(check_in(none, "gds.kernel_log").status, CheckStatus::info);
  EXPECT_NE(check_in(none, "gds.kernel_log").found.find("no kernel log"), std::string::npos);

  // /dev/kmsg's record format, with continuation lines and benign NVMe and nvidia-fs lines.
  tree.write("dev/kmsg",
             "6,100,5000,-;nvme nvme0: Shutdown timeout set to 10 seconds\n"
             "6,101,5001,-;nvme nvme0: 64/0/0 default/read/poll queues\n"
             " SUBSYSTEM=pci\n"
             "6,102,5002,-;nvidia_fs: Initializing nvfs driver module\n");
  const auto clean = hbmio::run_doctor({.root = tree.path().string()});
  const Check& ok = check_in(clean, "gds.kernel_log");
  EXPECT_EQ(ok.status, CheckStatus::pass) << ok.found;
  EXPECT_NE(ok.found.find("/dev/kmsg: 3 lines read; no nvidia-fs"), std::string::npos) << ok.found;

  tree.write("dev/kmsg",
             "6,100,5000,-;nvme nvme0: Shutdown timeout set to 10 seconds\n"
             "4,200,9000,-;nvme nvme0: I/O 17 QID 3 timeout, aborting\n"
             "3,201,9001,-;nvme0n1: I/O Cmd(0x2) @ LBA 2048, 256 blocks, I/O Error (sct 0x2 / sc 0x81)\n"
             "3,202,9002,-;nvidia-fs:nvfs_mgroup_check_and_set:error: page not in mgroup\n"
             "4,203,9003,-;NVRM: Xid (PCI:0000:03:00): 79, pid=1234, GPU has fallen off the bus.\n");
  const auto bad = hbmio::run_doctor({.root = tree.path().string()});
  SCOPED_TRACE(dump(bad));
  const Check& c = check_in(bad, "gds.kernel_log");
  EXPECT_EQ(c.status, CheckStatus::warn);
  for (const char* part : {"5 lines read", "1 nvidia-fs error line (last: \"nvidia-fs:nvfs_mgroup_check_and_set:error: page not in mgroup\")",
                           "2 NVMe error lines (last: \"nvme0n1: I/O Cmd(0x2)", "1 GPU (NVRM Xid) error line"})
    EXPECT_NE(c.found.find(part), std::string::npos) << part << " in " << c.found;
  EXPECT_NE(c.fix.find("nvme smart-log"), std::string::npos) << c.fix;

  // Without /dev/kmsg, the syslog's copy; a /dev/kmsg that cannot be read is named.
  fs::remove(tree.path() / "dev/kmsg");
  tree.write("var/log/kern.log", "Dec  5 10:00:00 host kernel: [ 12.3] nvme nvme1: controller is down; will reset: CSTS=0xffffffff\n");
  const Check syslog = check_in(hbmio::run_doctor({.root = tree.path().string()}), "gds.kernel_log");
  EXPECT_NE(syslog.found.find("/var/log/kern.log: 1 lines read; 1 NVMe error line"), std::string::npos) << syslog.found;
  fs::remove(tree.path() / "var/log/kern.log");
  tree.mkdir("dev/kmsg");  // exists, but no file to read
  tree.write("proc/sys/kernel/dmesg_restrict", "1\n");
  const Check denied = check_in(hbmio::run_doctor({.root = tree.path().string()}), "gds.kernel_log");
  EXPECT_EQ(denied.status, CheckStatus::info);
  EXPECT_NE(denied.found.find("kernel log not readable: /dev/kmsg: not readable"), std::string::npos) << denied.found;
  EXPECT_NE(denied.found.find("kernel.dmesg_restrict=1: reading the kernel log needs root or CAP_SYSLOG"), std::string::npos) << denied.found;
  EXPECT_NE(denied.fix.find("as root"), std::string::npos);
}

TEST(DoctorModes, LibcufileVersionGating) {
  Tree tree;
  build_gds_server(tree);
  tree.write("proc/self/mountinfo",
             "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
             "25 22 259:1 / /data rw,noatime shared:2 - ext4 /dev/nvme0n1p1 rw,data=ordered\n"
             "32 22 0:42 / /scratch rw - tmpfs tmpfs rw,size=1g\n"
             "33 22 0:43 / /pool rw - zfs tank/pool rw,xattr\n");
  const auto unknown = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  EXPECT_EQ(check_in(unknown, "gds.cufile_version").status, CheckStatus::info);
  EXPECT_NE(check_in(unknown, "gds.cufile_version").found.find("libcufile version unknown"), std::string::npos);

  tree.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.14.0", "");
  tree.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1", "");
  const auto plain = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data"}});
  const Check& ok = check_in(plain, "gds.cufile_version");
  EXPECT_EQ(ok.status, CheckStatus::pass) << ok.found;
  EXPECT_NE(ok.found.find("libcufile 1.15.1 (/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1)"), std::string::npos) << ok.found;

  tree.write("etc/cufile.json",
             "{ \"properties\": { \"gpu_bounce_buffer_slab_config\": { \"p2p\": [] } }, \"block\": { \"nvme\": { \"use_pci_p2pdma\": true } } }\n");
  const auto gated = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/data", "/scratch", "/pool"}});
  SCOPED_TRACE(dump(gated));
  const Check& c = check_in(gated, "gds.cufile_version");
  EXPECT_EQ(c.status, CheckStatus::warn);
  for (const char* part : {"/scratch on tmpfs (compatibility mode there) needs 1.16", "/pool on zfs (compatibility mode there) needs 1.17",
                           "properties.gpu_bounce_buffer_slab_config in /etc/cufile.json needs 1.17",
                           "block.nvme.use_pci_p2pdma read only by releases after 1.15 (ignored)"})
    EXPECT_NE(c.found.find(part), std::string::npos) << part << " in " << c.found;

  // A newer library serves them all.
  tree.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.17.0", "");
  const auto newer = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/scratch", "/pool"}});
  EXPECT_EQ(check_in(newer, "gds.cufile_version").status, CheckStatus::pass) << check_in(newer, "gds.cufile_version").found;
}

// gds-diag's support matrix on this machine: the driver, hbmio's CUDA runtime and libcufile each
// serve the others, and the modes they allow together.
TEST(DoctorModes, SupportMatrixOfDriverCudaAndLibcufile) {
  Tree tree;
  build_gds_server(tree);  // driver 580.95.05, open module, P2PDMA kernel
  const auto none = hbmio::run_doctor({.root = tree.path().string()});
  const Check& unknown = check_in(none, "gds.support_matrix");
  EXPECT_NE(unknown.found.find("driver 580.95.05"), std::string::npos) << unknown.found;
  EXPECT_NE(unknown.found.find("libcufile not found"), std::string::npos) << unknown.found;

  // libcufile 1.15 is CUDA 13.0's: the 580 driver serves it; the modes as the machine has them.
  tree.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1", "");
  const auto ok = hbmio::run_doctor({.root = tree.path().string()});
  const Check& pass = check_in(ok, "gds.support_matrix");
  EXPECT_EQ(pass.status, CheckStatus::pass) << pass.found;
  EXPECT_NE(pass.found.find("libcufile 1.15.1 (CUDA 13.0)"), std::string::npos) << pass.found;
  EXPECT_NE(pass.found.find("they allow: compatibility mode"), std::string::npos) << pass.found;

  // A 550 driver (CUDA 12.4) cannot run CUDA 13's libcufile: nothing of cuFile starts.
  tree.write("proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14\n");
  const auto old_driver = hbmio::run_doctor({.root = tree.path().string()});
  const Check& fail = check_in(old_driver, "gds.support_matrix");
  EXPECT_EQ(fail.status, CheckStatus::fail) << fail.found;
  EXPECT_NE(fail.found.find("libcufile 1.15.1 needs a driver of 580.65.06 or later (CUDA 13.x); driver 550.54.14 is older"),
            std::string::npos)
      << fail.found;
  EXPECT_FALSE(fail.fix.empty());

  // CUDA 12.6's libcufile (1.11) on that driver runs, but knows no P2PDMA, which cufile.json asks for.
  fs::remove(tree.path() / "usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.15.1");
  tree.write("usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.1.11.1", "");
  tree.write("etc/cufile.json", "{ \"properties\": { \"use_pci_p2pdma\": true } }\n");
  const auto old_cufile = hbmio::run_doctor({.root = tree.path().string()});
  const Check& warn = check_in(old_cufile, "gds.support_matrix");
  if (hbmio::cuda_built_version() >= 13000) {
    EXPECT_EQ(warn.status, CheckStatus::fail) << warn.found;  // hbmio's own CUDA 13 runtime on a 550 driver
    EXPECT_NE(warn.found.find("hbmio's CUDA runtime needs a driver of 580.65.06"), std::string::npos) << warn.found;
  }
  EXPECT_NE(warn.found.find("libcufile 1.11.1 (CUDA 12.6)"), std::string::npos) << warn.found;
  EXPECT_NE(warn.found.find("P2PDMA mode needs libcufile 1.13 (CUDA 12.8) or later; libcufile 1.11.1 ignores use_pci_p2pdma"),
            std::string::npos)
      << warn.found;
  EXPECT_EQ(warn.found.find("libcufile 1.11.1 needs a driver"), std::string::npos) << warn.found;  // 550 serves CUDA 12
}

TEST(DoctorModes, GpfsAndWekaRdmaSettings) {
  Tree tree;
  build_gds_server(tree);
  // A second GPU and NIC, so the load-balancing policy matters.
  tree.pci(std::string(kSwitch) + "/0000:02:03.0/0000:06:00.0", "0x10de", "0x2335", "0x030200", 0);
  const std::string nic2 = "pci0000:80/0000:80:02.0/0000:82:00.0";
  tree.pci(nic2, "0x15b3", "0x101d", "0x020700", 1);
  tree.write("sys/devices/" + nic2 + "/infiniband/mlx5_1/ports/1/state", "4: ACTIVE\n");
  tree.write("sys/devices/" + nic2 + "/infiniband/mlx5_1/ports/1/rate", "200 Gb/sec (4X HDR)\n");
  tree.link("sys/class/infiniband/mlx5_1", "../../devices/" + nic2 + "/infiniband/mlx5_1");
  tree.write("proc/self/mountinfo",
             "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
             "40 22 0:50 / /gpfs/fs1 rw,relatime - gpfs fs1 rw\n"
             "41 22 0:51 / /mnt/weka rw,relatime - wekafs default rw\n");
  tree.write("proc/net/fib_trie",
             "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 192.168.10.2\n        /32 host LOCAL\n     |-- 10.0.0.9\n        /32 host LOCAL\n");
  // cufile.json names the client NIC and a storage server's address.
  tree.write("etc/cufile.json", "{ \"properties\": { \"rdma_dev_addr_list\": [\"192.168.10.2\", \"192.168.10.50\"] },"
                                " \"fs\": { \"gpfs\": { \"gds_write_support\": true } } }\n");
  const auto checks = hbmio::run_doctor({.root = tree.path().string(), .paths = {"/gpfs/fs1", "/mnt/weka", "/"}});
  SCOPED_TRACE(dump(checks));
  const Check& gpfs = check_in(checks, "gds.rdma_config:/gpfs/fs1");
  EXPECT_EQ(gpfs.status, CheckStatus::warn);
  for (const char* part : {"IBM Storage Scale (GPFS) at /gpfs/fs1", "rdma_dev_addr_list 192.168.10.2, 192.168.10.50 (from properties.rdma_dev_addr_list)",
                           "not addresses of this machine (/proc/net/fib_trie): 192.168.10.50", "nvidia_peermem loaded", "writes by RDMA",
                           "rdma_load_balancing_policy RoundRobin (default)"})
    EXPECT_NE(gpfs.found.find(part), std::string::npos) << part << " in " << gpfs.found;
  EXPECT_NE(gpfs.fix.find("RoundRobinMaxMin"), std::string::npos) << gpfs.fix;
  EXPECT_NE(check_in(checks, "gds.rdma_config:/mnt/weka").found.find("writes through compatibility mode (fs.weka.rdma_write_support not true)"),
            std::string::npos);
  EXPECT_EQ(find_check(checks, "gds.rdma_config:/"), nullptr);  // ext4: not an RDMA file system

  // Without addresses and without nvidia_peermem: compatibility mode, named with both fixes.
  fs::remove_all(tree.path() / "sys/module/nvidia_peermem");
  tree.write("etc/cufile.json", "{ \"properties\": { \"rdma_load_balancing_policy\": \"RoundRobinMaxMin\" } }\n");
  const Check bare = check_in(hbmio::run_doctor({.root = tree.path().string(), .paths = {"/mnt/weka"}}), "gds.rdma_config:/mnt/weka");
  EXPECT_EQ(bare.status, CheckStatus::warn);
  EXPECT_NE(bare.found.find("WekaFS without rdma_dev_addr_list goes through compatibility mode"), std::string::npos) << bare.found;
  EXPECT_NE(bare.found.find("neither nvidia_peermem nor dma-buf"), std::string::npos) << bare.found;
  EXPECT_EQ(bare.fix.find("RoundRobinMaxMin\", which"), std::string::npos) << bare.fix;

  // Set up as it should be: the client's own address, nvidia_peermem, the policy.
  tree.mkdir("sys/module/nvidia_peermem");
  tree.write("etc/cufile.json", "{ \"properties\": { \"rdma_dev_addr_list\": [\"10.0.0.9\"], \"rdma_load_balancing_policy\": \"RoundRobinMaxMin\" },"
                                " \"fs\": { \"weka\": { \"rdma_write_support\": true } } }\n");
  const Check good = check_in(hbmio::run_doctor({.root = tree.path().string(), .paths = {"/mnt/weka"}}), "gds.rdma_config:/mnt/weka");
  EXPECT_EQ(good.status, CheckStatus::pass) << good.found;
}

// ---------------------------------------------------------------------------------------------
// Pieces
// ---------------------------------------------------------------------------------------------

TEST(DoctorPieces, StripsCufileJsonComments) {
  const std::string text = "{ // a comment\n \"a\": \"x//y\", /* block\n */ \"b\": \"q\\\"//\" }\n";
  const std::string stripped = strip_json_comments(text);
  EXPECT_EQ(stripped, "{ \n \"a\": \"x//y\", \n \"b\": \"q\\\"//\" }\n");
}

TEST(DoctorPieces, FindsTheMountHoldingAPath) {
  const std::string mountinfo =
      "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
      "30 22 0:31 / /my\\040data rw - tmpfs tmpfs rw,size=10g\n"
      "31 22 259:3 / /data rw,noatime - xfs /dev/nvme0n1 rw,attr2\n"
      "32 31 259:4 / /data/fast rw - ext4 /dev/nvme1n1 rw,data=ordered\n";
  EXPECT_EQ(find_mount(mountinfo, "/data/fast/x")->fs_type, "ext4");
  EXPECT_EQ(find_mount(mountinfo, "/data/fastx")->fs_type, "xfs");
  EXPECT_EQ(find_mount(mountinfo, "/my data/f")->fs_type, "tmpfs");
  EXPECT_EQ(find_mount(mountinfo, "/etc")->major, 254u);
  EXPECT_EQ(find_mount(mountinfo, "/data")->super_options, "rw,attr2");
  EXPECT_FALSE(find_mount("", "/"));
}

TEST(DoctorPieces, RootReadsPaddedAttributes) {
  Tree tree;
  tree.write("a", std::string("QEMU NVMe Ctrl  \n") + std::string(100, '\0'));
  tree.write("n", "0x10de\n");
  tree.write("neg", "-1\n");
  tree.write("bad", "12abc\n");
  const Root root(tree.path());
  EXPECT_FALSE(root.is_live());
  EXPECT_EQ(root.read_attribute("/a"), "QEMU NVMe Ctrl");
  EXPECT_EQ(root.read_integer("n"), 0x10de);
  EXPECT_EQ(root.read_integer("neg"), -1);
  EXPECT_FALSE(root.read_integer("bad"));
  EXPECT_FALSE(root.read_attribute("missing"));
  EXPECT_TRUE(root.list("missing").empty());
  EXPECT_TRUE(Root("/").is_live());
}

// ---------------------------------------------------------------------------------------------
// Recorded trees (../shared/fixtures/sysfs)
// ---------------------------------------------------------------------------------------------

TEST(DoctorFixtures, GhwQemuVmWithPassedThroughP100) {
  FIXTURE_ROOT(root, "ghw/linux-amd64-accel-nvidia.tar.gz");
  const Root tree(root);
  const auto gpus = find_gpus(tree, list_pci_devices(tree));
  ASSERT_EQ(gpus.size(), 1u);
  EXPECT_EQ(gpus[0].pci.address, "0000:06:00.0");
  EXPECT_EQ(gpus[0].pci.device, 0x15f8u);
  EXPECT_EQ(gpus[0].pci.driver, "nvidia");
  EXPECT_FALSE(gpus[0].pci.numa_node);  // -1 in the capture
  EXPECT_EQ(pci_chain_of(gpus[0].pci.sysfs_path), (std::vector<std::string>{"0000:00:01.5", "0000:06:00.0"}));
  const auto checks = hbmio::run_doctor({.root = root.string()});
  EXPECT_EQ(find_check(checks, "gpu.device:0000:06:00.0")->status, CheckStatus::pass);
  EXPECT_EQ(find_check(checks, "gpu.link:0000:06:00.0")->status, CheckStatus::info);  // no link attributes in the VM
}

TEST(DoctorFixtures, HwlocPower9SixV100sWithMemoryNumaNodes) {
  FIXTURE_ROOT(root, "hwloc/nvidiagpunumanodes.tar.bz2");
  const Root tree(root);
  const auto gpus = find_gpus(tree, list_pci_devices(tree));
  ASSERT_EQ(gpus.size(), 6u);
  EXPECT_EQ(gpus[0].pci.address, "0004:05:00.0");
  EXPECT_EQ(gpus[0].memory_numa_node, 255);
  const auto checks = hbmio::run_doctor({.root = root.string()});
  EXPECT_NE(find_check(checks, "gpu.device:0035:05:00.0"), nullptr);
}

TEST(DoctorFixtures, HwlocPlxSwitchesWithConnectX4) {
  FIXTURE_ROOT(root, "hwloc/32intel64-2p8co2t+8ve.tar.bz2");
  const Root tree(root);
  const auto pci = list_pci_devices(tree);
  const auto at = [&](const std::string& address) {
    const auto it = std::find_if(pci.begin(), pci.end(), [&](const PciDevice& d) { return d.address == address; });
    EXPECT_NE(it, pci.end()) << address;
    return it == pci.end() ? PciDevice{} : *it;
  };
  const PciDevice nic = at("0000:1a:00.0");
  EXPECT_EQ(nic.vendor, 0x15b3u);
  EXPECT_EQ(nic.link.current_width, 16);
  // The ConnectX-4 and a VectorEngine card share the PEX9797 switch; the other ConnectX-4 sits
  // behind the second root complex of the same socket (numa_node 0 everywhere).
  EXPECT_EQ(classify_pci_path(nic, at("0000:1b:00.0")), PciPathType::pix);
  EXPECT_EQ(classify_pci_path(nic, at("0000:3e:00.0")), PciPathType::node);
  EXPECT_TRUE(find_rdma_devices(tree).empty());  // the IB stack was not loaded
  const auto checks = hbmio::run_doctor({.root = root.string()});
  for (const auto& c : checks) EXPECT_FALSE(c.id.starts_with("doctor.error")) << c.found;
  EXPECT_EQ(find_check(checks, "gpu.count")->status, CheckStatus::info);
}

TEST(DoctorFixtures, HwlocOldKernelNvmeAndConnectX3) {
  FIXTURE_ROOT(root, "hwloc/32em64t-2n8c+dax+nvme+mic+dimms.tar.bz2");
  const Root tree(root);
  const auto pci = list_pci_devices(tree);
  const auto nvme = find_nvme_controllers(tree, pci);
  ASSERT_EQ(nvme.size(), 1u);
  EXPECT_EQ(nvme[0].address, "0000:00:02.0");  // no /sys/class/nvme: found by PCI class 0x0108
  EXPECT_EQ(nvme[0].name, "nvme0");
  const auto rdma = find_rdma_devices(tree);
  ASSERT_EQ(rdma.size(), 2u);
  EXPECT_EQ(rdma[0].name, "mlx4_0");
  ASSERT_TRUE(rdma[0].pci);
  EXPECT_EQ(rdma[0].pci->address, "0000:82:00.0");
  EXPECT_EQ(rdma[0].pci->numa_node, 1);
  EXPECT_TRUE(rdma[0].active());
  EXPECT_FALSE(rdma[1].pci);  // scif0 is not a PCI device
  const auto checks = hbmio::run_doctor({.root = root.string()});
  EXPECT_EQ(find_check(checks, "fabric.rdma:mlx4_0")->status, CheckStatus::pass);
}

TEST(DoctorFixtures, LibnvmePowerLparThreePcieControllers) {
  FIXTURE_ROOT(root, "libnvme/tree-pcie.tar.xz");
  const Root tree(root);
  const auto nvme = find_nvme_controllers(tree, list_pci_devices(tree));
  ASSERT_EQ(nvme.size(), 3u);
  for (const auto& c : nvme) {
    EXPECT_EQ(c.transport, "pcie") << c.name;
    EXPECT_EQ(c.state, "live") << c.name;
    ASSERT_TRUE(c.pci) << c.name;
    EXPECT_EQ(c.pci->address, c.address);
  }
  EXPECT_EQ(nvme[0].model, "3.2TB NVMe Gen4 U.2 SSD V");
  EXPECT_EQ(nvme[1].address, "052e:78:00.0");
  EXPECT_EQ(nvme[1].subsysnqn, nvme[2].subsysnqn);  // two ports of one dual-port drive
  const auto checks = hbmio::run_doctor({.root = root.string()});
  EXPECT_EQ(find_check(checks, "storage.nvme:nvme2")->status, CheckStatus::pass);
  EXPECT_NE(find_check(checks, "storage.nvme_fabrics"), nullptr);
}

TEST(DoctorFixtures, LibnvmeQemuNulPaddedAttributes) {
  FIXTURE_ROOT(root, "libnvme/config-pcie.tar.xz");
  const Root tree(root);
  const auto nvme = find_nvme_controllers(tree, list_pci_devices(tree));
  ASSERT_EQ(nvme.size(), 2u);
  EXPECT_EQ(nvme[1].model, "QEMU NVMe Ctrl");
  EXPECT_EQ(nvme[1].transport, "pcie");
  ASSERT_TRUE(nvme[0].pci);
  EXPECT_EQ(pci_chain_of(nvme[0].pci->sysfs_path).size(), 2u);  // behind a bridge
}

TEST(DoctorFixtures, LibnvmeAppleNvmeIsNotPcie) {
  FIXTURE_ROOT(root, "libnvme/tree-apple-nvme.tar.xz");
  const Root tree(root);
  const auto nvme = find_nvme_controllers(tree, list_pci_devices(tree));
  ASSERT_EQ(nvme.size(), 1u);
  EXPECT_EQ(nvme[0].transport, "apple-nvme");
  EXPECT_FALSE(nvme[0].pci);
  EXPECT_EQ(nvme[0].namespaces.size(), 3u);
  const auto checks = hbmio::run_doctor({.root = root.string()});
  EXPECT_EQ(find_check(checks, "storage.nvme:nvme0")->status, CheckStatus::info);
}

TEST(DoctorFixtures, EveryCaptureRunsWithoutProbeErrors) {
  for (const char* archive : {"ghw/linux-amd64-415ee03b8c4d1c4f07ae2e9d8b3d3d6d.tar.gz", "ghw/linux-arm64-c288e0776090cd558ef793b2a4e61939.tar.gz",
                              "hwloc/2pa-pcidomain32bits.tar.bz2", "hwloc/40intel64-2g2n4c+pcilocality.tar.bz2",
                              "hwloc/nvidia-dgx-gb10.tar.bz2", "libnvme/config-pcie-with-tcp-config.tar.xz"}) {
    FIXTURE_ROOT(root, archive);
    const auto checks = hbmio::run_doctor({.root = root.string(), .paths = {"/"}});
    EXPECT_FALSE(checks.empty()) << archive;
    for (const auto& c : checks) EXPECT_FALSE(c.id.starts_with("doctor.error")) << archive << ": " << c.found;
  }
  // The DGX Spark's command line asks for translated DMA.
  std::string why;
  const fs::path spark = unpack_fixture("hwloc/nvidia-dgx-gb10.tar.bz2", why);
  const auto checks = hbmio::run_doctor({.root = spark.string()});
  EXPECT_EQ(find_check(checks, "topology.iommu")->status, CheckStatus::warn);
}

// ---------------------------------------------------------------------------------------------
// Captures of the project's own machines (tests/data/doctor, made by scripts/capture-sysfs.sh)
// ---------------------------------------------------------------------------------------------

// The development VM: a 2-core Firecracker guest, six virtio PCI functions, root file system ext4
// on the virtio-blk disk vda (254:0), no GPU, no NVMe, no RDMA, no IOMMU groups, no udev, a
// kernel without PCI P2PDMA. Captured as root (full 256-byte config space of the virtio functions).
TEST(DoctorCaptures, DevVmVirtioDiskNoGpu) {
  std::string why;
  const fs::path root = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "dev-vm.tar.xz", "local-dev-vm", why);
  ASSERT_FALSE(root.empty()) << why;
  const Root tree(root);

  const auto pci = list_pci_devices(tree);
  ASSERT_EQ(pci.size(), 6u);
  EXPECT_EQ(pci[0].address, "0000:00:00.0");
  EXPECT_EQ(pci[0].vendor, 0x8086u);  // the host bridge, no driver
  EXPECT_TRUE(pci[0].driver.empty());
  for (std::size_t i = 1; i < pci.size(); ++i) {
    EXPECT_EQ(pci[i].vendor, 0x1af4u) << pci[i].address;  // virtio
    EXPECT_EQ(pci[i].driver, "virtio-pci") << pci[i].address;
    EXPECT_FALSE(pci[i].numa_node) << pci[i].address;  // -1
    EXPECT_EQ(pci_chain_of(pci[i].sysfs_path), std::vector<std::string>{pci[i].address});
  }
  // The disk's link leads, inside the tree, to the virtio-blk function (modern id 0x1042).
  const auto disk = tree.resolve("sys/dev/block/254:0");
  ASSERT_TRUE(disk);
  EXPECT_EQ(*disk, "sys/devices/pci0000:00/0000:00:02.0/virtio1/block/vda");
  const auto function = pci_device_above(tree, *disk);
  ASSERT_TRUE(function);
  EXPECT_EQ(function->address, "0000:00:02.0");
  EXPECT_EQ(function->device, 0x1042u);
  EXPECT_TRUE(find_gpus(tree, pci).empty());
  EXPECT_TRUE(find_nvme_controllers(tree, pci).empty());
  EXPECT_TRUE(find_rdma_devices(tree).empty());

  const auto checks = hbmio::run_doctor({.root = root.string(), .paths = {"/", "/var/tmp"}});
  SCOPED_TRACE(dump(checks));
  EXPECT_FALSE(hbmio::any_failed(checks));
  for (const auto& c : checks) {
    EXPECT_FALSE(c.id.starts_with("doctor.error")) << c.found;
    EXPECT_FALSE(c.id.starts_with("gpu.device:")) << c.id;
    EXPECT_NE(c.status, CheckStatus::warn) << c.id << ": " << c.found;  // nothing GDS needs is missing without a GPU
  }
  const auto status_of = [&](const std::string& id) {
    const Check* c = find_check(checks, id);
    EXPECT_NE(c, nullptr) << id;
    return c ? c->status : CheckStatus::fail;
  };
  const auto found_of = [&](const std::string& id) {
    const Check* c = find_check(checks, id);
    return c ? c->found : std::string("(no check " + id + ")");
  };
  EXPECT_EQ(status_of("gpu.count"), CheckStatus::info);
  EXPECT_EQ(found_of("gpu.count"), "no NVIDIA GPU among 6 PCI devices");
  EXPECT_EQ(find_check(checks, "gpu.driver"), nullptr);  // no /proc/driver/nvidia
  EXPECT_EQ(status_of("storage.nvme"), CheckStatus::info);
  for (const std::string path : {"/", "/var/tmp"}) {
    EXPECT_EQ(status_of("storage.filesystem:" + path), CheckStatus::pass);
    EXPECT_TRUE(found_of("storage.filesystem:" + path).starts_with("ext4 on / (")) << found_of("storage.filesystem:" + path);
    EXPECT_NE(found_of("storage.filesystem:" + path).find("source /dev/vda"), std::string::npos);
    EXPECT_EQ(status_of("storage.block_device:" + path), CheckStatus::info);
    EXPECT_EQ(found_of("storage.block_device:" + path), "vda (virtio-blk)");
    EXPECT_EQ(found_of("storage.o_direct:" + path), kSkippedForRoot);
    EXPECT_NE(found_of("summary.auto:" + path).find("the storage rate (virtio-blk: not in sysfs)"), std::string::npos);
  }
  EXPECT_EQ(status_of("fabric.rdma"), CheckStatus::info);
  for (const char* module : {"nvidia_fs", "nvidia_peermem", "nvme_fabrics", "nvme_rdma", "nvme_tcp", "ib_core", "mlx5_core", "mlx5_ib"})
    EXPECT_TRUE(found_of(std::string("fabric.module:") + module).starts_with("not loaded")) << module;
  EXPECT_EQ(found_of("topology.paths"), "nothing to pair: 0 NVIDIA GPU(s), 0 NVMe/RDMA device(s) with a PCI position");
  EXPECT_EQ(status_of("topology.iommu"), CheckStatus::pass);
  EXPECT_EQ(found_of("topology.iommu"), "IOMMU off (no IOMMU groups); no iommu options on /proc/cmdline");
  EXPECT_EQ(status_of("gds.nvidia_fs"), CheckStatus::info);
  EXPECT_EQ(found_of("gds.nvidia_fs"), "nvidia-fs not loaded (no /proc/driver/nvidia-fs/version)");
  EXPECT_EQ(found_of("gds.cufile_json"), "no /etc/cufile.json: libcufile uses its built-in defaults");
  EXPECT_EQ(found_of("gds.p2pdma"), "kernel without PCI P2PDMA (no p2pdma_pgmap_ops in /proc/kallsyms)");
  EXPECT_EQ(found_of("gds.udev"), "no /run/udev/data (a container or micro-VM without udevd)");
}

// The lent GPU machine (scripts/capture-sysfs.sh there, 2026-11-30): a Firecracker VM with one
// H200 behind no switch (its function sits on the root bus, as in the live `hbmio doctor`), two
// virtio disks, mlx5 modules loaded without any RDMA device, no nvidia-fs, no P2PDMA, no udev.
TEST(DoctorCaptures, GpuMachineH200VirtioNoGds) {
  std::string why;
  const fs::path root = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "gpu-h200.tar.xz", "local-gpu-h200", why);
  ASSERT_FALSE(root.empty()) << why;
  const Root tree(root);
  const auto pci = list_pci_devices(tree);
  ASSERT_EQ(pci.size(), 7u);
  const auto gpus = find_gpus(tree, pci);
  ASSERT_EQ(gpus.size(), 1u);
  EXPECT_EQ(gpus[0].pci.address, "0000:00:06.0");
  EXPECT_EQ(gpus[0].pci.vendor, 0x10deu);
  EXPECT_EQ(gpus[0].pci.device, 0x2335u);  // H200
  EXPECT_EQ(gpus[0].pci.driver, "nvidia");
  EXPECT_TRUE(find_nvme_controllers(tree, pci).empty());
  EXPECT_TRUE(find_rdma_devices(tree).empty());

  const auto checks = hbmio::run_doctor({.root = root.string(), .paths = {"/tmp", "/var/tmp"}});
  SCOPED_TRACE(dump(checks));
  EXPECT_FALSE(hbmio::any_failed(checks));
  const auto check = [&](const std::string& id) {
    const Check* c = find_check(checks, id);
    EXPECT_NE(c, nullptr) << id;
    return c ? *c : Check{};
  };
  EXPECT_EQ(check("gpu.device:0000:00:06.0").status, CheckStatus::pass);
  EXPECT_EQ(check("gpu.link:0000:00:06.0").found, "32.0 GT/s PCIe x16 (max 32.0 GT/s PCIe x16)");
  EXPECT_NE(check("gpu.driver").found.find("580.159.04"), std::string::npos);
  EXPECT_EQ(check("storage.nvme").status, CheckStatus::info);
  for (const std::string path : {"/tmp", "/var/tmp"}) {
    EXPECT_EQ(check("storage.block_device:" + path).found, "vda (virtio-blk)");
    EXPECT_NE(check("storage.filesystem:" + path).found.find("source /dev/vda"), std::string::npos);
    EXPECT_NE(check("summary.auto:" + path).found.find("ceiling: 63.0 GB/s, the GPU 0000:00:06.0"), std::string::npos)
        << check("summary.auto:" + path).found;
  }
  // With a GPU present, what keeps GDS off is a WARN with its fix.
  EXPECT_EQ(check("fabric.module:nvidia_fs").status, CheckStatus::warn);
  EXPECT_EQ(check("gds.nvidia_fs").status, CheckStatus::warn);
  EXPECT_EQ(check("gds.p2pdma").status, CheckStatus::warn);
  EXPECT_EQ(check("gds.udev").status, CheckStatus::warn);
  EXPECT_NE(check("gds.udev").fix.find("CUFILE_EXPERIMENTAL_FS=1"), std::string::npos);
  EXPECT_EQ(check("gds.cufile_json").found,
            "/etc/cufile.json: allow_compat_mode true, force_compat_mode unset, use_pci_p2pdma false, rdma_dev_addr_list []");
  for (const char* module : {"ib_core", "mlx5_core", "mlx5_ib"})
    EXPECT_EQ(check(std::string("fabric.module:") + module).found, "loaded (in-kernel: no mlx_compat)") << module;
  EXPECT_EQ(check("fabric.rdma").status, CheckStatus::info);
  EXPECT_EQ(check("topology.paths").found, "nothing to pair: 1 NVIDIA GPU(s), 0 NVMe/RDMA device(s) with a PCI position");
}

// ---------------------------------------------------------------------------------------------
// The live machine
// ---------------------------------------------------------------------------------------------

TEST(DoctorLive, RunsOnThisMachine) {
  const std::string dir = test_dir().string();
  const auto checks = hbmio::run_doctor({.root = "/", .paths = {dir, "/nonexistent/hbmio-doctor"}});
  SCOPED_TRACE(dump(checks));
  for (const auto& c : checks) EXPECT_FALSE(c.id.starts_with("doctor.error")) << c.found;
  ASSERT_NE(find_check(checks, "storage.o_direct:" + dir), nullptr);
  ASSERT_NE(find_check(checks, "gds.verdict:" + dir), nullptr);
  const Check* summary = find_check(checks, "summary.auto:" + dir);
  ASSERT_NE(summary, nullptr);
  EXPECT_NE(summary->found.find("auto: "), std::string::npos);
  EXPECT_EQ(find_check(checks, "storage.path:/nonexistent/hbmio-doctor")->status, CheckStatus::fail);
  // The probe file is gone again.
  for (const auto& entry : fs::directory_iterator(dir)) EXPECT_FALSE(entry.path().filename().string().starts_with(".hbmio-doctor-"));
}

// ---------------------------------------------------------------------------------------------
// --explain: a real read, the way it took, and what would make it faster
// ---------------------------------------------------------------------------------------------

namespace {

std::vector<std::string> advice_ids(const hbmio::Explanation& e) {
  std::vector<std::string> ids;
  for (const auto& c : e.advice) ids.push_back(c.id);
  return ids;
}

std::string dump(const hbmio::Explanation& e) { return e.summary + "\n" + dump(e.advice); }

// Explains `path` (inside `tree`), holding `bytes` bytes written there first. The read runs on
// this machine (host memory without a GPU); the checks judge the tree.
hbmio::Explanation explain_in(const Tree& tree, const std::string& path, std::size_t bytes = 300000) {
  tree.write(path.substr(1), std::string(bytes, 'x'));
  return hbmio::explain_transfer({.path = path, .root = tree.path().string()});
}

}  // namespace

TEST(DoctorExplain, DeviceMapperVolumeNamesTheModeFirst) {
  Tree tree;
  build_gds_server(tree);
  tree.write("sys/devices/virtual/block/dm-0/dm/name", "vg0-data\n");
  tree.write("sys/devices/virtual/block/dm-0/dm/uuid", "LVM-Xq2vQ9\n");
  tree.link("sys/devices/virtual/block/dm-0/slaves/nvme0n1p1",
            "../../../../../" + ("sys/devices/" + kNvmePath + "/nvme/nvme0/nvme0n1").substr(4) + "/nvme0n1p1");
  tree.link("sys/dev/block/253:0", "../../devices/virtual/block/dm-0");
  tree.write("proc/self/mountinfo",
             "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
             "27 22 253:0 / /lvm rw,noatime - ext4 /dev/mapper/vg0-data rw\n");
  const auto e = explain_in(tree, "/lvm/model.safetensors");
  SCOPED_TRACE(dump(e));
  // The read itself: every byte of the file, one way, named by the file read.
  ASSERT_EQ(e.stats.paths.size(), 1u);
  EXPECT_EQ(e.stats.paths[0].file, (tree.path() / "lvm/model.safetensors").string());
  EXPECT_EQ(e.stats.paths[0].bytes, 300000u);
  EXPECT_FALSE(e.stats.paths[0].reason.empty());
  if (hbmio::cuda_device_count() == 0) {
    EXPECT_EQ(e.into, "host");
    EXPECT_FALSE(e.why_host.empty());
  }
  // The recorded server has a GPU, and the read did not go by DMA: the GDS mode of the file leads.
  EXPECT_NE(e.summary.find("Not by DMA"), std::string::npos);
  EXPECT_NE(e.summary.find("the checks judge the recorded one"), std::string::npos);
  ASSERT_GE(e.advice.size(), 2u);
  EXPECT_EQ(e.advice.front().id, "gds.mode:/lvm/model.safetensors");
  EXPECT_NE(e.advice.front().found.find("device-mapper (LVM)"), std::string::npos) << e.advice.front().found;
  EXPECT_NE(e.advice.front().fix.find("not on LVM"), std::string::npos);
  EXPECT_EQ(e.advice.back().id, "summary.auto:/lvm/model.safetensors");
  // ACS on the GPU's switch port bounds any path between storage and the GPU.
  const auto ids = advice_ids(e);
  EXPECT_NE(std::find(ids.begin(), ids.end(), "topology.acs:0000:02:00.0"), ids.end());
  for (const auto& c : e.advice)
    if (c.id != "gds.mode:/lvm/model.safetensors" && c.id != "summary.auto:/lvm/model.safetensors")
      EXPECT_NE(c.status, CheckStatus::pass) << c.id;
}

TEST(DoctorExplain, ContainerWithoutNvidiaFsNodesSaysSo) {
  Tree tree;
  build_container(tree);
  const auto e = explain_in(tree, "/data/shard.bin");
  SCOPED_TRACE(dump(e));
  const auto ids = advice_ids(e);
  EXPECT_EQ(ids.front(), "gds.mode:/data/shard.bin");
  EXPECT_NE(std::find(ids.begin(), ids.end(), "gds.container_devices"), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), "gds.container_mounts"), ids.end());
}

TEST(DoctorExplain, P2pdmaCapableAndIncapableKernels) {
  Tree tree;
  build_p2pdma_server(tree);
  {
    // Ready: the mode is P2PDMA (PASS, still shown first), and nothing about P2PDMA to fix.
    const auto e = explain_in(tree, "/data/a.bin");
    SCOPED_TRACE(dump(e));
    EXPECT_EQ(e.advice.front().id, "gds.mode:/data/a.bin");
    EXPECT_EQ(e.advice.front().status, CheckStatus::pass);
    EXPECT_TRUE(e.advice.front().found.starts_with("P2PDMA: ")) << e.advice.front().found;
    const auto ids = advice_ids(e);
    EXPECT_EQ(std::find(ids.begin(), ids.end(), "gds.p2pdma_mode"), ids.end());
  }
  tree.write("proc/kallsyms", "ffffffff81000000 T _text\n");
  tree.write("proc/sys/kernel/osrelease", "5.15.0-test\n");
  tree.write("boot/config-5.15.0-test", "CONFIG_PCI=y\n# CONFIG_PCI_P2PDMA is not set\n");
  const auto e = explain_in(tree, "/data/a.bin");
  SCOPED_TRACE(dump(e));
  EXPECT_EQ(e.advice.front().status, CheckStatus::warn);
  EXPECT_NE(e.advice.front().found.find("P2PDMA mode is not ready"), std::string::npos) << e.advice.front().found;
  const auto p2pdma = std::find_if(e.advice.begin(), e.advice.end(), [](const Check& c) { return c.id == "gds.p2pdma_mode"; });
  ASSERT_NE(p2pdma, e.advice.end());
  EXPECT_NE(p2pdma->found.find("CONFIG_PCI_P2PDMA=n"), std::string::npos) << p2pdma->found;
}

TEST(DoctorExplain, CufileJsonThatForbidsCompatibilityMode) {
  Tree tree;
  build_gds_server(tree);
  fs::remove_all(tree.path() / "proc/driver/nvidia-fs");
  fs::remove_all(tree.path() / "sys/module/nvidia_fs");
  tree.write("etc/cufile.json", "{ \"properties\": { \"allow_compat_mode\": false, \"use_pci_p2pdma\": false } }\n");
  const auto e = explain_in(tree, "/data/a.bin");
  SCOPED_TRACE(dump(e));
  EXPECT_TRUE(e.advice.front().found.starts_with("none: ")) << e.advice.front().found;
  const auto ids = advice_ids(e);
  EXPECT_NE(std::find(ids.begin(), ids.end(), "gds.cufile_setting:properties.allow_compat_mode"), ids.end());
  EXPECT_NE(std::find(ids.begin(), ids.end(), "gds.nvidia_fs"), ids.end());
}

TEST(DoctorExplain, CapturedVmWithoutGpuTalksOfStorageOnly) {
  std::string why;
  const fs::path dev = unpack_archive(fs::path(HBMIO_TEST_DATA) / "doctor" / "dev-vm.tar.xz", "local-dev-vm", why);
  ASSERT_FALSE(dev.empty()) << why;
  const fs::path file = dev / "var/tmp/hbmio-explain.bin";
  fs::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary) << std::string(100000, 'y');
  const auto e = hbmio::explain_transfer({.path = "/var/tmp/hbmio-explain.bin", .root = dev.string()});
  fs::remove(file);
  SCOPED_TRACE(dump(e));
  EXPECT_NE(e.summary.find("No NVIDIA GPU on the recorded machine"), std::string::npos);
  for (const auto& c : e.advice) EXPECT_FALSE(c.id.starts_with("gds.")) << c.id;
  EXPECT_EQ(e.advice.back().id, "summary.auto:/var/tmp/hbmio-explain.bin");
  ASSERT_EQ(e.stats.paths.size(), 1u);
  EXPECT_EQ(e.stats.paths[0].bytes, 100000u);
}

TEST(DoctorExplain, LiveDirectoryReadsItsLargestFile) {
  const fs::path dir = test_dir() / fmt::format("explain-{}", ::getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "small", std::ios::binary) << std::string(10, 's');
  std::ofstream(dir / "large", std::ios::binary) << std::string(5000, 'l');
  const auto e = hbmio::explain_transfer({.path = dir.string(), .max_bytes = 4096});
  fs::remove_all(dir);
  SCOPED_TRACE(dump(e));
  EXPECT_EQ(e.file, (dir / "large").string());
  EXPECT_EQ(e.stats.bytes, 4096u);  // at most max_bytes
  ASSERT_EQ(e.stats.paths.size(), 1u);
  EXPECT_EQ(e.stats.paths[0].file, (dir / "large").string());
  EXPECT_EQ(e.advice.back().id, "summary.auto:" + (dir / "large").string());
}
