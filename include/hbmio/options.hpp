// Tuning knobs and per-transfer statistics.
//
// Every option has a default chosen for NVMe-class storage and PCIe Gen4/5 hosts, and an
// environment variable that overrides the default, read by Options::from_env and
// RemoteOptions::from_env (src/core/config.cpp, the one place hbmio reads HBMIO_*; see
// hbmio/config.hpp). docs/configuration.md is the table of every variable: its default, the
// values it accepts and what it sets. Where a call takes no options, these structs are made from
// the environment at the time of the call.
//
// Sizes accept suffixes: 4096, 64K, 4MiB, 1G, 2GiB (binary multiples).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

  // `base` with every HBMIO_* variable of these fields that is set applied (HBMIO_CHUNK_SIZE,
  // HBMIO_BOUNCE_BUFFER_SIZE, HBMIO_BOUNCE_BUFFERS, HBMIO_QUEUE_DEPTH, HBMIO_WORKERS,
  // HBMIO_DIRECT_IO); throws Error(EINVAL) naming the variable, its value and what it accepts.
  static Options from_env(Options base);
  static Options from_env();
  // Checks ranges (sizes > 0, bounce buffer a multiple of 4 KiB, ...); throws Error(EINVAL)
  // naming the field, its variable and its value.
  void validate() const;
  unsigned resolved_workers() const noexcept;  // workers, with 0 resolved to min(cores, 16)
};

// How objects at URLs (s3://, http(s)://) are read and written; see hbmio/remote.hpp.
struct RemoteOptions {
  unsigned connections = 16;                 // GETs in flight (one connection each)
  // Bytes per ranged GET (or uploaded part). 0: chosen per transfer, two parts per connection
  // from 8 MiB up to 256 MiB for reads (large parts cost fewer requests: bench/RESULTS.md,
  // "Remote checkpoints (S3)"; a read's pinned memory does not grow with its parts)
  // and up to 64 MiB for uploads (each part in flight is a buffer of that size); small parts keep
  // every connection busy on a small checkpoint.
  std::size_t part_size = 0;
  unsigned max_attempts = 5;                 // per part, the first included
  double backoff_seconds = 0.2;              // before the first retry; doubles, jittered, up to 10 s
  double connect_timeout_seconds = 10;
  double stall_timeout_seconds = 30;         // a transfer below 1 KiB/s this long is retried
  // The slowest rate a request may average: each request must end within
  // deadline_seconds(its bytes), or it is timed out (ETIMEDOUT) and retried for its missing bytes.
  // A body that trickles just above the stall limit would otherwise hold a load forever.
  double min_rate_bytes_per_second = 256 * 1024;
  std::string endpoint;                      // S3: overrides AWS_ENDPOINT_URL(_S3)
  std::string region;                        // S3: overrides AWS_REGION & co.
  std::string profile;                       // S3: overrides AWS_PROFILE
  // Benchmark support: reads receive every byte and drop it (the destination is not written):
  // what the connections deliver when nothing is done with the data.
  bool discard = false;

  // The defaults with HBMIO_REMOTE_CONNECTIONS, HBMIO_REMOTE_PART_SIZE (a size, e.g. "8MiB"),
  // HBMIO_REMOTE_ATTEMPTS, HBMIO_REMOTE_MIN_RATE (bytes per second, e.g. "256KiB") and
  // HBMIO_REMOTE_STALL_TIMEOUT (seconds) applied where set; throws Error(EINVAL) naming the
  // variable, its value and what it accepts.
  static RemoteOptions from_env();
  // A request of `bytes` must be done within: the stall timeout (first byte, latency) plus its
  // bytes at the minimum rate.
  double deadline_seconds(std::uint64_t bytes) const noexcept {
    return stall_timeout_seconds + static_cast<double>(bytes) / min_rate_bytes_per_second;
  }
  static constexpr std::uint64_t kLargestReadPart = std::uint64_t{256} << 20;
  static constexpr std::uint64_t kLargestUploadPart = std::uint64_t{64} << 20;
  // The part size for a transfer of `bytes` in all: part_size, or where that is 0 the rule above
  // with `largest` as its bound.
  std::uint64_t part_size_for(std::uint64_t bytes, std::uint64_t largest = kLargestReadPart) const noexcept;
};

