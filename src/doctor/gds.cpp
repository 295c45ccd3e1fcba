// GDS: libcufile, cufile.json, nvidia-fs, PCI P2PDMA, udev, and cuFile's verdict on each PATH.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "doctor/doctor_internal.hpp"
#include "hbmio/memory.hpp"
#include "shim/cufile_api.hpp"

extern char** environ;  // this process's environment (unistd.h declares it only with _GNU_SOURCE)

namespace hbmio::doctor {

std::string strip_json_comments(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];  // an escaped quote does not end the string
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
      out += c;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;  // keep the newline: parse errors keep their line numbers
      if (i < text.size()) out += '\n';
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      for (i += 2; i + 1 < text.size() && !(text[i] == '*' && text[i + 1] == '/'); ++i)
        if (text[i] == '\n') out += '\n';
      ++i;
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

bool kernel_has_symbol(const Root& root, std::string_view symbol, bool& readable) {
  std::ifstream in(root.path("proc/kallsyms"));
  readable = static_cast<bool>(in);
  for (std::string line; std::getline(in, line);) {
    // "ffffffff81234560 d p2pdma_pgmap_ops": the name is the third field.
    const auto space = line.rfind(' ');
    if (space != std::string::npos && std::string_view(line).substr(space + 1) == symbol) return true;
  }
  return false;
}

}  // namespace

namespace {

// The CUFILE_* variables cuFile reads in place of a cufile.json setting, with the setting each
// overrides. Sources: NVIDIA gds-diag's list of environment overrides (checks/cufile_config.py,
// ENV_OVERRIDES), the GDS documentation for CUFILE_ENV_PATH_JSON and CUFILE_LOGFILE_PATH, and
// NVIDIA's GDS troubleshooting guide for CUFILE_EXPERIMENTAL_FS.
struct CufileVariable {
  std::string_view name, setting, what;
  bool boolean;
};
constexpr CufileVariable kCufileVariables[] = {
    {"CUFILE_ENV_PATH_JSON", "", "the cufile.json cuFile reads instead of /etc/cufile.json", false},
    {"CUFILE_LOGFILE_PATH", "logging.dir", "cuFile's log file, ahead of logging.dir", false},
    {"CUFILE_LOGGING_LEVEL", "logging.level", "cuFile's log level", false},
    {"CUFILE_FORCE_COMPAT_MODE", "properties.force_compat_mode", "", true},
    {"CUFILE_ALLOW_COMPAT_MODE", "properties.allow_compat_mode", "", true},
    {"CUFILE_USE_PCIP2PDMA", "properties.use_pci_p2pdma", "", true},
    {"CUFILE_NVTX", "profile.nvtx", "", true},
    {"CUFILE_SKIP_TOPOLOGY_DETECTION", "miscellaneous.skip_topology_detection", "", true},
    {"CUFILE_EXPERIMENTAL_FS", "", "lets cuFile open files on file systems outside its supported list", false},
};

const CufileVariable* cufile_variable(std::string_view name) {
  for (const auto& v : kCufileVariables)
    if (v.name == name) return &v;
  return nullptr;
}

// "true"/"1" and "false"/"0", the spellings NVIDIA's examples use; nothing for anything else.
std::optional<bool> environment_flag(std::string value) {
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  return std::nullopt;
}

// CUFILE_* variables cuFile would see. On the live machine this process's environment, which a
// program started from the same shell inherits; a recorded tree holds its capture's in
// proc/self/environ.
std::vector<std::pair<std::string, std::string>> cufile_environment(const Root& root) {
  std::vector<std::pair<std::string, std::string>> found;
  const auto add = [&](std::string_view entry) {
    const auto equals = entry.find('=');
    if (entry.starts_with("CUFILE_") && equals != std::string_view::npos)
      found.emplace_back(std::string(entry.substr(0, equals)), std::string(entry.substr(equals + 1)));
  };
  if (root.is_live()) {
    for (char** entry = environ; entry && *entry; ++entry) add(*entry);
  } else if (const auto text = root.read_file("proc/self/environ")) {
    for (std::size_t at = 0; at < text->size();) {
      const auto end = std::min(text->find('\0', at), text->size());
      add(std::string_view(*text).substr(at, end - at));
      at = end + 1;
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

CufileConfig load_cufile_config(const Root& root) {
  CufileConfig config;
  config.environment = cufile_environment(root);
  std::string env;
  for (const auto& [name, value] : config.environment) {
    if (name == "CUFILE_ENV_PATH_JSON") env = value;
    const auto* variable = cufile_variable(name);
    if (variable && variable->boolean)
      if (const auto on = environment_flag(value)) config.overrides.emplace_back(std::string(variable->setting), *on);
  }
  config.from_env = !env.empty();
  config.shown = config.from_env ? env : "/etc/cufile.json";
  if (config.from_env && root.is_live()) {
    std::ifstream in(env, std::ios::binary);  // relative to this process's directory, as cuFile takes it
    if (in) config.text = std::string(std::istreambuf_iterator<char>(in), {});
  } else {
    config.text = root.read_file(config.from_env ? env : "etc/cufile.json");
  }
  if (!config.text) return config;
  const std::string stripped = strip_json_comments(*config.text);  // comments leave their newlines: lines stay the file's
  try {
    config.json = nlohmann::json::parse(stripped);
  } catch (const nlohmann::json::parse_error& e) {
    // The parser stops after the offending token, often on the next line: name the line of the
    // last thing it read that is not white space, and show it.
    std::size_t at = std::min<std::size_t>(e.byte > 0 ? e.byte - 1 : 0, stripped.size());
    while (at > 0 && (at >= stripped.size() || std::isspace(static_cast<unsigned char>(stripped[at])))) --at;
    const auto line = 1 + std::count(stripped.begin(), stripped.begin() + static_cast<std::ptrdiff_t>(at), '\n');
    const auto begin = stripped.rfind('\n', at == 0 ? 0 : at - (stripped[at] == '\n' ? 1 : 0));
    const auto start = begin == std::string::npos || at == 0 ? 0 : begin + 1;
    const auto end = stripped.find('\n', start);
    config.parse_error = fmt::format("line {}: `{}`: {}", line, attribute_value(stripped.substr(start, end == std::string::npos ? end : end - start)),
                                     e.what());
  } catch (const nlohmann::json::exception& e) {
    config.parse_error = e.what();
  }
  return config;
}

const nlohmann::json* CufileConfig::find(std::string_view dotted) const {
  if (!json) return nullptr;
  const nlohmann::json* node = &*json;
  while (!dotted.empty()) {
    const auto dot = dotted.find('.');
    const std::string key(dotted.substr(0, dot));
    if (!node->is_object() || !node->contains(key)) return nullptr;
    node = &(*node)[key];
    dotted = dot == std::string_view::npos ? std::string_view() : dotted.substr(dot + 1);
  }
  return node;
}

std::optional<bool> CufileConfig::flag(std::string_view dotted) const {
  for (const auto& [setting, on] : overrides)
    if (setting == dotted) return on;
  const auto* value = find(dotted);
  if (!value || !value->is_boolean()) return std::nullopt;
  return value->get<bool>();
}

namespace {

void check_cufile_json(const Root& root, const Inventory& inventory, const CufileConfig& cufile, std::vector<Check>& out) {
  const std::string& shown = cufile.shown;
  if (!cufile.text) {
    if (cufile.from_env)
      out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::warn, "CUFILE_ENV_PATH_JSON=" + shown + " cannot be read",
                               "a readable cufile.json", "fix or unset CUFILE_ENV_PATH_JSON"));
    else
      out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::info, "no /etc/cufile.json: libcufile uses its built-in defaults",
                               "", "install one (it ships with nvidia-gds) to set allow_compat_mode, use_pci_p2pdma, rdma_dev_addr_list"));
    return;
  }
  if (!cufile.json) {
    out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::fail, fmt::format("{} is not valid JSON at {}", shown, cufile.parse_error),
                             "valid JSON (// comments allowed)", "correct " + shown + " at the position named"));
    return;
  }
  const nlohmann::json& config = *cufile.json;
  (void)root;
  const nlohmann::json properties = config.is_object() && config.contains("properties") && config["properties"].is_object()
                                        ? config["properties"]
                                        : nlohmann::json::object();
  const auto flag = [&](const char* key) -> std::string {
    if (!properties.contains(key)) return "unset";
    return properties[key].dump();
  };
  const nlohmann::json rdma_list = properties.value("rdma_dev_addr_list", nlohmann::json::array());
  const std::string found = fmt::format("{}: allow_compat_mode {}, force_compat_mode {}, use_pci_p2pdma {}, rdma_dev_addr_list {}", shown,
                                        flag("allow_compat_mode"), flag("force_compat_mode"), flag("use_pci_p2pdma"), rdma_list.dump());
  const bool have_rdma_nvme = std::any_of(inventory.nvme.begin(), inventory.nvme.end(), [](const NvmeController& c) { return c.transport == "rdma"; });
  if (properties.value("force_compat_mode", false) == true) {
    out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::warn, found, "force_compat_mode false",
                             "force_compat_mode makes cuFile copy through host memory always: set it to false in " + shown));
  } else if (have_rdma_nvme && (!rdma_list.is_array() || rdma_list.empty())) {
    out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::warn, found, "rdma_dev_addr_list naming the RDMA NICs' addresses",
                             "NVMe-oF over RDMA is present: list the NICs' IP addresses in properties.rdma_dev_addr_list"));
  } else {
    out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::pass, found));
  }
}

}  // namespace

namespace {

// The running kernel's build configuration: /boot/config-<release>, else /proc/config.gz (through
// gzip, where readable). Nothing when neither is there; `where` names the one read.
std::optional<std::string> kernel_config(const Root& root, std::string& where) {
  const std::string release = root.read_attribute("proc/sys/kernel/osrelease").value_or("");
  if (!release.empty()) {
    if (auto text = root.read_file("boot/config-" + release, 16 << 20)) {
      where = "/boot/config-" + release;
      return text;
    }
  } else {
    // A tree without the release: the one /boot/config-* it holds, if only one.
    std::vector<std::string> configs;
    for (const auto& name : root.list("boot"))
      if (name.starts_with("config-")) configs.push_back(name);
    if (configs.size() == 1)
      if (auto text = root.read_file("boot/" + configs.front(), 16 << 20)) {
        where = "/boot/" + configs.front();
        return text;
      }
  }
  const auto gz = root.path("proc/config.gz");
  if (!root.exists("proc/config.gz")) return std::nullopt;
  std::string quoted = "'";
  for (const char c : gz.string()) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(("gzip -dc -- " + quoted + " 2>/dev/null").c_str(), "r"), ::pclose);
  if (!pipe) return std::nullopt;
  std::string text;
  char buffer[65536];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe.get())) > 0 && text.size() < (64u << 20);) text.append(buffer, n);
  if (text.empty()) return std::nullopt;
  where = "/proc/config.gz";
  return text;
}

// "y", "m", "n" (a "# CONFIG_X is not set" line) or nothing (not mentioned) for one option.
std::optional<std::string> config_option(const std::string& config, std::string_view option) {
  std::istringstream in(config);
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with(option) && line.size() > option.size() && line[option.size()] == '=') return attribute_value(line.substr(option.size() + 1));
    if (line == "# " + std::string(option) + " is not set") return "n";
  }
  return std::nullopt;
}

