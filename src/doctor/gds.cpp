// GDS: libcufile, cufile.json, nvidia-fs, PCI P2PDMA, udev, and cuFile's verdict on each PATH.
#include <cstdlib>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "doctor/doctor_internal.hpp"
#include "shim/cufile_api.hpp"

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

void check_cufile_json(const Root& root, const Inventory& inventory, std::vector<Check>& out) {
  // CUFILE_ENV_PATH_JSON is this process's environment: it names a file on the live machine only.
  const char* env = root.is_live() ? std::getenv("CUFILE_ENV_PATH_JSON") : nullptr;
  const std::string shown = env && *env ? std::string(env) : "/etc/cufile.json";
  std::optional<std::string> text;
  if (env && *env) {
    std::ifstream in(env, std::ios::binary);
    if (in) text = std::string(std::istreambuf_iterator<char>(in), {});
  } else {
    text = root.read_file("etc/cufile.json");
  }
  if (!text) {
    if (env && *env)
      out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::warn, "CUFILE_ENV_PATH_JSON=" + shown + " cannot be read",
                               "a readable cufile.json", "fix or unset CUFILE_ENV_PATH_JSON"));
    else
      out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::info, "no /etc/cufile.json: libcufile uses its built-in defaults",
                               "", "install one (it ships with nvidia-gds) to set allow_compat_mode, use_pci_p2pdma, rdma_dev_addr_list"));
    return;
  }
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(strip_json_comments(*text));
  } catch (const nlohmann::json::exception& e) {
    out.push_back(make_check("gds.cufile_json", kGroupGds, CheckStatus::fail, fmt::format("{} is not valid JSON: {}", shown, e.what()),
                             "valid JSON (// comments allowed)", "correct " + shown + " at the position named"));
    return;
  }
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

  check_cufile_json(root, inventory, out);

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
}

}  // namespace hbmio::doctor
