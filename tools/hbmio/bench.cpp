// `hbmio bench`: every backend reads (and with --write, saves) one whole file, cold and warm,
// N times, beside the ceilings measured in the same run: what the storage delivers to O_DIRECT
// reads, what the page cache delivers, and (with a GPU) what a pinned host-to-device copy does.
//
// The flow, top to bottom in run_bench():
//   1. validate the flags; create a random sample file unless --file names one;
//   2. describe the machine (CPU, memory, GPU, kernel, file system and device of the file);
//   3. allocate the destination once (timing excludes allocation, as a loader reuses buffers);
//   4. measure rows: per mode, first the ceiling, then each backend; cold runs empty the page
//      cache before every run, warm rows read once untimed first; the first run of each backend
//      is compared with a plain pread of the file;
//   5. print the table; write --json and --chart.
// A backend that cannot run here still gets a row, saying why.
#include "bench.hpp"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "hbmio/hbmio.hpp"

namespace hbmio::cli {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kSchemaVersion = 1;

// ---------------------------------------------------------------------------------------------
// Flags

struct BenchFlags {
  std::string file, size, dir, backends = "posix,uring,cufile,auto", into, json, chart;
  bool write = false, cold = false, warm = false, both = false;
  unsigned runs = 5;
  TuningFlags tuning;
};

std::vector<std::string> split_backends(const std::string& list) {
  const auto known = backend_names();
  std::vector<std::string> names;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    if (name.empty()) continue;
    if (std::find(known.begin(), known.end(), name) == known.end())
      throw Error(errno_code(EINVAL), {.op = "bench --backends"},
                  fmt::format("unknown backend '{}': use a comma-separated list of {}", name, fmt::join(known, ", ")));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  if (names.empty()) throw Error(errno_code(EINVAL), {.op = "bench --backends"}, "no backend named");
  return names;
}

// The command line as typed, for the JSON record (CLI11 does not keep argv).
std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string text, arg;
  while (std::getline(in, arg, '\0')) {
    if (!text.empty()) text += ' ';
    text += arg.find_first_of(" \t'\"") == std::string::npos ? arg : "'" + arg + "'";
  }
  return text;
}

std::string iso8601_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

// ---------------------------------------------------------------------------------------------
// Scratch files: the generated sample and the write target, removed on every way out.

// The signal handler may only call async-signal-safe functions (unlink, rmdir, raise), so the
// paths it removes wait in fixed buffers rather than std::strings.
char g_scratch_files[2][PATH_MAX];
char g_scratch_dir[PATH_MAX];

extern "C" void remove_scratch_and_reraise(int signal_number) {
  for (auto& path : g_scratch_files)
    if (path[0]) ::unlink(path);
  if (g_scratch_dir[0]) ::rmdir(g_scratch_dir);
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

// A temporary directory holding sample.bin and write.bin. The destructor removes them on a
// normal return or an exception; Ctrl-C, SIGTERM and SIGHUP remove them through the handler.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& parent) {
    std::string path = parent + "/hbmio-bench-XXXXXX";
    if (path.size() + 16 >= PATH_MAX)
      throw Error(errno_code(ENAMETOOLONG), {.op = "create temporary directory", .path = parent});
    if (::mkdtemp(path.data()) == nullptr)
      throw Error(errno_code(errno), {.op = "create temporary directory", .path = parent},
                  "--dir must be a writable directory");
    path_ = path;
    std::snprintf(g_scratch_dir, PATH_MAX, "%s", path_.c_str());
    std::snprintf(g_scratch_files[0], PATH_MAX, "%s", sample_path().c_str());
    std::snprintf(g_scratch_files[1], PATH_MAX, "%s", write_path().c_str());
    struct sigaction action {};
    action.sa_handler = remove_scratch_and_reraise;
    for (int s : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(s, &action, nullptr);
  }
  ~ScratchDir() {
    for (int s : {SIGINT, SIGTERM, SIGHUP}) ::signal(s, SIG_DFL);
    ::unlink(sample_path().c_str());
    ::unlink(write_path().c_str());
    ::rmdir(path_.c_str());
    g_scratch_dir[0] = g_scratch_files[0][0] = g_scratch_files[1][0] = '\0';
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string sample_path() const { return path_ + "/sample.bin"; }
  std::string write_path() const { return path_ + "/write.bin"; }

 private:
  std::string path_;
};

void require_free_space(const std::string& dir, std::uint64_t needed) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return;  // unknown: let the write itself fail, naming the cause
  const std::uint64_t available = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (available < needed)
    throw Error(errno_code(ENOSPC), {.op = "bench", .path = dir},
                fmt::format("needs {} free for its files, {} available: use a smaller --size or another --dir",
                            format_size(needed), format_size(available)));
}

