// The pieces of `hbmio doctor`, one file per group: what each group discovers (the inventory)
// and the checks it writes. run_doctor() in doctor.cpp strings them together.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "doctor/pci.hpp"
#include "platform/sysfs.hpp"
#include "hbmio/doctor.hpp"

namespace hbmio::doctor {

// The platform layer's sysfs reading, under the names the doctor's checks use.
using platform::attribute_value;
using platform::name_of;
using platform::parent_of;
using platform::Root;

inline constexpr const char* kGroupGpus = "GPUs";
inline constexpr const char* kGroupStorage = "Storage";
inline constexpr const char* kGroupFabric = "Fabric";
inline constexpr const char* kGroupTopology = "Topology";
inline constexpr const char* kGroupGds = "GDS";
inline constexpr const char* kGroupSummary = "Summary";
inline constexpr const char* kSkippedForRoot = "skipped: --root given (needs the live machine)";

struct Gpu {
  PciDevice pci;
  std::optional<std::uint64_t> bar1_bytes;        // from the `resource` file (BAR1 is its second line)
  std::optional<int> memory_numa_node;            // GPU memory onlined as a NUMA node (POWER9, Grace)
};

struct NvmeController {
  std::string name;        // "nvme0"; the PCI address for old kernels without /sys/class/nvme
  std::string transport;   // "pcie", "rdma", "tcp", "fc", "loop", "apple-nvme"; empty when unknown
  std::string address;     // "0000:04:00.0" or "traddr=192.168.1.10,trsvcid=4420"
  std::string subsysnqn, state, model;
  std::vector<std::string> namespaces;
  std::optional<PciDevice> pci;  // the PCIe function of a pcie controller
  bool fabrics() const { return !transport.empty() && transport != "pcie" && transport != "apple-nvme"; }
};

struct RdmaPort {
  std::string number, state, rate, link_layer;  // "1", "4: ACTIVE", "100 Gb/sec (4X EDR)", "InfiniBand"
};
struct RdmaDevice {
  std::string name;  // "mlx5_0"
  std::optional<PciDevice> pci;
  std::vector<RdmaPort> ports;
  bool active() const;
};

struct Inventory {
  std::vector<PciDevice> pci;
  std::vector<Gpu> gpus;
  std::vector<NvmeController> nvme;
  std::vector<RdmaDevice> rdma;
};
Inventory discover(const Root& root);

// What was learnt about one PATH, for the GDS verdict and the summary.
struct PathFacts {
  std::string path;
  bool exists = false;
  std::string fs_type, mount_point, mount_options;
  std::string block_device;                  // "vda", "nvme0n1", "md0"
  std::string block_kind;                    // "NVMe", "virtio-blk", "md RAID", "loop", "none"
  std::vector<std::string> nvme_controllers; // controllers behind it
  std::string super_options;                 // the file system's own options ("rw,vers=4.2,proto=rdma,...")
  std::string layers;                        // "dm-0 (LVM vg0-data) > md0 (raid0) > nvme0n1, nvme1n1"; empty for a plain disk
  std::string dm_kind;                       // "LVM", "dm-crypt", "dm-multipath", "device-mapper" anywhere in the stack
  std::string md_level;                      // "raid0", ... of an md device in the stack
  bool all_members_nvme = false;             // every disk at the bottom of the stack is NVMe
  std::vector<std::string> disks;            // sysfs directories of the whole disks at the bottom of the stack
  bool direct_io_tried = false, direct_io_works = false;
  bool verdict_tried = false, cufile_usable = false, cufile_direct = false;
  std::string cufile_mode, cufile_reason;
  // What the auto backend picks for this file into GPU memory (detail::choose_auto, the function
  // the backend itself calls): "cufile", "uring" or "posix"; empty when not decided.
  std::string auto_backend, auto_passed_over;
};

Check make_check(std::string id, const char* group, CheckStatus status, std::string found, std::string expected = {},
                 std::string fix = {});

// gpu.cpp
std::vector<Gpu> find_gpus(const Root& root, const std::vector<PciDevice>& pci);
void check_gpus(const Root& root, const Inventory& inventory, std::vector<Check>& out);
// Grace's CoherentGPUMemoryMode (CDMM or NUMA); no line on machines without coherent GPU memory.
void check_coherent_memory(const Root& root, const Inventory& inventory, std::vector<Check>& out);

// storage.cpp
std::vector<NvmeController> find_nvme_controllers(const Root& root, const std::vector<PciDevice>& pci);
void check_nvme(const Root& root, const Inventory& inventory, std::vector<Check>& out);
PathFacts check_path(const Root& root, const Inventory& inventory, const std::string& path, std::vector<Check>& out);

struct Mount {
  std::string mount_point, fs_type, source, options, super_options;
  unsigned major = 0, minor = 0;
};
// The mount holding `path` (longest mount point prefix) in a mountinfo text.
std::optional<Mount> find_mount(const std::string& mountinfo, const std::string& path);

// fabric.cpp
std::vector<RdmaDevice> find_rdma_devices(const Root& root);
void check_fabric(const Root& root, const Inventory& inventory, std::vector<Check>& out);

// topology.cpp
void check_topology(const Root& root, const Inventory& inventory, std::vector<Check>& out);

// gds.cpp
// cufile.json allows // comments, which JSON does not: removes them (outside strings).
std::string strip_json_comments(const std::string& text);

// The cufile.json libcufile reads: CUFILE_ENV_PATH_JSON, else /etc/cufile.json, and the CUFILE_*
// variables that override its settings.
struct CufileConfig {
  std::string shown;                       // the path as cuFile would name it
  bool from_env = false;                   // named by CUFILE_ENV_PATH_JSON
  std::optional<std::string> text;         // nothing: not there or unreadable
  std::optional<nlohmann::json> json;      // nothing: no text, or not valid JSON (parse_error says why)
  std::string parse_error;
  // CUFILE_* variables of the environment cuFile would see (this process's on the live machine,
  // proc/self/environ in a recorded tree), sorted by name.
  std::vector<std::pair<std::string, std::string>> environment;
  // Boolean settings a CUFILE_* variable overrides: "properties.allow_compat_mode" -> false.
  std::vector<std::pair<std::string, bool>> overrides;
  // The value at "properties.use_pci_p2pdma" in the file; nothing when absent.
  const nlohmann::json* find(std::string_view dotted) const;
  // A boolean setting as cuFile takes it (a CUFILE_* override first, then the file); nothing when
  // absent or not a boolean.
  std::optional<bool> flag(std::string_view dotted) const;
};
CufileConfig load_cufile_config(const Root& root);

// PCI P2PDMA, the GDS mode without nvidia-fs (CUDA 12.8+): each requirement, nothing when unknown.
struct P2pdmaFacts {
  std::optional<bool> kernel;       // CONFIG_PCI_P2PDMA
  std::string kernel_evidence;
  std::optional<bool> open_module;  // the open GPU kernel modules, >= 565
  std::string module_evidence;
  std::optional<bool> registry;     // RegistryDwords RMForceStaticBar1=1;RmForceDisableIomapWC=1 (x86)
  std::string registry_evidence;
  std::optional<bool> nvme;         // a local NVMe controller bound to the kernel's nvme driver, nvme_core multipath off
  std::string nvme_evidence;
  bool requested = false;           // cufile.json: properties.use_pci_p2pdma true
  bool forced_compat = false;       // cufile.json: properties.force_compat_mode true
  // Every requirement but the request is met (or unknown only for the registry).
  bool capable() const { return kernel == true && open_module == true && nvme == true && registry != false; }
  bool ready() const { return capable() && requested && !forced_compat; }
};
P2pdmaFacts find_p2pdma_facts(const Root& root, const Inventory& inventory, const CufileConfig& cufile);
void check_gds(const Root& root, const Inventory& inventory, const std::vector<PathFacts>& paths, std::vector<Check>& out);

// doctor.cpp
void check_summary(const Root& root, const Inventory& inventory, const std::vector<PathFacts>& paths, std::vector<Check>& out);

}  // namespace hbmio::doctor
