// hbmio: move tensor data between storage and GPU memory, and measure how fast it goes.
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstring>
#include <iostream>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "ckpt.hpp"
#include "cli_common.hpp"
#include "doctor.hpp"
#include "hbmio/hbmio.hpp"

namespace hbmio::cli {
namespace {

int run_read(const std::string& path, const std::string& into, const std::string& backend, const std::string& offset_text,
             const std::string& length_text, bool verify, const std::string& json, const TuningFlags& tuning) {
  const Options options = tuning.resolve();
  const MemoryLocation where = MemoryLocation::parse(into);
  File file = File::open(path, OpenMode::read);
  const std::uint64_t offset = offset_text.empty() ? 0 : parse_size(offset_text);
  const std::uint64_t size = file.size();
  if (offset > size)
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset},
                fmt::format("offset is past the end of the file ({} bytes)", size));
  const std::uint64_t length = length_text.empty() ? size - offset : parse_size(length_text);
  if (length == 0)
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset}, "nothing to read (length 0)");
  if (length > size - offset)  // before the memory is allocated: a typo should not ask for a TiB
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset, .length = length},
                fmt::format("the range ends past the end of the file ({} bytes)", size));
  auto engine = make_engine(backend, options);
  Buffer buffer = Buffer::allocate(where, length);
  Progress progress(fmt::format("read {} -> {}", path, where.to_string()), length);
  IoRequest request{.op = IoOp::read, .file = &file, .offset = offset, .memory = buffer.span(), .progress = progress.counter()};
  Stats stats = engine->submit(request);
  std::optional<std::uint64_t> mismatch;
  if (verify) mismatch = first_difference(buffer.span(), path, offset);
  if (!json.empty()) {
    nlohmann::json j = {{"command", "read"}, {"file", path}, {"into", where.to_string()}, {"offset", offset},
                        {"length", length}, {"stats", to_json(stats)}};
    if (verify) j["verified"] = !mismatch;
    if (mismatch) j["first_mismatch_offset"] = *mismatch;
    write_json(j, json);
  }
  if (json != "-") fmt::print("{}\n", summary_line(stats));
  if (mismatch) {
    fmt::print(stderr, "hbmio: verify FAILED: {} differs from a plain read at byte {}\n", path, *mismatch);
    return 1;
  }
  if (verify && json != "-") fmt::print("verified: {} bytes identical to a plain read\n", length);
  return 0;
}

int run_write(const std::string& path, const std::string& from, const std::string& backend, const std::string& size_text,
              const std::string& offset_text, std::uint64_t seed, bool sync, bool verify, bool force, const std::string& json,
              const TuningFlags& tuning) {
  const Options options = tuning.resolve();
  const MemoryLocation where = MemoryLocation::parse(from);
  const std::uint64_t length = parse_size(size_text);
  const std::uint64_t offset = offset_text.empty() ? 0 : parse_size(offset_text);
  if (length == 0) throw Error(errno_code(EINVAL), {.op = "write", .path = path}, "nothing to write (size 0)");
  // Random bytes over a real file (a checkpoint) destroy it: only when asked for.
  if (struct stat st {}; !force && ::lstat(path.c_str(), &st) == 0)
    throw Error(errno_code(EEXIST), {.op = "write-random", .path = path},
                "the file exists, and write-random would overwrite it with random bytes: add --force to do that");
  auto engine = make_engine(backend, options);
  Buffer buffer = Buffer::allocate(where, length);
  {
    Buffer staging = where.kind == MemoryKind::device ? Buffer::allocate({MemoryKind::host}, length) : Buffer();
    MemorySpan fill = where.kind == MemoryKind::device ? staging.span() : buffer.span();
    fill_random(fill.data, fill.size, seed);
    if (where.kind == MemoryKind::device) copy_memory(buffer.span(), staging.span());
  }
  File file = File::open(path, offset == 0 ? OpenMode::write : OpenMode::read_write);
  Progress progress(fmt::format("write {} -> {}", where.to_string(), path), length);
  IoRequest request{.op = IoOp::write, .file = &file, .offset = offset, .memory = buffer.span(), .progress = progress.counter()};
  Stats stats = engine->submit(request);
  if (sync) {
    const auto start = std::chrono::steady_clock::now();
    file.sync();
    stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::optional<std::uint64_t> mismatch;
  if (verify) mismatch = first_difference(buffer.span(), path, offset);
  if (!json.empty()) {
    nlohmann::json j = {{"command", "write-random"}, {"file", path}, {"from", where.to_string()}, {"offset", offset},
                        {"length", length}, {"fsync", sync}, {"stats", to_json(stats)}};
    if (verify) j["verified"] = !mismatch;
    write_json(j, json);
  }
  if (json != "-") fmt::print("{}\n", summary_line(stats));
  if (mismatch) {
    fmt::print(stderr, "hbmio: verify FAILED: {} differs from the written data at byte {}\n", path, *mismatch);
    return 1;
  }
  if (verify && json != "-") fmt::print("verified: {} bytes read back with a plain read, identical to what was written\n", length);
  return 0;
}

int run_backends(const std::string& json, const TuningFlags& tuning) {
  const auto statuses = probe_backends(tuning.resolve());
  nlohmann::json j = nlohmann::json::array();
  for (const auto& s : statuses) j.push_back({{"name", s.name}, {"available", s.available}, {"detail", s.detail}});
  const int devices = cuda_device_count();
  if (!json.empty()) {
    write_json({{"backends", j},
                {"cuda", {{"built_with_cuda", built_with_cuda()}, {"devices", devices}, {"reason", cuda_unavailable_reason()}}}},
               json);
    if (json == "-") return 0;
  }
  for (const auto& s : statuses) fmt::print("{:<7} {:<4} {}\n", s.name, s.available ? "yes" : "no", s.detail);
  if (devices > 0) {
    for (int d = 0; d < devices; ++d) fmt::print("cuda:{}  {}\n", d, cuda_device_name(d));
  } else {
    fmt::print("GPU     no   {}\n", cuda_unavailable_reason());
  }
  return 0;
}

}  // namespace
}  // namespace hbmio::cli