// Writes `size` random bytes with hbmio's own write path and fsyncs them. One 64 MiB random block
// is generated and reused, with each 4 KiB page stamped with its file offset: every page is
// unique (a chunk landing in the wrong place fails verification) without generating gigabytes
// of random numbers.
void create_sample_file(const std::string& path, std::uint64_t size, const Options& options) {
  const std::size_t block = static_cast<std::size_t>(std::min<std::uint64_t>(size, std::uint64_t{64} << 20));
  Buffer buffer = Buffer::allocate({MemoryKind::host}, block);
  fill_random(buffer.data(), block, 0x5eed);
  File file = File::open(path, OpenMode::write);
  auto engine = make_engine("auto", options);
  Progress progress("creating " + path, size);
  for (std::uint64_t offset = 0; offset < size; offset += block) {
    const std::size_t length = static_cast<std::size_t>(std::min<std::uint64_t>(block, size - offset));
    for (std::size_t page = 0; page + 8 <= length; page += 4096) {
      const std::uint64_t stamp = offset + page;
      std::memcpy(buffer.data() + page, &stamp, 8);
    }
    engine->submit({.op = IoOp::write, .file = &file, .offset = offset, .memory = buffer.span().subspan(0, length),
                    .progress = progress.counter()});
  }
  file.sync();
}

// ---------------------------------------------------------------------------------------------
// Machine description

struct Machine {
  std::string cpu_model = "unknown";
  unsigned cpus = 1;
  std::uint64_t memory_bytes = 0;
  std::string kernel;
  bool gpu = false;
  std::string gpu_name;    // "NVIDIA H200" when there is one
  std::string gpu_reason;  // why there is none
  std::string file_system, device, device_model;
};

std::string trim(std::string text) {
  const auto first = text.find_first_not_of(" \t\n");
  const auto last = text.find_last_not_of(" \t\n");
  return first == std::string::npos ? "" : text.substr(first, last - first + 1);
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return trim(text.str());
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) return trim(line.substr(line.find(':') + 1));
  return "unknown";
}

// The block device under `path` and its model. A file system on a real device has
// /sys/dev/block/MAJ:MIN, whose uevent names it (DEVNAME); for the rest (overlay, tmpfs, NFS) the
// mount's source in /proc/self/mountinfo says what it is.
void describe_device(const std::string& path, Machine& machine) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  const std::string dev = fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  std::error_code ec;
  const auto sys = std::filesystem::canonical("/sys/dev/block/" + dev, ec);
  if (!ec) {
    std::ifstream uevent(sys / "uevent");
    for (std::string line; std::getline(uevent, line);)
      if (line.rfind("DEVNAME=", 0) == 0) machine.device = "/dev/" + line.substr(8);
    // A partition's model is its parent disk's.
    const auto disk = std::filesystem::exists(sys / "partition") ? sys.parent_path() : sys;
    machine.device_model = read_text_file(disk / "device" / "model");
  }
  if (machine.device.empty()) {
    // mountinfo: "36 35 98:0 /root /mnt rw,noatime shared:1 - ext4 /dev/sda1 rw"
    std::ifstream mountinfo("/proc/self/mountinfo");
    for (std::string line; std::getline(mountinfo, line);) {
      std::istringstream fields(line);
      std::string id, parent, majmin;
      fields >> id >> parent >> majmin;
      const auto dash = line.find(" - ");
      if (majmin != dev || dash == std::string::npos) continue;
      std::istringstream tail(line.substr(dash + 3));
      std::string type, source;
      tail >> type >> source;
      machine.device = source;
      break;
    }
  }
  if (machine.device.empty()) machine.device = "device " + dev;
}

