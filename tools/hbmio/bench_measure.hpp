// `hbmio bench`: the measurements. A row is one backend (or one ceiling) doing one operation in
// one mode, N times; its runs are summarised as median and p99 latency, throughput and CPU load,
// and each backend row is set against the slowest ceiling its data must pass.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hbmio/hbmio.hpp"

namespace hbmio::cli {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The ceilings: what the hardware does for each kind of transfer, measured in the same run with
// the same tuning (queue depth, workers, chunk size) as the backends.
inline constexpr const char* kStorageRead = "ceiling: storage read (O_DIRECT)";
inline constexpr const char* kPageCacheRead = "ceiling: page-cache read";
inline constexpr const char* kHostToDevice = "ceiling: pinned host->device copy";
inline constexpr const char* kStorageWrite = "ceiling: storage write (O_DIRECT)";
inline constexpr const char* kRemoteRead = "ceiling: the same GETs, bytes dropped";

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
  // Summary of `runs`: median and p99 latency, throughput from the median, CPU over all runs.
  double median_seconds = 0, p99_seconds = 0, gib_per_second = 0, cpu_percent = 0, cpu_seconds_per_gib = 0,
         direct_fraction = 0;
  // The ceiling that bounds this row and the fraction of it reached (backend rows).
  std::string bound_by;
  double bound_gib_per_second = 0, fraction_of_bound = 0;

  bool ok() const { return status == "ok"; }
  std::string label() const {
    return name == "auto" && !backend_used.empty() && backend_used != "auto" ? "auto (" + backend_used + ")" : name;
  }
};

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
  // Once it reads true, the row stops at the next chunk or run and Error(ECANCELED) is thrown.
  const std::atomic<bool>* cancel = nullptr;
};

// Measures one row: cold rows empty the page cache before each run, warm rows read once untimed
// first. An error before any run completed means the path cannot run here ("unavailable", with
// the error as the reason); an error after that means it broke mid-way ("failed"). A stop
// request is thrown on, not recorded.
Row measure_row(Row row, const RowPlan& plan);

// io_uring into pinned memory with O_DIRECT forced on or off: the storage's own rate (cold) or
// the page cache's (warm), with hbmio's engine as the load generator.
Row measure_uring_ceiling(const char* name, const std::string& op, const std::string& mode, DirectIo direct, RowPlan plan,
                          const Options& options);

// cudaMemcpy from pinned host memory into the device buffer, the whole file size at once: the
// rate at which any path that stages in host memory can feed the GPU.
Row measure_host_to_device(MemorySpan device, MemorySpan pinned, unsigned runs, unsigned cpus, const std::atomic<bool>* cancel);

// A remote object read whole (`hbmio bench --url`), `runs` times, with `options` (connections,
// part size): into `memory`, or with options.discard, received and dropped (the ceiling: what the
// server and the connections deliver when nothing is done with the bytes). verify: the first
// run's bytes are compared with a second, sequential read of the object (one GET at a time).
Row measure_remote(Row row, const RemoteObject& object, MemorySpan memory, const RemoteOptions& options, unsigned runs, bool verify,
                   unsigned cpus, const std::atomic<bool>* cancel);

// Sets each backend row's bound: the slowest ceiling its data must pass. Cold reads pass the
// storage (and, into a GPU, the host-to-device link unless GDS bypasses it: the min is still the
// honest bound for the staged paths); warm reads the page cache (and the link); writes the storage.
void attach_bounds(std::vector<Row>& rows, bool device_target);

// Throws Error(ECANCELED) once `cancel` reads true: the check between steps that no engine makes.
void throw_if_stopped(const std::atomic<bool>* cancel);

}  // namespace hbmio::cli
