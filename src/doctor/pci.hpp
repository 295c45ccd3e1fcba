// PCI devices as sysfs shows them, and the PCIe path between two of them, classified the way
// `nvidia-smi topo -m` does.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "platform/sysfs.hpp"

namespace hbmio::doctor {

// The platform layer's sysfs reading, under the names the doctor's checks use.
using platform::attribute_value;
using platform::name_of;
using platform::parent_of;
using platform::Root;

struct PciLink {
  std::string current_speed, max_speed;  // "16.0 GT/s PCIe" as sysfs writes it; empty when absent
  std::optional<int> current_width, max_width;
};

struct PciDevice {
  std::string address;     // "0000:06:00.0"
  std::string sysfs_path;  // relative to the root, after links: "sys/devices/pci0000:00/0000:00:01.5/0000:06:00.0"
  std::optional<unsigned> vendor, device, class_code;  // class_code: 24 bits, 0x030200
  std::optional<int> numa_node;                        // nothing when absent, garbled or -1
  std::string driver;                                  // "nvidia", "nvme", "mlx5_core"; empty when unbound/unknown
  PciLink link;
};

// Every device in /sys/bus/pci/devices, sorted by address. Trees whose entries are plain
// directories (no links into /sys/devices) give devices without a topology position.
std::vector<PciDevice> list_pci_devices(const Root& root);
// The device whose sysfs directory is `sysfs_path`, or the nearest PCI device above it (for a
// block device or controller path). Nothing when no PCI function is on the path.
std::optional<PciDevice> pci_device_above(const Root& root, std::string_view sysfs_path);
PciDevice read_pci_device(const Root& root, std::string address, std::string sysfs_path);

bool is_pci_address(std::string_view name) noexcept;
// "pci0000:17" from a device path (the host bridge directory); empty when not under one.
std::string host_bridge_of(std::string_view sysfs_path);
// The PCI functions from the host bridge down to the device: root port, switch ports, device.
std::vector<std::string> pci_chain_of(std::string_view sysfs_path);

enum class PciPathType {
  same,     // one and the same device
  pix,      // at most one PCIe switch between them, below one root port
  pxb,      // several switches, still below one root port (no host bridge crossed)
  phb,      // through the PCIe host bridge (the CPU's root complex)
  node,     // between host bridges within one NUMA node
  sys,      // across the interconnect between NUMA nodes (sockets)
  unknown,  // the tree does not show where one of them sits
};
std::string_view to_string(PciPathType type) noexcept;  // "PIX", ...
PciPathType classify_pci_path(const PciDevice& a, const PciDevice& b);
// The bridges (switch ports, root ports) the traffic between `a` and `b` passes, as addresses.
std::vector<std::string> bridges_between(const PciDevice& a, const PciDevice& b);

// Access Control Services on a bridge, from its PCI config space.
struct AcsState {
  enum class Kind { enabled, disabled, not_capable, unreadable } kind = Kind::unreadable;
  unsigned control = 0;  // ACS control register (bit 2: P2P request redirect, 3: completion redirect, 5: egress control)
  std::string detail;    // why unreadable
};
AcsState read_acs(const Root& root, const PciDevice& bridge);
// The same, from the bytes of a config space (exposed for tests).
AcsState parse_acs(std::string_view config);

// GB/s (10^9 bytes) one direction, from "8.0 GT/s PCIe" and a width; nothing when unknown.
std::optional<double> pcie_gigabytes_per_second(std::string_view speed, int width);

}  // namespace hbmio::doctor