Machine describe_machine(const std::string& file_path, const MemoryLocation& into) {
  Machine m;
  m.cpu_model = cpu_model();
  m.cpus = static_cast<unsigned>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  m.memory_bytes = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  utsname u{};
  if (::uname(&u) == 0) m.kernel = fmt::format("{} {}", u.sysname, u.release);
  m.gpu = cuda_device_count() > 0;
  if (m.gpu) m.gpu_name = cuda_device_name(into.kind == MemoryKind::device ? into.device : 0);
  else m.gpu_reason = cuda_unavailable_reason();
  m.file_system = file_system_type(file_path);
  describe_device(file_path, m);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Page cache

// Puts the whole file in the page cache with plain buffered reads. A warm-up through the
// backend itself would not do: O_DIRECT "auto" reads a cold file past the cache and leaves it
// cold, so every "warm" run would again come from storage.
void fill_page_cache(const std::string& path) {
  const File file = File::open(path, OpenMode::read, /*with_direct_io=*/false);
  ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<std::byte> scratch(std::size_t{8} << 20);
  for (std::uint64_t offset = 0;;) {
    const std::size_t n = file.read_at(scratch, offset);
    if (n < scratch.size()) break;
    offset += n;
  }
}

// ---------------------------------------------------------------------------------------------
// Rows: one backend (or ceiling) in one operation and mode, measured N times

struct Run {
  double seconds = 0, cpu_seconds = 0;
  std::uint64_t bytes = 0, bytes_direct = 0;
  std::string backend, note;
};

struct Row {
  std::string name;          // backend name, or the ceiling's name
  bool ceiling = false;
  std::string op;            // "read" | "write" | "copy" (host-to-device ceiling)
  std::string mode;          // "cold" | "warm" | "durable" (writes: fsync counted) | "" (applies to every read mode)
  std::string status = "ok"; // "ok" | "unavailable" (cannot run here) | "failed" (wrong data, or broke mid-way)
  std::string reason;        // why not ok
  std::string backend_used;  // the backend that did the work (auto names its pick)
  std::string note;          // the engine's notes (fallbacks, compatibility mode, auto's reasons)
  std::string cache_drop;    // cold rows: how the page cache was emptied
  std::optional<bool> verified;
  std::vector<Run> runs;
  // Summary of `runs` (see summarize).
  double median_seconds = 0, p99_seconds = 0, gib_per_second = 0, cpu_percent = 0, cpu_seconds_per_gib = 0,
         direct_fraction = 0;
  // The ceiling that bounds this row and the fraction of it reached (backend rows).
  std::string bound_by;
  double bound_gib_per_second = 0, fraction_of_bound = 0;

  bool ok() const { return status == "ok"; }
  std::string label() const {
    return name == "auto" && !backend_used.empty() && backend_used != "auto" ? fmt::format("auto ({})", backend_used) : name;
  }
};

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

Run run_from(const Stats& s) {
  return {.seconds = s.seconds, .cpu_seconds = s.cpu_seconds, .bytes = s.bytes, .bytes_direct = s.bytes_direct,
          .backend = s.backend, .note = s.note};
}

// One transfer of the whole file through `engine`: a read into `memory`, or a write of `memory`
// into a freshly truncated file followed by fsync, counted in time and CPU (a save is done when
// it is durable).
Run transfer_once(Engine& engine, IoOp op, const std::string& path, MemorySpan memory, const std::string& label) {
  Progress progress(label, memory.size);
  if (op == IoOp::read) {
    File file = File::open(path, OpenMode::read);
    return run_from(engine.submit({.op = op, .file = &file, .offset = 0, .memory = memory, .progress = progress.counter()}));
  }
  File file = File::open(path, OpenMode::write);
  Run run = run_from(engine.submit({.op = op, .file = &file, .offset = 0, .memory = memory, .progress = progress.counter()}));
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = process_cpu_seconds();
  file.sync();
  run.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.cpu_seconds += process_cpu_seconds() - cpu_start;
  return run;
}

// What measure_row needs besides the row itself.
struct RowPlan {
  Engine* engine = nullptr;    // null: `unavailable` says why
  std::string unavailable;
  IoOp op = IoOp::read;
  std::string path;            // file read, or written
  MemorySpan memory;
  unsigned runs = 1;
  bool verify = false;         // compare with the file after the first run
  unsigned cpus = 1;
};

// Measures one row: cold rows empty the page cache before each run, warm rows read once untimed
// first. An error before any run completed means the path cannot run here ("unavailable", with
// the error as the reason); an error after that means it broke mid-way ("failed").
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
      fill_page_cache(plan.path);
      transfer_once(*plan.engine, plan.op, plan.path, plan.memory, what + " warm-up");
    }
    for (unsigned i = 1; i <= plan.runs; ++i) {
      if (row.mode == "cold") row.cache_drop = drop_page_cache(plan.path);
      const std::string label = fmt::format("{} run {}/{}", what, i, plan.runs);
      Run run = transfer_once(*plan.engine, plan.op, plan.path, plan.memory, label);
      if (stderr_is_terminal())
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
    row.status = row.runs.empty() ? "unavailable" : "failed";
    row.reason = e.what();
  }
  summarize(row, plan.cpus);
  return row;
}

// ---------------------------------------------------------------------------------------------
// Ceilings: what the hardware does for each kind of transfer, measured in the same run with the
// same tuning (queue depth, workers, chunk size) as the backends.

const char* const kStorageRead = "ceiling: storage read (O_DIRECT)";
const char* const kPageCacheRead = "ceiling: page-cache read";
const char* const kHostToDevice = "ceiling: pinned host->device copy";
const char* const kStorageWrite = "ceiling: storage write (O_DIRECT)";

