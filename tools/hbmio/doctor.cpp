#include "doctor.hpp"

#include <unistd.h>

#include <algorithm>
#include <map>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "hbmio/doctor.hpp"
#include "hbmio/version.hpp"

namespace hbmio::cli {
namespace {

struct DoctorFlags {
  std::vector<std::string> paths;
  std::string root = "/";
  std::string json;
  std::string explain;  // --explain PATH
  bool verbose = false;
};

nlohmann::json check_json(const Check& c) {
  return {{"id", c.id}, {"group", c.group}, {"status", std::string(to_string(c.status))}, {"found", c.found}, {"expected", c.expected}, {"fix", c.fix}};
}

nlohmann::json to_json(const std::vector<Check>& checks, const DoctorFlags& flags) {
  nlohmann::json list = nlohmann::json::array();
  std::map<std::string, int> counts{{"PASS", 0}, {"WARN", 0}, {"FAIL", 0}, {"INFO", 0}};
  for (const auto& c : checks) {
    const std::string status(to_string(c.status));
    ++counts[status];
    list.push_back(check_json(c));
  }
  return {{"command", "doctor"}, {"version", version()}, {"root", flags.root}, {"paths", flags.paths},
          {"checks", list}, {"counts", counts}, {"failed", any_failed(checks)}};
}

// Where there is no NVIDIA GPU, the fabric and GDS checks can only say "not here": without -v
// they are one line, not twenty (a WARN or FAIL among them is still shown).
bool gds_does_not_apply(const std::vector<Check>& checks) {
  return std::any_of(checks.begin(), checks.end(),
                     [](const Check& c) { return c.id == "gpu.count" && c.status != CheckStatus::pass; });
}

bool folded(const Check& c, bool no_gpu) {
  return no_gpu && c.status == CheckStatus::info && (c.group == "Fabric" || c.group == "GDS" || c.id == "topology.paths");
}

// Grouped checklist: "  STATUS  id  found". With -v, for anything but PASS the expectation and
// the fix on indented lines below; without it, only for WARN and FAIL, and on a terminal each line
// is cut to its usual width (the whole text is in -v and --json). Piped or redirected output is
// never cut: it is read later, pasted into a report or searched, where "..." hides the answer.
void print_checklist(const std::vector<Check>& checks, const DoctorFlags& flags) {
  const bool no_gpu = !flags.verbose && gds_does_not_apply(checks);
  const bool cut = !flags.verbose && ::isatty(STDOUT_FILENO) == 1;
  std::size_t id_width = 0;
  for (const auto& c : checks) id_width = std::max(id_width, c.id.size());
  id_width = std::min<std::size_t>(id_width, 40);
  const std::string indent(2 + 4 + 2 + id_width + 2, ' ');
  const auto line = [&](const std::string& text) { return cut ? fit(text, 118 - indent.size()) : text; };
  fmt::print("hbmio doctor (root {}{}{})\n", flags.root, flags.paths.empty() ? "" : ", paths: ",
             without_url_secrets(fmt::format("{}", fmt::join(flags.paths, " "))));
  std::string group;
  std::size_t hidden = 0;
  for (const auto& c : checks) {
    if (folded(c, no_gpu)) {
      ++hidden;
      continue;
    }
    if (c.group != group) {
      group = c.group;
      fmt::print("\n{}\n", group);
    }
    if (c.id.size() > id_width)
      fmt::print("  {}  {}\n{}{}\n", to_string(c.status), c.id, indent, line(c.found));
    else
      fmt::print("  {}  {:<{}}  {}\n", to_string(c.status), c.id, id_width, line(c.found));
    if (c.status == CheckStatus::pass || (c.status == CheckStatus::info && !flags.verbose)) continue;
    // The labels ("expected: ", "fix: ") count against the width too.
    if (!c.expected.empty()) fmt::print("{}expected: {}\n", indent, cut ? fit(c.expected, 108 - indent.size()) : c.expected);
    if (!c.fix.empty()) fmt::print("{}fix: {}\n", indent, cut ? fit(c.fix, 113 - indent.size()) : c.fix);
  }
  if (hidden > 0)
    fmt::print("\nGDS checks do not apply: no NVIDIA GPU here ({} fabric and GDS checks not shown; -v shows them)\n", hidden);
  int pass = 0, warn = 0, fail = 0, info = 0;
  for (const auto& c : checks) {
    pass += c.status == CheckStatus::pass;
    warn += c.status == CheckStatus::warn;
    fail += c.status == CheckStatus::fail;
    info += c.status == CheckStatus::info;
  }
  fmt::print("\n{} PASS, {} WARN, {} FAIL, {} INFO\n", pass, warn, fail, info);
}

// --explain: what the read did (each way its bytes took, and why), then the advice checks with
// their fixes, as the checklist prints them.
void print_explanation(const Explanation& e, const DoctorFlags& flags) {
  fmt::print("{}\n", e.summary);
  if (!e.why_host.empty()) fmt::print("(host memory: {})\n", e.why_host);
  if (!e.stats.paths.empty()) fmt::print("\nPath taken\n");
  for (const TransferPath& p : e.stats.paths)
    fmt::print("  {:<13}  {}: {}, {}\n  {:<13}  {}\n", to_string(p.path), p.file, format_size(p.bytes),
               p.bytes_direct == p.bytes ? "all bypassing the page cache"
               : p.bytes_direct == 0     ? "all through the page cache"
                                         : format_size(p.bytes_direct) + " bypassing the page cache",
               "", p.reason);
  if (flags.verbose && !e.stats.note.empty()) fmt::print("  engine note: {}\n", e.stats.note);
  fmt::print("\nWhat bounds it, and what would make it faster\n");
  if (e.advice.size() <= 1) fmt::print("  nothing to fix found for this path\n");
  for (const Check& c : e.advice) {
    fmt::print("  {}  {}\n        {}\n", to_string(c.status), c.id, c.found);
    if (c.status == CheckStatus::pass) continue;
    if (!c.expected.empty()) fmt::print("        expected: {}\n", c.expected);
    if (!c.fix.empty()) fmt::print("        fix: {}\n", c.fix);
  }
}

}  // namespace

void add_doctor_command(CLI::App& app, int& exit_status) {
  auto flags = std::make_shared<DoctorFlags>();
  auto* doctor = app.add_subcommand(
      "doctor",
      "Check this machine for GPUDirect Storage: GPUs, NVMe (local and NVMe-oF), RDMA and modules, PCIe topology "
      "(nvidia-smi topo classes), ACS, IOMMU, cufile.json (audited key by key), nvidia-fs, the P2PDMA mode, a container's "
      "devices, mounts and libraries; and for each PATH the file system, the GDS mode a file there gets, "
      "O_DIRECT (tried: a directory gets a 4 KiB probe file, removed again), cuFile's verdict, the path `auto` takes "
      "and the slowest link bounding it. Lines are PASS / WARN / FAIL / INFO, with the fix below anything not PASS. "
      "Exit status 1 when any check FAILs.");
  doctor->add_option("paths", flags->paths, "Files or directories to judge (data you will load)");
  doctor->add_option("--root", flags->root,
                     "Read sysfs, procfs and /etc under DIR instead of / (a recorded tree); live-only probes are then skipped")
      ->type_name("DIR")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
  add_json_option(doctor, flags->json, "Write every check {id, group, status, found, expected, fix}");
  doctor->add_flag("-v,--verbose", flags->verbose,
                   "Every check in full: the expectation and fix of INFO lines too, long findings uncut, and the fabric "
                   "and GDS checks of a machine without an NVIDIA GPU");
  doctor->add_option("--explain", flags->explain,
                     "Read PATH for real (its first 64 MiB; a directory: its largest file) into GPU memory where there is a GPU, "
                     "else host memory, and say which way its bytes took (GDS through nvidia-fs or P2PDMA, cuFile's compatibility "
                     "mode, io_uring with or without O_DIRECT, posix), why, how fast, and which checks say what would make it "
                     "faster. HBMIO_BACKEND picks the backend (default auto). With --root, the checks judge the recorded machine")
      ->type_name("PATH");
  doctor->callback([flags, &exit_status] {
    if (!flags->explain.empty()) {
      const Explanation e = explain_transfer({.path = flags->explain, .root = flags->root});
      if (!flags->json.empty()) {
        nlohmann::json advice = nlohmann::json::array();
        for (const Check& c : e.advice) advice.push_back(check_json(c));
        write_json({{"command", "doctor --explain"}, {"version", version()}, {"root", flags->root}, {"path", flags->explain},
                    {"file", e.file}, {"into", e.into}, {"why_host", e.why_host}, {"summary", e.summary},
                    {"stats", to_json(e.stats)}, {"advice", advice}},
                   flags->json);
      }
      if (flags->json != "-") print_explanation(e, *flags);
      exit_status = any_failed(e.advice) ? 1 : 0;
      return;
    }
    const std::vector<Check> checks = run_doctor({.root = flags->root, .paths = flags->paths});
    if (!flags->json.empty()) write_json(to_json(checks, *flags), flags->json);
    if (flags->json != "-") print_checklist(checks, *flags);
    for (const auto& c : checks)
      if (c.status == CheckStatus::fail && c.id.starts_with("storage.path:")) fmt::print(stderr, "hbmio doctor: {}\n", c.found);
    exit_status = any_failed(checks) ? 1 : 0;
  });
}

}  // namespace hbmio::cli
