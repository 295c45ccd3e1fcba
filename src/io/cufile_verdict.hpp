// Whether the cufile backend can serve a given file, and how (true GPUDirect DMA or cuFile's
// compatibility mode). The auto backend asks this before it picks cufile: only a direct path
// beats io_uring, since compatibility mode is pread + copy done inside libcufile.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "platform/sysfs.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/file.hpp"

namespace hbmio::shim {
class DriverSession;
}

namespace hbmio::detail {

// What the cuFile driver says it can do, independent of any file: the facts a transfer's path is
// decided from (plan_cufile_transfer), apart from the session so that tests can state them.
struct CufileDriverFacts {
  bool nvidia_fs = false;         // the nvidia-fs kernel module is loaded (its version non-zero)
  std::string nvidia_fs_version;  // "2.26"
  bool p2pdma = false;            // PCI P2PDMA supported by the driver and selected in cufile.json
  bool has_properties = false;    // cuFileDriverGetProperties answered
  unsigned dstatusflags = 0;      // its back ends (shim::CUfileDriverStatusFlags_t bits)
  static CufileDriverFacts of(const shim::DriverSession& session);
};

// Which descriptor a cufile transfer hands cuFile, and the way the bytes then move. cuFile has no
// call that says which mode a registered handle is in, so this follows its documented rules: DMA
// needs nvidia-fs or P2PDMA, a file system the driver lists, and an O_DIRECT descriptor;
// otherwise cuFile preads/pwrites into host memory (compatibility mode). Where cuFile falls back
// on its own for reasons these facts cannot see (device-mapper below ext4), `hbmio doctor`'s
// gds.mode:PATH names them.
struct CufileTransferPlan {
  int fd = -1;
  bool o_direct = false;
  bool dma = false;  // GDS or P2PDMA; false: compatibility mode
  DataPath path = DataPath::cufile_compat;
  std::string fs_type;
  std::string mode;  // "GDS (nvidia-fs 2.26)", "P2PDMA", "compatibility mode (why)": notes and verdicts
};
// `offset`/`length`: the range, for the page-cache test of DirectIo::automatic (length 0: none).
CufileTransferPlan plan_cufile_transfer(const CufileDriverFacts& driver, const File& file, DirectIo policy,
                                        std::uint64_t offset, std::uint64_t length);

struct CufileVerdict {
  bool usable = false;  // cuFile accepted the file (driver open, handle registered)
  bool direct = false;  // the data would move by DMA (GDS through nvidia-fs, or PCI P2PDMA)
  std::string mode;     // "GDS (nvidia-fs 2.26)", "P2PDMA", "compatibility mode (...)"; empty when unusable
  std::string reason;   // why unusable: cuFile code and name, what was tried, how to fix it
};

// Opens the cuFile driver if needed (once per process) and registers, then releases, a cuFile
// handle for `file` (its O_DIRECT descriptor where it has one). Never throws. Thread-safe.
// `device`: the GPU the transfer is for, where the driver is opened if this thread has no
// current CUDA context (see DriverSession::acquire).
CufileVerdict cufile_verdict(const File& file, int device = -1);

// What `auto` does with a transfer between `file` and device memory on `device`: the one place
// that decides it, used by the auto backend and by `hbmio doctor`'s summary, so the two cannot
// disagree. Order: cufile where it moves the data by DMA (GDS or P2PDMA: its compatibility mode is
// a pread + copy that uring beats), else uring where io_uring runs (`uring`: probe_uring()'s
// answer), else posix. Never throws.
struct AutoChoice {
  std::string backend;      // "cufile", "uring" or "posix"
  std::string cufile_mode;  // how cufile moves it, when that is the pick
  std::string passed_over;  // "cufile: why not; uring: why not", for what was not picked
};
AutoChoice choose_auto(const File& file, int device, const BackendStatus& uring);
// The same decision from a verdict already at hand (the doctor asks cuFile once and reports it):
// `verdict` is what choose_auto would have asked, cuFile's answer or the sysfs ruling.
AutoChoice choose_auto(const CufileVerdict& verdict, const BackendStatus& uring);

// Why cuFile cannot move `file`'s data by DMA, judged from sysfs alone (a few file reads; opening
// the cuFile driver to ask is a large part of a process's first load, see bench/RESULTS.md,
// "First use"), or nullopt when DMA is conceivable and only the driver can say. Without
// the nvidia-fs module, cuFile's one DMA path is PCI P2PDMA to an NVMe device; so a file on any
// other block device (virtio, SCSI, ...) or on none (network, FUSE, overlay) is ruled out.
// Composite devices (md, device mapper), and machines whose /sys/module cannot be read, are left
// to the driver. `root` stands for "/" (tests give a recorded tree).
std::optional<std::string> cufile_dma_ruled_out(const File& file, const platform::Root& root = platform::Root("/"));

// Why cuFileHandleRegister may have refused `fd` with CU_FILE_HANDLE_NOT_REGISTERED (5027):
// libcufile needs the udev data of the file's block device even in compatibility mode. Inspects
// st_dev and /run/udev; says what is missing and how to work around it. Exposed for tests.
std::string diagnose_handle_not_registered(int fd);

}  // namespace hbmio::detail