// io_uring into pinned memory with O_DIRECT forced on or off: the storage's own rate (cold) or
// the page cache's (warm), with hbmio's engine as the load generator.
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

// cudaMemcpy from pinned host memory into the device buffer, the whole file size at once: the
// rate at which any path that stages in host memory can feed the GPU.
Row measure_host_to_device(MemorySpan device, MemorySpan pinned, unsigned runs, unsigned cpus) {
  Row row{.name = kHostToDevice, .ceiling = true, .op = "copy", .mode = ""};
  try {
    copy_memory(device, pinned);  // untimed: the first copy may still set up the CUDA context's mappings
    for (unsigned i = 1; i <= runs; ++i) {
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = process_cpu_seconds();
      copy_memory(device, pinned);
      row.runs.push_back({.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                          .cpu_seconds = process_cpu_seconds() - cpu_start,
                          .bytes = device.size,
                          .backend = "cudaMemcpy"});
    }
  } catch (const std::exception& e) {
    row.status = row.runs.empty() ? "unavailable" : "failed";
    row.reason = e.what();
  }
  row.backend_used = "cudaMemcpy";
  summarize(row, cpus);
  return row;
}

// Each backend row's bound: the slowest ceiling its data must pass. Cold reads pass the storage
// (and, into a GPU, the host-to-device link unless GDS bypasses it: the min is still the honest
// bound for the staged paths); warm reads the page cache (and the link); writes the storage.
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
    else limits = {rate_of(row.mode == "cold" ? kStorageRead : kPageCacheRead)};
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

// ---------------------------------------------------------------------------------------------
// Output: table, JSON, SVG

struct Report {
  Machine machine;
  std::string date, command, file_path, into;
  bool generated = false;
  std::uint64_t size = 0;
  unsigned runs = 0;
  Options options;
  std::vector<Row> rows;
};

// The groups the table and the chart show, in order: read cold, read warm, write.
struct Group {
  std::string op, mode, title;
};
std::vector<Group> groups_of(const Report& report) {
  std::vector<Group> groups;
  auto add = [&](const std::string& op, const std::string& mode, const std::string& title) {
    for (const Row& r : report.rows)
      if (!r.ceiling && r.op == op && r.mode == mode) return groups.push_back({op, mode, title});
  };
  add("read", "cold", "read, cold: page cache emptied before each run");
  add("read", "warm", "read, warm: file in the page cache (one untimed read first)");
  add("write", "durable", "write, durable: memory -> new file, fsync counted");
  return groups;
}
// A group's rows: its ceilings first (the host-to-device copy bounds every read), then backends.
std::vector<const Row*> rows_of(const Report& report, const Group& group) {
  std::vector<const Row*> rows;
  for (const Row& r : report.rows)
    if (r.ceiling && ((r.op == group.op && r.mode == group.mode) || (r.op == "copy" && group.op == "read")))
      rows.push_back(&r);
  for (const Row& r : report.rows)
    if (!r.ceiling && r.op == group.op && r.mode == group.mode) rows.push_back(&r);
  return rows;
}

std::string gpu_line(const Report& r) {
  if (r.machine.gpu) return fmt::format("{} ({} device(s))", r.machine.gpu_name, cuda_device_count());
  return "none: " + r.machine.gpu_reason;
}

std::string shorten(const std::string& text, std::size_t width) {
  return text.size() <= width ? text : text.substr(0, width - 3) + "...";
}

