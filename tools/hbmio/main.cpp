// hbmio: move tensor data between storage and GPU memory, and measure how fast it goes.
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bench.hpp"
#include "ckpt.hpp"
#include "cli_common.hpp"
#include "cache.hpp"
#include "doctor.hpp"
#include "hbmio/config.hpp"
#include "hbmio/hbmio.hpp"

namespace hbmio::cli {
namespace {

int run_read(const std::string& path, const std::string& into, const std::string& backend, const std::string& offset_text,
             const std::string& length_text, bool verify, const std::string& json, bool verbose, const TuningFlags& tuning) {
  const Options options = tuning.resolve();
  const MemoryLocation where = MemoryLocation::parse(into);
  // A URL is read by ranged GETs (docs/remote.md); a file by the engine of --backend.
  std::shared_ptr<RemoteObject> object;
  std::optional<File> file;
  if (is_remote_url(path)) object = RemoteObject::open(path);
  else file.emplace(File::open(path, OpenMode::read));
  const std::uint64_t offset = offset_text.empty() ? 0 : parse_size(offset_text);
  const std::uint64_t size = object ? object->size() : file->size();
  if (offset > size)
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset},
                fmt::format("offset is past the end of the file ({} bytes)", size));
  const std::uint64_t length = length_text.empty() ? size - offset : parse_size(length_text);
  if (length == 0)
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset}, "nothing to read (length 0)");
  if (length > size - offset)  // before the memory is allocated: a typo should not ask for a TiB
    throw Error(errno_code(EINVAL), {.op = "read", .path = path, .offset = offset, .length = length},
                fmt::format("the range ends past the end of the file ({} bytes)", size));
  Buffer buffer = Buffer::allocate(where, length);
  const Stats stats = with_progress(fmt::format("read {} -> {}", object ? object->shown() : path, where.to_string()), length,
                                    [&](std::atomic<std::uint64_t>* progress) {
                                      if (object) {
                                        const RemoteRead read{object.get(), offset, buffer.span()};
                                        return read_remote({&read, 1}, RemoteOptions::from_env(), progress);
                                      }
                                      auto engine = make_engine(backend, options);
                                      return engine->submit(
                                          {.op = IoOp::read, .file = &*file, .offset = offset, .memory = buffer.span(), .progress = progress});
                                    });
  std::optional<std::uint64_t> mismatch;
  if (verify) mismatch = first_difference(buffer.span(), path, offset);
  if (!json.empty()) {
    nlohmann::json j = {{"command", "read"}, {"file", path}, {"into", where.to_string()}, {"offset", offset},
                        {"length", length}, {"stats", to_json(stats)}};
    if (verify) j["verified"] = !mismatch;
    if (mismatch) j["first_mismatch_offset"] = *mismatch;
    write_json(j, json);
  }
  if (json != "-") fmt::print("{}\n", summary_line(stats, verbose));
  if (mismatch) {
    fmt::print(stderr, "hbmio: verification failed: {} as read differs from a plain read of the file at byte {}\n", shown_path(path), *mismatch);
    return 1;
  }
  if (verify && json != "-") fmt::print("verified: {} bytes identical to a plain read\n", length);
  return 0;
}

