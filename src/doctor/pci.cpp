#include "doctor/pci.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>

namespace hbmio::doctor {

namespace {

bool all_hex(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

std::vector<std::string_view> components(std::string_view path) {
  std::vector<std::string_view> parts;
  while (!path.empty()) {
    const auto slash = path.find('/');
    const auto part = path.substr(0, slash);
    if (!part.empty()) parts.push_back(part);
    if (slash == std::string_view::npos) break;
    path.remove_prefix(slash + 1);
  }
  return parts;
}

bool is_host_bridge_name(std::string_view name) {
  // "pci0000:00", and "pci10000:00" for the 32-bit domains of VMD and some hypervisors.
  if (!name.starts_with("pci")) return false;
  name.remove_prefix(3);
  const auto colon = name.find(':');
  return colon != std::string_view::npos && colon >= 4 && colon <= 8 && all_hex(name.substr(0, colon)) &&
         name.size() == colon + 3 && all_hex(name.substr(colon + 1));
}

std::optional<unsigned> read_hex(const Root& root, const std::string& file) {
  const auto value = root.read_integer(file);
  if (!value || *value < 0 || *value > 0xffffffffLL) return std::nullopt;
  return static_cast<unsigned>(*value);
}

std::uint32_t little_endian(std::string_view bytes, std::size_t offset, std::size_t size) {
  std::uint32_t value = 0;
  for (std::size_t i = 0; i < size; ++i)
    value |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[offset + i])) << (8 * i);
  return value;
}

}  // namespace

bool is_pci_address(std::string_view name) noexcept {
  // domain:bus:device.function, e.g. "0000:06:00.0" or "10000:00:04.0".
  const auto first = name.find(':');
  if (first == std::string_view::npos || first < 4 || first > 8) return false;
  const auto rest = name.substr(first + 1);
  return rest.size() == 7 && all_hex(name.substr(0, first)) && all_hex(rest.substr(0, 2)) && rest[2] == ':' &&
         all_hex(rest.substr(3, 2)) && rest[5] == '.' && rest[6] >= '0' && rest[6] <= '7';
}

std::string host_bridge_of(std::string_view sysfs_path) {
  for (const auto part : components(sysfs_path))
    if (is_host_bridge_name(part)) return std::string(part);
  return {};
}

std::vector<std::string> pci_chain_of(std::string_view sysfs_path) {
  std::vector<std::string> chain;
  bool below_host_bridge = false;
  for (const auto part : components(sysfs_path)) {
    if (is_host_bridge_name(part)) {
      below_host_bridge = true;
    } else if (below_host_bridge) {
      if (!is_pci_address(part)) break;  // "nvme", "virtio1", "infiniband": below the PCI function
      chain.emplace_back(part);
    }
  }
  return chain;
}

PciDevice read_pci_device(const Root& root, std::string address, std::string sysfs_path) {
  PciDevice device{.address = std::move(address), .sysfs_path = std::move(sysfs_path)};
  const std::string dir = device.sysfs_path + "/";
  device.vendor = read_hex(root, dir + "vendor");
  device.device = read_hex(root, dir + "device");
  device.class_code = read_hex(root, dir + "class");
  if (const auto numa = root.read_integer(dir + "numa_node"); numa && *numa >= 0) device.numa_node = static_cast<int>(*numa);
  if (const auto driver = root.resolve(dir + "driver")) device.driver = name_of(*driver);
  device.link.current_speed = root.read_attribute(dir + "current_link_speed").value_or("");
  device.link.max_speed = root.read_attribute(dir + "max_link_speed").value_or("");
  if (const auto width = root.read_integer(dir + "current_link_width")) device.link.current_width = static_cast<int>(*width);
  if (const auto width = root.read_integer(dir + "max_link_width")) device.link.max_width = static_cast<int>(*width);
  return device;
}

std::vector<PciDevice> list_pci_devices(const Root& root) {
  std::vector<PciDevice> devices;
  for (const auto& name : root.list("sys/bus/pci/devices")) {
    if (!is_pci_address(name)) continue;
    const std::string entry = "sys/bus/pci/devices/" + name;
    devices.push_back(read_pci_device(root, name, root.resolve(entry).value_or(entry)));
  }
  return devices;
}

std::optional<PciDevice> pci_device_above(const Root& root, std::string_view sysfs_path) {
  const auto parts = components(sysfs_path);
  for (std::size_t i = parts.size(); i-- > 0;) {
    if (!is_pci_address(parts[i])) continue;
    std::string prefix;
    for (std::size_t j = 0; j <= i; ++j) prefix += (j ? "/" : "") + std::string(parts[j]);
    return read_pci_device(root, std::string(parts[i]), prefix);
  }
  return std::nullopt;
}

std::string_view to_string(PciPathType type) noexcept {
  switch (type) {
    case PciPathType::same: return "X";
    case PciPathType::pix: return "PIX";
    case PciPathType::pxb: return "PXB";
    case PciPathType::phb: return "PHB";
    case PciPathType::node: return "NODE";
    case PciPathType::sys: return "SYS";
    case PciPathType::unknown: break;
  }
  return "unknown";
}

