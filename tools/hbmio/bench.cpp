// `hbmio bench`: every backend reads (and with --write, saves) one whole file, cold and warm,
// N times, beside the ceilings measured in the same run: what the storage delivers to O_DIRECT
// reads, what the page cache delivers, and (with a GPU) what a pinned host-to-device copy does.
//
// This file is the command: flags, the scratch files, and the flow of run_bench(), top to bottom:
//   1. validate the flags; allocate the destination once (timing excludes allocation, as a
//      loader reuses buffers); create a random sample file unless --file names one;
//   2. describe the machine (describe_machine, hbmio/doctor.hpp);
//   3. measure rows (bench_measure.hpp): per mode, first the ceiling, then each backend; the
//      first run of each backend is compared with a plain pread of the file;
//   4. print the table; write --json and --chart (bench_report.hpp).
// A backend that cannot run here still gets a row, saying why. Ctrl-C (SIGINT, SIGTERM, SIGHUP)
// stops the run through run_stoppable(): the engines see the stop flag, the run unwinds, and the
// scratch files go with it.
#include "bench.hpp"

#include <sys/statvfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bench_measure.hpp"
#include "bench_report.hpp"
#include "cli_common.hpp"
#include "hbmio/hbmio.hpp"

namespace hbmio::cli {
namespace {

// ---------------------------------------------------------------------------------------------
// Flags

struct BenchFlags {
  std::string file, size, dir, backends = "posix,uring,cufile,auto", into, json, chart, url;
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

// The GPU whose name the machine's record carries: the one measured into, else the first.
int gpu_of(const MemoryLocation& into) { return into.kind == MemoryKind::device ? into.device : 0; }

// The command line as typed, for the JSON record (CLI11 does not keep argv), each argument as
// messages show paths: a URL without its user info and query (a password, a presigned URL's
// signature and session token).
std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string text, arg;
  while (std::getline(in, arg, '\0')) {
    const std::size_t equals = arg.starts_with("--") ? arg.find('=') : std::string::npos;  // --url=URL
    arg = equals == std::string::npos ? shown_path(arg) : arg.substr(0, equals + 1) + shown_path(arg.substr(equals + 1));
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

// ---------------------------------------------------------------------------------------------
// Scratch files: the generated sample and the write target, removed on every way out.

// A temporary directory holding sample.bin and write.bin, removed by the destructor: on a normal
// return, on an error, and on Ctrl-C, which unwinds the run as an Error(ECANCELED).
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
  }
  ~ScratchDir() {
    ::unlink(sample_path().c_str());
    ::unlink(write_path().c_str());
    ::rmdir(path_.c_str());
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
void create_sample_file(const std::string& path, std::uint64_t size, const Options& options, const std::atomic<bool>& stop) {
  const std::size_t block = static_cast<std::size_t>(std::min<std::uint64_t>(size, std::uint64_t{64} << 20));
  Buffer buffer = Buffer::allocate({MemoryKind::host}, block);
  fill_random(buffer.data(), block, 0x5eed);
  File file = File::open(path, OpenMode::write);
  auto engine = make_engine("auto", options);
  with_progress("creating " + path, size, [&](std::atomic<std::uint64_t>* progress) {
    for (std::uint64_t offset = 0; offset < size; offset += block) {
      const std::size_t length = static_cast<std::size_t>(std::min<std::uint64_t>(block, size - offset));
      for (std::size_t page = 0; page + 8 <= length; page += 4096) {
        const std::uint64_t stamp = offset + page;
        std::memcpy(buffer.data() + page, &stamp, 8);
      }
      engine->submit({.op = IoOp::write, .file = &file, .offset = offset, .memory = buffer.span().subspan(0, length),
                      .progress = progress, .cancel = &stop});
    }
  });
  file.sync();
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

// Step 4 of both flows: the table, --json and --chart; exit status 1 when a row failed.
int report_and_status(const Report& report, const BenchFlags& flags) {
  if (flags.json != "-") fmt::print("{}", render_table(report));
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

// --url: one object at a URL read whole, N times, into --into, beside the ceiling of the same
// GETs with the bytes dropped on arrival (and, into a GPU, the pinned host-to-device copy).
// Connections and part size: HBMIO_REMOTE_CONNECTIONS, HBMIO_REMOTE_PART_SIZE.
int run_bench_url(const BenchFlags& flags, const std::atomic<bool>& stop) {
  if (!flags.file.empty() || !flags.size.empty() || flags.write || flags.cold || flags.warm || flags.both || !flags.dir.empty())
    throw Error(errno_code(EINVAL), {.op = "bench --url"}, "--url reads one object: --file, --size, --dir, --write, --cold, --warm and --both do not apply");
  if (flags.runs < 1) throw Error(errno_code(EINVAL), {.op = "bench --runs"}, "at least 1 run is needed");
  const bool gpu = cuda_device_count() > 0;
  const MemoryLocation into = MemoryLocation::parse(flags.into.empty() ? (gpu ? "cuda:0" : "pinned") : flags.into);
  const RemoteOptions options = RemoteOptions::from_env();
  const auto object = RemoteObject::open(flags.url, options);
  const std::uint64_t size = object->size();
  if (size == 0) throw Error(errno_code(EINVAL), {.op = "bench --url", .path = object->shown()}, "the object is empty");
  Buffer destination = Buffer::allocate(into, size);
  fill_memory(destination.span(), std::byte{0});  // page faults out of the timed runs
  Report report{.machine = describe_machine(".", gpu_of(into)), .date = iso8601_now(), .command = command_line(),
                .file_path = object->shown(), .into = into.to_string(), .generated = false, .size = size,
                .runs = flags.runs, .options = flags.tuning.resolve()};
  if (!gpu && flags.json == "-") fmt::print(stderr, "hbmio: no GPU: measuring the URL into host memory ({})\n", into.to_string());
  const unsigned cpus = report.machine.cpus;
  RemoteOptions dropped = options;
  dropped.discard = true;
  report.rows.push_back(measure_remote({.name = kRemoteRead, .ceiling = true, .op = "read", .mode = "remote"}, *object,
                                       destination.span(), dropped, flags.runs, false, cpus, &stop));
  report.rows.push_back(measure_remote({.name = "remote", .op = "read", .mode = "remote"}, *object, destination.span(), options,
                                       flags.runs, true, cpus, &stop));
  if (into.kind == MemoryKind::device) {
    Buffer pinned = Buffer::allocate({MemoryKind::pinned}, size);
    report.rows.push_back(measure_host_to_device(destination.span(), pinned.span(), flags.runs, cpus, &stop));
  }
  attach_bounds(report.rows, into.kind == MemoryKind::device);
  return report_and_status(report, flags);
}

int run_bench(const BenchFlags& flags, const std::atomic<bool>& stop) {
  if (!flags.url.empty()) return run_bench_url(flags, stop);
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
  throw_if_stopped(&stop);  // before any file is made, after what may take seconds

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
  if (flags.file.empty()) create_sample_file(path, size, options, stop);

  // 2. The machine.
  Report report{.machine = describe_machine(path, gpu_of(into)), .date = iso8601_now(), .command = command_line(),
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
                           .cpus = report.machine.cpus, .cancel = &stop});
    if (row.verified) verified.push_back(key);
    report.rows.push_back(std::move(row));
  };
  const RowPlan ceiling_read{.op = IoOp::read, .path = path, .memory = pinned, .runs = flags.runs, .cpus = report.machine.cpus,
                             .cancel = &stop};
  for (const auto& mode : modes) {
    if (mode == "cold")
      report.rows.push_back(measure_uring_ceiling(kStorageRead, "read", "cold", DirectIo::on, ceiling_read, options));
    else
      report.rows.push_back(measure_uring_ceiling(kPageCacheRead, "read", "warm", DirectIo::off, ceiling_read, options));
    for (std::size_t i = 0; i < backends.size(); ++i) backend_row(i, "read", mode, path);
  }
  if (into.kind == MemoryKind::device)
    report.rows.push_back(measure_host_to_device(destination.span(), pinned, flags.runs, report.machine.cpus, &stop));
  if (flags.write) {
    RowPlan ceiling_write = ceiling_read;
    ceiling_write.op = IoOp::write;
    ceiling_write.path = scratch->write_path();
    report.rows.push_back(measure_uring_ceiling(kStorageWrite, "write", "durable", DirectIo::on, ceiling_write, options));
    for (std::size_t i = 0; i < backends.size(); ++i) backend_row(i, "write", "durable", scratch->write_path());
  }
  attach_bounds(report.rows, into.kind == MemoryKind::device);

  // 4. Output.
  return report_and_status(report, flags);
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_status) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Measure posix vs io_uring vs GPUDirect Storage on this machine: latency (median, p99), GiB/s and host CPU per\n"
      "backend, cold and warm, beside the ceilings of this hardware measured in the same run");
  bench->add_option("--file", flags->file, "Existing file to read (default: generate a random sample file of --size)");
  bench->add_option("--size", flags->size, "Size of the generated sample file, e.g. 1GiB (default 4GiB, about one shard\n"
                    "of a large model's safetensors checkpoint)");
  bench->add_option("--dir", flags->dir,
                    "Directory (and so file system) for the sample file and the write target; removed afterwards\n"
                    "(default: the directory of --file, else the current directory)");
  bench->add_option("--url", flags->url,
                    "Measure reads of one object at a URL instead (s3://BUCKET/KEY, http(s)://...): the whole object\n"
                    "into --into, --runs times, beside the same GETs with the bytes dropped (the server's and the\n"
                    "network's ceiling); HBMIO_REMOTE_CONNECTIONS and HBMIO_REMOTE_PART_SIZE set the parallelism")
      ->type_name("URL");
  // --backend too: every other command takes that spelling, and one backend is a list of one.
  bench->add_option("--backends,--backend", flags->backends, "Comma-separated backends to measure: posix, uring, cufile, auto")
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
  bench->callback([flags, &exit_status] {
    exit_status = run_stoppable([flags](const std::atomic<bool>& stop) { return run_bench(*flags, stop); },
                                [](bool stopped) {
                                  return stopped ? std::string("no report; the files the run made are removed")
                                                 : std::string("the run had ended already (see above)");
                                });
  });
}

}  // namespace hbmio::cli
