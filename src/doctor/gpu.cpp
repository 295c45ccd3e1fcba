// GPUs: each NVIDIA GPU's PCI address, NUMA node, PCIe link and BAR1; the driver; CUDA's view.
#include <algorithm>
#include <cctype>
#include <sstream>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"
#include "hbmio/memory.hpp"

namespace hbmio::doctor {

namespace {

constexpr unsigned kNvidiaVendor = 0x10de;

bool is_display_class(const PciDevice& device) { return device.class_code && (*device.class_code >> 16) == 0x03; }

// BAR1 is the GPU's window onto its memory that peers (NVMe, NICs) DMA into; GDS needs it large.
// Its bounds are the second line of `resource` ("start end flags", hex).
std::optional<std::uint64_t> bar1_size(const Root& root, const PciDevice& device) {
  const auto text = root.read_file(device.sysfs_path + "/resource", 16 * 1024);
  if (!text) return std::nullopt;
  std::istringstream lines(*text);
  std::string line;
  for (int i = 0; i < 2 && std::getline(lines, line); ++i) {
    if (i != 1) continue;
    std::uint64_t start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx %lx", &start, &end) != 2 || start == 0 || end <= start) return std::nullopt;
    return end - start + 1;
  }
  return std::nullopt;
}

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{} GiB", bytes >> 30);
  return fmt::format("{} MiB", bytes >> 20);
}

}  // namespace

std::vector<Gpu> find_gpus(const Root& root, const std::vector<PciDevice>& pci) {
  std::vector<Gpu> gpus;
  for (const auto& device : pci) {
    // Some captures (POWER9) keep only `class`; the NVIDIA driver's own directory then tells.
    const bool nvidia_by_vendor = device.vendor == kNvidiaVendor;
    const bool nvidia_by_driver = !device.vendor && root.is_directory("proc/driver/nvidia/gpus/" + device.address);
    if (!is_display_class(device) || !(nvidia_by_vendor || nvidia_by_driver)) continue;
    Gpu gpu{.pci = device, .bar1_bytes = bar1_size(root, device)};
    if (const auto status = root.read_file("proc/driver/nvidia/gpus/" + device.address + "/numa_status")) {
      int node = -1;
      if (std::sscanf(status->c_str(), "Node: %d", &node) == 1 && node >= 0) gpu.memory_numa_node = node;
    }
    gpus.push_back(std::move(gpu));
  }
  return gpus;
}

namespace {

// Why this machine is an NVIDIA Grace (Grace Hopper, Grace Blackwell), or empty: an Arm machine
// whose firmware or device tree names Grace or NVIDIA, or whose cores are Neoverse V2 (CPU part
// 0xd4f, Grace's core) beside an NVIDIA GPU, as NVIDIA's gds-diag decides it.
std::string grace_evidence(const Root& root, const Inventory& inventory) {
  const std::string cpuinfo = root.read_file("proc/cpuinfo", 4 << 20).value_or("");
  const std::string arch = root.read_attribute("proc/sys/kernel/arch").value_or("");
  const bool arm = arch == "aarch64" || cpuinfo.find("CPU implementer") != std::string::npos;
  if (!arm) return {};
  for (const char* file : {"sys/class/dmi/id/product_name", "sys/class/dmi/id/product_family", "sys/class/dmi/id/board_name",
                           "sys/class/dmi/id/sys_vendor", "proc/device-tree/compatible"}) {
    std::string value = attribute_value(root.read_file(file).value_or(""));
    std::string lowered = value;
    std::transform(lowered.begin(), lowered.end(), lowered.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lowered.find("grace") != std::string::npos || lowered.find("nvidia") != std::string::npos)
      return fmt::format("/{} \"{}\"", file, value);
  }
  if (cpuinfo.find("0xd4f") != std::string::npos && !inventory.gpus.empty())
    return "Neoverse V2 cores (CPU part 0xd4f in /proc/cpuinfo) with an NVIDIA GPU";
  return {};
}

}  // namespace