// "580.95.05" from "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ...".
std::string driver_version_in(const std::string& text) {
  std::istringstream in(text);
  for (std::string word; in >> word;) {
    const auto dot = word.find('.');
    if (dot >= 3 && dot != std::string::npos && word.find_first_not_of("0123456789.") == std::string::npos) return word;
  }
  return {};
}

}  // namespace

P2pdmaFacts find_p2pdma_facts(const Root& root, const Inventory& inventory, const CufileConfig& cufile) {
  P2pdmaFacts facts;
  // The kernel: its build configuration where readable, else the symbols P2PDMA brings.
  std::string config_where;
  const auto config = kernel_config(root, config_where);
  const auto option = config ? config_option(*config, "CONFIG_PCI_P2PDMA") : std::nullopt;
  bool kallsyms_readable = false;
  const char* symbol = nullptr;
  for (const char* name : {"p2pdma_pgmap_ops", "pci_p2pdma_add_resource"})
    if (!symbol && kernel_has_symbol(root, name, kallsyms_readable)) symbol = name;
  if (option == "y") {
    facts.kernel = true;
    facts.kernel_evidence = "CONFIG_PCI_P2PDMA=y in " + config_where;
  } else if (symbol) {
    facts.kernel = true;
    facts.kernel_evidence = std::string(symbol) + " in /proc/kallsyms";
  } else if (option) {
    facts.kernel = false;
    facts.kernel_evidence = fmt::format("CONFIG_PCI_P2PDMA={} in {}", *option, config_where);
  } else if (kallsyms_readable) {
    facts.kernel = false;
    facts.kernel_evidence = "no p2pdma_pgmap_ops in /proc/kallsyms";
  } else {
    facts.kernel_evidence = "unknown (no kernel config, /proc/kallsyms not readable)";
  }
  if (const auto release = root.read_attribute("proc/sys/kernel/osrelease"); release && !release->empty())
    facts.kernel_evidence = "Linux " + *release + ", " + facts.kernel_evidence;

  // The GPU kernel module: P2PDMA needs the open modules, 565 or later.
  const auto version_text = root.read_file("proc/driver/nvidia/version");
  const std::string module_version =
      version_text ? driver_version_in(*version_text) : root.read_attribute("sys/module/nvidia/version").value_or("");
  const int major = module_version.empty() ? 0 : std::atoi(module_version.c_str());
  if (version_text) {
    const bool open = version_text->find("Open Kernel Module") != std::string::npos;
    facts.open_module = open && major >= 565;
    facts.module_evidence = fmt::format("{} {}", open ? "open" : "proprietary", module_version.empty() ? "(version unknown)" : module_version);
  } else if (!module_version.empty()) {
    facts.module_evidence = "nvidia " + module_version + " (open or proprietary unknown: no /proc/driver/nvidia/version)";
    if (major < 565) facts.open_module = false;
  } else {
    facts.module_evidence = "not loaded (no /proc/driver/nvidia/version)";
    facts.open_module = false;
  }

  // The driver's registry: NVIDIA's gds-diag requires these two on x86 for P2PDMA.
  if (const auto params = root.read_file("proc/driver/nvidia/params")) {
    std::istringstream in(*params);
    std::string registry;
    for (std::string line; std::getline(in, line);)
      if (line.starts_with("RegistryDwords:")) registry = attribute_value(line.substr(15));
    const bool bar1 = registry.find("RMForceStaticBar1=1") != std::string::npos;
    const bool iomap = registry.find("RmForceDisableIomapWC=1") != std::string::npos;
    facts.registry = bar1 && iomap;
    facts.registry_evidence = registry.empty() || registry == "\"\"" ? "RegistryDwords empty" : "RegistryDwords " + registry;
  } else {
    facts.registry_evidence = "RegistryDwords unknown (no /proc/driver/nvidia/params)";
  }

  // The NVMe side: a local controller bound to the kernel's nvme driver, native multipath off.
  std::vector<std::string> bound, other;
  for (const auto& c : inventory.nvme) {
    if (c.fabrics() || !c.pci) continue;
    if (c.pci->driver == "nvme") bound.push_back(c.name);
    else other.push_back(fmt::format("{} bound to {}", c.name, c.pci->driver.empty() ? "no driver" : c.pci->driver));
  }
  const auto multipath = root.read_attribute("sys/module/nvme_core/parameters/multipath");
  const bool multipath_on = multipath && (*multipath == "Y" || *multipath == "1");
  std::string nvme = bound.empty() ? (other.empty() ? "no local NVMe controller" : "") : fmt::format("{} bound to nvme", fmt::join(bound, ", "));
  for (const auto& o : other) nvme += (nvme.empty() ? "" : ", ") + o;
  if (multipath) nvme += ", nvme_core multipath " + *multipath;
  facts.nvme = !bound.empty() && !multipath_on;
  facts.nvme_evidence = nvme;

  facts.requested = cufile.flag("properties.use_pci_p2pdma") == true;
  facts.forced_compat = cufile.flag("properties.force_compat_mode") == true;
  return facts;
}

namespace {

void check_p2pdma_mode(const Root& root, const Inventory& inventory, const CufileConfig& cufile, const P2pdmaFacts& p,
                       bool nvidia_fs, std::vector<Check>& out) {
  (void)root;
  const auto yes_no = [](const std::optional<bool>& v) { return !v ? "unknown" : *v ? "yes" : "no"; };
  std::string found = fmt::format("kernel P2PDMA {} ({}); GPU module {} ({}); NVMe {} ({}); driver registry {} ({}); {}: use_pci_p2pdma {}",
                                  yes_no(p.kernel), p.kernel_evidence, yes_no(p.open_module), p.module_evidence, yes_no(p.nvme),
                                  p.nvme_evidence, yes_no(p.registry), p.registry_evidence, cufile.shown,
                                  p.requested ? "true" : "false (or unset)");
  if (p.forced_compat) found += ", force_compat_mode true";
  std::vector<std::string> fixes;
  if (p.kernel != true) fixes.push_back("boot a kernel built with CONFIG_PCI_P2PDMA=y (most distribution kernels from 6.2 on)");
  if (p.open_module != true) fixes.push_back("install the open GPU kernel modules, 565 or later (nvidia-open)");
  if (p.nvme != true)
    fixes.push_back(p.nvme_evidence.find("multipath Y") != std::string::npos
                        ? "boot with nvme_core.multipath=N (P2PDMA mode does not serve native NVMe multipath)"
                        : "P2PDMA mode reads local PCIe NVMe bound to the kernel's nvme driver (not NVMe-oF, not vfio/SPDK)");
  if (p.registry == false)
    fixes.push_back("options nvidia NVreg_RegistryDwords=\"RMForceStaticBar1=1;RmForceDisableIomapWC=1;\" in /etc/modprobe.d, then reboot");
  if (!p.requested) fixes.push_back("set \"use_pci_p2pdma\": true in the properties of " + cufile.shown);
  if (p.forced_compat) fixes.push_back("set force_compat_mode to false in " + cufile.shown);
  std::string fix;
  for (const auto& f : fixes) fix += (fix.empty() ? "" : "; ") + f;
  const std::string expected = "kernel with CONFIG_PCI_P2PDMA, open GPU kernel modules >= 565, local NVMe on the nvme driver "
                               "(nvme_core multipath=N), properties.use_pci_p2pdma true";
  const bool have_gpu = !inventory.gpus.empty();
  const bool compat_allowed = cufile.flag("properties.allow_compat_mode") != false;
  if (p.ready()) {
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::pass, "P2PDMA mode on: " + found));
  } else if (!have_gpu) {
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::info, "P2PDMA mode off (no NVIDIA GPU): " + found));
  } else if (p.requested && !nvidia_fs && !compat_allowed) {
    // Asked for P2PDMA, cannot have it, no nvidia-fs and compatibility mode forbidden: cuFile has no mode left.
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::fail,
                             "P2PDMA mode selected but unavailable, nvidia-fs absent and allow_compat_mode false: cuFile cannot read files here: " + found,
                             expected, fix));
  } else if (p.requested) {
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::warn,
                             fmt::format("P2PDMA mode selected but unavailable ({} instead): {}", nvidia_fs ? "nvidia-fs" : "compatibility mode", found),
                             expected, fix));
  } else if (nvidia_fs) {
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::info,
                             fmt::format("P2PDMA mode off ({}; nvidia-fs serves GDS): {}", p.capable() ? "this machine could use it" : "not needed", found),
                             "", p.capable() ? fix : ""));
  } else {
    out.push_back(make_check("gds.p2pdma_mode", kGroupGds, CheckStatus::warn,
                             fmt::format("P2PDMA mode off ({}), and no nvidia-fs: cuFile runs in compatibility mode: {}",
                                         p.capable() ? "only cufile.json keeps it off" : "requirements missing", found),
                             expected, fix));
  }
}

}  // namespace

