// Topology: the PCIe path between each GPU and each NVMe drive / RDMA NIC (nvidia-smi topo's
// classes), ACS on the bridges in between, and the IOMMU.
#include <algorithm>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"

namespace hbmio::doctor {

namespace {

struct Peer {
  std::string name;  // "nvme0", "mlx5_0"
  const PciDevice* pci;
};

std::string acs_bits(unsigned control) {
  std::string bits;
  const std::pair<unsigned, const char*> names[] = {{0x01, "source validation"}, {0x02, "translation blocking"},
                                                    {0x04, "P2P request redirect"}, {0x08, "P2P completion redirect"},
                                                    {0x10, "upstream forwarding"}, {0x20, "P2P egress control"},
                                                    {0x40, "direct translated P2P"}};
  for (const auto& [bit, name] : names)
    if (control & bit) bits += (bits.empty() ? "" : ", ") + std::string(name);
  return bits.empty() ? "nothing" : bits;
}

void check_iommu(const Root& root, std::vector<Check>& out) {
  const auto cmdline = root.read_attribute("proc/cmdline");
  std::set<std::string> words;
  if (cmdline) {
    std::istringstream in(*cmdline);
    for (std::string word; in >> word;) words.insert(word);
  }
  const auto has = [&](const char* word) { return words.count(word) > 0; };
  const bool passthrough = has("iommu=pt") || has("iommu.passthrough=1") || has("amd_iommu=pt");
  const bool translated_asked = has("iommu.passthrough=0") || has("iommu=nopt");
  const bool off_asked = has("iommu=off") || has("intel_iommu=off") || has("amd_iommu=off");
  std::string flags;
  for (const auto& word : words)
    if (word.find("iommu") != std::string::npos) flags += (flags.empty() ? "" : " ") + word;
  const std::string cmdline_text =
      cmdline ? (flags.empty() ? "no iommu options on /proc/cmdline" : "/proc/cmdline: " + flags) : "no /proc/cmdline";

  const char* fix = "add iommu=pt to the kernel command line (x86; iommu.passthrough=1 on arm64), or turn the IOMMU off: "
                    "translated DMA slows or blocks peer-to-peer transfers";
  if (!root.is_directory("sys/kernel/iommu_groups")) {
    if (translated_asked)
      out.push_back(make_check("topology.iommu", kGroupTopology, CheckStatus::warn, "IOMMU translating DMA (" + cmdline_text + ")",
                               "IOMMU off or pass-through", fix));
    else
      out.push_back(make_check("topology.iommu", kGroupTopology, passthrough || off_asked ? CheckStatus::pass : CheckStatus::info,
                               "no /sys/kernel/iommu_groups in this tree; " + cmdline_text));
    return;
  }
  const std::size_t groups = root.list("sys/kernel/iommu_groups").size();
  if (groups == 0) {
    out.push_back(make_check("topology.iommu", kGroupTopology, CheckStatus::pass, "IOMMU off (no IOMMU groups); " + cmdline_text));
  } else if (passthrough) {
    out.push_back(make_check("topology.iommu", kGroupTopology, CheckStatus::pass,
                             fmt::format("IOMMU on in pass-through mode ({} groups); {}", groups, cmdline_text)));
  } else {
    out.push_back(make_check("topology.iommu", kGroupTopology, CheckStatus::warn,
                             fmt::format("IOMMU on and translating DMA ({} groups); {}", groups, cmdline_text),
                             "IOMMU off or pass-through (iommu=pt)", fix));
  }
}

}  // namespace

void check_topology(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  std::vector<Peer> peers;
  for (const auto& c : inventory.nvme)
    if (c.pci) peers.push_back({c.name, &*c.pci});
  for (const auto& r : inventory.rdma)
    if (r.pci) peers.push_back({r.name, &*r.pci});

  if (inventory.gpus.empty() || peers.empty()) {
    out.push_back(make_check("topology.paths", kGroupTopology, CheckStatus::info,
                             fmt::format("nothing to pair: {} NVIDIA GPU(s), {} NVMe/RDMA device(s) with a PCI position",
                                         inventory.gpus.size(), peers.size())));
  }
  std::set<std::string> bridges_to_check;
  for (const auto& gpu : inventory.gpus) {
    for (const auto& peer : peers) {
      const PciPathType type = classify_pci_path(gpu.pci, *peer.pci);
      const std::string id = fmt::format("topology.path:{}-{}", gpu.pci.address, peer.name);
      std::string found = fmt::format("GPU {} <-> {} ({}): {}", gpu.pci.address, peer.name, peer.pci->address, to_string(type));
      switch (type) {
        case PciPathType::same:
        case PciPathType::pix:
        case PciPathType::pxb:
          out.push_back(make_check(id, kGroupTopology, CheckStatus::pass, found + " (behind a common PCIe switch)"));
          break;
        case PciPathType::phb:
        case PciPathType::node:
          out.push_back(make_check(id, kGroupTopology, CheckStatus::warn,
                                   found + (type == PciPathType::phb ? " (through the CPU's host bridge)" : " (between host bridges of one socket)"),
                                   "PIX or PXB (one PCIe switch)",
                                   "peer-to-peer DMA crosses the root complex: put the drive/NIC under the GPU's PCIe switch, "
                                   "or use the GPU nearest to it (CUDA_VISIBLE_DEVICES)"));
          break;
        case PciPathType::sys:
          out.push_back(make_check(id, kGroupTopology, CheckStatus::warn,
                                   found + fmt::format(" (across sockets: NUMA {} vs {})", gpu.pci.numa_node.value_or(-1),
                                                       peer.pci->numa_node.value_or(-1)),
                                   "PIX or PXB (one PCIe switch), at least the same socket",
                                   "data crosses the inter-socket link: use a GPU on the drive's/NIC's socket, or move the device"));
          break;
        case PciPathType::unknown:
          out.push_back(make_check(id, kGroupTopology, CheckStatus::info, found + " (the tree does not show where both sit)"));
          break;
      }
      if (type != PciPathType::same && type != PciPathType::unknown)
        for (auto& bridge : bridges_between(gpu.pci, *peer.pci)) bridges_to_check.insert(std::move(bridge));
    }
  }

  for (const auto& address : bridges_to_check) {
    const auto bridge = std::find_if(inventory.pci.begin(), inventory.pci.end(), [&](const PciDevice& d) { return d.address == address; });
    if (bridge == inventory.pci.end()) continue;
    const AcsState acs = read_acs(root, *bridge);
    const std::string id = "topology.acs:" + address;
    switch (acs.kind) {
      case AcsState::Kind::enabled:
        out.push_back(make_check(id, kGroupTopology, CheckStatus::warn,
                                 fmt::format("bridge {}: ACS control 0x{:04x} ({})", address, acs.control, acs_bits(acs.control)),
                                 "no P2P redirect on bridges between GPU and storage/NIC",
                                 fmt::format("ACS sends peer-to-peer traffic up to the root complex: disable it in the BIOS, or "
                                             "setpci -s {} ECAP_ACS+0x6.w=0000 (until reboot)", address)));
        break;
      case AcsState::Kind::disabled:
        out.push_back(make_check(id, kGroupTopology, CheckStatus::pass,
                                 fmt::format("bridge {}: ACS control 0x{:04x} (no P2P redirect)", address, acs.control)));
        break;
      case AcsState::Kind::not_capable:
        out.push_back(make_check(id, kGroupTopology, CheckStatus::pass, fmt::format("bridge {}: no ACS capability", address)));
        break;
      case AcsState::Kind::unreadable:
        out.push_back(make_check(id, kGroupTopology, CheckStatus::info, fmt::format("bridge {}: {}", address, acs.detail), "",
                                 "run hbmio doctor as root to read the extended config space"));
        break;
    }
  }
  check_iommu(root, out);
}

}  // namespace hbmio::doctor