int run_write(const std::string& path, const std::string& from, const std::string& backend, const std::string& size_text,
              const std::string& offset_text, std::uint64_t seed, bool sync, bool verify, bool force, const std::string& json,
              bool verbose, const TuningFlags& tuning) {
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
  Stats stats = with_progress(fmt::format("write {} -> {}", where.to_string(), shown_path(path)), length,
                              [&](std::atomic<std::uint64_t>* progress) {
                                return engine->submit(
                                    {.op = IoOp::write, .file = &file, .offset = offset, .memory = buffer.span(), .progress = progress});
                              });
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
  if (json != "-") fmt::print("{}\n", summary_line(stats, verbose));
  if (mismatch) {
    fmt::print(stderr, "hbmio: verification failed: {} differs from the written data at byte {}\n", shown_path(path), *mismatch);
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

// Levenshtein distance, for "did you mean": command names are short, so the plain O(n*m) table.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> command_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) names.push_back(sub->get_name());
  return names;
}

// What people coming from safetensors' CLI, git or fio type, and the command that does it here.
std::optional<std::string> alias_of(std::string_view typed, std::string_view parent) {
  static const std::vector<std::pair<std::string_view, std::string_view>> top = {
      {"info", "ckpt info"},         {"inspect", "ckpt info"}, {"ls", "ckpt info"},        {"list", "ckpt info"},
      {"show", "ckpt info"},         {"load", "ckpt load"},    {"verify", "ckpt verify"},  {"check", "ckpt verify"},
      {"checksum", "ckpt checksum"}, {"save", "ckpt generate"}, {"generate", "ckpt generate"}, {"benchmark", "bench"},
      {"version", "--version"},      {"write", "write-random"}};
  static const std::vector<std::pair<std::string_view, std::string_view>> ckpt = {
      {"inspect", "info"}, {"show", "info"}, {"ls", "info"}, {"list", "info"}, {"check", "verify"},
      {"save", "generate"}, {"checksums", "checksum"}, {"read", "load"}};
  for (const auto& [word, command] : parent.empty() ? top : ckpt)
    if (word == typed) return std::string(command);
  return std::nullopt;
}

// "unknown command 'info'; did you mean 'hbmio ckpt info'?" for a word where a command belongs
// (CLI11 alone says only that a subcommand is required). Nothing when the command line is fine.
std::optional<std::string> unknown_command(const CLI::App& app, const std::vector<std::string>& args) {
  const CLI::App* parent = &app;
  std::string prefix = "hbmio";
  for (const std::string& word : args) {
    if (word.starts_with("-")) return std::nullopt;  // options before a command: CLI11's to judge
    const std::vector<std::string> names = command_names(*parent);
    if (std::find(names.begin(), names.end(), word) != names.end()) {
      parent = parent->get_subcommand(word);
      prefix += " " + word;
      if (command_names(*parent).empty()) return std::nullopt;  // a command that takes arguments
      continue;
    }
    std::optional<std::string> guess = alias_of(word, parent == &app ? "" : parent->get_name());
    if (!guess) {
      std::size_t best = 3;  // at most two edits away: a typo, not another word
      for (const auto& name : names)
        if (const std::size_t d = edit_distance(word, name); d < best && d < name.size()) {
          best = d;
          guess = name;
        }
    }
    std::string text = fmt::format("unknown command '{}'", word);
    if (guess) text += fmt::format("; did you mean '{} {}'?", guess->starts_with("--") ? "hbmio" : prefix, *guess);
    return text + fmt::format("\nThe commands of '{}': {}. '{} --help' says more.", prefix, fmt::join(names, ", "), prefix);
  }
  // The words ran out where a command must follow ("hbmio", "hbmio ckpt").
  return fmt::format("'{}' needs a command: {}. '{} --help' says more.", prefix, fmt::join(command_names(*parent), ", "), prefix);
}

// The option names `commands` take ("--into", "-b"), innermost command first: an option of an
// outer command is accepted too, so it is not "unknown".
std::vector<std::string> option_names(const std::vector<const CLI::App*>& commands) {
  std::vector<std::string> names;
  for (auto it = commands.rbegin(); it != commands.rend(); ++it)
    for (const CLI::Option* option : (*it)->get_options()) {
      for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
      for (const std::string& name : option->get_snames()) names.push_back("-" + name);
    }
  return names;
}

// "unknown option '--verfy'; did you mean '--verify'?" for each word of `args` that is spelled as
// an option but is none of the command's. CLI11 says only "arguments were not expected: x --int"
// (the x being the value --int's typo left over), or reports a missing argument first; the typo is
// the cause, so it is what the message names. Empty when every option is known.
std::vector<std::string> unknown_options(const std::vector<const CLI::App*>& commands, const std::vector<std::string>& args) {
  const std::vector<std::string> names = option_names(commands);
  std::vector<std::string> out;
  for (const std::string& arg : args) {
    if (arg == "--") break;  // what follows is positional
    if (arg.size() < 2 || arg[0] != '-' || std::isdigit(static_cast<unsigned char>(arg[1])) || arg[1] == '.') continue;
    const std::string word = arg.substr(0, arg.find('='));  // --into=cuda:0
    if (std::find(names.begin(), names.end(), word) != names.end()) continue;
    if (!word.starts_with("--") && word.size() > 2) {  // -vb: single-letter flags together
      if (std::all_of(word.begin() + 1, word.end(), [&](char c) {
            return std::find(names.begin(), names.end(), std::string{'-', c}) != names.end();
          }))
        continue;
    }
    std::optional<std::string> guess;
    std::size_t best = 3;  // at most two edits away, as for commands
    for (const std::string& name : names)
      if (const std::size_t d = edit_distance(word, name); d < best && d + 2 < name.size()) {
        best = d;
        guess = name;
      }
    std::string text = fmt::format("unknown option '{}'", word);
    if (guess) text += fmt::format("; did you mean '{}'?", *guess);
    out.push_back(std::move(text));
  }
  return out;
}

}  // namespace
}  // namespace hbmio::cli