namespace {

// The keys libcufile 1.15 reads. Source: the cufile.json libcufile 1.15.1 ships (CUDA 13.0; the
// copy in tests/data/doctor/gpu-h200.tar.xz, /etc/cufile.json), its commented-out keys included,
// plus properties.force_compat_mode and the batch limits (NVIDIA's GDS troubleshooting guide, "JSON
// Config Parameters Used by GPUDirect Storage") and the older blacklist.* names of denylist.*.
constexpr std::string_view kCufileKeys115[] = {
    "logging.dir", "logging.level", "profile.nvtx", "profile.cufile_stats",
    "execution.max_io_queue_depth", "execution.max_io_threads", "execution.parallel_io", "execution.min_io_threshold_size_kb",
    "execution.max_request_parallelism",
    "properties.max_direct_io_size_kb", "properties.max_device_cache_size_kb", "properties.per_buffer_cache_size_kb",
    "properties.max_device_pinned_mem_size_kb", "properties.posix_pool_slab_size_kb", "properties.posix_pool_slab_count",
    "properties.use_poll_mode", "properties.poll_mode_max_size_kb", "properties.use_pci_p2pdma", "properties.allow_compat_mode",
    "properties.force_compat_mode", "properties.gds_rdma_write_support", "properties.io_batchsize", "properties.io_priority",
    "properties.rdma_dev_addr_list", "properties.rdma_load_balancing_policy", "properties.rdma_dc_key", "properties.rdma_access_mask",
    "properties.rdma_dynamic_routing", "properties.rdma_dynamic_routing_order", "properties.max_batch_io_size",
    "properties.max_batch_io_timeout_msecs",
    "fs.generic.posix_unaligned_writes",
    "fs.beegfs.posix_gds_min_kb", "fs.beegfs.rdma_dev_addr_list", "fs.beegfs.mount_table",
    "fs.lustre.posix_gds_min_kb", "fs.lustre.rdma_dev_addr_list", "fs.lustre.mount_table",
    "fs.nfs.rdma_dev_addr_list", "fs.nfs.mount_table",
    "fs.gpfs.gds_write_support", "fs.gpfs.gds_async_support", "fs.gpfs.rdma_dev_addr_list", "fs.gpfs.mount_table",
    "fs.weka.rdma_write_support",
    "denylist.drivers", "denylist.devices", "denylist.mounts", "denylist.filesystems",
    "blacklist.drivers", "blacklist.devices", "blacklist.mounts", "blacklist.filesystems",
    "miscellaneous.api_check_aggressive",
};

// Keys of later libcufile releases that 1.15 ignores. Source: NVIDIA gds-diag's configuration
// schema (NVIDIA/MagnumIO gds-diag/checks/cufile_config.py, CONFIG_SCHEMA).
constexpr std::string_view kCufileKeysLater[] = {
    "block.nvme.use_pci_p2pdma", "block.nvmeof.use_pci_p2pdma", "block.raid.use_pci_p2pdma", "block.raid1.use_pci_p2pdma",
    "block.raid10.use_pci_p2pdma", "fs.virtiofs.use_pci_p2pdma", "fs.lustre.use_pci_p2pdma", "fs.beegfs.use_pci_p2pdma",
    "fs.gpfs.use_pci_p2pdma", "fs.nfs.use_pci_p2pdma", "fs.scatefs.posix_gds_min_kb", "fs.scatefs.use_pci_p2pdma",
    "profile.io_batchsize", "properties.use_compat_mode", "properties.force_odirect_mode", "properties.prefer_iouring",
    "properties.vanilla_posix_io_mode", "properties.gds_fallback_io", "properties.allow_rdma_token_reset",
    "properties.compat_odirect_unaligned_read_split", "properties.compat_odirect_unaligned_read_split_min_size_kb",
    "properties.gpu_bounce_buffer_slab_size_kb", "properties.gpu_bounce_buffer_slab_count", "properties.gpu_bounce_buffer_slab_config",
    "properties.rdma_peer_type", "properties.rdma_peer_affinity_policy", "properties.rdma_topN_ranks", "properties.rdma_transport_type",
    "sparse.min_p2pdma_threshold_kb", "sparse.p2p_compat_enable",
};

template <std::size_t N>
bool listed(const std::string_view (&keys)[N], std::string_view key) {
  return std::find(std::begin(keys), std::end(keys), key) != std::end(keys);
}

// Every setting as "a.b.c" -> value; mount tables and slab configs are one value (their keys are
// paths and sizes, not settings).
void flatten(const nlohmann::json& node, const std::string& prefix, std::vector<std::pair<std::string, const nlohmann::json*>>& out) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object() && it.key() != "mount_table" && it.key() != "gpu_bounce_buffer_slab_config")
      flatten(*it, key, out);
    else
      out.emplace_back(key, &*it);
  }
}

// What is wrong with one value, or nothing. Ranges from the comments of the shipped cufile.json.
std::optional<std::string> out_of_range(const std::string& key, const nlohmann::json& v, const CufileConfig& cufile) {
  static const std::vector<std::string> bools = {
      "profile.nvtx", "execution.parallel_io", "properties.use_poll_mode", "properties.use_pci_p2pdma", "properties.allow_compat_mode",
      "properties.force_compat_mode", "properties.gds_rdma_write_support", "properties.rdma_dynamic_routing",
      "fs.generic.posix_unaligned_writes", "fs.gpfs.gds_write_support", "fs.gpfs.gds_async_support", "fs.weka.rdma_write_support",
      "miscellaneous.api_check_aggressive"};
  if (std::find(bools.begin(), bools.end(), key) != bools.end())
    return v.is_boolean() ? std::nullopt : std::optional<std::string>(fmt::format("{} is not true or false", v.dump()));
  const auto one_of = [&](std::initializer_list<const char*> allowed) -> std::optional<std::string> {
    if (v.is_string())
      for (const char* a : allowed)
        if (v.get<std::string>() == a) return std::nullopt;
    std::string list;
    for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    return fmt::format("{} is not one of {}", v.dump(), list);
  };
  if (key == "logging.level") return one_of({"NOTICE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"});
  if (key == "properties.io_priority") return one_of({"default", "low", "med", "high"});
  if (key == "properties.rdma_load_balancing_policy") return one_of({"RoundRobin", "RoundRobinMaxMin"});
  if (key == "properties.rdma_dynamic_routing_order") {
    if (!v.is_array()) return "not a list";
    for (const auto& item : v)
      if (!item.is_string() || (item != "GPU_MEM_NVLINKS" && item != "GPU_MEM" && item != "SYS_MEM" && item != "P2P"))
        return fmt::format("{} is not one of GPU_MEM_NVLINKS, GPU_MEM, SYS_MEM, P2P", item.dump());
    return std::nullopt;
  }
  if (key.ends_with("rdma_dev_addr_list") || key.starts_with("denylist.") || key.starts_with("blacklist."))
    return v.is_array() ? std::nullopt : std::optional<std::string>("not a list");
  const auto multiple = [&](const nlohmann::json& x, long long unit, long long low, long long high) -> std::optional<std::string> {
    if (!x.is_number_integer() || x.get<long long>() < low || x.get<long long>() > high)
      return fmt::format("{} is not an integer from {} to {}", x.dump(), low, high);
    if (unit > 1 && x.get<long long>() % unit != 0) return fmt::format("{} is not a multiple of {}", x.dump(), unit);
    return std::nullopt;
  };
  constexpr long long kMax = 1LL << 40;
  if (key == "profile.cufile_stats") return multiple(v, 1, 0, 3);
  if (key == "properties.max_direct_io_size_kb") return multiple(v, 64, 64, kMax);
  if (key == "properties.per_buffer_cache_size_kb") return multiple(v, 64, 1024, 16384);
  if (key == "properties.max_device_cache_size_kb" || key == "properties.max_device_pinned_mem_size_kb" ||
      key == "properties.poll_mode_max_size_kb" || key.ends_with(".posix_gds_min_kb"))
    return multiple(v, 4, 0, kMax);
  if (key == "execution.max_io_queue_depth" || key == "execution.max_request_parallelism" || key == "properties.io_batchsize")
    return multiple(v, 1, 1, kMax);
  if (key == "execution.max_io_threads" || key == "execution.min_io_threshold_size_kb") return multiple(v, 1, 0, kMax);
  if (key == "properties.posix_pool_slab_size_kb" || key == "properties.posix_pool_slab_count") {
    if (!v.is_array() || v.empty()) return "not a non-empty list";
    for (const auto& item : v)
      if (auto bad = multiple(item, key.ends_with("size_kb") ? 4 : 1, 1, kMax)) return "an entry " + *bad;
    const auto* other = cufile.find(key.ends_with("size_kb") ? "properties.posix_pool_slab_count" : "properties.posix_pool_slab_size_kb");
    if (other && other->is_array() && other->size() != v.size())
      return fmt::format("{} entries, but the other posix_pool_slab list has {}", v.size(), other->size());
  }
  return std::nullopt;
}

void check_cufile_audit(const Root& root, const Inventory& inventory, const CufileConfig& cufile, const P2pdmaFacts& p2pdma,
                        bool nvidia_fs, std::vector<Check>& out) {
  if (!cufile.json || !cufile.json->is_object()) {
    if (cufile.json)
      out.push_back(make_check("gds.cufile_audit", kGroupGds, CheckStatus::fail, cufile.shown + " is not a JSON object", "{ \"properties\": {...} }",
                               "write the settings as one JSON object, as the shipped cufile.json does"));
    return;  // no file, or not JSON: gds.cufile_json says so
  }
  std::vector<std::pair<std::string, const nlohmann::json*>> settings;
  flatten(*cufile.json, "", settings);
  const bool have_gpu = !inventory.gpus.empty();
  const std::string& file = cufile.shown;
  const auto setting = [&](const std::string& key, CheckStatus status, const std::string& found, const std::string& expected = {},
                           const std::string& fix = {}) {
    out.push_back(make_check("gds.cufile_setting:" + key, kGroupGds, status, found, expected, fix));
  };
  std::vector<std::string> unknown, later;
  int bad = 0, modes = 0;
  for (const auto& [key, value] : settings) {
    if (!listed(kCufileKeys115, key)) {
      (listed(kCufileKeysLater, key) ? later : unknown).push_back(key);
      continue;
    }
    if (const auto why = out_of_range(key, *value, cufile)) {
      ++bad;
      setting(key, CheckStatus::warn, fmt::format("{}: {} out of range: {}", file, key, *why), "a value libcufile accepts",
              "correct it in " + file + " (libcufile falls back to its default or refuses to start)");
      continue;
    }
    const auto is_true = [&] { return value->is_boolean() && value->get<bool>(); };
    const auto is_false = [&] { return value->is_boolean() && !value->get<bool>(); };
    if (key == "properties.force_compat_mode" && is_true()) {
      ++modes;
      setting(key, have_gpu ? CheckStatus::warn : CheckStatus::info,
              "forces compatibility mode: every file goes through host memory, nvidia-fs and P2PDMA unused", "false",
              "set it to false in " + file);
    } else if (key == "properties.allow_compat_mode" && is_false()) {
      ++modes;
      const bool direct = nvidia_fs || p2pdma.ready();
      setting(key, have_gpu && !direct ? CheckStatus::warn : CheckStatus::info,
              fmt::format("forbids compatibility mode: a file cuFile cannot move by DMA fails instead of going through host memory{}",
                          direct ? "" : " (and no DMA mode is available here: nvidia-fs absent, P2PDMA not ready)"),
              direct ? "" : "true, or a DMA mode (nvidia-fs or P2PDMA)",
              direct ? "" : "set allow_compat_mode to true in " + file + ", or make nvidia-fs or P2PDMA available");
    } else if (key == "properties.use_pci_p2pdma" && is_true()) {
      ++modes;
      setting(key, CheckStatus::info, "selects P2PDMA mode for NVMe (see gds.p2pdma_mode)");
    } else if (key == "properties.gds_rdma_write_support" && is_false()) {
      ++modes;
      setting(key, CheckStatus::info, "writes to RDMA-backed file systems go through compatibility mode");
    } else if (key == "fs.generic.posix_unaligned_writes" && is_true()) {
      ++modes;
      setting(key, CheckStatus::info, "unaligned writes go through POSIX writes (compatibility), not GDS");
    } else if (key.ends_with(".posix_gds_min_kb") && value->is_number_integer() && value->get<long long>() > 0) {
      ++modes;
      setting(key, CheckStatus::info, fmt::format("I/O of {} KiB or less on {} goes through POSIX (compatibility)", value->dump(),
                                                  key.substr(3, key.find('.', 3) - 3)));
    } else if ((key.starts_with("denylist.") || key.starts_with("blacklist.")) && value->is_array() && !value->empty()) {
      ++modes;
      setting(key, CheckStatus::info, fmt::format("cuFile does no GDS I/O for these {}: {}", key.substr(key.find('.') + 1), value->dump()));
    } else if ((key == "execution.parallel_io" && is_false()) ||
               (key == "execution.max_io_threads" && value->is_number_integer() && value->get<long long>() == 0)) {
      ++modes;
      setting(key, CheckStatus::info, fmt::format("{} {}: one request is not split across cuFile's threads", key, value->dump()));
    }
  }
  // max_device_cache_size_kb / per_buffer_cache_size_kb bounce buffers must cover a batch.
  const auto number = [&](const char* key, long long fallback) {
    const auto* v = cufile.find(key);
    return v && v->is_number_integer() && v->get<long long>() > 0 ? v->get<long long>() : fallback;
  };
  const long long cache = number("properties.max_device_cache_size_kb", 131072), buffer = number("properties.per_buffer_cache_size_kb", 1024),
                  batch = number("properties.io_batchsize", 128);
  if (cache / buffer < batch) {
    ++bad;
    setting("properties.io_batchsize", CheckStatus::warn,
            fmt::format("{}: max_device_cache_size_kb / per_buffer_cache_size_kb = {} / {} = {} bounce buffers, fewer than io_batchsize {}",
                        file, cache, buffer, cache / buffer, batch),
            "max_device_cache_size_kb / per_buffer_cache_size_kb >= io_batchsize", "raise max_device_cache_size_kb or lower io_batchsize");
  }

  std::string version = "1.15";
  if (root.is_live()) {
    const auto& api = shim::CufileApi::instance();
    if (api.loaded()) version = api.version_string();
  }
  std::string found = fmt::format("{}: {} settings checked against libcufile 1.15's keys{}; {} out of range, {} that force or forbid a path",
                                  file, settings.size(), version == "1.15" ? "" : " (installed: " + version + ")", bad, modes);
  const auto names = [](const std::vector<std::string>& keys) {
    std::string text;
    for (const auto& k : keys) text += (text.empty() ? "" : ", ") + k;
    return text;
  };
  if (!unknown.empty()) found += "; unknown to libcufile (ignored): " + names(unknown);
  if (!later.empty()) found += "; known only to later libcufile (ignored by 1.15): " + names(later);
  if (!unknown.empty())
    out.push_back(make_check("gds.cufile_audit", kGroupGds, CheckStatus::warn, found, "only keys libcufile reads",
                             "correct the misspelt keys or remove them: libcufile ignores them silently"));
  else if (bad > 0 || !later.empty())
    out.push_back(make_check("gds.cufile_audit", kGroupGds, CheckStatus::info, found, "",
                             later.empty() ? "see the gds.cufile_setting lines" : "these keys take effect only with a newer libcufile"));
  else
    out.push_back(make_check("gds.cufile_audit", kGroupGds, CheckStatus::pass, found));
}

}  // namespace