std::string to_string(DirectIo mode);
DirectIo parse_direct_io(const std::string& text);  // "on" | "off" | "auto"

// Which way a file's bytes moved between storage and memory.
enum class DataPath {
  gds_nvidia_fs,  // cuFile: DMA between storage and GPU memory through the nvidia-fs kernel module
  gds_p2pdma,     // cuFile: DMA through the kernel's PCI P2PDMA, without nvidia-fs (GDS 1.13+)
  cufile_compat,  // cuFile's compatibility mode: libcufile's own pread/pwrite through host memory
  uring,          // io_uring, with O_DIRECT or through the page cache (TransferPath::bytes_direct)
  posix,          // pread/pwrite through the page cache (and a pageable copy for GPU memory)
  remote,         // ranged GETs or uploads of an object at a URL
  cache_host,     // the node's resident cache: its copy of the file in shared host memory (hbmio/cache.hpp)
  cache_device,   // the node's resident cache: its copy of the file in the destination GPU's memory
  cache_shared,   // the node's resident cache: its copy in the GPU's memory mapped in place, nothing
                  // moved (LoadOptions::share; TransferPath::bytes: the tensors' bytes mapped)
};
// "gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix", "remote", "cache-host",
// "cache-device", "cache-shared".
std::string_view to_string(DataPath path) noexcept;

// The way one file's bytes took in a transfer, and why that one. A transfer reports one per file
// and way (Stats::paths): a file read partly by DMA and partly in compatibility mode has two.
struct TransferPath {
  std::string file;  // the path the file was opened by, or the object's URL
  DataPath path = DataPath::posix;
  // Why this way, in words: the choice ("auto chose uring: host memory, which cuFile does not
  // move") and how it went ("O_DIRECT refused: tmpfs refuses O_DIRECT: ...; page cache").
  std::string reason;
  std::uint64_t bytes = 0;         // moved this way
  std::uint64_t bytes_direct = 0;  // of `bytes`, bypassing the page cache (O_DIRECT or DMA)
};

// Adds `path` to `paths`: to the entry of the same file and way if there is one (bytes summed,
// a reason it does not hold yet appended), else as a new entry. The newest entries are searched
// first: a transfer (or a stream's shards, read in turn) meets most files again soon after.
void add_path(std::vector<TransferPath>& paths, const TransferPath& path);

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
  // Where a uring transfer's time went besides moving bytes (other backends leave them 0): from
  // the submit to the last worker's start (threads waking), from the first worker out of work to
  // the last one done (the tail, when fewer and fewer workers run), and the workers' time blocked
  // on copies to the GPU (a slot to reuse, or the last copies), summed over workers.
  double wake_seconds = 0;
  double drain_seconds = 0;
  double copy_wait_seconds = 0;
  std::string note;                    // e.g. why auto picked this backend, a fallback made
  // Per file, the way its bytes moved and why, in the order the files were first met. Every
  // engine, remote read and upload fills it, so a load's, save's or read's Stats say it too.
  std::vector<TransferPath> paths;

  double gib_per_second() const noexcept;
  // Adds the counts of a part of a larger transfer (one of several requests): bytes, direct and
  // buffered bytes, bounce copies, the wake, drain and copy-wait times, paths (add_path); keeps the
  // largest worker count and the part's backend. Time and CPU are the caller's to measure over the whole.
  void add_part(const Stats& part);
  void add_path(const TransferPath& path) { hbmio::add_path(paths, path); }  // the free add_path
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
