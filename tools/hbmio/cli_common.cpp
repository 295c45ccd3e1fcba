#include "cli_common.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "hbmio/remote.hpp"

namespace hbmio::cli {

void TuningFlags::add_to(CLI::App* app) {
  app->add_option("--chunk-size", chunk_size, "Work unit per worker (e.g. 16MiB)")->group("Tuning")->check(size_value());
  app->add_option("--bounce-buffer-size", bounce_buffer_size, "Size of one storage I/O and copy (default 8MiB)")->group("Tuning")->check(size_value());
  app->add_option("--bounce-buffers", bounce_buffers, "Pinned bounce buffers per worker (default 4)")
      ->check(CLI::Range(1, 1024))  // Options' bound (HBMIO_BOUNCE_BUFFERS)
      ->group("Tuning");
  app->add_option("--queue-depth", queue_depth, "I/Os in flight per worker (default 8)")->check(CLI::Range(1, 4096))->group("Tuning");
  app->add_option("--workers", workers, "Worker threads (0: min(cores, 16))")->group("Tuning");
  app->add_option("--direct-io", direct_io, "O_DIRECT: on, off or auto (by page-cache residency)")
      ->check(CLI::IsMember({"on", "off", "auto"}))
      ->group("Tuning");
}

Options TuningFlags::resolve() const {
  Options o = Options::from_env();
  if (!chunk_size.empty()) o.chunk_size = parse_size(chunk_size);
  if (!bounce_buffer_size.empty()) o.bounce_buffer_size = parse_size(bounce_buffer_size);
  if (bounce_buffers) o.bounce_buffers = bounce_buffers;
  if (queue_depth) o.queue_depth = queue_depth;
  if (workers) o.workers = workers;
  if (!direct_io.empty()) o.direct_io = parse_direct_io(direct_io);
  o.validate();
  return o;
}

void fill_random(std::byte* data, std::size_t size, std::uint64_t seed) {
  std::uint64_t state = seed;
  std::size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(data + i, &z, 8);
  }
  for (; i < size; ++i) data[i] = static_cast<std::byte>(i * 131 + seed);
}

std::optional<std::uint64_t> first_difference(MemorySpan memory, const std::string& path, std::uint64_t offset) {
  // The reference: a plain read of the file, or of a URL one ranged GET at a time on one connection.
  std::optional<File> file;
  std::shared_ptr<RemoteObject> object;
  if (is_remote_url(path)) {
    RemoteOptions sequential = RemoteOptions::from_env();
    sequential.connections = 1;
    object = RemoteObject::open(path, sequential);
  } else {
    file.emplace(File::open(path, OpenMode::read, /*with_direct_io=*/false));
  }
  const std::size_t piece = std::min<std::size_t>(memory.size, std::size_t{64} << 20);
  std::vector<std::byte> expected(piece), actual(piece);
  for (std::size_t at = 0; at < memory.size; at += piece) {
    const std::size_t length = std::min(piece, memory.size - at);
    // Where the reference ends (the object's size, or where the file's read stopped).
    const std::uint64_t stop = object ? object->size() : offset + at + file->read_at({expected.data(), length}, offset + at);
    if (stop < offset + at + length)
      throw Error(errno_code(EIO), {.op = "verify read", .path = path, .offset = stop}, "the file ends before the range in memory");
    if (object) object->read(offset + at, {expected.data(), length, {}});
    copy_memory({actual.data(), length, {}}, memory.subspan(at, length));
    const auto end = actual.begin() + static_cast<std::ptrdiff_t>(length);
    const auto [a, e] = std::mismatch(actual.begin(), end, expected.begin());
    if (a != end) return offset + at + static_cast<std::uint64_t>(a - actual.begin());
  }
  return std::nullopt;
}

nlohmann::json to_json(const Stats& s) {
  return {{"backend", s.backend},
          {"bytes", s.bytes},
          {"seconds", s.seconds},
          {"gib_per_second", s.gib_per_second()},
          {"cpu_seconds", s.cpu_seconds},
          {"bytes_direct", s.bytes_direct},
          {"bytes_buffered", s.bytes_buffered},
          {"direct_io", s.used_direct_io()},
          {"bounce_copies", s.bounce_copies},
          {"workers", s.workers},
          {"wake_seconds", s.wake_seconds},
          {"drain_seconds", s.drain_seconds},
          {"copy_wait_seconds", s.copy_wait_seconds},
          {"note", s.note},
          {"paths", to_json(s.paths)}};
}

