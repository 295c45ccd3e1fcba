// `hbmio doctor --explain PATH`: a real read of a file, the way it took (Stats::paths, which every
// engine fills), and the doctor's checks that bear on that way, so "which path did my I/O take,
// and why not a faster one?" is answered by the transfer itself, not inferred.
#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "doctor/doctor_internal.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"

namespace hbmio {
namespace {

namespace fs = std::filesystem;

// A directory stands for the largest regular file directly in it (a checkpoint's biggest shard).
std::string file_to_read(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  std::string best;
  std::uintmax_t best_size = 0;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    std::error_code size_ec;
    if (!entry.is_regular_file(size_ec)) continue;
    const std::uintmax_t size = entry.file_size(size_ec);
    if (!size_ec && (best.empty() || size > best_size)) best = entry.path().string(), best_size = size;
  }
  if (best.empty()) throw Error(errno_code(ENOENT), {.op = "explain", .path = path}, "the directory holds no regular file to read");
  return best;
}

bool starts_with_any(const std::string& id, std::initializer_list<std::string_view> prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(), [&](std::string_view p) { return id.starts_with(p); });
}

// Where a check stands in the advice, lower first; -1: not advice for this transfer. `gds`: the
// judged machine has an NVIDIA GPU and the read did not go by DMA, so what keeps cuFile off the
// direct path is the answer to "what would make it faster".
int rank_of(const Check& c, const std::string& path, bool gpu, bool gds) {
  if (c.id == "summary.auto:" + path) return 100;  // the ceiling: always, last
  // The mode a file there gets, even where it is a DMA mode: a read that went otherwise (another
  // backend asked for; a recorded machine judged while the read ran here) is then explained by
  // what differs from it.
  if (gds && c.id == "gds.mode:" + path) return 1;
  if (c.status == CheckStatus::pass) return -1;
  if (c.id == "storage.path:" + path) return 0;
  if (gds) {
    if (c.id == "gds.verdict:" + path) return 2;
    if (c.status == CheckStatus::info) return -1;
    if (c.id == "gds.nvidia_fs" || c.id == "gds.p2pdma_mode") return 3;
    if (c.id == "gds.rdma_config:" + path) return 3;
    if (c.id.starts_with("gds.cufile_setting:") || c.id == "gds.cufile_json" || c.id == "gds.cufile_env") return 4;
    if (c.id == "gds.udev" || c.id == "gds.libcufile" || c.id == "gds.cufile_version" || c.id.starts_with("gds.container_")) return 5;
  }
  if (c.status == CheckStatus::info) return -1;
  if (c.id == "storage.o_direct:" + path || c.id == "storage.filesystem:" + path || c.id == "storage.queue_depth:" + path ||
      c.id == "gds.kernel_log")
    return 6;
  if (gpu && (starts_with_any(c.id, {"topology.path:", "topology.acs:", "gpu.link:"}) || c.id == "topology.iommu")) return 7;
  return -1;
}

}  // namespace

Explanation explain_transfer(const ExplainOptions& options) {
  const doctor::Root root(options.root.empty() ? "/" : options.root);
  const std::string given = root.is_live() ? options.path : root.path(options.path).string();
  const std::string file = file_to_read(given);
  // The doctor judges the file read, named as the caller named it (inside the tree where one is given).
  const std::string judged = file == given ? options.path : (fs::path(options.path) / fs::path(file).filename()).string();

  Explanation out;
  out.file = file;
  const File opened = File::open(file, OpenMode::read);
  const std::uint64_t bytes = std::min(opened.size(), options.max_bytes);
  MemoryLocation into{MemoryKind::host};
  if (cuda_device_count() > 0) into = {MemoryKind::device, 0};
  else out.why_host = cuda_unavailable_reason();
  out.into = into.to_string();
  const Buffer buffer = Buffer::allocate(into, std::max<std::uint64_t>(bytes, 1));
  const std::unique_ptr<Engine> engine = make_engine(options.backend, Options::from_env());
  out.stats = engine->read(opened, 0, buffer.span().subspan(0, bytes));

  const std::vector<Check> checks = run_doctor({.root = options.root.empty() ? "/" : options.root, .paths = {judged}});
  const bool gpu = std::none_of(checks.begin(), checks.end(), [](const Check& c) { return c.id == "gpu.count" && c.status != CheckStatus::pass; });
  const bool dma = std::any_of(out.stats.paths.begin(), out.stats.paths.end(), [](const TransferPath& p) {
    return p.path == DataPath::gds_nvidia_fs || p.path == DataPath::gds_p2pdma;
  });
  std::vector<std::pair<int, const Check*>> ranked;
  for (const Check& c : checks)
    if (const int rank = rank_of(c, judged, gpu, gpu && !dma); rank >= 0) ranked.emplace_back(rank, &c);
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [rank, check] : ranked) out.advice.push_back(*check);

  const Stats& s = out.stats;
  if (s.paths.empty()) {
    out.summary = fmt::format("{} is empty: nothing moved.", file);
    return out;
  }
  std::string ways;
  for (const TransferPath& p : s.paths) ways += fmt::format("{}{} ({})", ways.empty() ? "" : "; ", to_string(p.path), p.reason);
  out.summary = fmt::format("Read {} of {} into {} in {:.3f} s ({:.2f} GiB/s) by {}.", format_size(s.bytes), file,
                            into.kind == MemoryKind::host ? "host memory" : out.into, s.seconds, s.gib_per_second(), ways);
  if (dma)
    out.summary += " That is GPUDirect Storage's DMA, the fastest path there is; what bounds it is below.";
  else if (gpu)
    out.summary += " Not by DMA: GDS (nvidia-fs or P2PDMA) would move storage straight into GPU memory; the checks below say what keeps "
                   "cuFile off that path here and how to change it.";
  else
    out.summary += " No NVIDIA GPU on " + std::string(root.is_live() ? "this machine" : "the recorded machine") +
                   ", so no GDS: the checks below bear on the storage path only.";
  // A fresh engine's first transfer sets up its rings and pinned buffers (the note says how long):
  // a process that loads often pays it once, so the figure is a lower bound of its rate.
  if (s.note.find("first-use set-up") != std::string::npos)
    out.summary += " The time includes the engine's first-use set-up (rings, pinned buffers), which a process pays once.";
  if (!root.is_live()) out.summary += " (The read ran on this machine; the checks judge the recorded one.)";
  const bool cached = std::any_of(s.paths.begin(), s.paths.end(), [](const TransferPath& p) { return p.bytes_direct < p.bytes; });
  if (cached && std::any_of(s.paths.begin(), s.paths.end(), [](const TransferPath& p) { return p.reason.find("already cached") != std::string::npos; }))
    out.summary += " Part of the file was in the page cache, so the figure is memory's, not the storage's: a cold read (echo 1 > "
                   "/proc/sys/vm/drop_caches) measures the storage.";
  return out;
}

}  // namespace hbmio