int main(int argc, char** argv) {
  using namespace hbmio::cli;
  CLI::App app{"hbmio: move tensor data between storage and GPU memory at the speed of the hardware.\n"
               "Backends: posix (pread + cudaMemcpy baseline), uring (io_uring + O_DIRECT + pinned bounce buffers),\n"
               "cufile (GPUDirect Storage), auto (the best that works here). Environment: HBMIO_* (see --help of each command)."};
  app.set_version_flag("--version", "hbmio " + hbmio::version());
  app.require_subcommand(1);

  std::string path, into = "host", from = "host", backend = hbmio::cli::default_backend(), offset, length, size, json;
  bool verify = false, sync = false;
  std::uint64_t seed = 1;
  TuningFlags tuning;

  auto* read = app.add_subcommand("read", "Read a file range into host, pinned or GPU memory and report the throughput");
  read->add_option("file", path, "File to read")->required();
  read->add_option("--into", into, "Destination memory: host, pinned or cuda:N")->capture_default_str();
  read->add_option("--backend,-b", backend, "posix, uring, cufile or auto")->capture_default_str();
  read->add_option("--offset", offset, "First byte to read (default 0)")->check(hbmio::cli::size_value());
  read->add_option("--length", length, "Bytes to read (default: to the end of the file)")->check(hbmio::cli::size_value());
  read->add_flag("--verify", verify, "Compare what was read with a plain read of the file, byte for byte");
  hbmio::cli::add_json_option(read, json, "Write the result");
  tuning.add_to(read);

  bool force = false;
  auto* write = app.add_subcommand("write-random",
                                   "Write generated random bytes from host, pinned or GPU memory into a file (a write "
                                   "benchmark; an existing file is replaced only with --force)");
  write->add_option("file", path, "File to write (created, or with --force truncated when --offset is 0)")->required();
  write->add_flag("--force", force, "Write into an existing file (or block device): its bytes are overwritten with random data");
  write->add_option("--from", from, "Source memory: host, pinned or cuda:N")->capture_default_str();
  write->add_option("--size", size, "Bytes to write (e.g. 1GiB)")->required()->check(hbmio::cli::size_value());
  write->add_option("--backend,-b", backend, "posix, uring, cufile or auto")->capture_default_str();
  write->add_option("--offset", offset, "File offset to write at (default 0)")->check(hbmio::cli::size_value());
  write->add_option("--seed", seed, "Seed of the generated data")->capture_default_str();
  write->add_flag("--sync", sync, "fsync before reporting (counted in the time)");
  write->add_flag("--verify", verify, "Read the file back with a plain read and compare");
  hbmio::cli::add_json_option(write, json, "Write the result");
  tuning.add_to(write);

  auto* backends = app.add_subcommand("backends", "Which backends work on this machine, and why not where they do not");
  hbmio::cli::add_json_option(backends, json, "Write the result");
  tuning.add_to(backends);

  int bench_status = 0;  // set by the bench callback, which runs inside app.parse()
  hbmio::cli::add_bench_command(app, bench_status);
  int doctor_status = 0;  // set by the doctor callback, which runs inside app.parse()
  hbmio::cli::add_doctor_command(app, doctor_status);
  int ckpt_status = 0;
  hbmio::cli::add_ckpt_command(app, ckpt_status);

  app.footer(
      "Environment overrides (defaults in brackets): HBMIO_BACKEND [auto], HBMIO_CHUNK_SIZE [16MiB],\n"
      "HBMIO_BOUNCE_BUFFER_SIZE [8MiB], HBMIO_BOUNCE_BUFFERS [4], HBMIO_QUEUE_DEPTH [8],\n"
      "HBMIO_WORKERS [min(cores,16)], HBMIO_DIRECT_IO [auto].");

  // Commands renamed because their old names hid that they write random data over the path given.
  if (argc >= 2 && std::string_view(argv[1]) == "write") {
    fmt::print(stderr, "hbmio: 'write' was renamed 'write-random': it writes generated random bytes (an existing file "
                       "needs --force)\n");
    return 1;
  }
  if (argc >= 3 && std::string_view(argv[1]) == "ckpt" && std::string_view(argv[2]) == "save") {
    fmt::print(stderr, "hbmio: 'ckpt save' was renamed 'ckpt generate': it saves generated random tensors (an existing "
                       "checkpoint needs --force)\n");
    return 1;
  }
  try {
    app.parse(argc, argv);
    if (*read) return run_read(path, into, backend, offset, length, verify, json, tuning);
    if (*write) return run_write(path, from, backend, size, offset, seed, sync, verify, force, json, tuning);
    if (*backends) return run_backends(json, tuning);
    if (app.got_subcommand("bench")) return bench_status;
    if (app.got_subcommand("doctor")) return doctor_status;
    if (app.got_subcommand("ckpt")) return ckpt_status;
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message (and --help its page); its own codes (104-109) would tell a
    // script nothing the message does not: a usage error exits 1 like every other error.
    return app.exit(e) == 0 ? 0 : 1;
  } catch (const hbmio::Error& e) {
    fmt::print(stderr, "hbmio: {}\n", e.what());
    return 1;
  } catch (const std::system_error& e) {
    fmt::print(stderr, "hbmio: {}\n", e.code() == std::errc::resource_unavailable_try_again ? hbmio::thread_limit_message(e) : e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "hbmio: {}\n", e.what());
    return 1;
  }
  return 0;
}