// Grace's coherent GPU memory: CoherentGPUMemoryMode in /proc/driver/nvidia/params says whether the
// driver keeps GPU memory to itself ("driver", CDMM) or onlines it as a NUMA node ("numa").
void check_coherent_memory(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  const std::string grace = grace_evidence(root, inventory);
  const auto params = root.read_file("proc/driver/nvidia/params");
  std::optional<std::string> mode;
  if (params) {
    std::istringstream in(*params);
    for (std::string line; std::getline(in, line);)
      if (line.starts_with("CoherentGPUMemoryMode:")) {
        mode = attribute_value(line.substr(22));
        if (mode->size() >= 2 && mode->front() == '"' && mode->back() == '"') *mode = mode->substr(1, mode->size() - 2);
      }
  }
  if (grace.empty() && (!mode || mode->empty())) return;  // not a coherent-memory machine: nothing to say
  std::string numa;
  for (const auto& gpu : inventory.gpus)
    if (gpu.memory_numa_node) numa += fmt::format("{}{} memory is NUMA node {}", numa.empty() ? "" : ", ", gpu.pci.address, *gpu.memory_numa_node);
  const std::string on = (grace.empty() ? std::string("coherent GPU memory") : "Grace (" + grace + ")") + (numa.empty() ? "" : "; " + numa);
  const char* id = "gpu.cdmm";
  if (!mode) {
    out.push_back(make_check(id, kGroupGpus, CheckStatus::warn,
                             on + ": no CoherentGPUMemoryMode in /proc/driver/nvidia/params (" +
                                 (params ? "a driver without the parameter" : "the NVIDIA driver is not loaded") + ")",
                             "CoherentGPUMemoryMode driver (CDMM) or numa", "load the NVIDIA driver (modprobe nvidia) and run the doctor again"));
  } else if (*mode == "driver") {
    out.push_back(make_check(id, kGroupGpus, CheckStatus::pass,
                             on + ": CDMM (CoherentGPUMemoryMode=driver in /proc/driver/nvidia/params): the driver manages GPU memory, "
                                  "which is not onlined as a NUMA node"));
  } else if (*mode == "numa") {
    out.push_back(make_check(id, kGroupGpus, CheckStatus::pass,
                             on + ": NUMA mode (CoherentGPUMemoryMode=numa in /proc/driver/nvidia/params): GPU memory is onlined as a NUMA node"));
  } else if (mode->empty()) {
    out.push_back(make_check(id, kGroupGpus, CheckStatus::info,
                             on + ": CoherentGPUMemoryMode empty in /proc/driver/nvidia/params: the driver's default mode" +
                                 (numa.empty() ? "" : " (NUMA here: GPU memory is onlined)"),
                             "", "to choose, set the nvidia module's CoherentGPUMemoryMode parameter to driver (CDMM) or numa and reload it"));
  } else {
    out.push_back(make_check(id, kGroupGpus, CheckStatus::warn,
                             fmt::format("{}: CoherentGPUMemoryMode \"{}\" in /proc/driver/nvidia/params, neither driver nor numa", on, *mode),
                             "driver (CDMM) or numa", "set the nvidia module's CoherentGPUMemoryMode parameter to driver or numa"));
  }
}