void print_table(const Report& r) {
  const Machine& m = r.machine;
  fmt::print("hbmio bench {}  {}\n", version(), r.date);
  if (!m.gpu) fmt::print("no GPU: measuring storage into host memory ({})\n", r.into);
  fmt::print("machine  {}, {} cores, {} memory, {}\n", m.cpu_model, m.cpus, format_size(m.memory_bytes), m.kernel);
  fmt::print("GPU      {}\n", gpu_line(r));
  fmt::print("file     {}, {}{}, {} on {}{}\n", r.file_path, format_size(r.size),
             r.generated ? " of random data (generated, removed afterwards)" : "", m.file_system, m.device,
             m.device_model.empty() ? "" : " (" + m.device_model + ")");
  fmt::print("into     {}; {} timed runs per row; chunk {}, bounce buffers {} x {}, queue depth {}, {} workers, direct_io {}\n",
             r.into, r.runs, format_size(r.options.chunk_size), r.options.bounce_buffers,
             format_size(r.options.bounce_buffer_size), r.options.queue_depth, r.options.resolved_workers(),
             to_string(r.options.direct_io));
  fmt::print("CPU % is of all {} cores; GiB/s is from the median latency; 'of bound' is the share of the slowest ceiling\n"
             "the data passes (above 100%: the path beat the ceiling's own run, e.g. through readahead or a virtual disk's cache).\n",
             m.cpus);

  for (const Group& g : groups_of(r)) {
    std::string cache_drop;
    for (const Row* row : rows_of(r, g))
      if (!row->cache_drop.empty()) cache_drop = row->cache_drop;
    fmt::print("\n{}{}\n", g.title, cache_drop.empty() ? "" : " (" + cache_drop + ")");
    fmt::print("  {:<36} {:>9} {:>9} {:>7} {:>6} {:>9} {:>8} {:>8}  {}\n", "path", "median s", "p99 s", "GiB/s", "CPU %",
               "CPU s/GiB", "O_DIRECT", "of bound", "notes");
    for (const Row* row : rows_of(r, g)) {
      if (row->status == "unavailable") {
        fmt::print("  {:<36} unavailable: {}\n", row->label(), row->reason);
        continue;
      }
      const std::string bound = row->bound_by.empty() ? "-" : fmt::format("{:.0f}%", 100 * row->fraction_of_bound);
      std::string notes = row->status == "failed" ? "FAILED: " + row->reason : shorten(row->note, 90);
      fmt::print("  {:<36} {:>9.4f} {:>9.4f} {:>7.2f} {:>6.1f} {:>9.3f} {:>7.0f}% {:>8}  {}\n", row->label(),
                 row->median_seconds, row->p99_seconds, row->gib_per_second, row->cpu_percent, row->cpu_seconds_per_gib,
                 100 * row->direct_fraction, bound, notes);
    }
  }
}

nlohmann::json to_json(const Row& row) {
  nlohmann::json runs = nlohmann::json::array();
  for (const Run& run : row.runs)
    runs.push_back({{"seconds", run.seconds}, {"cpu_seconds", run.cpu_seconds}, {"bytes", run.bytes},
                    {"bytes_direct", run.bytes_direct}, {"backend", run.backend}, {"note", run.note}});
  nlohmann::json j = {{"name", row.name},
                      {"op", row.op},
                      {"mode", row.mode},
                      {"available", row.status != "unavailable"},
                      {"status", row.status},
                      {"reason", row.reason},
                      {"backend_used", row.backend_used},
                      {"note", row.note},
                      {"runs", runs},
                      {"median_seconds", row.median_seconds},
                      {"p99_seconds", row.p99_seconds},
                      {"gib_per_second", row.gib_per_second},
                      {"cpu_percent_of_all_cores", row.cpu_percent},
                      {"cpu_seconds_per_gib", row.cpu_seconds_per_gib},
                      {"direct_io_fraction", row.direct_fraction}};
  if (!row.cache_drop.empty()) j["cache_drop"] = row.cache_drop;
  if (row.verified) j["verified"] = *row.verified;
  if (!row.ceiling)
    j["bound"] = row.bound_by.empty() ? nlohmann::json(nullptr)
                                      : nlohmann::json{{"ceiling", row.bound_by},
                                                       {"gib_per_second", row.bound_gib_per_second},
                                                       {"fraction", row.fraction_of_bound}};
  return j;
}

nlohmann::json to_json(const Report& r) {
  const Machine& m = r.machine;
  nlohmann::json results = nlohmann::json::array(), ceilings = nlohmann::json::array();
  for (const Row& row : r.rows) (row.ceiling ? ceilings : results).push_back(to_json(row));
  return {{"schema_version", kSchemaVersion},
          {"hbmio_version", version()},
          {"date", r.date},
          {"command_line", r.command},
          {"machine",
           {{"cpu_model", m.cpu_model},
            {"cpus", m.cpus},
            {"memory_bytes", m.memory_bytes},
            {"kernel", m.kernel},
            {"gpu", {{"present", m.gpu}, {"name", m.gpu_name}, {"reason", m.gpu_reason}}}}},
          {"file",
           {{"path", r.file_path},
            {"bytes", r.size},
            {"generated", r.generated},
            {"file_system", m.file_system},
            {"device", m.device},
            {"device_model", m.device_model}}},
          {"settings",
           {{"into", r.into},
            {"runs", r.runs},
            {"options",
             {{"chunk_size", r.options.chunk_size},
              {"bounce_buffer_size", r.options.bounce_buffer_size},
              {"bounce_buffers", r.options.bounce_buffers},
              {"queue_depth", r.options.queue_depth},
              {"workers", r.options.resolved_workers()},
              {"direct_io", to_string(r.options.direct_io)}}}}},
          {"ceilings", ceilings},
          {"results", results}};
}

