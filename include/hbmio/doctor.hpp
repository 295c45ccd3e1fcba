// `hbmio doctor`: the GPUDirect Storage deployment checklist, checked on the machine at hand (or
// on a recorded sysfs/procfs tree): GPUs, storage and NVMe(-oF) controllers, RDMA and modules,
// PCIe topology with ACS and IOMMU, cuFile configuration, and for each given path which data
// path `auto` takes there and what bounds it.
//
// Every probe is read-only, except the O_DIRECT trial on a directory PATH, which creates,
// reads and removes one 4 KiB file in it. Thread-safety: run_doctor may run concurrently with
// itself; it never throws for what it finds (missing or garbled files become WARN/INFO checks).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/options.hpp"

namespace hbmio {

enum class CheckStatus {
  pass,  // as GDS wants it
  warn,  // works, but slower than it could be, or cannot be confirmed
  fail,  // broken: a transfer would fail or the setup is invalid
  info,  // a fact, or a probe that was not possible here (and why)
};
std::string_view to_string(CheckStatus status) noexcept;  // "PASS", "WARN", "FAIL", "INFO"

struct Check {
  std::string id;        // stable key: "gpu.device:0000:06:00.0", "gds.cufile_json", "summary.auto:/data"
  std::string group;     // "GPUs", "Storage", "Fabric", "Topology", "GDS", "Summary"
  CheckStatus status = CheckStatus::info;
  std::string found;     // what the machine has
  std::string expected;  // what GDS wants (empty when there is nothing to compare against)
  std::string fix;       // the command or setting that would change it (empty for PASS)
};

struct DoctorOptions {
  // Where sysfs, procfs and /etc live. Anything but "/" is a recorded tree: probes that need the
  // live machine (O_DIRECT trial, cuFile handle registration, CUDA, io_uring) report INFO
  // "skipped: --root given" there.
  std::string root = "/";
  // Files or directories to judge: file system, block device, O_DIRECT, cuFile verdict, and the
  // summary of what `auto` picks. With a recorded root they are paths inside that tree.
  std::vector<std::string> paths;
};

// Runs every check, grouped in the order GPUs, Storage, Fabric, Topology, GDS, Summary.
std::vector<Check> run_doctor(const DoctorOptions& options);

// True when any check FAILs (the CLI's exit status 1).
bool any_failed(const std::vector<Check>& checks) noexcept;

// `hbmio doctor --explain PATH`: a small real read of a file, the way its bytes took and why,
// and the doctor's checks that say what would make it faster.
struct ExplainOptions {
  // A file, or a directory (its largest regular file is read). With a recorded `root` it is a path
  // inside the tree, as for DoctorOptions::paths: the checks judge the recorded machine, while the
  // read runs here, on the file at root/path.
  std::string path;
  std::string root = "/";
  std::string backend;  // posix | uring | cufile | auto; "": configured_backend() (HBMIO_BACKEND, else auto)
  // The file's first bytes, at most this many: enough for every worker to take part, little
  // enough to take a moment.
  std::uint64_t max_bytes = std::uint64_t{64} << 20;
};

struct Explanation {
  std::string file;         // the file read
  std::string into;         // "cuda:0" where this machine has a CUDA device, else "host"
  std::string why_host;     // why host memory, where it is ("no CUDA device: ...")
  Stats stats;              // the read's: bytes, seconds, and per file the way it took (Stats::paths)
  // One or two sentences: what the read did, and whether this machine has a faster way.
  std::string summary;
  // The checks of the machine and PATH that bound or explain this path (the GDS mode a file there
  // gets, nvidia-fs, P2PDMA, cufile.json, O_DIRECT, the PCIe path...), not PASS, most telling
  // first, each with its fix; then summary.auto:PATH, the ceiling. Only the ceiling: nothing to fix.
  std::vector<Check> advice;
};

// Reads the file into GPU memory where there is a CUDA device (cuda:0), else host memory, through
// the backend asked for, and runs the doctor on PATH. Throws Error naming the file when it cannot
// be opened or read; the checks themselves never throw.
Explanation explain_transfer(const ExplainOptions& options);

// The machine a measurement ran on, recorded beside its figures (`hbmio bench`): a figure means
// little without the CPU, kernel, GPU and storage it came from.
struct Machine {
  std::string cpu_model = "unknown";
  unsigned cpus = 1;
  std::uint64_t memory_bytes = 0;
  std::string kernel;      // "Linux 6.8.0-45-generic", as uname(2) reports sysname and release
  bool gpu = false;
  std::string gpu_name;    // "NVIDIA H200" when there is one
  std::string gpu_reason;  // why there is none
  std::string file_system, device, device_model;
};

// The live machine, GPU `device` (when there is a GPU), and the file system and block device that
// hold `path`. Facts that cannot be read stay at their defaults: nothing here throws.
Machine describe_machine(const std::string& path, int device = 0);

}  // namespace hbmio
