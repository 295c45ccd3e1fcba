// Tuning knobs and per-transfer statistics.
//
// Every option has a default chosen for NVMe-class storage and PCIe Gen4/5 hosts, and an
// environment variable that overrides the default (read by Options::from_env, which the CLI and
// make_engine() use). The table below is the one place they are documented.
//
//   variable                    field               default
//   HBMIO_BACKEND               (make_engine)       auto      posix | uring | cufile | auto
//   HBMIO_CHUNK_SIZE            chunk_size          16MiB     unit of work handed to a worker
//   HBMIO_BOUNCE_BUFFER_SIZE    bounce_buffer_size  8MiB      one O_DIRECT I/O and one copy (page-cache
//                                                             pieces: at most 2 MiB, see uring_engine.cpp)
//   HBMIO_BOUNCE_BUFFERS        bounce_buffers      4         pinned slots per worker
//   HBMIO_QUEUE_DEPTH           queue_depth         8         I/Os in flight per worker ring
//   HBMIO_WORKERS               workers             0 (auto)  threads; auto = min(cores, 16)
//   HBMIO_DIRECT_IO             direct_io           auto      on | off | auto (page-cache residency)
//
// Outside Options: HBMIO_CUFILE_LIBRARY (the libcufile to load, instead of searching), and
// libcufile's own CUFILE_ENV_PATH_JSON / CUFILE_EXPERIMENTAL_FS (see README, "cuFile in containers").
//
// Sizes accept suffixes: 4096, 64K, 4MiB, 1G, 2GiB (binary multiples).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hbmio {

enum class DirectIo {
  off,        // always through the page cache
  on,         // O_DIRECT wherever the file system allows it
  automatic,  // per chunk: O_DIRECT when the range is not in the page cache (cachestat/mincore)
};

struct Options {
  std::size_t chunk_size = std::size_t{16} << 20;
  std::size_t bounce_buffer_size = std::size_t{8} << 20;
  unsigned bounce_buffers = 4;
  unsigned queue_depth = 8;
  unsigned workers = 0;
  DirectIo direct_io = DirectIo::automatic;

  // `base` with every HBMIO_* variable that is set applied; throws Error(EINVAL) naming the
  // variable on a malformed value.
  static Options from_env(Options base);
  static Options from_env();
  // Checks ranges (sizes > 0, bounce buffer a multiple of 4 KiB, ...); throws Error(EINVAL).
  void validate() const;
  unsigned resolved_workers() const noexcept;  // workers, with 0 resolved to min(cores, 16)
};

std::string to_string(DirectIo mode);
DirectIo parse_direct_io(const std::string& text);  // "on" | "off" | "auto"

// What one transfer did. Engines fill every field.
struct Stats {
  std::string backend;                 // the backend that did the work (auto names its pick)
  std::uint64_t bytes = 0;             // bytes transferred
  double seconds = 0;                  // wall time of the transfer
  double cpu_seconds = 0;              // user + system CPU of the process during the transfer
  std::uint64_t bytes_direct = 0;      // of `bytes`, moved with O_DIRECT (or GDS DMA)
  std::uint64_t bytes_buffered = 0;    // of `bytes`, through the page cache
  std::uint64_t bounce_copies = 0;     // staging copies through bounce buffers
  unsigned workers = 0;                // threads that took part
  std::string note;                    // e.g. why auto picked this backend, a fallback made

  double gib_per_second() const noexcept;
  // Adds the counts of a part of a larger transfer (one of several requests): bytes, direct and
  // buffered bytes, bounce copies; keeps the largest worker count and the part's backend. Time
  // and CPU are the caller's to measure over the whole.
  void add_part(const Stats& part) noexcept;
  bool used_direct_io() const noexcept { return bytes_direct > 0; }
};

// User + system CPU seconds of this process so far (getrusage: every thread, io_uring's workers
// included): what Stats::cpu_seconds is a difference of.
double process_cpu_seconds() noexcept;

// Parses "4096", "64K", "4MiB", "1.5G" (binary), "5GB", "500MB" (decimal, as Hugging Face's
// max_shard_size); throws Error(EINVAL) naming the accepted forms. "5Gb" (bits) is refused.
std::uint64_t parse_size(const std::string& text);
std::string format_size(std::uint64_t bytes);  // "1.50 GiB"

}  // namespace hbmio