// Text for XML: markup characters escaped, control characters (invalid in XML 1.0) dropped.
std::string xml_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        if (static_cast<unsigned char>(c) >= 0x20) out += c;
    }
  }
  return out;
}

// A self-contained SVG: per group, one line per row with a throughput bar (GiB/s, scaled to the
// group's fastest row) and a host-CPU bar (% of all cores); the bound appears as a dashed line.
std::string render_svg(const Report& r) {
  constexpr int kWidth = 1000, kLabelX = 12, kBarX = 270, kBarWidth = 380, kCpuX = 760, kCpuWidth = 160, kLine = 22;
  // One colour per backend, the same in every group; ceilings grey.
  auto color_of = [](const Row& row) {
    if (row.ceiling) return "#9e9e9e";
    if (row.name == "posix") return "#4e79a7";
    if (row.name == "uring") return "#f28e2b";
    if (row.name == "cufile") return "#59a14f";
    return "#b07aa1";
  };
  std::string body;
  int y = 54;
  auto text = [&](int x, int ty, const std::string& s, const char* extra = "") {
    body += fmt::format("<text x=\"{}\" y=\"{}\"{}>{}</text>\n", x, ty, extra, xml_escape(s));
  };
  for (const Group& g : groups_of(r)) {
    const auto rows = rows_of(r, g);
    double max_rate = 0;
    for (const Row* row : rows) max_rate = std::max(max_rate, row->gib_per_second);
    if (max_rate <= 0) max_rate = 1;
    y += 26;
    text(kLabelX, y, g.title, " font-weight=\"bold\"");
    text(kBarX, y + 16, "throughput, GiB/s", " fill=\"#555\"");
    text(kCpuX, y + 16, fmt::format("host CPU, % of {} cores", r.machine.cpus), " fill=\"#555\"");
    y += 22;
    const int top = y;
    double bound = 0;
    for (const Row* row : rows) {
      const int mid = y + kLine / 2;
      text(kLabelX, mid + 4, row->label());
      if (!row->ok() && row->runs.empty()) {
        text(kBarX + 4, mid + 4, shorten(row->status + ": " + row->reason, 110), " fill=\"#b00\"");
      } else {
        const char* fill = color_of(*row);
        const int w = static_cast<int>(kBarWidth * row->gib_per_second / max_rate);
        body += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", kBarX, y + 3, std::max(w, 1),
                            kLine - 6, fill);
        text(kBarX + std::max(w, 1) + 4, mid + 4,
             fmt::format("{:.2f}{}", row->gib_per_second, row->status == "failed" ? " FAILED" : ""));
        const int cw = static_cast<int>(kCpuWidth * std::min(row->cpu_percent, 100.0) / 100.0);
        body += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>\n", kCpuX, y + 3, std::max(cw, 1),
                            kLine - 6, fill);
        text(kCpuX + std::max(cw, 1) + 4, mid + 4, fmt::format("{:.1f}%", row->cpu_percent));
      }
      if (!row->ceiling && row->bound_gib_per_second > 0) bound = row->bound_gib_per_second;
      y += kLine;
    }
    body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n", kBarX, top, y);
    body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n", kCpuX, top, y);
    if (bound > 0) {
      const int x = kBarX + static_cast<int>(kBarWidth * bound / max_rate);
      body += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#c00\" stroke-dasharray=\"4,3\"/>\n", x,
                          top - 2, y + 2);
      text(x + 3, y + 13, fmt::format("bound {:.2f} GiB/s", bound), " fill=\"#c00\"");
      y += 14;
    }
  }
  const Machine& m = r.machine;
  std::string header;
  header += fmt::format("<text x=\"{}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n", kLabelX,
                        xml_escape(fmt::format("hbmio bench: {} {} into {}, {} runs per row ({})", format_size(r.size),
                                               m.file_system, r.into, r.runs, r.date)));
  header += fmt::format("<text x=\"{}\" y=\"42\">{}</text>\n", kLabelX,
                        xml_escape(fmt::format("{} x{}, {}; GPU: {}; device {}", m.cpu_model, m.cpus, m.kernel,
                                               m.gpu ? m.gpu_name : "none", m.device)));
  const int height = y + 20;
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{2}{3}</svg>\n",
      kWidth, height, header, body);
}

void write_text(const std::string& text, const std::string& path) {
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) throw Error(errno_code(EIO), {.op = "write", .path = path}, "could not write the chart");
}

// ---------------------------------------------------------------------------------------------
// The command

struct Engines {
  std::vector<std::pair<std::string, std::unique_ptr<Engine>>> engines;
  std::vector<std::string> errors;  // per backend: why make_engine refused, else ""
};

