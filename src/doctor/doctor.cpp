// run_doctor: discovers the machine once, runs each group's checks, and closes with what `auto`
// will do for each PATH and what bounds it.
#include "hbmio/doctor.hpp"

#include "hbmio/cache.hpp"
#include "hbmio/config.hpp"

#include <algorithm>
#include <charconv>
#include <exception>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"
#include "io/engine_internal.hpp"

namespace hbmio {

std::string_view to_string(CheckStatus status) noexcept {
  switch (status) {
    case CheckStatus::pass: return "PASS";
    case CheckStatus::warn: return "WARN";
    case CheckStatus::fail: return "FAIL";
    case CheckStatus::info: break;
  }
  return "INFO";
}

bool any_failed(const std::vector<Check>& checks) noexcept {
  return std::any_of(checks.begin(), checks.end(), [](const Check& c) { return c.status == CheckStatus::fail; });
}

namespace doctor {

Check make_check(std::string id, const char* group, CheckStatus status, std::string found, std::string expected, std::string fix) {
  return Check{.id = std::move(id), .group = group, .status = status, .found = std::move(found), .expected = std::move(expected),
               .fix = std::move(fix)};
}

Inventory discover(const Root& root) {
  Inventory inventory;
  inventory.pci = list_pci_devices(root);
  inventory.gpus = find_gpus(root, inventory.pci);
  inventory.nvme = find_nvme_controllers(root, inventory.pci);
  inventory.rdma = find_rdma_devices(root);
  return inventory;
}

namespace {

struct Link {
  std::string what;
  std::optional<double> gigabytes_per_second;
};

std::optional<double> pci_link_rate(const PciDevice& device) {
  // Idle devices lower their link speed, so take the top speed at the trained width.
  const std::string& speed = device.link.max_speed.empty() ? device.link.current_speed : device.link.max_speed;
  const int width = device.link.current_width.value_or(device.link.max_width.value_or(0));
  return pcie_gigabytes_per_second(speed, width);
}

std::string pci_link_text(const PciDevice& device) {
  const std::string& speed = device.link.max_speed.empty() ? device.link.current_speed : device.link.max_speed;
  return fmt::format("{} x{}", speed, device.link.current_width.value_or(device.link.max_width.value_or(0)));
}

// "100 Gb/sec (4X EDR)" -> 12.5 GB/s.
std::optional<double> rdma_rate(const RdmaDevice& device) {
  std::optional<double> best;
  for (const auto& port : device.ports) {
    double gigabits = 0;
    const auto [end, error] = std::from_chars(port.rate.data(), port.rate.data() + port.rate.size(), gigabits);
    if (error == std::errc() && gigabits > 0 && port.state.find("ACTIVE") != std::string::npos)
      best = std::max(best.value_or(0), gigabits / 8.0);
  }
  return best;
}

// The links data passes from the storage of `facts` into GPU memory, as far as sysfs shows them.
std::vector<Link> links_of(const Inventory& inventory, const PathFacts& facts, bool through_host_memory, std::vector<std::string>& unknown) {
  std::vector<Link> links;
  double storage_total = 0;
  std::string storage_what;
  bool storage_known = !facts.nvme_controllers.empty();
  for (const auto& name : facts.nvme_controllers) {
    const auto c = std::find_if(inventory.nvme.begin(), inventory.nvme.end(), [&](const NvmeController& n) { return n.name == name; });
    std::optional<double> rate;
    std::string what;
    if (c != inventory.nvme.end() && c->pci) {
      rate = pci_link_rate(*c->pci);
      what = fmt::format("{} PCIe {}", name, pci_link_text(*c->pci));
    } else if (c != inventory.nvme.end() && c->transport == "rdma") {
      for (const auto& r : inventory.rdma)
        if (const auto r_rate = rdma_rate(r)) rate = std::max(rate.value_or(0), *r_rate);
      what = fmt::format("{} over rdma (fastest active RDMA port)", name);
    }
    if (!rate) {
      storage_known = false;
      break;
    }
    storage_total += *rate;  // md RAID 0 members add up
    storage_what += (storage_what.empty() ? "" : " + ") + what;
  }
  if (storage_known) {
    links.push_back({"storage link " + storage_what, storage_total});
    unknown.push_back("the drive's own read rate (below its link)");
  } else {
    unknown.push_back(facts.block_kind.empty() || facts.block_kind == "none" ? "the storage rate"
                                                                              : "the storage rate (" + facts.block_kind + ": not in sysfs)");
  }
  if (!inventory.gpus.empty()) {
    const PciDevice& gpu = inventory.gpus.front().pci;
    if (const auto rate = pci_link_rate(gpu))
      links.push_back({fmt::format("GPU {} PCIe {}", gpu.address, pci_link_text(gpu)), rate});
    else
      unknown.push_back("the GPU's PCIe link");
  }
  if (through_host_memory) unknown.push_back("host memory bandwidth (hbmio bench measures the pinned copy rate)");
  return links;
}

}  // namespace

void check_summary(const Root& root, const Inventory& inventory, const std::vector<PathFacts>& paths, std::vector<Check>& out) {
  if (paths.empty())
    out.push_back(make_check("summary.paths", kGroupSummary, CheckStatus::info, "no PATH given",
                             "", "name files or directories: hbmio doctor /data/checkpoints"));
  for (const auto& facts : paths) {
    const std::string id = "summary.auto:" + facts.path;
    if (root.is_live() && !facts.exists) {
      out.push_back(make_check(id, kGroupSummary, CheckStatus::fail, facts.path + " cannot be read: nothing to decide", "", "see storage.path"));
      continue;
    }
    std::string choice;
    CheckStatus status = CheckStatus::info;
    bool through_host_memory = true;
    if (!root.is_live()) {
      choice = "auto: cannot be decided from a recorded tree (cuFile and io_uring are probed on the live machine)";
    } else if (facts.auto_backend == "cufile") {
      // The auto backend's own decision (detail::choose_auto), not a second derivation of it.
      choice = "auto: cufile (" + facts.cufile_mode + "): DMA from storage into GPU memory";
      status = CheckStatus::pass;
      through_host_memory = false;
    } else if (facts.auto_backend == "uring") {
      choice = fmt::format("auto: uring (io_uring{}, pinned bounce buffers)",
                           !facts.direct_io_tried ? ", O_DIRECT not checked here"
                           : facts.direct_io_works ? " + O_DIRECT"
                                                   : ", page cache: no O_DIRECT here");
    } else if (facts.auto_backend == "posix") {
      choice = "auto: posix (" + facts.auto_passed_over + ")";
      status = CheckStatus::warn;
    } else {
      choice = "auto: not decided (" + (facts.cufile_reason.empty() ? std::string("the path could not be opened") : facts.cufile_reason) + ")";
    }
    std::vector<std::string> unknown;
    const auto links = links_of(inventory, facts, through_host_memory, unknown);
    const auto slowest = std::min_element(links.begin(), links.end(), [](const Link& a, const Link& b) {
      return a.gigabytes_per_second.value_or(1e18) < b.gigabytes_per_second.value_or(1e18);
    });
    std::string ceiling = slowest == links.end() || !slowest->gigabytes_per_second
                              ? "ceiling: no link rate readable"
                              : fmt::format("ceiling: {:.1f} GB/s, the {}", *slowest->gigabytes_per_second, slowest->what);
    if (inventory.gpus.empty()) ceiling += "; no GPU: data lands in host memory";
    std::string not_measured;
    for (const auto& u : unknown) not_measured += (not_measured.empty() ? "" : ", ") + u;
    // Without a GPU there is no faster path to point at: uring into host memory is the best.
    const bool could_be_faster = status != CheckStatus::pass && !inventory.gpus.empty();
    out.push_back(make_check(id, kGroupSummary, status, fmt::format("{}; {}; not measured: {}", choice, ceiling, not_measured),
                             could_be_faster ? "auto: cufile with GDS or P2PDMA" : "",
                             could_be_faster ? "see the WARN lines above for what keeps cuFile off the direct path" : ""));
  }
}

// The node's resident cache (docs/cache.md): whether loads here ask one, and whether it answers.
// Live only: a recorded tree says nothing about a server running now.
void check_cache(const Root& root, std::vector<Check>& out) {
  if (!root.is_live()) return;
  const std::string socket = configured_cache_socket();
  if (socket.empty()) {
    out.push_back(make_check("summary.cache", kGroupSummary, CheckStatus::info,
                             "no resident cache: HBMIO_CACHE is not set, so every load reads its files", "",
                             "where processes on this node load the same checkpoints again (restarts, replicas): "
                             "`hbmio cache serve --host-memory SIZE` and HBMIO_CACHE=its socket (docs/cache.md)"));
    return;
  }
  try {
    const CacheStatus status = cache_status(socket);
    std::size_t pinned = 0;
    for (const CacheEntryStatus& e : status.entries) pinned += e.pinned ? 1 : 0;
    out.push_back(make_check("summary.cache", kGroupSummary, CheckStatus::pass,
                             fmt::format("resident cache at {}: {} file(s), {} of {} held, {} pinned for GPU DMA; {} hits, {} misses",
                                         socket, status.entries.size(), format_size(status.host_bytes),
                                         format_size(status.host_bytes_limit), pinned, status.hits, status.misses),
                             "a server answering at HBMIO_CACHE", ""));
  } catch (const std::exception& e) {
    out.push_back(make_check("summary.cache", kGroupSummary, CheckStatus::warn,
                             fmt::format("HBMIO_CACHE={} but no cache answers there ({}): loads read their files", socket, e.what()),
                             "a server answering at HBMIO_CACHE",
                             fmt::format("start `hbmio cache serve --socket {} --host-memory SIZE`, or unset HBMIO_CACHE", socket)));
  }
}

}  // namespace doctor

std::vector<Check> run_doctor(const DoctorOptions& options) {
  using namespace doctor;
  const Root root(options.root.empty() ? "/" : options.root);
  std::vector<Check> checks;
  // Each group is fenced off: whatever a garbled tree makes one probe throw (bad_alloc, a
  // filesystem_error), the rest of the checklist still runs and the failure is reported.
  const auto guarded = [&](const char* group, auto&& probe) {
    try {
      probe();
    } catch (const std::exception& e) {
      checks.push_back(make_check(std::string("doctor.error:") + group, group, CheckStatus::warn,
                                  fmt::format("the {} probes stopped: {}", group, e.what()), "", "report this as a bug of hbmio doctor"));
    }
  };
  Inventory inventory;
  guarded(kGroupGpus, [&] { inventory = discover(root); });
  guarded(kGroupGpus, [&] { check_gpus(root, inventory, checks); });
  guarded(kGroupStorage, [&] { check_nvme(root, inventory, checks); });
  std::vector<PathFacts> paths;
  for (const auto& path : options.paths)
    guarded(kGroupStorage, [&] { paths.push_back(check_path(root, inventory, path, checks)); });
  guarded(kGroupFabric, [&] { check_fabric(root, inventory, checks); });
  guarded(kGroupTopology, [&] { check_topology(root, inventory, checks); });
  guarded(kGroupGds, [&] { check_gds(root, inventory, paths, checks); });
  guarded(kGroupSummary, [&] { check_summary(root, inventory, paths, checks); });
  guarded(kGroupSummary, [&] { check_cache(root, checks); });

  // Checks are written per group above, except per-PATH storage lines that are interleaved:
  // order by group, keeping each group's own order.
  const auto rank = [](const std::string& group) {
    const char* order[] = {kGroupGpus, kGroupStorage, kGroupFabric, kGroupTopology, kGroupGds, kGroupSummary};
    for (int i = 0; i < 6; ++i)
      if (group == order[i]) return i;
    return 6;
  };
  std::stable_sort(checks.begin(), checks.end(), [&](const Check& a, const Check& b) { return rank(a.group) < rank(b.group); });
  // A PATH may be a URL with a password or a presigned query: no check shows them.
  for (Check& c : checks)
    for (std::string* text : {&c.id, &c.found, &c.expected, &c.fix}) *text = without_url_secrets(*text);
  return checks;
}

}  // namespace hbmio
