// Pieces every hbmio subcommand shares: progress on a terminal, JSON output, error reporting.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "hbmio/hbmio.hpp"

namespace CLI {
class App;
}

namespace hbmio::cli {

// Options a user may tune from the command line; unset flags keep the HBMIO_* / default value.
struct TuningFlags {
  std::string chunk_size, bounce_buffer_size, direct_io;
  unsigned bounce_buffers = 0, queue_depth = 0, workers = 0;

  void add_to(CLI::App* app);
  Options resolve() const;  // throws Error(EINVAL) on a bad value
};

// Shows "label  1.2 GiB / 4.0 GiB  (30%)  3.1 GiB/s" on stderr, refreshed while a transfer runs,
// when stderr is a terminal. Silent otherwise, so logs and pipes stay clean.
class Progress {
 public:
  Progress(std::string label, std::uint64_t total);
  ~Progress();  // stops and clears the line
  std::atomic<std::uint64_t>* counter() { return &done_; }

 private:
  std::string label_;
  std::uint64_t total_;
  std::atomic<std::uint64_t> done_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

nlohmann::json to_json(const Stats& stats);
std::string summary_line(const Stats& stats);
// Writes `j` to `path` ("-" for stdout), pretty-printed.
void write_json(const nlohmann::json& j, const std::string& path);

}  // namespace hbmio::cli