Engines make_engines(const std::vector<std::string>& names, const Options& options) {
  Engines e;
  for (const auto& name : names) {
    std::unique_ptr<Engine> engine;
    std::string error;
    try {
      engine = make_engine(name, options);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    e.engines.emplace_back(name, std::move(engine));
    e.errors.push_back(error);
  }
  return e;
}

int run_bench(const BenchFlags& flags) {
  // 1. Flags.
  const Options options = flags.tuning.resolve();
  const auto backends = split_backends(flags.backends);
  // Conflicting flags are checked here rather than with CLI11's excludes() so that every bad
  // argument exits 1 with a message naming it, as the other errors do.
  auto bad_argument = [](const std::string& flag, const std::string& why) {
    return Error(errno_code(EINVAL), {.op = "bench " + flag}, why);
  };
  if (!flags.file.empty() && !flags.size.empty()) throw bad_argument("--size", "--file and --size exclude each other");
  if (int(flags.cold) + int(flags.warm) + int(flags.both) > 1)
    throw bad_argument("--cold/--warm/--both", "give at most one of them");
  if (flags.runs < 1) throw bad_argument("--runs", "at least 1 run is needed (5 or more for figures to quote)");
  const bool both = flags.both || flags.cold == flags.warm;  // neither flag: both modes
  std::vector<std::string> modes;
  if (both || flags.cold) modes.push_back("cold");
  if (both || flags.warm) modes.push_back("warm");
  const bool gpu = cuda_device_count() > 0;
  MemoryLocation into;
  try {
    into = MemoryLocation::parse(flags.into.empty() ? (gpu ? "cuda:0" : "pinned") : flags.into);
  } catch (const Error& e) {
    throw bad_argument("--into", e.detail());
  }
  if (flags.runs < 5)
    fmt::print(stderr, "hbmio: warning: --runs {} is below 5: the median and p99 of so few runs are rough\n", flags.runs);

  std::uint64_t size = 0;
  if (flags.file.empty()) {
    try {
      size = parse_size(flags.size.empty() ? "4GiB" : flags.size);
    } catch (const Error& e) {
      throw bad_argument("--size", e.detail());
    }
    if (size == 0) throw bad_argument("--size", "the sample file must not be empty");
  } else {
    size = File::open(flags.file, OpenMode::read).size();  // names the file and the cause when missing
    if (size == 0) throw bad_argument("--file", flags.file + " is empty");
  }

  // Memory, allocated once and before the sample file is generated (a bad --into or too little
  // memory fails at once, not after minutes of writing): the destination of --into, and pinned host memory for the ceilings.
  Buffer destination = Buffer::allocate(into, size);
  Buffer pinned_storage = into.kind == MemoryKind::pinned ? Buffer() : Buffer::allocate({MemoryKind::pinned}, size);
  const MemorySpan pinned = into.kind == MemoryKind::pinned ? destination.span() : pinned_storage.span();
  // Touch the host pages now so that the first timed run does not pay for page faults.
  fill_memory(destination.span(), std::byte{0});
  if (pinned.data != destination.data()) fill_memory(pinned, std::byte{0});

  // The sample file, and the write target, live in a scratch directory on the file system under
  // test: --dir, else the directory of --file (writes then land on the same storage), else ".".
  std::string dir = flags.dir;
  if (dir.empty() && !flags.file.empty()) dir = std::filesystem::path(flags.file).parent_path().string();
  if (dir.empty()) dir = ".";
  std::unique_ptr<ScratchDir> scratch;
  if (flags.file.empty() || flags.write) {
    require_free_space(dir, (flags.file.empty() ? size : 0) + (flags.write ? size : 0));
    scratch = std::make_unique<ScratchDir>(dir);
  }
  const std::string path = flags.file.empty() ? scratch->sample_path() : flags.file;
  if (flags.file.empty()) create_sample_file(path, size, options);

  // 2. The machine.
  Report report{.machine = describe_machine(path, into), .date = iso8601_now(), .command = command_line(),
                .file_path = path, .into = into.to_string(), .generated = flags.file.empty(), .size = size,
                .runs = flags.runs, .options = options};
  if (!gpu && flags.json == "-")  // the table, which says so at its top, is not printed then
    fmt::print(stderr, "hbmio: no GPU: measuring storage into host memory ({})\n", into.to_string());


  // 3. Rows.
  Engines engines = make_engines(backends, options);
  std::vector<std::string> verified;  // "backend op" pairs whose data has been checked (reads and writes each once)
  auto backend_row = [&](std::size_t i, const std::string& op, const std::string& mode, const std::string& target) {
    const auto& [name, engine] = engines.engines[i];
    const std::string key = name + " " + op;
    const bool verify = std::find(verified.begin(), verified.end(), key) == verified.end();
    Row row = measure_row({.name = name, .op = op, .mode = mode},
                          {.engine = engine.get(), .unavailable = engines.errors[i], .op = op == "read" ? IoOp::read : IoOp::write,
                           .path = target, .memory = destination.span(), .runs = flags.runs, .verify = verify,
                           .cpus = report.machine.cpus});
    if (row.verified) verified.push_back(key);
    report.rows.push_back(std::move(row));
  };
  const RowPlan ceiling_read{.op = IoOp::read, .path = path, .memory = pinned, .runs = flags.runs, .cpus = report.machine.cpus};
  for (const auto& mode : modes) {
    if (mode == "cold")
      report.rows.push_back(measure_uring_ceiling(kStorageRead, "read", "cold", DirectIo::on, ceiling_read, options));
    else
      report.rows.push_back(measure_uring_ceiling(kPageCacheRead, "read", "warm", DirectIo::off, ceiling_read, options));
    for (std::size_t i = 0; i < backends.size(); ++i) backend_row(i, "read", mode, path);
  }
  if (into.kind == MemoryKind::device)
    report.rows.push_back(measure_host_to_device(destination.span(), pinned, flags.runs, report.machine.cpus));
  if (flags.write) {
    RowPlan ceiling_write = ceiling_read;
    ceiling_write.op = IoOp::write;
    ceiling_write.path = scratch->write_path();
    report.rows.push_back(measure_uring_ceiling(kStorageWrite, "write", "durable", DirectIo::on, ceiling_write, options));
    for (std::size_t i = 0; i < backends.size(); ++i) backend_row(i, "write", "durable", scratch->write_path());
  }
  attach_bounds(report.rows, into.kind == MemoryKind::device);

  // 4. Output.
  if (flags.json != "-") print_table(report);
  if (!flags.json.empty()) write_json(to_json(report), flags.json);
  if (!flags.chart.empty()) write_text(render_svg(report), flags.chart);

  int status = 0;
  for (const Row& row : report.rows)
    if (row.status == "failed") {
      fmt::print(stderr, "hbmio: bench: {} {} {} FAILED: {}\n", row.op, row.mode, row.name, row.reason);
      status = 1;
    }
  return status;
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_status) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Measure posix vs io_uring vs GPUDirect Storage on this machine: latency (median, p99), GiB/s and host CPU per\n"
      "backend, cold and warm, beside the ceilings of this hardware measured in the same run");
  bench->add_option("--file", flags->file, "Existing file to read (default: generate a random sample file of --size)");
  bench->add_option("--size", flags->size, "Size of the generated sample file, e.g. 1GiB (default 4GiB, the article's shard)");
  bench->add_option("--dir", flags->dir,
                    "Directory (and so file system) for the sample file and the write target; removed afterwards\n"
                    "(default: the directory of --file, else the current directory)");
  bench->add_option("--backends", flags->backends, "Comma-separated backends to measure: posix, uring, cufile, auto")
      ->capture_default_str();
  bench->add_option("--into", flags->into, "Destination memory: cuda:N, pinned or host (default: cuda:0 with a GPU, else pinned)");
  bench->add_flag("--write", flags->write, "Also measure saving: memory -> a new file, fsync counted in the time");
  bench->add_flag("--cold", flags->cold, "Only cold reads: the page cache is emptied before every run");
  bench->add_flag("--warm", flags->warm, "Only warm reads: the file is read once, untimed, before timing");
  bench->add_flag("--both", flags->both, "Cold and warm reads (the default)");
  bench->add_option("--runs", flags->runs, "Timed runs per row; latency is their median and p99 (use >= 5 for figures to quote)")
      ->capture_default_str();
  add_json_option(bench, flags->json, "Write every figure and the machine description");
  bench->add_option("--chart", flags->chart, "Write an SVG bar chart of throughput and CPU load per backend to FILE.svg")->type_name("FILE")->check(writable_file());
  flags->tuning.add_to(bench);
  bench->footer(
      "Ceilings, measured in the same run with the same tuning: storage read (io_uring, O_DIRECT, cold, into pinned\n"
      "memory), page-cache read (io_uring, buffered, warm), pinned host->device copy (with a GPU and --into cuda:N),\n"
      "storage write (io_uring, O_DIRECT, fsync; with --write). Cold runs drop the page cache as root\n"
      "(/proc/sys/vm/drop_caches), else with posix_fadvise(DONTNEED); the table says which.");
  bench->callback([flags, &exit_status] { exit_status = run_bench(*flags); });
}

}  // namespace hbmio::cli
