// Fabric: RDMA devices and the kernel modules GDS over NVMe-oF depends on.
#include <algorithm>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"

namespace hbmio::doctor {

bool RdmaDevice::active() const {
  return std::any_of(ports.begin(), ports.end(), [](const RdmaPort& p) { return p.state.find("ACTIVE") != std::string::npos; });
}

std::vector<RdmaDevice> find_rdma_devices(const Root& root) {
  std::vector<RdmaDevice> devices;
  for (const auto& name : root.list("sys/class/infiniband")) {
    const std::string dir = "sys/class/infiniband/" + name;
    RdmaDevice device{.name = name};
    if (const auto real = root.resolve(dir)) device.pci = pci_device_above(root, *real);
    for (const auto& port : root.list(dir + "/ports")) {
      const std::string port_dir = dir + "/ports/" + port + "/";
      device.ports.push_back({.number = port,
                              .state = root.read_attribute(port_dir + "state").value_or("unknown"),
                              .rate = root.read_attribute(port_dir + "rate").value_or(""),
                              .link_layer = root.read_attribute(port_dir + "link_layer").value_or("")});
    }
    devices.push_back(std::move(device));
  }
  return devices;
}

namespace {

struct ModuleSpec {
  const char* name;
  const char* purpose;
  const char* fix;
};

// In the order a GDS-over-NVMe-oF stack builds up.
constexpr ModuleSpec kModules[] = {
    {"nvidia_fs", "GDS kernel driver (DMA between storage and GPU memory)", "install nvidia-gds (nvidia-fs) and modprobe nvidia-fs"},
    {"nvidia_peermem", "lets RDMA NICs reach GPU memory", "modprobe nvidia-peermem (ships with the NVIDIA driver)"},
    {"nvme_fabrics", "NVMe over Fabrics core", "modprobe nvme-fabrics"},
    {"nvme_rdma", "NVMe over RDMA host", "modprobe nvme-rdma (MOFED's for GDS)"},
    {"nvme_tcp", "NVMe over TCP host (no GDS)", "modprobe nvme-tcp"},
    {"ib_core", "RDMA core", "install MOFED (DOCA-OFED) or modprobe ib_core"},
    {"mlx5_core", "ConnectX NIC driver", "install MOFED (DOCA-OFED)"},
    {"mlx5_ib", "ConnectX RDMA", "install MOFED (DOCA-OFED) or modprobe mlx5_ib"},
};

}  // namespace

void check_fabric(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  if (inventory.rdma.empty())
    out.push_back(make_check("fabric.rdma", kGroupFabric, CheckStatus::info, "no RDMA devices (/sys/class/infiniband is empty or absent)",
                             "", "NVMe-oF with GDS needs an RDMA NIC (ConnectX) and MOFED"));
  for (const auto& device : inventory.rdma) {
    std::string found = device.name;
    if (device.pci) {
      found += " at " + device.pci->address;
      found += device.pci->numa_node ? fmt::format(", NUMA node {}", *device.pci->numa_node) : ", NUMA node unknown";
      if (!device.pci->driver.empty()) found += ", driver " + device.pci->driver;
    } else {
      found += " (not a PCI device)";
    }
    for (const auto& port : device.ports)
      found += fmt::format("; port {}: {}{}{}", port.number, port.state, port.rate.empty() ? "" : ", " + port.rate,
                           port.link_layer.empty() ? "" : ", " + port.link_layer);
    if (device.active())
      out.push_back(make_check("fabric.rdma:" + device.name, kGroupFabric, CheckStatus::pass, found));
    else
      out.push_back(make_check("fabric.rdma:" + device.name, kGroupFabric, CheckStatus::warn, found, "a port in state ACTIVE",
                               "check the cable and the subnet manager (ibstat; for RoCE: the Ethernet link)"));
  }

  if (!root.is_directory("sys/module")) {
    out.push_back(make_check("fabric.modules", kGroupFabric, CheckStatus::info, "no /sys/module in this tree: modules unknown"));
    return;
  }
  // MOFED ships mlx_compat; the in-kernel RDMA stack does not have it.
  const bool mofed = root.is_directory("sys/module/mlx_compat");
  const bool have_gpu = !inventory.gpus.empty();
  const bool have_rdma = !inventory.rdma.empty();
  const bool have_rdma_nvme = std::any_of(inventory.nvme.begin(), inventory.nvme.end(), [](const NvmeController& c) { return c.transport == "rdma"; });
  for (const auto& spec : kModules) {
    const std::string name = spec.name;
    const std::string id = "fabric.module:" + name;
    if (root.is_directory("sys/module/" + name)) {
      std::string found = "loaded";
      if (const auto version = root.read_attribute("sys/module/" + name + "/version")) found += ", version " + *version;
      if (name.starts_with("nvidia"))
        found += " (NVIDIA)";
      else
        found += mofed ? " (MOFED: mlx_compat loaded)" : " (in-kernel: no mlx_compat)";
      out.push_back(make_check(id, kGroupFabric, CheckStatus::pass, found));
      continue;
    }
    // Missing matters only where the hardware that needs it is present.
    bool needed = false;
    if (name == "nvidia_fs") needed = have_gpu;
    if (name == "nvidia_peermem") needed = have_gpu && have_rdma;
    if (name == "nvme_rdma" || name == "nvme_fabrics") needed = have_rdma_nvme;
    if (name == "ib_core" || name == "mlx5_ib") needed = have_rdma_nvme;
    out.push_back(make_check(id, kGroupFabric, needed ? CheckStatus::warn : CheckStatus::info,
                             fmt::format("not loaded ({})", spec.purpose), "loaded", spec.fix));
  }
}

}  // namespace hbmio::doctor