namespace {

// Whether the tree is a container's view, and why it looks like one.
std::vector<std::string> container_markers(const Root& root) {
  std::vector<std::string> markers;
  if (root.exists(".dockerenv")) markers.push_back("/.dockerenv (Docker)");
  if (root.exists("run/.containerenv")) markers.push_back("/run/.containerenv (Podman)");
  if (root.exists("var/run/secrets/kubernetes.io/serviceaccount") || root.exists("run/secrets/kubernetes.io/serviceaccount"))
    markers.push_back("Kubernetes service account mounted");
  for (const char* file : {"proc/1/cgroup", "proc/self/cgroup"}) {
    const std::string text = root.read_file(file, 1 << 16).value_or("");
    std::string hits;
    for (const char* word : {"docker", "kubepods", "containerd", "libpod", "lxc", "enroot"})
      if (text.find(word) != std::string::npos) hits += (hits.empty() ? "" : ", ") + std::string(word);
    if (!hits.empty()) {
      markers.push_back(fmt::format("/{} names {}", file, hits));
      break;
    }
  }
  if (root.is_live())
    for (const char* variable : {"container", "KUBERNETES_SERVICE_HOST"})
      if (const char* value = std::getenv(variable); value && *value) markers.push_back(fmt::format("${}={}", variable, value));
  return markers;
}

// Library files named `stem`.so.<version> in the usual places; "libcuda.so.580.95.05" -> "580.95.05".
std::vector<std::pair<std::string, std::string>> find_libraries(const Root& root, std::string_view stem) {
  std::vector<std::pair<std::string, std::string>> found;
  const std::string prefix = std::string(stem) + ".so.";
  for (const char* dir : {"usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu",
                          "usr/local/cuda/lib64", "usr/local/cuda/targets/x86_64-linux/lib", "usr/local/cuda/targets/sbsa-linux/lib"})
    for (const auto& name : root.list(dir))
      if (name.starts_with(prefix) && name.size() > prefix.size() && std::isdigit(static_cast<unsigned char>(name[prefix.size()])))
        found.emplace_back("/" + std::string(dir) + "/" + name, name.substr(prefix.size()));
  return found;
}

void check_container(const Root& root, const Inventory& inventory, bool nvidia_fs, const CufileConfig& cufile, std::vector<Check>& out) {
  const auto markers = container_markers(root);
  std::string why;
  for (const auto& m : markers) why += (why.empty() ? "" : "; ") + m;
  if (markers.empty()) {
    out.push_back(make_check("gds.container", kGroupGds, CheckStatus::info,
                             "not in a container (no /.dockerenv, /run/.containerenv, Kubernetes account or container cgroup)"));
    return;
  }
  out.push_back(make_check("gds.container", kGroupGds, CheckStatus::info, "in a container: " + why));
  const bool have_gpu = !inventory.gpus.empty();

  // Device nodes: the GPU's, nvidia-fs's (the host's module is visible in /proc, its nodes only if passed in), RDMA's.
  std::vector<std::string> gpu_nodes, nvfs_nodes, rdma_nodes;
  for (const auto& name : root.list("dev")) {
    if (name.starts_with("nvidia-fs")) nvfs_nodes.push_back("/dev/" + name);
    else if (name == "nvidiactl" || name == "nvidia-uvm" || (name.starts_with("nvidia") && name.size() > 6 && std::isdigit(static_cast<unsigned char>(name[6]))))
      gpu_nodes.push_back("/dev/" + name);
  }
  for (const auto& name : root.list("dev/infiniband"))
    if (name == "rdma_cm" || name.starts_with("uverbs")) rdma_nodes.push_back("/dev/infiniband/" + name);
  const auto list = [](const std::vector<std::string>& items) {
    if (items.empty()) return std::string("none");
    std::string text;
    for (std::size_t i = 0; i < items.size() && i < 4; ++i) text += (text.empty() ? "" : " ") + items[i];
    return items.size() > 4 ? fmt::format("{} (+{} more)", text, items.size() - 4) : text;
  };
  const bool rdma_wanted = !inventory.rdma.empty() ||
                           std::any_of(inventory.nvme.begin(), inventory.nvme.end(), [](const NvmeController& c) { return c.transport == "rdma"; });
  const std::string devices = fmt::format("GPU nodes {}; nvidia-fs nodes {} (module {}); RDMA nodes {}", list(gpu_nodes), list(nvfs_nodes),
                                          nvidia_fs ? "loaded on the host" : "not loaded", list(rdma_nodes));
  std::vector<std::string> fixes;
  if (have_gpu && gpu_nodes.empty()) fixes.push_back("run with the NVIDIA container toolkit: docker run --gpus all (or --runtime=nvidia)");
  if (nvidia_fs && nvfs_nodes.empty())
    fixes.push_back("pass the nvidia-fs nodes in: --device /dev/nvidia-fs0 ... for each /dev/nvidia-fs* of the host (or NVIDIA_GDS=enabled with the toolkit)");
  if (rdma_wanted && rdma_nodes.empty()) fixes.push_back("pass /dev/infiniband/rdma_cm and /dev/infiniband/uverbs* in (--device) for NVMe-oF and RDMA file systems");
  std::string fix;
  for (const auto& f : fixes) fix += (fix.empty() ? "" : "; ") + f;
  if (!fixes.empty() && have_gpu)
    out.push_back(make_check("gds.container_devices", kGroupGds, CheckStatus::warn,
                             devices + (nvidia_fs && nvfs_nodes.empty() ? ": without the nvidia-fs nodes cuFile cannot use nvidia-fs here and falls back "
                                                                          "to compatibility mode (or P2PDMA where ready)"
                                                                        : ""),
                             "the GPU and nvidia-fs device nodes of the host", fix));
  else
    out.push_back(make_check("gds.container_devices", kGroupGds, have_gpu ? CheckStatus::pass : CheckStatus::info, devices, "", fix));

  // Mounts: the host's udev database, sysfs, and the cuFile configuration.
  const std::string mountinfo = root.read_file("proc/self/mountinfo").value_or("");
  const auto sys = find_mount(mountinfo, "/sys");
  const bool udev = root.is_directory("run/udev/data");
  const std::string mounts = fmt::format("/run/udev/data {}; /sys {}; {} {}", udev ? "present" : "absent",
                                         sys && sys->fs_type == "sysfs" ? "sysfs (" + sys->options.substr(0, 2) + ")" : "not sysfs",
                                         cufile.shown, cufile.text ? "visible" : "not visible");
  std::vector<std::string> mount_fixes;
  if (!udev) mount_fixes.push_back("bind the host's udev database: -v /run/udev:/run/udev:ro (libcufile refuses files without it)");
  if (!cufile.text) mount_fixes.push_back("bind the host's cufile.json: -v /etc/cufile.json:/etc/cufile.json:ro");
  if (!sys || sys->fs_type != "sysfs") mount_fixes.push_back("mount sysfs at /sys (read-only is enough)");
  std::string mount_fix;
  for (const auto& f : mount_fixes) mount_fix += (mount_fix.empty() ? "" : "; ") + f;
  out.push_back(make_check("gds.container_mounts", kGroupGds, !have_gpu ? CheckStatus::info : !udev ? CheckStatus::warn : CheckStatus::pass, mounts,
                           mount_fix.empty() ? "" : "/run/udev, /sys and cufile.json of the host", mount_fix));

  // Capabilities and the locked-memory limit: pinning buffers needs CAP_IPC_LOCK or a high limit.
  const std::string status = root.read_file("proc/self/status").value_or("");
  std::optional<unsigned long long> cap_eff;
  if (const auto at = status.find("CapEff:"); at != std::string::npos) cap_eff = std::strtoull(status.c_str() + at + 7, nullptr, 16);
  std::string memlock;
  if (const auto limits = root.read_file("proc/self/limits")) {
    std::istringstream in(*limits);
    for (std::string line; std::getline(in, line);)
      if (line.starts_with("Max locked memory")) {
        std::istringstream fields(line.substr(17));
        fields >> memlock;  // the soft limit
      }
  }
  const bool ipc_lock = cap_eff && (*cap_eff >> 14 & 1);
  const bool memlock_low = !memlock.empty() && memlock != "unlimited" && std::strtoull(memlock.c_str(), nullptr, 10) < (1ULL << 30);
  const std::string caps = fmt::format("CAP_IPC_LOCK {}; Max locked memory {}", !cap_eff ? "unknown" : ipc_lock ? "yes" : "no",
                                       memlock.empty() ? "unknown" : memlock == "unlimited" ? memlock : memlock + " bytes");
  if (have_gpu && cap_eff && !ipc_lock && memlock_low)
    out.push_back(make_check("gds.container_capabilities", kGroupGds, CheckStatus::warn, caps + ": pinning (cuFileBufRegister, bounce buffers) is limited",
                             "CAP_IPC_LOCK, or an unlimited locked-memory limit", "docker run --cap-add=IPC_LOCK (or --ulimit memlock=-1)"));
  else
    out.push_back(make_check("gds.container_capabilities", kGroupGds, cap_eff && have_gpu ? CheckStatus::pass : CheckStatus::info, caps));

  // Libraries inside against the driver outside: the user-space driver must match the kernel module.
  const auto version_text = root.read_file("proc/driver/nvidia/version");
  const std::string module = version_text ? driver_version_in(*version_text) : "";
  const auto libcuda = find_libraries(root, "libcuda");
  const auto libcufile = find_libraries(root, "libcufile");
  std::string libs = fmt::format("kernel module {}; libcuda", module.empty() ? "unknown" : module);
  std::vector<std::string> mismatched;
  for (const auto& [file, version] : libcuda) {
    libs += " " + file;
    if (!module.empty() && version != module && version != "1") mismatched.push_back(file);
  }
  if (libcuda.empty()) libs += " not found";
  libs += "; libcufile";
  for (const auto& [file, version] : libcufile) libs += " " + file;
  if (libcufile.empty()) libs += " not found in the usual directories";
  if (!mismatched.empty())
    out.push_back(make_check("gds.container_libraries", kGroupGds, CheckStatus::fail, libs + ": the user-space driver does not match the kernel module",
                             "libcuda.so." + module, "use the host's driver libraries (the NVIDIA container toolkit mounts them) instead of ones baked into the image"));
  else if (have_gpu && libcuda.empty())
    out.push_back(make_check("gds.container_libraries", kGroupGds, CheckStatus::warn, libs, "libcuda.so." + (module.empty() ? "<driver version>" : module),
                             "run with the NVIDIA container toolkit (--gpus all), which mounts the driver's libraries"));
  else
    out.push_back(make_check("gds.container_libraries", kGroupGds, have_gpu ? CheckStatus::pass : CheckStatus::info, libs));
}

}  // namespace