nlohmann::json to_json(const std::vector<TransferPath>& paths) {
  nlohmann::json list = nlohmann::json::array();
  for (const TransferPath& p : paths)
    list.push_back({{"file", p.file}, {"path", std::string(to_string(p.path))}, {"reason", p.reason}, {"bytes", p.bytes},
                    {"bytes_direct", p.bytes_direct}});
  return list;
}

std::string fit(const std::string& text, std::size_t width) {
  if (text.size() <= width) return text;
  std::size_t cut = text.rfind(' ', width - 4);  // at a word's end, with room for " ..."
  if (cut == std::string::npos || cut < width / 2) cut = width - 4;
  while (cut > 0 && (text[cut - 1] == ',' || text[cut - 1] == ';' || text[cut - 1] == ':' || text[cut - 1] == ' ')) --cut;
  return text.substr(0, cut) + " ...";
}

std::string summary_line(const Stats& s, bool verbose) {
  std::string direct = s.bytes == 0                 ? "-"
                       : s.backend == "remote"      ? "network"
                       : s.bytes_direct == s.bytes  ? "O_DIRECT"
                       : s.bytes_direct == 0        ? "page cache"
                                                    : fmt::format("{:.0f}% O_DIRECT", 100.0 * static_cast<double>(s.bytes_direct) / static_cast<double>(s.bytes));
  std::string line = fmt::format("{:<7} {:>10} in {:8.3f} s  {:7.2f} GiB/s  cpu {:6.2f} s  {}", s.backend, format_size(s.bytes),
                                 s.seconds, s.gib_per_second(), s.cpu_seconds, direct);
  if (s.note.empty()) return line;
  // The note's parts ("auto picked uring; O_DIRECT auto: ...; first-use set-up ...") each on a line
  // of its own with -v; else its first part, cut to keep the line readable (--json has it whole).
  if (verbose) {
    std::string parts;
    for (std::size_t at = 0; at < s.note.size();) {
      std::size_t end = s.note.find("; ", at);
      if (end == std::string::npos) end = s.note.size();
      parts += "\n  " + s.note.substr(at, end - at);
      at = end + 2;
    }
    for (const TransferPath& p : s.paths) parts += fmt::format("\n  path of {}: {} ({})", p.file, to_string(p.path), p.reason);
    return line + parts;
  }
  const std::string first = s.note.substr(0, s.note.find("; "));
  return line + "  " + fit(first, line.size() + 2 < 118 ? 118 - line.size() - 2 : 30);
}

namespace {

// Every URL in the strings of a JSON output without its secrets: a script's log must not keep what
// a message would not show. A file's own data (its metadata, its tensors' names) is shown as it is:
// it is what the file holds, not what the command was given.
nlohmann::json without_secrets(const nlohmann::json& j, std::string_view key = {}) {
  if (key == "metadata" || key == "name") return j;
  if (j.is_string()) return without_url_secrets(j.get_ref<const std::string&>());
  if (!j.is_structured()) return j;
  nlohmann::json out = j;
  if (out.is_object()) {
    for (auto it = out.begin(); it != out.end(); ++it) *it = without_secrets(*it, it.key());
  } else {
    for (auto& item : out) item = without_secrets(item, key);
  }
  return out;
}

}  // namespace

void write_json(const nlohmann::json& shown, const std::string& path) {
  // A name that is not UTF-8 (a file's, a tensor's) is written with U+FFFD for its odd bytes: JSON
  // holds text only, and the rest of the output is still worth having.
  const std::string text = without_secrets(shown).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (path == "-") {
    std::cout << text << std::flush;
    return;
  }
  std::FILE* out = std::fopen(path.c_str(), "we");
  if (out == nullptr) throw Error(errno_code(errno), {.op = "write", .path = path}, "of the JSON output");
  const bool written = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  const int err = errno;
  if (std::fclose(out) != 0 || !written) throw Error(errno_code(written ? errno : err), {.op = "write", .path = path}, "of the JSON output");
}

CLI::Validator size_value() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          (void)parse_size(text);
          return {};
        } catch (const Error& e) {
          return e.detail();
        }
      },
      "SIZE");
}

CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path == "-") return {};
        struct stat st {};
        if (::stat(path.c_str(), &st) == 0) {
          if (S_ISDIR(st.st_mode)) return fmt::format("{} is a directory", path);
          return ::access(path.c_str(), W_OK) == 0 ? "" : fmt::format("cannot write {}: {}", path, std::strerror(errno));
        }
        const auto slash = path.rfind('/');
        const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
        return ::access(dir.c_str(), W_OK | X_OK) == 0 ? "" : fmt::format("cannot create {} in {}: {}", path, dir, std::strerror(errno));
      },
      "");
}

CLI::Option* add_json_option(CLI::App* app, std::string& json, const std::string& what) {
  // A flag whose value is optional and only ever attached with '=': `--json` alone must not take
  // the next word, which is the command's own argument (`doctor --json /data`).
  return app->add_flag("--json{-}", json, what + " as JSON to standard output, or to FILE with --json=FILE")
      ->type_name("[=FILE]")
      ->check(writable_file());
}

std::vector<std::string> attach_json_values(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    // A checkpoint's index (model.safetensors.index.json) is never taken as the output: `doctor
    // --json model.safetensors.index.json` judges it (and would otherwise overwrite it).
    const bool json_file = i + 1 < args.size() && (args[i + 1] == "-" || (args[i + 1].size() > 5 && args[i + 1].ends_with(".json") &&
                                                                           !args[i + 1].ends_with(".index.json")));
    if (args[i] == "--json" && json_file) {
      out.push_back("--json=" + args[++i]);
    } else {
      out.push_back(args[i]);
    }
  }
  return out;
}

// Empties the page cache of `path` so that the next read comes from storage, and says how. As
// root the whole cache is dropped (after sync, so dirty pages can go too); otherwise, or where
// /proc/sys is read-only (containers), the file's own pages are evicted with
// posix_fadvise(DONTNEED), which skips dirty pages: hence the fdatasync first.
std::string drop_page_cache(const std::string& path) {
  if (::geteuid() == 0) {
    ::sync();
    const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      const bool dropped = ::write(fd, "1", 1) == 1;
      ::close(fd);
      if (dropped) return "drop_caches";
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(errno_code(errno), {.op = "open", .path = path}, "to drop its pages from the page cache");
  ::fdatasync(fd);
  const int err = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (err != 0) throw Error(errno_code(err), {.op = "posix_fadvise(DONTNEED)", .path = path});
  return "posix_fadvise(DONTNEED)";
}

}  // namespace hbmio::cli

// run_stoppable: blocked signals taken by sigtimedwait, not a handler.
#include <pthread.h>
#include <signal.h>

#include "hbmio/threads.hpp"

namespace hbmio::cli {

int run_stoppable(const std::function<int(const std::atomic<bool>& stop)>& work, const std::function<std::string(bool)>& outcome) {
  sigset_t stop_signals, previous;
  sigemptyset(&stop_signals);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stop_signals, sig);
  pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
  const timespec now{};
  int received = 0;
  int status = 0;
  const InterruptibleRun run = run_interruptible([&](const std::atomic<bool>& stop) { status = work(stop); },
                                                 [&] {
                                                   siginfo_t info{};
                                                   const int sig = sigtimedwait(&stop_signals, &info, &now);
                                                   if (sig <= 0) return false;
                                                   received = sig;
                                                   fmt::print(stderr, "\nhbmio: SIG{} received: stopping at the next safe point\n",
                                                              sigabbrev_np(sig));
                                                   return true;
                                                 },
                                                 std::chrono::milliseconds(10));
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  if (!run.interrupted) {
    if (run.error) std::rethrow_exception(run.error);
    return status;
  }
  bool stopped = false;
  try {
    if (run.error) std::rethrow_exception(run.error);
  } catch (const Error& e) {
    stopped = e.code() == std::errc::operation_canceled;
    if (!stopped) fmt::print(stderr, "hbmio: {}\n", e.what());
  } catch (const std::exception& e) {
    fmt::print(stderr, "hbmio: {}\n", e.what());
  }
  fmt::print(stderr, "hbmio: stopped by SIG{}: {}\n", sigabbrev_np(received), outcome(stopped));
  signal(received, SIG_DFL);
  raise(received);
  _exit(128 + received);  // not reached: the signal's default action ends the process
}

}  // namespace hbmio::cli