int main(int argc, char** argv) {
  using namespace hbmio::cli;
  CLI::App app{"hbmio: move tensor data between storage and GPU memory at the speed of the hardware.\n"
               "Backends: posix (pread + cudaMemcpy baseline), uring (io_uring + O_DIRECT + pinned bounce buffers),\n"
               "cufile (GPUDirect Storage), auto (the best that works here). Environment: HBMIO_* (see --help of each command)."};
  app.name("hbmio");  // parse() is given the arguments, not argv[0], so the usage line needs the name
  app.set_version_flag("-V,--version", "hbmio " + hbmio::version());  // -V as python, gcc and fio take it
  app.require_subcommand(1);

  std::string path, into = "host", from = "host", backend, offset, length, size, json;
  bool verify = false, sync = false, verbose = false;
  std::string verify_mode;  // read and write-random compare bytes: --verify or --verify=bytes
  std::uint64_t seed = 1;
  TuningFlags tuning;

  auto* read = app.add_subcommand("read", "Read a file range into host, pinned or GPU memory and report the throughput");
  read->add_option("file", path, "File to read, or a URL (s3://BUCKET/KEY, http(s)://...) read by parallel ranged GETs (docs/remote.md)")->required();
  read->add_option("--into", into, "Destination memory: host (or cpu), pinned, cuda or cuda:N")->capture_default_str();
  read->add_option("--backend,-b", backend, hbmio::cli::kBackendHelp);
  read->add_option("--offset", offset, "First byte to read (default 0)")->check(hbmio::cli::size_value());
  read->add_option("--length", length, "Bytes to read (default: to the end of the file)")->check(hbmio::cli::size_value());
  read->add_flag("--verify{bytes}", verify_mode, "Compare what was read with a plain read of the file, byte for byte")
      ->type_name("[=bytes]")
      ->check(CLI::IsMember({"bytes"}));
  read->add_flag("-v,--verbose", verbose, "Print the transfer's whole note (the engine's choices, first-use set-up)");
  hbmio::cli::add_json_option(read, json, "Write the result");
  tuning.add_to(read);

  bool force = false;
  auto* write = app.add_subcommand("write-random",
                                   "Write generated random bytes from host, pinned or GPU memory into a file (a write "
                                   "benchmark; an existing file is replaced only with --force)");
  write->add_option("file", path, "File to write (created, or with --force truncated when --offset is 0)")->required();
  write->add_flag("--force", force, "Write into an existing file (or block device): its bytes are overwritten with random data");
  write->add_option("--from", from, "Source memory: host (or cpu), pinned, cuda or cuda:N")->capture_default_str();
  write->add_option("--size", size, "Bytes to write (e.g. 1GiB)")->required()->check(hbmio::cli::size_value());
  write->add_option("--backend,-b", backend, hbmio::cli::kBackendHelp);
  write->add_option("--offset", offset, "File offset to write at (default 0)")->check(hbmio::cli::size_value());
  write->add_option("--seed", seed, "Seed of the generated data")->capture_default_str();
  write->add_flag("--sync", sync, "fsync before reporting (counted in the time)");
  write->add_flag("--verify{bytes}", verify_mode, "Read the file back with a plain read and compare, byte for byte")
      ->type_name("[=bytes]")
      ->check(CLI::IsMember({"bytes"}));
  write->add_flag("-v,--verbose", verbose, "Print the transfer's whole note (the engine's choices, first-use set-up)");
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
  int cache_status = 0;
  hbmio::cli::add_cache_command(app, cache_status);

  // The library's table of variables (hbmio/config.hpp), so this list cannot drift from it.
  std::string environment = "Environment (defaults in brackets; flags win over them; docs/configuration.md):";
  for (const hbmio::ConfigVariable& v : hbmio::config_variables())
    environment += fmt::format("\n  {} [{}]: {}", v.name, v.default_value, v.accepted);
  app.footer(environment);

  std::vector<std::string> args(argv + 1, argv + argc);
  // `hbmio help [COMMAND...]` is `hbmio [COMMAND...] --help`, as in git.
  if (!args.empty() && args[0] == "help") {
    args.erase(args.begin());
    args.push_back("--help");
  }
  args = attach_json_values(args);
  // Commands renamed because their old names hid that they write random data over the path given.
  if (!args.empty() && args[0] == "write") {
    fmt::print(stderr, "hbmio: 'write' was renamed 'write-random': it writes generated random bytes (an existing file "
                       "needs --force)\n");
    return 1;
  }
  if (args.size() >= 2 && args[0] == "ckpt" && args[1] == "save") {
    fmt::print(stderr, "hbmio: 'ckpt save' was renamed 'ckpt generate': it saves generated random tensors (an existing "
                       "checkpoint needs --force)\n");
    return 1;
  }
  if (const auto unknown = unknown_command(app, args)) {
    fmt::print(stderr, "hbmio: {}\n", *unknown);
    return 1;
  }
  // The words that name the command, for the hint after a usage error.
  std::string command = "hbmio";
  std::vector<const CLI::App*> commands{&app};  // and the apps themselves, for unknown options
  for (const std::string& word : args) {
    const CLI::App* at = commands.back();
    if (word.starts_with("-") || at->get_subcommands([&](const CLI::App* s) { return s->get_name() == word; }).empty()) break;
    commands.push_back(at->get_subcommand(word));
    command += " " + word;
  }
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes a vector last word first
    app.parse(reversed);
    verify = !verify_mode.empty();
    if (*read) return run_read(path, into, backend, offset, length, verify, json, verbose, tuning);
    if (*write) return run_write(path, from, backend, size, offset, seed, sync, verify, force, json, verbose, tuning);
    if (*backends) return run_backends(json, tuning);
    if (app.got_subcommand("bench")) return bench_status;
    if (app.got_subcommand("doctor")) return doctor_status;
    if (app.got_subcommand("ckpt")) return ckpt_status;
    if (app.got_subcommand("cache")) return cache_status;
  } catch (const CLI::ParseError& e) {
    // --help and --version: CLI11 prints the page. A usage error is said like every other error
    // ("hbmio: ..."), and exits 1: CLI11's own codes (104-109) would tell a script nothing more.
    if (e.get_exit_code() == 0) return app.exit(e);
    const std::vector<std::string> unknown = unknown_options(commands, args);
    // CLI11 quotes the arguments it refused: a URL among them is shown without its secrets.
    if (unknown.empty()) fmt::print(stderr, "hbmio: {}\n", hbmio::without_url_secrets(e.what()));
    for (const std::string& text : unknown) fmt::print(stderr, "hbmio: {}\n", hbmio::without_url_secrets(text));
    fmt::print(stderr, "'{} --help' lists the arguments and options.\n", command);
    return 1;
  } catch (const hbmio::Error& e) {
    fmt::print(stderr, "hbmio: {}\n", e.what());
    return 1;
  } catch (const std::system_error& e) {
    fmt::print(stderr, "hbmio: {}\n", e.code() == std::errc::resource_unavailable_try_again ? hbmio::thread_limit_message(e) : e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "hbmio: {}\n", hbmio::without_url_secrets(e.what()));
    return 1;
  }
  return 0;
}