namespace {

// Which of the three modes (or a file system's own GDS client) cuFile will use for a file under
// one PATH, and why: the file system, its options, the block stack below it, and the modes this
// machine has (nvidia-fs loaded, P2PDMA ready, compatibility allowed).
void check_path_mode(const Root& root, const Inventory& inventory, const PathFacts& facts, const CufileConfig& cufile,
                     const P2pdmaFacts& p2pdma, bool nvidia_fs, std::vector<Check>& out) {
  const std::string id = "gds.mode:" + facts.path;
  const bool have_gpu = !inventory.gpus.empty();
  if (facts.fs_type.empty()) {
    out.push_back(make_check(id, kGroupGds, CheckStatus::info, "unknown: the file system of " + facts.path + " is unknown (see storage.path)"));
    return;
  }
  const bool compat_allowed = cufile.flag("properties.allow_compat_mode") != false;
  const std::string options = facts.mount_options + "," + facts.super_options;
  const auto has_option = [&](std::string_view option) {
    for (std::size_t at = options.find(option); at != std::string::npos; at = options.find(option, at + 1))
      if ((at == 0 || options[at - 1] == ',') && (at + option.size() == options.size() || options[at + option.size()] == ','))
        return true;
    return false;
  };
  std::string transport;  // of the NVMe controllers behind the path: "pcie", "rdma", "tcp", mixed
  for (const auto& name : facts.nvme_controllers)
    for (const auto& c : inventory.nvme)
      if (c.name == name && transport.find(c.transport) == std::string::npos) transport += (transport.empty() ? "" : "+") + c.transport;
  const std::string stack = facts.layers.empty() ? facts.block_device + " (" + facts.block_kind + ")" : facts.layers;
  const std::string on = fmt::format("{} on {}", facts.fs_type, facts.block_device.empty() ? facts.mount_point : stack);

  std::string direct;     // the DMA mode a file gets, empty for compatibility mode
  std::string why, fix;   // why not direct, and what would make it direct
  const auto by_nvidia_fs = [&](const std::string& what, const std::string& missing_fix) {
    if (nvidia_fs) direct = "nvidia-fs";
    else {
      why = what + " needs nvidia-fs, which is not loaded";
      fix = missing_fix;
    }
  };
  const std::string fs = facts.fs_type == "overlayfs" ? "overlay" : facts.fs_type;  // statfs's name on the live machine
  if (cufile.flag("properties.force_compat_mode") == true) {
    why = "force_compat_mode is true in " + cufile.shown;
    fix = "set force_compat_mode to false";
  } else if (fs == "nfs" || fs == "nfs4") {
    if (has_option("proto=rdma") || has_option("proto=rdma6")) by_nvidia_fs("NFS over RDMA", "install nvidia-gds and modprobe nvidia-fs (with MOFED's NFS over RDMA)");
    else {
      why = "NFS over TCP: GDS reads NFS only over RDMA";
      fix = "mount with proto=rdma (NFS over RDMA), with nvidia-fs loaded";
    }
  } else if (fs == "lustre") {
    by_nvidia_fs("Lustre", "install nvidia-gds and modprobe nvidia-fs, with a Lustre client built with GDS support (o2ib)");
  } else if (fs == "beegfs" || fs == "gpfs") {
    by_nvidia_fs(fs == "gpfs" ? "IBM Storage Scale (GPFS)" : "BeeGFS", "install nvidia-gds and modprobe nvidia-fs, and set up the file system's GDS support");
  } else if (fs == "wekafs") {
    if (root.exists("sys/module/nvidia_peermem")) direct = "WekaFS's RDMA client";
    else {
      why = "WekaFS moves data to GPU memory by RDMA, and nvidia_peermem is not loaded";
      fix = "modprobe nvidia_peermem and list the NICs in rdma_dev_addr_list";
    }
  } else if (fs == "ext4" || fs == "xfs") {
    if (facts.super_options.find("data=journal") != std::string::npos) {
      why = "ext4 data=journal has no O_DIRECT";
      fix = "remount with data=ordered";
    } else if (facts.direct_io_tried && !facts.direct_io_works) {
      why = "O_DIRECT failed here (see storage.o_direct)";
    } else if (!facts.dm_kind.empty()) {
      why = fmt::format("cuFile does not move data by DMA through device-mapper ({})", facts.dm_kind);
      fix = "keep the data on a plain NVMe partition or md RAID 0 over NVMe, not on LVM, dm-crypt or dm-multipath";
    } else if (facts.block_kind == "md RAID") {
      if (facts.md_level == "raid0" && facts.all_members_nvme) {
        by_nvidia_fs("md RAID 0 (P2PDMA mode does not serve RAID)", "install nvidia-gds and modprobe nvidia-fs (P2PDMA mode does not serve md RAID)");
      } else {
        why = fmt::format("md {} {}: GDS reads md RAID 0 over NVMe only", facts.md_level.empty() ? "RAID" : facts.md_level,
                          facts.all_members_nvme ? "over NVMe" : "not all on NVMe");
        fix = "use RAID 0 over NVMe for data read by GDS";
      }
    } else if (facts.block_kind == "NVMe" && (transport == "pcie" || transport.empty())) {
      if (nvidia_fs) direct = "nvidia-fs";
      else if (p2pdma.ready()) direct = "P2PDMA";
      else {
        why = "local NVMe, but nvidia-fs is not loaded and P2PDMA mode is not ready (see gds.p2pdma_mode)";
        fix = "load nvidia-fs, or make P2PDMA mode ready (gds.p2pdma_mode)";
      }
    } else if (facts.block_kind == "NVMe" && transport == "rdma") {
      by_nvidia_fs("NVMe over RDMA (P2PDMA mode does not serve NVMe-oF)", "install nvidia-gds and modprobe nvidia-fs, with MOFED's nvme-rdma");
    } else if (facts.block_kind == "NVMe") {
      why = fmt::format("NVMe over {}: GDS reads NVMe-oF over RDMA only", transport);
      fix = "connect the namespace over RDMA (nvme connect -t rdma)";
    } else {
      why = fmt::format("{} is not NVMe: cuFile moves data by DMA only from NVMe", facts.block_device.empty() ? "the device" : facts.block_device + " (" + facts.block_kind + ")");
      fix = "keep the data on NVMe (local, or NVMe-oF over RDMA)";
    }
  } else if (fs == "virtiofs") {
    why = "virtiofs: P2PDMA for virtiofs needs a libcufile later than 1.15 (fs.virtiofs.use_pci_p2pdma)";
  } else if (fs == "overlay") {
    why = "overlay (a container's image layers): no GDS";
    fix = "bind-mount the data from an ext4 or xfs file system on NVMe";
  } else {
    why = fs + " has no GDS support (GDS: ext4 and xfs on NVMe, NFS over RDMA, Lustre, GPFS, BeeGFS, WekaFS)";
    fix = "keep the data on ext4 or xfs on NVMe";
  }

  std::string found;
  CheckStatus status;
  if (!direct.empty()) {
    found = fmt::format("{}: {}", direct, on);
    status = CheckStatus::pass;
  } else if (compat_allowed) {
    found = fmt::format("compatibility mode (through host memory): {}; {}", on, why);
    status = have_gpu ? CheckStatus::warn : CheckStatus::info;
  } else {
    found = fmt::format("none: {}; {}, and allow_compat_mode is false: cuFile refuses the file (auto reads it another way)", on, why);
    status = have_gpu ? CheckStatus::warn : CheckStatus::info;
  }
  if (!have_gpu) found += "; no NVIDIA GPU here";
  out.push_back(make_check(id, kGroupGds, status, found, status == CheckStatus::pass || !have_gpu ? "" : "nvidia-fs or P2PDMA",
                           status == CheckStatus::pass || !have_gpu ? "" : fix));
}

}  // namespace

