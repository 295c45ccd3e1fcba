// `hbmio bench`: running a row (a backend or a ceiling, N times) and summarising its runs. See
// bench_measure.hpp for what a row is; nothing here prints a report.
#include "bench_measure.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include <fmt/format.h>

#include "cli_common.hpp"

namespace hbmio::cli {
namespace {

// Median and nearest-rank p99 latency; throughput from the median (a typical run, not skewed by
// one slow outlier); CPU load over all runs, as a share of every core and per GiB moved.
void summarize(Row& row, unsigned cpus) {
  if (row.runs.empty()) return;
  std::vector<double> seconds;
  double wall = 0, cpu = 0, bytes = 0, direct = 0;
  for (const Run& r : row.runs) {
    seconds.push_back(r.seconds);
    wall += r.seconds;
    cpu += r.cpu_seconds;
    bytes += static_cast<double>(r.bytes);
    direct += static_cast<double>(r.bytes_direct);
  }
  std::sort(seconds.begin(), seconds.end());
  const std::size_t n = seconds.size();
  row.median_seconds = n % 2 ? seconds[n / 2] : (seconds[n / 2 - 1] + seconds[n / 2]) / 2;
  row.p99_seconds = seconds[static_cast<std::size_t>(std::ceil(0.99 * static_cast<double>(n))) - 1];
  row.gib_per_second = row.median_seconds > 0 ? static_cast<double>(row.runs.front().bytes) / kGiB / row.median_seconds : 0;
  row.cpu_percent = wall > 0 ? 100.0 * cpu / (wall * cpus) : 0;
  row.cpu_seconds_per_gib = bytes > 0 ? cpu / (bytes / kGiB) : 0;
  row.direct_fraction = bytes > 0 ? direct / bytes : 0;
}

// Puts the whole file in the page cache with plain buffered reads. A warm-up through the
// backend itself would not do: O_DIRECT "auto" reads a cold file past the cache and leaves it
// cold, so every "warm" run would again come from storage.
void fill_page_cache(const std::string& path, const std::atomic<bool>* cancel) {
  const File file = File::open(path, OpenMode::read, /*with_direct_io=*/false);
  ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<std::byte> scratch(std::size_t{8} << 20);
  for (std::uint64_t offset = 0;;) {
    throw_if_stopped(cancel);
    const std::size_t n = file.read_at(scratch, offset);
    if (n < scratch.size()) break;
    offset += n;
  }
}

Run run_from(const Stats& s) {
  return {.seconds = s.seconds, .cpu_seconds = s.cpu_seconds, .bytes = s.bytes, .bytes_direct = s.bytes_direct,
          .backend = s.backend, .note = s.note};
}

// One transfer of the whole file through the plan's engine: a read into its memory, or a write of
// its memory into a freshly truncated file followed by fsync, counted in time and CPU (a save is
// done when it is durable).
Run transfer_once(const RowPlan& plan, const std::string& label) {
  File file = File::open(plan.path, plan.op == IoOp::read ? OpenMode::read : OpenMode::write);
  Run run = with_progress(label, plan.memory.size, [&](std::atomic<std::uint64_t>* progress) {
    return run_from(
        plan.engine->submit({.op = plan.op, .file = &file, .offset = 0, .memory = plan.memory, .progress = progress, .cancel = plan.cancel}));
  });
  if (plan.op == IoOp::read) return run;
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = process_cpu_seconds();
  file.sync();
  run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.cpu_seconds += process_cpu_seconds() - cpu_start;
  return run;
}

}  // namespace

void throw_if_stopped(const std::atomic<bool>* cancel) {
  if (cancel != nullptr && cancel->load()) throw Error(errno_code(ECANCELED), {.op = "bench"}, "stopped on request");
}

Row measure_row(Row row, const RowPlan& plan) {
  if (plan.engine == nullptr) {
    row.status = "unavailable";
    row.reason = plan.unavailable;
    return row;
  }
  const std::string what = fmt::format("{} {} {}", row.op, row.mode, row.name);
  try {
    // Stale bytes from an earlier row must not pass a read's check. (A write's source keeps the
    // sample data that the reads left in it; its target is truncated on every run.)
    if (plan.verify && plan.op == IoOp::read) fill_memory(plan.memory, std::byte{0xA5});
    if (row.mode == "warm") {
      fill_page_cache(plan.path, plan.cancel);
      transfer_once(plan, what + " warm-up");
    }
    for (unsigned i = 1; i <= plan.runs; ++i) {
      throw_if_stopped(plan.cancel);
      if (row.mode == "cold") row.cache_drop = drop_page_cache(plan.path);
      const std::string label = fmt::format("{} run {}/{}", what, i, plan.runs);
      Run run = transfer_once(plan, label);
      if (::isatty(STDERR_FILENO) == 1)
        fmt::print(stderr, "{}: {:.3f} s, {:.2f} GiB/s\n", label, run.seconds,
                   run.seconds > 0 ? static_cast<double>(run.bytes) / kGiB / run.seconds : 0.0);
      if (row.backend_used.empty()) row.backend_used = run.backend;
      if (!run.note.empty() && row.note.find(run.note) == std::string::npos)
        row.note += (row.note.empty() ? "" : "; ") + run.note;
      row.runs.push_back(std::move(run));
      if (i == 1 && plan.verify) {
        const auto mismatch = first_difference(plan.memory, plan.path);
        row.verified = !mismatch;
        if (mismatch) {
          row.status = "failed";
          row.reason = fmt::format("data differs from a plain pread of the file at byte {}", *mismatch);
        }
      }
    }
  } catch (const std::exception& e) {
    // After a stop request an error is the stop itself (ECANCELED), or what it interrupted:
    // either way not a property of the backend.
    if (plan.cancel != nullptr && plan.cancel->load()) throw;
    row.status = row.runs.empty() ? "unavailable" : "failed";
    row.reason = e.what();
  }
  summarize(row, plan.cpus);
  return row;
}

Row measure_uring_ceiling(const char* name, const std::string& op, const std::string& mode, DirectIo direct, RowPlan plan,
                          const Options& options) {
  Options forced = options;
  forced.direct_io = direct;
  std::unique_ptr<Engine> engine;
  try {
    engine = make_engine("uring", forced);
  } catch (const std::exception& e) {
    plan.unavailable = e.what();
  }
  plan.engine = engine.get();
  plan.verify = false;
  Row row = measure_row({.name = name, .ceiling = true, .op = op, .mode = mode}, plan);
  if (row.ok() && direct == DirectIo::on && row.direct_fraction < 1.0)
    row.note += (row.note.empty() ? "" : "; ") +
                std::string("the file system refused O_DIRECT for part of the file: this is not the bare storage rate");
  return row;
}

Row measure_host_to_device(MemorySpan device, MemorySpan pinned, unsigned runs, unsigned cpus, const std::atomic<bool>* cancel) {
  Row row{.name = kHostToDevice, .ceiling = true, .op = "copy", .mode = ""};
  try {
    copy_memory(device, pinned);  // untimed: the first copy may still set up the CUDA context's mappings
    for (unsigned i = 1; i <= runs; ++i) {
      throw_if_stopped(cancel);
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = process_cpu_seconds();
      copy_memory(device, pinned);
      row.runs.push_back({.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                          .cpu_seconds = process_cpu_seconds() - cpu_start,
                          .bytes = device.size,
                          .backend = "cudaMemcpy"});
    }
  } catch (const std::exception& e) {
    if (cancel != nullptr && cancel->load()) throw;
    row.status = row.runs.empty() ? "unavailable" : "failed";
    row.reason = e.what();
  }
  row.backend_used = "cudaMemcpy";
  summarize(row, cpus);
  return row;
}

Row measure_remote(Row row, const RemoteObject& object, MemorySpan memory, const RemoteOptions& options, unsigned runs, bool verify,
                   unsigned cpus, const std::atomic<bool>* cancel) {
  try {
    if (verify) fill_memory(memory, std::byte{0xA5});
    for (unsigned i = 1; i <= runs; ++i) {
      throw_if_stopped(cancel);
      const RemoteRead read{&object, 0, memory};
      const Stats s = read_remote({&read, 1}, options);
      const std::string label = fmt::format("{} run {}/{}", row.name, i, runs);
      if (::isatty(STDERR_FILENO) == 1) fmt::print(stderr, "{}: {:.3f} s, {:.2f} GiB/s\n", label, s.seconds, s.gib_per_second());
      row.runs.push_back({.seconds = s.seconds, .cpu_seconds = s.cpu_seconds, .bytes = s.bytes, .backend = "remote", .note = s.note});
      row.note = s.note;
      if (i == 1 && verify) {
        const auto mismatch = first_difference(memory, object.url());
        row.verified = !mismatch;
        if (mismatch) {
          row.status = "failed";
          row.reason = fmt::format("data differs from a sequential read of the object at byte {}", *mismatch);
        }
      }
    }
  } catch (const std::exception& e) {
    if (cancel != nullptr && cancel->load()) throw;
    row.status = row.runs.empty() ? "unavailable" : "failed";
    row.reason = e.what();
  }
  row.backend_used = "remote";
  summarize(row, cpus);
  return row;
}

void attach_bounds(std::vector<Row>& rows, bool device_target) {
  auto rate_of = [&](const char* name) -> const Row* {
    for (const Row& r : rows)
      if (r.ceiling && r.name == name && r.ok() && r.gib_per_second > 0) return &r;
    return nullptr;
  };
  for (Row& row : rows) {
    if (row.ceiling || !row.ok()) continue;
    std::vector<const Row*> limits;
    if (row.op == "write") limits = {rate_of(kStorageWrite)};
    else limits = {rate_of(row.mode == "cold" ? kStorageRead : row.mode == "remote" ? kRemoteRead : kPageCacheRead)};
    if (row.op == "read" && device_target) limits.push_back(rate_of(kHostToDevice));
    const Row* bound = nullptr;
    for (const Row* limit : limits)
      if (limit && (!bound || limit->gib_per_second < bound->gib_per_second)) bound = limit;
    if (!bound) continue;
    row.bound_by = bound->name;
    row.bound_gib_per_second = bound->gib_per_second;
    row.fraction_of_bound = row.gib_per_second / bound->gib_per_second;
  }
}

}  // namespace hbmio::cli
