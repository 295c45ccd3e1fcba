// Pieces every hbmio subcommand shares: progress on a terminal, JSON output, error reporting.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <chrono>
#include <exception>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "hbmio/hbmio.hpp"

namespace hbmio::cli {

// Options a user may tune from the command line; unset flags keep the HBMIO_* / default value.
struct TuningFlags {
  std::string chunk_size, bounce_buffer_size, direct_io;
  unsigned bounce_buffers = 0, queue_depth = 0, workers = 0;

  void add_to(CLI::App* app);
  Options resolve() const;  // throws Error(EINVAL) on a bad value
};

// Runs work(counter), where `counter` is the progress counter to hand to the transfer (the bytes
// done of `total`), and shows the line "label  1.2 GiB / 4.0 GiB  (30%)  3.1 GiB/s" on stderr
// meanwhile where stderr is a terminal (hbmio::ProgressLine: drawn by the library's pool, so the
// command starts no thread of its own), erased at the end. Returns what work returns; rethrows
// what it throws.
template <typename Work>
auto with_progress(const std::string& label, std::uint64_t total, Work&& work) {
  std::atomic<std::uint64_t> done{0};
  std::optional<ProgressLine> line;
  if (ProgressLine::wanted(total)) line.emplace(label, total, done);
  return work(&done);  // the line, destroyed first, stops drawing before `done` goes
}

// Deterministic fast pseudo-random bytes (splitmix64): data that does not compress and that the
// same seed reproduces.
void fill_random(std::byte* data, std::size_t size, std::uint64_t seed);

// Compares `memory` (any kind) with bytes [offset, offset + memory.size) of the file, read with
// plain pread: the independent source every --verify uses. 64 MiB at a time, so checking a 4 GiB
// shard needs no 8 GiB of host memory. Returns the file offset of the first differing byte, or
// nothing when identical; throws Error when the file is shorter.
std::optional<std::uint64_t> first_difference(MemorySpan memory, const std::string& path, std::uint64_t offset = 0);

nlohmann::json to_json(const Stats& stats);  // its `paths` too: [{file, path, reason, bytes, bytes_direct}]
nlohmann::json to_json(const std::vector<TransferPath>& paths);
// One line of figures and the note's first part, under 120 columns; verbose: the whole note
// below it, a part per line.
std::string summary_line(const Stats& stats, bool verbose = false);
// `text` cut at a word's end to at most `width` characters, " ..." marking the cut.
std::string fit(const std::string& text, std::size_t width);
// Writes `j` to `path` ("-" for stdout), pretty-printed.
void write_json(const nlohmann::json& j, const std::string& path);
// Adds `--json` (standard output) and `--json=FILE`, checked when the command line is read (the
// directory exists and is writable, FILE is not a directory), so a long command does not fail
// only at its end.
CLI::Option* add_json_option(CLI::App* app, std::string& json, const std::string& what);
// The command line with `--json FILE` written as `--json=FILE` where FILE is "-" or ends in
// ".json" (not ".index.json": a checkpoint's index is an argument): the spelling scripts used before --json
// took its value only after '='.
std::vector<std::string> attach_json_values(const std::vector<std::string>& args);
// The help of every --backend. Its default is "", which the library takes for its configured
// backend (hbmio::configured_backend(): $HBMIO_BACKEND where set, else "auto"), so that the
// command reads no variable of its own; a --backend given on the command line wins over it.
inline constexpr const char* kBackendHelp = "posix, uring, cufile or auto (default: $HBMIO_BACKEND, else auto)";
// A size option's check (parse_size: bytes or a binary suffix), so that a bad value is refused when
// the command line is read, with the option's name.
CLI::Validator size_value();
// The check behind it, for other output files: "-" or a file that can be created or written.
CLI::Validator writable_file();

// Empties the page cache of `path` (drop_caches as root, else posix_fadvise(DONTNEED) of the
// file) so that the next read comes from storage; returns which of the two it did.
std::string drop_page_cache(const std::string& path);

}  // namespace hbmio::cli

// Stopping a long command on Ctrl-C without a signal handler: kept apart from the pieces above.
#include <functional>

namespace hbmio::cli {

// Runs `work` on a thread of its own while this thread waits for SIGINT, SIGTERM or SIGHUP (they
// are blocked in every thread the work starts, so they come here). On one, `stop` is set: the
// work stops at its next safe point (engines see it as IoRequest::cancel and throw
// Error(ECANCELED)) and cleans up after itself, and this thread waits for it to end. Nothing is
// removed from here: a clean-up beside running work could race it (a save's final rename once
// lost the old checkpoint with the new one). Then a line says what is left, from how the work
// ended (`outcome(true)`: it stopped with ECANCELED; `outcome(false)`: it had finished, or
// failed), and the process ends by that signal (exit status 128 + N, as shells expect). Without
// a signal it returns what `work` returns, or throws what it throws.
int run_stoppable(const std::function<int(const std::atomic<bool>& stop)>& work, const std::function<std::string(bool)>& outcome);

}  // namespace hbmio::cli