namespace {

// The CUFILE_* variables set, what each overrides, and those that force or forbid a mode.
void check_cufile_env(const Inventory& inventory, const CufileConfig& cufile, const P2pdmaFacts& p2pdma, bool nvidia_fs,
                      std::vector<Check>& out) {
  if (cufile.environment.empty()) {
    out.push_back(make_check("gds.cufile_env", kGroupGds, CheckStatus::info,
                             "no CUFILE_* variable in the environment: " + cufile.shown + " alone sets cuFile's behaviour"));
    return;
  }
  const bool have_gpu = !inventory.gpus.empty();
  std::vector<std::string> parts, problems, fixes;
  for (const auto& [name, value] : cufile.environment) {
    const auto* variable = cufile_variable(name);
    std::string part = name + "=" + value;
    if (!variable) {
      part += " (not a variable the doctor knows cuFile to read: misspelt?)";
    } else if (variable->boolean) {
      const auto on = environment_flag(value);
      const auto* in_file = cufile.find(variable->setting);
      const std::string file_value = in_file ? in_file->dump() : "unset";
      if (!on) {
        part += fmt::format(" (not true, false, 1 or 0: {} stays {} from {})", variable->setting, file_value, cufile.shown);
        problems.push_back(name + " is not a boolean");
        fixes.push_back(fmt::format("set {} to true or false", name));
      } else {
        part += fmt::format(" (overrides {}: {} in {})", variable->setting, file_value, cufile.shown);
        if (variable->setting == "properties.force_compat_mode" && *on && have_gpu) {
          problems.push_back(name + " forces compatibility mode: every file goes through host memory");
          fixes.push_back("unset " + name);
        } else if (variable->setting == "properties.allow_compat_mode" && !*on && have_gpu && !nvidia_fs && !p2pdma.ready()) {
          problems.push_back(name + " forbids compatibility mode and no DMA mode is available here: cuFile refuses every file");
          fixes.push_back("unset " + name + ", or make nvidia-fs or P2PDMA available");
        }
      }
    } else if (name == "CUFILE_LOGGING_LEVEL") {
      static constexpr std::string_view levels[] = {"NOTICE", "ERROR", "WARN", "INFO", "DEBUG", "TRACE"};
      if (std::find(std::begin(levels), std::end(levels), value) == std::end(levels)) {
        part += " (not one of NOTICE, ERROR, WARN, INFO, DEBUG, TRACE)";
        problems.push_back(name + " is not a log level");
        fixes.push_back("set " + name + " to one of NOTICE, ERROR, WARN, INFO, DEBUG, TRACE");
      } else {
        part += " (overrides logging.level)";
      }
    } else {
      part += " (" + std::string(variable->what) + ")";
    }
    parts.push_back(part);
  }
  std::string found;
  for (const auto& p : parts) found += (found.empty() ? "" : "; ") + p;
  found = "environment: " + found;
  if (problems.empty()) {
    out.push_back(make_check("gds.cufile_env", kGroupGds, CheckStatus::info, found));
    return;
  }
  std::string why, fix;
  for (const auto& p : problems) why += (why.empty() ? "" : "; ") + p;
  for (const auto& f : fixes) fix += (fix.empty() ? "" : "; ") + f;
  out.push_back(make_check("gds.cufile_env", kGroupGds, CheckStatus::warn, found + ": " + why,
                           "CUFILE_* variables that do not force, forbid or garble a setting", fix));
}

// One line of the kernel log, the message only: /dev/kmsg writes "6,339,5140900,-;text".
std::string kernel_message(std::string_view line) {
  const auto semicolon = line.find(';');
  const auto comma = line.find(',');
  if (semicolon != std::string_view::npos && comma != std::string_view::npos && comma < semicolon &&
      std::isdigit(static_cast<unsigned char>(line[0])))
    line.remove_prefix(semicolon + 1);
  return std::string(line);
}

// The kernel's log: /dev/kmsg (live: every record still in the ring buffer; a recorded tree may
// hold a copy at dev/kmsg), else the syslog files. `denied` says why /dev/kmsg could not be read.
std::optional<std::string> read_kernel_log(const Root& root, std::string& source, std::string& denied) {
  constexpr std::size_t kLimit = 8u << 20;
  if (root.is_live()) {
    const int fd = ::open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      denied = fmt::format("/dev/kmsg: {}", std::strerror(errno));
    } else {
      // Each read returns one record; EAGAIN: none left; EPIPE: the next was overwritten, go on.
      std::string text;
      char record[8192];
      for (int skipped = 0; text.size() < kLimit && skipped < 1000;) {
        const ssize_t n = ::read(fd, record, sizeof record);
        if (n > 0) text.append(record, static_cast<std::size_t>(n));
        else if (n < 0 && errno == EPIPE) ++skipped;
        else if (n < 0 && errno == EINTR) continue;
        else break;
      }
      const int error = errno;
      ::close(fd);
      if (!text.empty() || error == EAGAIN) {
        source = "/dev/kmsg";
        return text;
      }
      denied = fmt::format("/dev/kmsg: {}", std::strerror(error));
    }
  } else if (root.exists("dev/kmsg")) {
    if (auto text = root.read_file("dev/kmsg", kLimit)) {
      source = "/dev/kmsg";
      return text;
    }
    denied = "/dev/kmsg: not readable";
  }
  for (const char* file : {"var/log/kern.log", "var/log/dmesg", "var/log/messages", "var/log/syslog"}) {
    // The end of a long log: the current boot's lines are last.
    std::ifstream in(root.path(file), std::ios::binary | std::ios::ate);
    if (!in) continue;
    const auto size = static_cast<std::size_t>(std::max<std::streamoff>(in.tellg(), 0));
    in.seekg(static_cast<std::streamoff>(size > kLimit ? size - kLimit : 0));
    std::string text(std::istreambuf_iterator<char>(in), {});
    source = "/" + std::string(file);
    return text;
  }
  return std::nullopt;
}

bool contains_any(const std::string& lowered, std::initializer_list<std::string_view> words) {
  return std::any_of(words.begin(), words.end(), [&](std::string_view w) { return lowered.find(w) != std::string::npos; });
}

// Errors from nvidia-fs, NVMe and the GPU driver in the kernel log: what the kernel saw go wrong
// under a transfer that cuFile or the engines only report as a failed read.
void check_kernel_log(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  std::string source, denied;
  const auto text = read_kernel_log(root, source, denied);
  if (!text) {
    const auto restrict = root.read_attribute("proc/sys/kernel/dmesg_restrict");
    std::string found = denied.empty() ? "no kernel log: no /dev/kmsg and no /var/log/kern.log, dmesg, messages or syslog"
                                       : "kernel log not readable: " + denied + "; no /var/log/kern.log, dmesg, messages or syslog";
    if (restrict == "1") found += " (kernel.dmesg_restrict=1: reading the kernel log needs root or CAP_SYSLOG)";
    out.push_back(make_check("gds.kernel_log", kGroupGds, CheckStatus::info, found, "",
                             denied.empty() ? "" : "run hbmio doctor as root (sudo) to include nvidia-fs, NVMe and GPU errors from the kernel log"));
    return;
  }
  struct Kind {
    const char* name;
    const char* fix;
    std::vector<std::string> lines;
  };
  Kind nvfs{"nvidia-fs", "look the message up in NVIDIA's GDS troubleshooting guide; after fixing, reload it: modprobe -r nvidia_fs && modprobe nvidia_fs", {}};
  Kind peermem{"nvidia_peermem", "reload it after the NVIDIA driver and MOFED/DOCA it was built against: modprobe nvidia_peermem", {}};
  Kind nvme{"NVMe", "check the drive and its link: nvme smart-log /dev/nvmeX, nvme error-log /dev/nvmeX, and the PCIe link (gpu.link, storage lines)", {}};
  Kind xid{"GPU (NVRM Xid)", "look the Xid up in NVIDIA's Xid catalog; nvidia-smi -q shows the GPU's state", {}};
  std::size_t lines = 0;
  std::istringstream in(*text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == ' ') continue;  // /dev/kmsg's continuation lines (SUBSYSTEM=...)
    ++lines;
    const std::string message = kernel_message(line);
    std::string lowered = message;
    std::transform(lowered.begin(), lowered.end(), lowered.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool bad = contains_any(lowered, {"error", "fail", "not supported", "unable", "mismatch", "invalid", "timeout", "denied"});
    if (lowered.find("nvrm: xid") != std::string::npos) xid.lines.push_back(message);
    else if (bad && contains_any(lowered, {"nvidia-fs", "nvidia_fs", "nvfs"})) nvfs.lines.push_back(message);
    else if (bad && lowered.find("nvidia_peermem") != std::string::npos) peermem.lines.push_back(message);
    // NVMe: "I/O ... timeout, aborting", "I/O Error", resets; not "Shutdown timeout set to 10 seconds".
    else if (lowered.find("nvme") != std::string::npos &&
             contains_any(lowered, {"error", "fail", "abort", "timeout,", "resetting", "controller is down", "not supported"}))
      nvme.lines.push_back(message);
  }
  std::string found = fmt::format("{}: {} lines read", source, lines), fix;
  bool any = false;
  for (const Kind* kind : {&nvfs, &peermem, &nvme, &xid}) {
    if (kind->lines.empty()) continue;
    any = true;
    std::string last = kind->lines.back();
    if (last.size() > 160) last = last.substr(0, 157) + "...";
    found += fmt::format("; {} {} error line{} (last: \"{}\")", kind->lines.size(), kind->name, kind->lines.size() == 1 ? "" : "s", last);
    fix += (fix.empty() ? "" : "; ") + std::string(kind->name) + ": " + kind->fix;
  }
  if (!any) {
    found += "; no nvidia-fs, nvidia_peermem, NVMe or GPU (Xid) errors";
    out.push_back(make_check("gds.kernel_log", kGroupGds, CheckStatus::pass, found));
  } else {
    out.push_back(make_check("gds.kernel_log", kGroupGds, inventory.gpus.empty() && nvme.lines.empty() ? CheckStatus::info : CheckStatus::warn,
                             found, "no errors from nvidia-fs, NVMe or the GPU driver", fix));
  }
}

// "1.15.1" -> {1, 15, 1}; nothing for text that does not start with a number ("unknown (before
// GDS 1.8)").
std::vector<int> version_numbers(std::string_view text) {
  std::vector<int> numbers;
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return numbers;
  for (std::size_t at = 0; at < text.size();) {
    if (!std::isdigit(static_cast<unsigned char>(text[at]))) {
      if (text[at] != '.') break;
      ++at;
      continue;
    }
    int n = 0;
    while (at < text.size() && std::isdigit(static_cast<unsigned char>(text[at]))) n = n * 10 + (text[at++] - '0');
    numbers.push_back(n);
  }
  return numbers;
}

bool at_least(const std::vector<int>& version, std::initializer_list<int> minimum) {
  return std::lexicographical_compare(version.begin(), version.end(), minimum.begin(), minimum.end()) == false;
}

// What the cufile.json and the PATHs use that needs a libcufile newer than the one installed.
// The releases that brought each: NVIDIA gds-diag's file-system matrix (checks/fs_matrix.py,
// from the GDS release notes: compatibility mode on tmpfs, ramfs, squashfs and overlay from 1.16,
// on zfs and btrfs from 1.17) and its configuration schema (properties.gpu_bounce_buffer_slab_config,
// 1.17); keys only later releases read are the audit's list above.
// The libcufile loads would use: the one loaded here (live), else the highest
// libcufile.so.<version> in the usual directories. {version text, where}; empty when unknown.
std::pair<std::string, std::string> installed_libcufile(const Root& root) {
  std::string version_text, where;
  if (root.is_live()) {
    const auto& api = shim::CufileApi::instance();
    if (api.loaded()) {
      version_text = api.version_string();
      where = api.library_path();
    }
  }
  if (version_text.empty() || version_numbers(version_text).size() < 2) {
    for (const auto& [file, version] : find_libraries(root, "libcufile"))
      if (version_text.empty() || version_numbers(version) > version_numbers(version_text)) {
        version_text = version;
        where = file;
      }
  }
  return {version_text, where};
}