void check_gpus(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  if (inventory.gpus.empty()) {
    out.push_back(make_check("gpu.count", kGroupGpus, CheckStatus::info,
                             fmt::format("no NVIDIA GPU among {} PCI devices", inventory.pci.size()),
                             "an NVIDIA GPU (vendor 0x10de, class 0x03xx)", "GDS needs an NVIDIA data-center GPU"));
  }
  for (const auto& gpu : inventory.gpus) {
    const auto& pci = gpu.pci;
    std::string found = fmt::format("NVIDIA {}{} ({}), NUMA node {}", pci.device ? fmt::format("10de:{:04x}", *pci.device) : "GPU",
                                    pci.class_code && (*pci.class_code >> 8) == 0x0302 ? " 3D controller" : "", pci.address,
                                    pci.numa_node ? std::to_string(*pci.numa_node) : "unknown");
    if (gpu.memory_numa_node) found += fmt::format(", its memory is NUMA node {}", *gpu.memory_numa_node);
    found += gpu.bar1_bytes ? ", BAR1 " + size_text(*gpu.bar1_bytes) : ", BAR1 size not readable";
    found += pci.driver.empty() ? ", driver unknown" : ", driver " + pci.driver;
    if (!pci.driver.empty() && pci.driver != "nvidia") {
      out.push_back(make_check("gpu.device:" + pci.address, kGroupGpus, CheckStatus::warn, found, "driver nvidia",
                               fmt::format("the GPU is bound to {}: bind it to the NVIDIA driver", pci.driver)));
    } else {
      out.push_back(make_check("gpu.device:" + pci.address, kGroupGpus, CheckStatus::pass, found));
    }

    const auto& link = pci.link;
    const std::string link_id = "gpu.link:" + pci.address;
    if (link.current_speed.empty() || !link.current_width) {
      out.push_back(make_check(link_id, kGroupGpus, CheckStatus::info, "PCIe link attributes not readable (virtual or recorded tree)"));
      continue;
    }
    const std::string found_link = fmt::format("{} x{} (max {} x{})", link.current_speed, *link.current_width, link.max_speed,
                                               link.max_width.value_or(0));
    if (link.max_width && *link.current_width < *link.max_width) {
      out.push_back(make_check(link_id, kGroupGpus, CheckStatus::warn, found_link, fmt::format("x{}", *link.max_width),
                               "the link trained narrower than the card supports: reseat it or use a full-width slot"));
    } else if (!link.max_speed.empty() && link.current_speed != link.max_speed) {
      out.push_back(make_check(link_id, kGroupGpus, CheckStatus::info, found_link, link.max_speed,
                               "idle GPUs lower their link speed; check under load: nvidia-smi -q -d PCIE"));
    } else {
      out.push_back(make_check(link_id, kGroupGpus, CheckStatus::pass, found_link));
    }
  }

  const auto driver = root.read_attribute("proc/driver/nvidia/version");
  if (driver) {
    out.push_back(make_check("gpu.driver", kGroupGpus, CheckStatus::pass, *driver));
  } else if (!inventory.gpus.empty()) {
    out.push_back(make_check("gpu.driver", kGroupGpus, CheckStatus::warn, "no /proc/driver/nvidia/version: NVIDIA driver not loaded",
                             "NVIDIA kernel driver loaded", "install the NVIDIA driver and load it: modprobe nvidia"));
  }

  check_coherent_memory(root, inventory, out);

  if (!root.is_live()) {
    out.push_back(make_check("gpu.cuda", kGroupGpus, CheckStatus::info, kSkippedForRoot));
    return;
  }
  const int devices = cuda_device_count();
  if (devices > 0) {
    std::string names;
    for (int d = 0; d < devices; ++d) names += fmt::format("{}cuda:{} {}", d ? ", " : "", d, cuda_device_name(d));
    out.push_back(make_check("gpu.cuda", kGroupGpus, CheckStatus::pass, fmt::format("{} CUDA device(s): {}", devices, names)));
  } else {
    out.push_back(make_check("gpu.cuda", kGroupGpus, inventory.gpus.empty() ? CheckStatus::info : CheckStatus::warn,
                             "CUDA sees no device: " + cuda_unavailable_reason(), "at least one CUDA device",
                             built_with_cuda() ? "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
                                               : "this hbmio was built without CUDA (-DHBMIO_CUDA=ON)"));
  }
}

}  // namespace hbmio::doctor