namespace {
std::size_t common_prefix(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  std::size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}
}  // namespace

PciPathType classify_pci_path(const PciDevice& a, const PciDevice& b) {
  if (a.address == b.address) return PciPathType::same;
  const std::string bridge_a = host_bridge_of(a.sysfs_path), bridge_b = host_bridge_of(b.sysfs_path);
  const auto chain_a = pci_chain_of(a.sysfs_path), chain_b = pci_chain_of(b.sysfs_path);
  if (bridge_a.empty() || bridge_b.empty() || chain_a.empty() || chain_b.empty()) return PciPathType::unknown;
  if (bridge_a != bridge_b) {
    // Different root complexes: within a socket or across sockets. numa_node -1 (unknown) is
    // what single-node machines report, so only two different known nodes mean "across".
    if (a.numa_node && b.numa_node && *a.numa_node != *b.numa_node) return PciPathType::sys;
    return PciPathType::node;
  }
  const std::size_t shared = common_prefix(chain_a, chain_b);
  if (shared == 0) return PciPathType::phb;  // different root ports of one host bridge
  // Below the deepest shared bridge each side passes at most one switch downstream port (then
  // the device itself): one switch. Deeper means a switch below a switch.
  const std::size_t depth_a = chain_a.size() - shared, depth_b = chain_b.size() - shared;
  return depth_a <= 2 && depth_b <= 2 ? PciPathType::pix : PciPathType::pxb;
}

std::vector<std::string> bridges_between(const PciDevice& a, const PciDevice& b) {
  const auto chain_a = pci_chain_of(a.sysfs_path), chain_b = pci_chain_of(b.sysfs_path);
  const bool same_bridge = host_bridge_of(a.sysfs_path) == host_bridge_of(b.sysfs_path);
  const std::size_t shared = same_bridge ? common_prefix(chain_a, chain_b) : 0;
  std::vector<std::string> bridges;
  if (shared > 0 && shared <= chain_a.size()) bridges.push_back(chain_a[shared - 1]);
  for (const auto* chain : {&chain_a, &chain_b})
    for (std::size_t i = shared; i + 1 < chain->size(); ++i) bridges.push_back((*chain)[i]);
  std::sort(bridges.begin(), bridges.end());
  bridges.erase(std::unique(bridges.begin(), bridges.end()), bridges.end());
  return bridges;
}

AcsState parse_acs(std::string_view config) {
  constexpr std::size_t first_extended = 0x100;
  constexpr unsigned acs_capability_id = 0x000d;
  if (config.size() < first_extended + 4)
    return {.kind = AcsState::Kind::unreadable,
            .detail = "only " + std::to_string(config.size()) + " bytes of config space readable (the extended space needs root)"};
  std::size_t offset = first_extended;
  for (int hops = 0; hops < 96 && offset + 4 <= config.size(); ++hops) {
    const std::uint32_t header = little_endian(config, offset, 4);
    if (header == 0 || header == 0xffffffffu) break;
    if ((header & 0xffffu) == acs_capability_id) {
      if (offset + 8 > config.size()) break;
      const unsigned control = little_endian(config, offset + 6, 2);
      // Request redirect, completion redirect and egress control send peer-to-peer traffic up
      // to the root complex (or block it): those are what defeat GPUDirect between devices.
      constexpr unsigned p2p_diverting = 0x04 | 0x08 | 0x20;
      return {.kind = (control & p2p_diverting) ? AcsState::Kind::enabled : AcsState::Kind::disabled, .control = control};
    }
    const std::size_t next = header >> 20;
    if (next < first_extended || next <= offset) break;  // end of list (or a loop in garbage)
    offset = next;
  }
  return {.kind = AcsState::Kind::not_capable};
}

AcsState read_acs(const Root& root, const PciDevice& bridge) {
  const auto config = root.read_file(bridge.sysfs_path + "/config", 4096);
  if (!config) return {.kind = AcsState::Kind::unreadable, .detail = "cannot read " + bridge.sysfs_path + "/config"};
  return parse_acs(*config);
}

std::optional<double> pcie_gigabytes_per_second(std::string_view speed, int width) {
  double transfers = 0;
  const auto [end, error] = std::from_chars(speed.data(), speed.data() + speed.size(), transfers);
  if (error != std::errc() || transfers <= 0 || width <= 0) return std::nullopt;
  // Line encoding: 8b/10b up to 5 GT/s (PCIe 1-2), 128b/130b for 8-32 GT/s, 242/256 flits at 64.
  const double efficiency = transfers <= 5.0 ? 0.8 : transfers <= 32.0 ? 128.0 / 130.0 : 242.0 / 256.0;
  return transfers * width * efficiency / 8.0;
}

}  // namespace hbmio::doctor