void check_cufile_version(const Root& root, const CufileConfig& cufile, const std::vector<PathFacts>& paths, std::vector<Check>& out) {
  const auto [version_text, where] = installed_libcufile(root);
  const auto version = version_numbers(version_text);
  struct Need {
    std::string what;
    int major, minor;
  };
  std::vector<Need> needs;
  for (const auto& facts : paths) {
    const std::string fs = facts.fs_type == "overlayfs" ? "overlay" : facts.fs_type;
    if (fs == "tmpfs" || fs == "ramfs" || fs == "squashfs" || fs == "overlay")
      needs.push_back({fmt::format("{} on {} (compatibility mode there)", facts.path, fs), 1, 16});
    else if (fs == "zfs" || fs == "btrfs")
      needs.push_back({fmt::format("{} on {} (compatibility mode there)", facts.path, fs), 1, 17});
  }
  if (cufile.find("properties.gpu_bounce_buffer_slab_config")) needs.push_back({"properties.gpu_bounce_buffer_slab_config in " + cufile.shown, 1, 17});
  std::vector<std::string> later;
  if (cufile.json && cufile.json->is_object()) {
    std::vector<std::pair<std::string, const nlohmann::json*>> settings;
    flatten(*cufile.json, "", settings);
    for (const auto& [key, value] : settings)
      if (listed(kCufileKeysLater, key) && key != "properties.gpu_bounce_buffer_slab_config") later.push_back(key);  // that one is above
  }
  std::string in_use;
  for (const auto& n : needs) in_use += fmt::format("{}{} (libcufile {}.{} or later)", in_use.empty() ? "" : "; ", n.what, n.major, n.minor);
  if (!later.empty())
    in_use += fmt::format("{}{} key{} of releases after 1.15 in {}", in_use.empty() ? "" : "; ", later.size(), later.size() == 1 ? "" : "s", cufile.shown);
  if (in_use.empty()) in_use = "nothing that needs a particular release";
  if (version.size() < 2) {
    out.push_back(make_check("gds.cufile_version", kGroupGds, CheckStatus::info,
                             "libcufile version unknown (not loadable here, no libcufile.so.<version> in the usual directories); in use: " + in_use));
    return;
  }
  std::vector<std::string> missing;
  for (const auto& n : needs)
    if (!at_least(version, {n.major, n.minor})) missing.push_back(fmt::format("{} needs {}.{}", n.what, n.major, n.minor));
  if (!later.empty() && !at_least(version, {1, 16}))
    missing.push_back(fmt::format("{} read only by releases after 1.15 (ignored)", fmt::join(later, ", ")));
  const std::string found = fmt::format("libcufile {} ({}); in use: {}", version_text, where, in_use);
  if (missing.empty()) {
    out.push_back(make_check("gds.cufile_version", kGroupGds, CheckStatus::pass, found));
  } else {
    std::string why;
    for (const auto& m : missing) why += (why.empty() ? "" : "; ") + m;
    out.push_back(make_check("gds.cufile_version", kGroupGds, CheckStatus::warn, found + ": " + why,
                             "a libcufile that serves what the PATHs and cufile.json use",
                             "install a newer libcufile (the CUDA toolkit's, or pip install nvidia-cufile-cu13), or keep the data on ext4/xfs"));
  }
}

// The CUDA release each libcufile came with (the CUDA toolkit ships it; NVIDIA's conda channel
// labels each libcufile build with its toolkit: 1.0 with 11.4 ... 1.13 with 12.8, 1.15 with 13.0,
// 1.18 with 13.3; there was no 1.12). {libcufile major, minor, CUDA major, minor}.
struct CufileRelease {
  int major, minor, cuda_major, cuda_minor;
};
constexpr CufileRelease kCufileReleases[] = {
    {1, 0, 11, 4},  {1, 1, 11, 5},  {1, 2, 11, 6},  {1, 3, 11, 7},  {1, 4, 11, 8},  {1, 5, 12, 0},  {1, 6, 12, 1},
    {1, 7, 12, 2},  {1, 8, 12, 3},  {1, 9, 12, 4},  {1, 10, 12, 5}, {1, 11, 12, 6}, {1, 13, 12, 8}, {1, 14, 12, 9},
    {1, 15, 13, 0}, {1, 16, 13, 1}, {1, 17, 13, 2}, {1, 18, 13, 3},
};

// The oldest driver that runs any release of a CUDA major version (CUDA's minor-version
// compatibility, from its compatibility guide): 11.x 450.80.02, 12.x 525.60.13, 13.x 580.65.06.
// A release newer than the driver's own runs on it, less the features that need a newer driver.
const char* oldest_driver_for(int cuda_major) {
  switch (cuda_major) {
    case 11: return "450.80.02";
    case 12: return "525.60.13";
    case 13: return "580.65.06";
    default: return nullptr;
  }
}

// What the installed driver, the CUDA runtime hbmio was built with and the installed libcufile
// allow together: gds-diag's support matrix, applied to this machine. A component the driver is
// too old for cannot start (cudaErrorInsufficientDriver: no GPU transfer at all, or cuFile
// refuses to open: every GPU read bounces through host memory); P2PDMA mode needs libcufile 1.13
// (CUDA 12.8) or later.
void check_support_matrix(const Root& root, const P2pdmaFacts& p2pdma, bool nvidia_fs, std::vector<Check>& out) {
  const auto version_text = root.read_file("proc/driver/nvidia/version");
  const std::string driver_text =
      version_text ? driver_version_in(*version_text) : root.read_attribute("sys/module/nvidia/version").value_or("");
  const auto driver = version_numbers(driver_text);
  const auto [cufile_text, cufile_where] = installed_libcufile(root);
  const auto cufile = version_numbers(cufile_text);
  std::optional<CufileRelease> release;
  if (cufile.size() >= 2)
    for (const auto& r : kCufileReleases)
      if (r.major == cufile[0] && r.minor == cufile[1]) release = r;
  const int built = cuda_built_version();  // 13000 for 13.0

  std::vector<std::string> found, problems, notes;
  found.push_back(driver.empty() ? "driver unknown (no NVIDIA kernel module)" : "driver " + driver_text);
  if (built > 0) found.push_back(fmt::format("hbmio built with CUDA {}.{}", built / 1000, built % 1000 / 10));
  if (cufile.size() >= 2)
    found.push_back(release ? fmt::format("libcufile {} (CUDA {}.{})", cufile_text, release->cuda_major, release->cuda_minor)
                            : fmt::format("libcufile {} (a release this doctor does not know)", cufile_text));
  else
    found.push_back("libcufile not found");

  const auto needs = [&](const std::string& who, int cuda_major) {
    const char* oldest = oldest_driver_for(cuda_major);
    if (!oldest || driver.empty()) return;
    const auto minimum = version_numbers(oldest);
    if (std::lexicographical_compare(driver.begin(), driver.end(), minimum.begin(), minimum.end()))
      problems.push_back(fmt::format("{} needs a driver of {} or later (CUDA {}.x); driver {} is older", who, oldest,
                                     cuda_major, driver_text));
  };
  if (built > 0) needs("hbmio's CUDA runtime", built / 1000);
  if (release) needs(fmt::format("libcufile {}", cufile_text), release->cuda_major);
  if (release && built > 0 && release->cuda_major != built / 1000)
    notes.push_back(fmt::format("libcufile of CUDA {} beside hbmio's CUDA {}: cuFile's C interface is the same; "
                                "one toolkit's pair is what NVIDIA tests",
                                release->cuda_major, built / 1000));

  // The modes each allows, as this machine has them.
  std::vector<std::string> modes;
  if (cufile.size() >= 2) {
    modes.push_back("compatibility mode");
    if (nvidia_fs) modes.push_back("nvidia-fs DMA");
    const bool p2pdma_release = at_least(cufile, {1, 13});
    if (p2pdma_release && p2pdma.capable()) modes.push_back("P2PDMA DMA");
    if (!p2pdma_release && (p2pdma.requested || (!nvidia_fs && p2pdma.capable())))
      problems.push_back(fmt::format("P2PDMA mode needs libcufile 1.13 (CUDA 12.8) or later; libcufile {} {}", cufile_text,
                                     p2pdma.requested ? "ignores use_pci_p2pdma in cufile.json" : "cannot use this machine's P2PDMA"));
  }
  std::string text = fmt::format("{}", fmt::join(found, "; "));
  if (!modes.empty()) text += fmt::format("; they allow: {}", fmt::join(modes, ", "));
  for (const auto& n : notes) text += "; " + n;

  if (driver.empty() && cufile.size() < 2) {
    out.push_back(make_check("gds.support_matrix", kGroupGds, CheckStatus::info, text));
  } else if (!problems.empty()) {
    // A driver older than a component's CUDA major stops it; an old libcufile only costs a mode.
    const bool stops = std::any_of(problems.begin(), problems.end(), [](const std::string& p) { return p.find("needs a driver") != std::string::npos; });
    out.push_back(make_check("gds.support_matrix", kGroupGds, stops ? CheckStatus::fail : CheckStatus::warn,
                             text + ": " + fmt::format("{}", fmt::join(problems, "; ")),
                             "a driver, CUDA runtime and libcufile that serve each other",
                             stops ? "install a newer NVIDIA driver (or the CUDA forward-compatibility package on data-center GPUs), "
                                     "or use hbmio and libcufile built for the driver's CUDA"
                                   : "install the libcufile of CUDA 12.8 or later (pip install nvidia-cufile-cu13, or the CUDA toolkit's)"));
  } else {
    out.push_back(make_check("gds.support_matrix", kGroupGds, CheckStatus::pass, text));
  }
}

// The IPv4 addresses this machine owns, from /proc/net/fib_trie ("|-- 10.0.0.5" followed by
// "/32 host LOCAL"); nothing when it cannot be read.
std::optional<std::vector<std::string>> local_addresses(const Root& root) {
  const auto text = root.read_file("proc/net/fib_trie", 4 << 20);
  if (!text) return std::nullopt;
  std::vector<std::string> addresses;
  std::istringstream in(*text);
  std::string last;
  for (std::string line; std::getline(in, line);) {
    if (const auto at = line.find("|-- "); at != std::string::npos) last = attribute_value(line.substr(at + 4));
    else if (line.find("host LOCAL") != std::string::npos && !last.empty() &&
             std::find(addresses.begin(), addresses.end(), last) == addresses.end())
      addresses.push_back(last);
  }
  return addresses;
}

bool is_ipv4(const std::string& text) {
  int parts = 0;
  for (std::size_t at = 0; at <= text.size(); ++parts) {
    const auto end = std::min(text.find('.', at), text.size());
    const std::string part = text.substr(at, end - at);
    if (part.empty() || part.size() > 3 || part.find_first_not_of("0123456789") != std::string::npos || std::stoi(part) > 255) return false;
    at = end + 1;
  }
  return parts == 4;
}

void collect_strings(const nlohmann::json& node, std::vector<std::string>& out) {
  if (node.is_string()) out.push_back(node.get<std::string>());
  else if (node.is_array() || node.is_object())
    for (const auto& item : node) collect_strings(item, out);
}

// A PATH on IBM Storage Scale (GPFS) or WekaFS: cuFile moves its data by its own (user-space) RDMA,
// which needs the client NICs in rdma_dev_addr_list (without them cuFile uses compatibility mode:
// the cuFile API reference, "cuFile Compatibility Mode"), nvidia_peermem or dma-buf to register GPU
// memory, and write support switched on per file system; with several GPUs and NICs gds-diag
// recommends the RoundRobinMaxMin policy.
void check_rdma_config(const Root& root, const Inventory& inventory, const PathFacts& facts, const CufileConfig& cufile,
                       std::vector<Check>& out) {
  const std::string fs = facts.fs_type;
  if (fs != "gpfs" && fs != "wekafs") return;
  const std::string section = fs == "gpfs" ? "gpfs" : "weka";
  const std::string name = fs == "gpfs" ? "IBM Storage Scale (GPFS)" : "WekaFS";
  std::vector<std::string> addresses, sources;
  for (const auto& key : std::vector<std::string>{"properties.rdma_dev_addr_list", "fs." + section + ".rdma_dev_addr_list", "fs." + section + ".mount_table"})
    if (const auto* value = cufile.find(key)) {
      const auto before = addresses.size();
      collect_strings(*value, addresses);
      if (addresses.size() > before) sources.push_back(key);
    }
  std::vector<std::string> parts, problems, fixes;
  parts.push_back(addresses.empty() ? fmt::format("no rdma_dev_addr_list in {}", cufile.shown)
                                    : fmt::format("rdma_dev_addr_list {} (from {})", fmt::join(addresses, ", "), fmt::join(sources, ", ")));
  if (addresses.empty()) {
    problems.push_back(name + " without rdma_dev_addr_list goes through compatibility mode");
    fixes.push_back("list this machine's RDMA NIC addresses in properties.rdma_dev_addr_list of " + cufile.shown);
  } else {
    std::vector<std::string> invalid, foreign;
    const auto local = local_addresses(root);
    for (const auto& a : addresses) {
      if (!is_ipv4(a)) invalid.push_back(a);
      else if (local && std::find(local->begin(), local->end(), a) == local->end()) foreign.push_back(a);
    }
    if (!invalid.empty()) {
      problems.push_back(fmt::format("not IPv4 addresses: {}", fmt::join(invalid, ", ")));
      fixes.push_back("write each entry as an IPv4 address");
    }
    if (!foreign.empty()) {
      problems.push_back(fmt::format("not addresses of this machine (/proc/net/fib_trie): {}", fmt::join(foreign, ", ")));
      fixes.push_back("rdma_dev_addr_list names this client's own RDMA NIC addresses, not the storage servers'");
    }
    if (!local) parts.push_back("this machine's addresses unknown (no /proc/net/fib_trie)");
  }
  const bool peermem = root.exists("sys/module/nvidia_peermem");
  const auto* peer_type = cufile.find("properties.rdma_peer_type");
  const bool dmabuf = peer_type && peer_type->is_string() && peer_type->get<std::string>() == "dmabuf";
  parts.push_back(fmt::format("nvidia_peermem {}, rdma_peer_type {}", peermem ? "loaded" : "not loaded", peer_type ? peer_type->dump() : "unset"));
  if (!peermem && !dmabuf) {
    problems.push_back("GPU memory cannot be registered for RDMA: neither nvidia_peermem nor dma-buf");
    fixes.push_back("modprobe nvidia_peermem (or set \"rdma_peer_type\": \"dmabuf\" with a libcufile that reads it)");
  }
  // Writes: off unless the file system's switch is on, and gds_rdma_write_support false overrides it.
  const std::string write_key = fs == "gpfs" ? "fs.gpfs.gds_write_support" : "fs.weka.rdma_write_support";
  const bool writes = cufile.flag(write_key) == true && cufile.flag("properties.gds_rdma_write_support") != false;
  parts.push_back(writes ? "writes by RDMA" : fmt::format("writes through compatibility mode ({} not true{})", write_key,
                                                           cufile.flag("properties.gds_rdma_write_support") == false ? ", or gds_rdma_write_support false" : ""));
  std::size_t active_nics = 0;
  for (const auto& r : inventory.rdma) active_nics += r.active() ? 1 : 0;
  const auto* policy = cufile.find("properties.rdma_load_balancing_policy");
  const std::string policy_text = policy && policy->is_string() ? policy->get<std::string>() : "RoundRobin (default)";
  parts.push_back("rdma_load_balancing_policy " + policy_text);
  std::string advice;
  if (inventory.gpus.size() > 1 && active_nics > 1 && !policy_text.starts_with("RoundRobinMaxMin"))
    advice = fmt::format("{} GPUs and {} active RDMA NICs: NVIDIA's gds-diag recommends \"rdma_load_balancing_policy\": \"RoundRobinMaxMin\", "
                         "which spreads GPUs over the nearest NICs least shared",
                         inventory.gpus.size(), active_nics);
  std::string found;
  for (const auto& p : parts) found += (found.empty() ? "" : "; ") + p;
  found = fmt::format("{} at {}: {}", name, facts.path, found);
  const std::string id = "gds.rdma_config:" + facts.path;
  if (problems.empty()) {
    out.push_back(make_check(id, kGroupGds, advice.empty() ? CheckStatus::pass : CheckStatus::info, found, "", advice));
    return;
  }
  std::string why, fix;
  for (const auto& p : problems) why += (why.empty() ? "" : "; ") + p;
  for (const auto& f : fixes) fix += (fix.empty() ? "" : "; ") + f;
  if (!advice.empty()) fix += "; " + advice;
  out.push_back(make_check(id, kGroupGds, inventory.gpus.empty() ? CheckStatus::info : CheckStatus::warn, found + ": " + why,
                           "rdma_dev_addr_list with this machine's RDMA NICs, and nvidia_peermem or dma-buf", fix));
}

}  // namespace

void check_gds(const Root& root, const Inventory& inventory, const std::vector<PathFacts>& paths, std::vector<Check>& out) {
  const bool have_gpu = !inventory.gpus.empty();
  if (root.is_live()) {
    const auto& api = shim::CufileApi::instance();
    if (api.loaded())
      out.push_back(make_check("gds.libcufile", kGroupGds, CheckStatus::pass,
                               fmt::format("{} (cuFile {})", api.library_path(), api.version_string())));
    else
      out.push_back(make_check("gds.libcufile", kGroupGds, have_gpu ? CheckStatus::warn : CheckStatus::info, api.load_error(),
                               "libcufile.so.0 loadable",
                               "install it (CUDA toolkit, or pip install nvidia-cufile-cu13) or set HBMIO_CUFILE_LIBRARY"));
  } else {
    out.push_back(make_check("gds.libcufile", kGroupGds, CheckStatus::info, kSkippedForRoot));
  }

  const CufileConfig cufile = load_cufile_config(root);
  check_cufile_json(root, inventory, cufile, out);

  const auto nvidia_fs = root.read_file("proc/driver/nvidia-fs/version");
  if (nvidia_fs) {
    std::string text = *nvidia_fs;
    text.erase(std::find(text.begin(), text.end(), '\0'), text.end());
    std::replace(text.begin(), text.end(), '\n', ' ');
    out.push_back(make_check("gds.nvidia_fs", kGroupGds, CheckStatus::pass, "/proc/driver/nvidia-fs/version: " + attribute_value(text)));
  } else {
    out.push_back(make_check("gds.nvidia_fs", kGroupGds, have_gpu ? CheckStatus::warn : CheckStatus::info,
                             "nvidia-fs not loaded (no /proc/driver/nvidia-fs/version)", "nvidia-fs loaded (or PCI P2PDMA)",
                             "install nvidia-gds and modprobe nvidia-fs; without it cuFile needs PCI P2PDMA or runs in compatibility mode"));
  }

  bool kallsyms_readable = false;
  const bool p2pdma = kernel_has_symbol(root, "p2pdma_pgmap_ops", kallsyms_readable);
  if (!kallsyms_readable) {
    out.push_back(make_check("gds.p2pdma", kGroupGds, CheckStatus::info, "/proc/kallsyms not readable: PCI P2PDMA support unknown"));
  } else if (p2pdma) {
    out.push_back(make_check("gds.p2pdma", kGroupGds, CheckStatus::pass,
                             "kernel has PCI P2PDMA (p2pdma_pgmap_ops in /proc/kallsyms)", "",
                             ""));
  } else {
    out.push_back(make_check("gds.p2pdma", kGroupGds, have_gpu && !nvidia_fs ? CheckStatus::warn : CheckStatus::info,
                             "kernel without PCI P2PDMA (no p2pdma_pgmap_ops in /proc/kallsyms)", "CONFIG_PCI_P2PDMA=y",
                             "cuFile's P2PDMA mode (no nvidia-fs) needs a kernel built with CONFIG_PCI_P2PDMA"));
  }

  const P2pdmaFacts p2pdma_facts = find_p2pdma_facts(root, inventory, cufile);
  check_p2pdma_mode(root, inventory, cufile, p2pdma_facts, nvidia_fs.has_value(), out);
  check_cufile_audit(root, inventory, cufile, p2pdma_facts, nvidia_fs.has_value(), out);
  check_cufile_env(inventory, cufile, p2pdma_facts, nvidia_fs.has_value(), out);
  check_cufile_version(root, cufile, paths, out);
  check_support_matrix(root, p2pdma_facts, nvidia_fs.has_value(), out);
  check_container(root, inventory, nvidia_fs.has_value(), cufile, out);

  if (!root.is_live() && !root.exists("run")) {
    out.push_back(make_check("gds.udev", kGroupGds, CheckStatus::info, "no /run in this tree: udev unknown"));
  } else if (root.is_directory("run/udev/data")) {
    out.push_back(make_check("gds.udev", kGroupGds, CheckStatus::pass, "/run/udev/data present (libcufile finds block devices there)"));
  } else {
    out.push_back(make_check("gds.udev", kGroupGds, have_gpu ? CheckStatus::warn : CheckStatus::info,
                             "no /run/udev/data (a container or micro-VM without udevd)", "/run/udev/data",
                             "libcufile refuses every file (5027) without udev data: run systemd-udevd, or set "
                             "CUFILE_EXPERIMENTAL_FS=1 (compatibility mode only)"));
  }

  for (const auto& facts : paths) check_path_mode(root, inventory, facts, cufile, p2pdma_facts, nvidia_fs.has_value(), out);
  for (const auto& facts : paths) check_rdma_config(root, inventory, facts, cufile, out);

  for (const auto& facts : paths) {
    const std::string id = "gds.verdict:" + facts.path;
    if (!root.is_live()) {
      out.push_back(make_check(id, kGroupGds, CheckStatus::info, kSkippedForRoot));
    } else if (!facts.verdict_tried) {
      out.push_back(make_check(id, kGroupGds, CheckStatus::info,
                               "not tried: " + (facts.cufile_reason.empty() ? std::string("no file to register") : facts.cufile_reason)));
    } else if (facts.cufile_usable && facts.cufile_direct) {
      out.push_back(make_check(id, kGroupGds, CheckStatus::pass, "cuFile registered the file: " + facts.cufile_mode));
    } else if (facts.cufile_usable) {
      out.push_back(make_check(id, kGroupGds, CheckStatus::warn, "cuFile registered the file in " + facts.cufile_mode,
                               "GDS or P2PDMA", "load nvidia-fs or enable PCI P2PDMA (use_pci_p2pdma) to move data by DMA"));
    } else {
      out.push_back(make_check(id, kGroupGds, have_gpu ? CheckStatus::warn : CheckStatus::info,
                               "cuFile unusable here: " + facts.cufile_reason, "GDS or P2PDMA", "see the reason; auto will not pick cufile"));
    }
  }

  check_kernel_log(root, inventory, out);
}

}  // namespace hbmio::doctor
