// The cufile backend: NVIDIA GPUDirect Storage through libcufile, loaded at run time (see
// src/shim/cufile_api.hpp). Moves bytes between files and CUDA device memory only.
//
// cuFile runs in one of three ways, and which one decides whether this backend is worth using:
//   GDS       nvidia-fs kernel module present: storage DMAs straight into GPU memory.
//   P2PDMA    (GDS 1.13+) the kernel's PCI P2PDMA does the same without nvidia-fs.
//   compat    neither (or an unsupported file system, or no O_DIRECT descriptor): libcufile does
//             pread/pwrite into its own host bounce buffers and copies them to the GPU. It works,
//             but it is what the uring backend does, with less control.
// Stats::note and cufile_verdict() say which one a transfer used.
#include <sys/stat.h>
#include <sys/sysmacros.h>  // major(), minor()
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "core/fault_hook.hpp"
#include "core/worker_threads.hpp"
#include "io/cufile_verdict.hpp"
#include "io/engine_internal.hpp"
#include "io/page_cache.hpp"
#include "memory/cuda_runtime.hpp"
#include "shim/cufile_api.hpp"

namespace hbmio::detail {
namespace {

constexpr std::string_view kBackend = "cufile";
constexpr const char* kCompatNoDirectPath = "compatibility mode (no nvidia-fs / P2PDMA: cuFile does pread + copy)";
// -EINTR / -EAGAIN are retried; this many in a row without progress is an error, not a livelock.
constexpr unsigned kMaxConsecutiveRetries = 1000;

using shim::CUfileError_t;
using shim::DriverSession;

// The way the driver itself can move data, independent of any file.
std::string driver_mode(const CufileDriverFacts& driver) {
  if (driver.nvidia_fs) return fmt::format("GDS (nvidia-fs {})", driver.nvidia_fs_version);
  if (driver.p2pdma) return "P2PDMA";
  return kCompatNoDirectPath;
}

// Whether the driver reports support for the back end under `fs_type`. GDS's local-disk path
// is ext4/XFS on a supported block device; distributed file systems each have their own bit.
// The block-device kind (NVMe, NVMe-oF, SCSI, ...) is not checked per file: any supported one
// counts, and cuFile falls back to compat mode itself where the guess is wrong.
bool file_system_supported(const CufileDriverFacts& driver, const std::string& fs_type) {
  if (!driver.has_properties) return false;
  const unsigned flags = driver.dstatusflags;
  auto has = [flags](int bit) { return (flags & (1u << bit)) != 0; };
  if (fs_type == "ext4" || fs_type == "xfs")
    return has(shim::CU_FILE_NVME_SUPPORTED) || has(shim::CU_FILE_NVMEOF_SUPPORTED) || has(shim::CU_FILE_SCSI_SUPPORTED) ||
           has(shim::CU_FILE_NVMESH_SUPPORTED) || has(shim::CU_FILE_SCALEFLUX_CSD_SUPPORTED) ||
           has(shim::CU_FILE_NVME_P2P_SUPPORTED);
  if (fs_type == "nfs") return has(shim::CU_FILE_NFS_SUPPORTED);
  if (fs_type == "lustre") return has(shim::CU_FILE_LUSTRE_SUPPORTED);
  if (fs_type == "gpfs") return has(shim::CU_FILE_GPFS_SUPPORTED);
  if (fs_type == "beegfs") return has(shim::CU_FILE_BEEGFS_SUPPORTED);
  if (fs_type == "wekafs") return has(shim::CU_FILE_WEKAFS_SUPPORTED);
  return false;
}

}  // namespace

CufileDriverFacts CufileDriverFacts::of(const DriverSession& session) {
  CufileDriverFacts facts;
  facts.nvidia_fs = session.nvidia_fs();
  if (facts.nvidia_fs) facts.nvidia_fs_version = session.nvidia_fs_version();
  facts.p2pdma = session.pci_p2pdma();
  facts.has_properties = session.has_properties();
  if (facts.has_properties) facts.dstatusflags = session.properties().nvfs.dstatusflags;
  return facts;
}

CufileTransferPlan plan_cufile_transfer(const CufileDriverFacts& session, const File& file, DirectIo policy,
                                        std::uint64_t offset, std::uint64_t length) {
  CufileTransferPlan plan;
  plan.fs_type = file_system_type(file.path());
  const bool has_direct_fd = file.direct_fd() >= 0;
  const bool driver_dma = session.nvidia_fs || session.p2pdma;
  const bool fs_ok = driver_dma && file_system_supported(session, plan.fs_type);

  // DMA needs O_DIRECT: the data must not pass through the page cache. So where DMA is
  // possible, "auto" means O_DIRECT (cuFile bounces unaligned edges itself on that path). In
  // compatibility mode cuFile just preads/pwrites the descriptor it is given, so "auto" is the
  // usual page-cache test, O_DIRECT only for a cold range, and only for an aligned one: an
  // unaligned O_DIRECT pread/pwrite fails with EINVAL there.
  bool use_direct = false;
  if (has_direct_fd && policy != DirectIo::off) {
    if (policy == DirectIo::on || fs_ok) {
      use_direct = true;
    } else if (length > 0) {
      const std::uint64_t alignment = file.direct_io().offset_alignment != 0 ? file.direct_io().offset_alignment : 4096;
      use_direct = offset % alignment == 0 && length % alignment == 0 &&
                   page_cache_residency(file.fd(), offset, length).fraction() < 0.5;
    }
  }
  plan.o_direct = use_direct;
  plan.fd = use_direct ? file.direct_fd() : file.fd();
  plan.dma = fs_ok && use_direct;

  plan.path = !plan.dma ? DataPath::cufile_compat : session.nvidia_fs ? DataPath::gds_nvidia_fs : DataPath::gds_p2pdma;
  if (plan.dma) {
    plan.mode = session.nvidia_fs ? driver_mode(session) : std::string("P2PDMA");
  } else if (!driver_dma) {
    plan.mode = kCompatNoDirectPath;
  } else if (!fs_ok) {
    plan.mode = fmt::format("compatibility mode ({} is not a GDS file system here: cuFile does pread + copy)", plan.fs_type);
  } else {
    plan.mode = has_direct_fd ? "compatibility mode (O_DIRECT off by option: cuFile does pread + copy)"
                              : fmt::format("compatibility mode (no O_DIRECT descriptor: {}; cuFile does pread + copy)",
                                            file.direct_io().reason.empty() ? std::string("unavailable") : file.direct_io().reason);
  }
  return plan;
}

// Why cuFileHandleRegister said CU_FILE_HANDLE_NOT_REGISTERED. Found with CUFILE_LOGGING_LEVEL=
// TRACE on an H200 VM (libcufile 1.15.1, no nvidia-fs, no udevd): libcufile looks up the file's
// device in the udev database (property ID_FS_USAGE, /run/udev/data/b<major>:<minor>) even in
// compatibility mode, and gives up when it is missing: in containers and VMs without udevd, and
// for file systems with no block device (tmpfs, overlayfs, FUSE: st_dev major 0). cufile.log
// then shows "udev property not found: ID_FS_USAGE" and "unable to get volume attributes".
// The workaround, CUFILE_EXPERIMENTAL_FS (undocumented; checked for presence only), makes
// libcufile skip those checks; writing the udev entry by hand fixed it too, confirming the cause.
std::string diagnose_handle_not_registered(int fd) {
  static constexpr const char* kFix =
      "fix: set CUFILE_EXPERIMENTAL_FS=1 before the first cuFile call (libcufile then skips its file-system checks; "
      "compatibility-mode I/O only, do not use it where nvidia-fs runs), or run udevd (udevadm trigger) so the "
      "device has udev data";
  if (std::getenv("CUFILE_EXPERIMENTAL_FS") != nullptr)
    return "CUFILE_EXPERIMENTAL_FS is set, so libcufile skipped its udev/file-system checks: the cause is elsewhere";
  struct stat st {};
  if (::fstat(fd, &st) != 0) return {};
  const unsigned dev_major = major(st.st_dev), dev_minor = minor(st.st_dev);
  if (dev_major == 0)
    return fmt::format(
        "the file system has no block device (st_dev {}:{}: tmpfs, overlayfs, FUSE, ...) and libcufile looks "
        "every file's device up in the udev database, even in compatibility mode; {}",
        dev_major, dev_minor, kFix);
  std::error_code ignored;
  if (!std::filesystem::exists("/run/udev", ignored))
    return fmt::format(
        "this machine has no udev database (/run/udev is missing: a container or VM without udevd), and libcufile "
        "needs udev's ID_FS_USAGE property of the file's device {}:{} even in compatibility mode; {}",
        dev_major, dev_minor, kFix);
  const std::string udev_data = fmt::format("/run/udev/data/b{}:{}", dev_major, dev_minor);
  std::ifstream in(udev_data);
  std::string line;
  bool has_usage = false;
  while (in && std::getline(in, line)) has_usage = has_usage || line.rfind("E:ID_FS_USAGE=", 0) == 0;
  if (!has_usage)
    return fmt::format(
        "udev has no ID_FS_USAGE property for the file's device {}:{} ({}), which libcufile needs even in "
        "compatibility mode; {}",
        dev_major, dev_minor, udev_data, kFix);
  return fmt::format("the udev data of device {}:{} looks complete, so the cause is something else", dev_major,
                     dev_minor);
}

namespace {

std::string explain_register_failure(const File& file, const CufileTransferPlan& plan, CUfileError_t status) {
  std::string text = fmt::format("cuFileHandleRegister refused {} ({} descriptor, {}): {}", file.path(),
                                 plan.o_direct ? "O_DIRECT" : "buffered", plan.fs_type, shim::describe_cufile_error(status));
  std::string why;
  switch (status.err) {
    case shim::CU_FILE_HANDLE_NOT_REGISTERED: why = diagnose_handle_not_registered(plan.fd); break;
    case shim::CU_FILE_IO_NOT_SUPPORTED:
      why = "GDS does not support this file system or device, and allow_compat_mode is off in cufile.json";
      break;
    case shim::CU_FILE_INVALID_FILE_OPEN_FLAG:
    case shim::CU_FILE_DIO_NOT_SET:
      why = plan.o_direct ? std::string("cuFile rejected the descriptor's open flags")
                          : "GDS needs an O_DIRECT descriptor" +
                                (file.direct_io().reason.empty() ? std::string() : " (" + file.direct_io().reason + ")");
      break;
    case shim::CU_FILE_INVALID_FILE_TYPE: why = "cuFile serves regular files only"; break;
    case shim::CU_FILE_IO_DISABLED: why = "cufile.json disables GPUDirect Storage for this file"; break;
    case shim::CU_FILE_DRIVER_NOT_INITIALIZED:
      why = "nvidia-fs is not loaded and allow_compat_mode is off in cufile.json";
      break;
    default: break;
  }
  if (!why.empty()) text += "; " + why;
  text +=
      "; CUFILE_LOGGING_LEVEL=TRACE makes libcufile log each registration step to cufile.log (in the working "
      "directory unless cufile.json sets logging.dir)";
  return text;
}

// cuFile takes one registration per descriptor (a second one fails with
// CU_FILE_HANDLE_ALREADY_REGISTERED), yet a File may serve several transfers at once, through
// several engines, and cufile_verdict() may look at it meanwhile. So registrations are shared
// per descriptor and reference-counted: the first user registers, the last one deregisters.
// The File keeps its descriptors open for as long as any transfer on it runs (File contract),
// so a descriptor number cannot be reused while its registration is alive.
class HandleLease {
 public:
  HandleLease() = default;
  // Registers `fd` or shares its registration. On failure `out` stays empty.
  static CUfileError_t acquire(const shim::CufileApi& api, int fd, HandleLease& out) {
    Table& table = Table::instance();
    std::lock_guard lock(table.mutex);
    auto found = table.entries.find(fd);
    if (found == table.entries.end()) {
      shim::FileHandle handle;
      const CUfileError_t status = shim::FileHandle::register_fd(api, fd, handle);
      if (status.err != shim::CU_FILE_SUCCESS) return status;
      found = table.entries.emplace(fd, Entry{std::move(handle), 0}).first;
    }
    ++found->second.users;
    out.release();
    out.fd_ = fd;
    out.handle_ = found->second.handle.get();
    return {shim::CU_FILE_SUCCESS, 0};
  }
  ~HandleLease() { release(); }
  HandleLease(HandleLease&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)), handle_(std::exchange(other.handle_, nullptr)) {}
  HandleLease& operator=(HandleLease&&) = delete;
  HandleLease(const HandleLease&) = delete;
  HandleLease& operator=(const HandleLease&) = delete;

  shim::CUfileHandle_t get() const noexcept { return handle_; }

 private:
  struct Entry {
    shim::FileHandle handle;  // deregisters when erased
    unsigned users = 0;
  };
  struct Table {
    std::mutex mutex;
    std::unordered_map<int, Entry> entries;
    // Leaked like the driver session: a lease released during exit still finds its table.
    static Table& instance() {
      static Table* const table = new Table();
      return *table;
    }
  };

  void release() noexcept {
    if (handle_ == nullptr) return;
    Table& table = Table::instance();
    std::lock_guard lock(table.mutex);
    if (auto found = table.entries.find(fd_); found != table.entries.end() && --found->second.users == 0)
      table.entries.erase(found);
    fd_ = -1;
    handle_ = nullptr;
  }

  int fd_ = -1;
  shim::CUfileHandle_t handle_ = nullptr;
};

// Context for an error in the piece [offset, offset + length) of a request.
ErrorContext piece_context(const IoRequest& request, std::uint64_t offset, std::uint64_t length) {
  ErrorContext context = context_of(request, kBackend);
  context.offset = offset;
  context.length = length;
  return context;
}

std::string error_code_name(long long code) {
  if (const char* name = shim::cufile_error_name(static_cast<int>(code))) return name;
  return fmt::format("errno {}", code);
}

class CufileEngine final : public Engine {
 public:
  CufileEngine(const Options& options, std::shared_ptr<FaultHook> faults, const DriverSession& session)
      : options_(options), faults_(std::move(faults)), driver_(CufileDriverFacts::of(session)), api_(session.api()),
        threads_(std::max(options.resolved_workers(), 1u), "cuFile worker") {}

  std::string_view name() const noexcept override { return kBackend; }

  Stats submit(const IoRequest& request) override {
    std::lock_guard lock(mutex_);  // one request at a time (Engine contract)
    validate_request(request, kBackend);
    const ErrorContext context = context_of(request, kBackend);
    // cuFile can read into host memory too (allow_system_memory), but that is pread + memcpy
    // with extra steps: the other backends do it better, so refuse rather than be slow.
    if (request.memory.kind() != MemoryKind::device)
      throw Error(errno_code(ENOTSUP), context,
                  fmt::format("cufile backend moves device memory only; use uring or posix for host memory (got {})",
                              request.memory.location.to_string()));

    Stats stats;
    stats.backend = std::string(kBackend);
    TransferTimer timer;
    const std::size_t size = request.memory.size;
    if (size == 0) {
      stats.note = "empty request";
      tell_landed(request);
      timer.finish(stats);
      return stats;
    }

    const int device = request.memory.location.device;
    const cuda::DeviceGuard guard(device, context);  // the caller's device is restored on return
    const CufileTransferPlan plan = plan_cufile_transfer(driver_, *request.file, options_.direct_io, request.offset, size);

    if (const int err = inject(faults_.get(), FaultSite::setup, "cuFileHandleRegister"))
      throw Error(errno_code(err), context, "cuFileHandleRegister failed (injected)");
    HandleLease handle;
    const CUfileError_t status = HandleLease::acquire(api_, plan.fd, handle);
    if (status.err != shim::CU_FILE_SUCCESS)
      throw Error(std::error_code(status.err, cufile_category()), context,
                  explain_register_failure(*request.file, plan, status));

    const unsigned workers = run_workers(request, handle.get(), device, context);

    stats.bytes = size;
    // O_DIRECT (compat mode with an O_DIRECT descriptor) and DMA both bypass the page cache.
    (plan.dma || plan.o_direct ? stats.bytes_direct : stats.bytes_buffered) = size;
    stats.workers = workers;
    stats.note = plan.mode;
    stats.paths.push_back({.file = request.file->path(),
                           .path = plan.path,
                           .reason = (plan.dma ? "cuFile registered the file for DMA: " : "cuFile opened the file in ") + plan.mode +
                                     (plan.o_direct ? "; O_DIRECT descriptor" : "; buffered descriptor"),
                           .bytes = size,
                           .bytes_direct = plan.dma || plan.o_direct ? size : 0});
    tell_landed(request);  // cuFileRead returns once its DMA is done
    timer.finish(stats);
    return stats;
  }

 private:
  // Splits the request into chunk_size pieces and moves them on up to resolved_workers()
  // threads, each taking the next piece as it finishes one. Returns the number of threads used.
  // On failure: the other threads stop taking pieces, all are joined, the first error is thrown.
  unsigned run_workers(const IoRequest& request, shim::CUfileHandle_t handle, int device, const ErrorContext& context) {
    const std::uint64_t size = request.memory.size;
    const std::uint64_t chunk = std::max<std::uint64_t>(options_.chunk_size, 1);
    const std::uint64_t chunks = (size + chunk - 1) / chunk;
    const auto workers = static_cast<unsigned>(std::min<std::uint64_t>(std::max(options_.resolved_workers(), 1u), chunks));

    std::atomic<std::uint64_t> next_chunk{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    std::exception_ptr first_error;

    auto work = [&](bool own_thread) {
      try {
        // A new thread has no current device; cuFile needs the buffer's context current.
        if (own_thread) cuda::set_device(device, context);
        for (;;) {
          if (failed.load(std::memory_order_relaxed)) return;
          if (request.cancel != nullptr && request.cancel->load(std::memory_order_relaxed))
            throw Error(errno_code(ECANCELED), context, "stopped on request");
          const std::uint64_t index = next_chunk.fetch_add(1, std::memory_order_relaxed);
          if (index >= chunks) return;
          const std::uint64_t begin = index * chunk;
          transfer_piece(request, handle, begin, static_cast<std::size_t>(std::min(chunk, size - begin)));
        }
      } catch (...) {
        failed.store(true, std::memory_order_relaxed);
        std::lock_guard error_lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
      }
    };

    // Task 0 runs on the caller's thread, under submit()'s device guard; the others on the engine's.
    threads_.run(workers, [&](unsigned i) { work(i != 0); });
    if (first_error) std::rethrow_exception(first_error);
    return workers;
  }

  // One cuFileRead/cuFileWrite loop over [begin, begin + length) of the request. cuFile returns
  // bytes moved (short counts happen and are resumed), -errno, or -CUfileOpError (> 5000).
  void transfer_piece(const IoRequest& request, shim::CUfileHandle_t handle, std::uint64_t begin, std::size_t length) {
    const bool reading = request.op == IoOp::read;
    const char* call = reading ? "cuFileRead" : "cuFileWrite";
    std::size_t done = 0;
    unsigned retries = 0;
    while (done < length) {
      const std::uint64_t file_offset = request.offset + begin + done;
      const std::uint64_t buffer_offset = begin + done;
      const std::size_t want = length - done;
      // base = the span's start and buf_offset into it, as cuFile expects for a registered
      // buffer; for an unregistered one the two forms are equivalent.
      const ssize_t moved =
          reading ? api_.read(handle, request.memory.data, want, static_cast<off_t>(file_offset), static_cast<off_t>(buffer_offset))
                  : api_.write(handle, request.memory.data, want, static_cast<off_t>(file_offset),
                               static_cast<off_t>(buffer_offset));
      const long long result = inject_io(faults_.get(), moved, want, call, file_offset);
      if (result > 0) {
        const auto n = static_cast<std::size_t>(std::min<long long>(result, static_cast<long long>(want)));
        done += n;
        retries = 0;
        if (request.progress) request.progress->fetch_add(n, std::memory_order_relaxed);
        continue;
      }
      if ((result == -EINTR || result == -EAGAIN) && ++retries <= kMaxConsecutiveRetries) continue;
      const ErrorContext context = piece_context(request, file_offset, want);
      if (result == 0)
        throw Error(errno_code(reading ? EIO : ENOSPC), context,
                    reading ? fmt::format("file ended at byte {} ({} returned 0; did it shrink during the read?)", file_offset, call)
                            : fmt::format("{} made no progress at byte {}", call, file_offset));
      const long long code = -result;
      const std::error_code error = code > shim::kCufileOpBaseError
                                        ? std::error_code(static_cast<int>(code), cufile_category())
                                        : errno_code(static_cast<int>(code));
      throw Error(error, context,
                  fmt::format("{} of {} bytes at file offset {} (buffer offset {}) returned {} ({}){}", call, want, file_offset,
                              buffer_offset, result, error_code_name(code),
                              retries > kMaxConsecutiveRetries ? fmt::format(" {} times in a row", retries) : std::string()));
    }
  }

  Options options_;
  std::shared_ptr<FaultHook> faults_;
  const CufileDriverFacts driver_;
  const shim::CufileApi& api_;
  WorkerThreads threads_;  // the engine's own; each makes the request's device current on itself
  std::mutex mutex_;
};

// Registers and releases a handle for a representative file, to tell whether cuFile accepts
// files here at all (a missing udev database fails every registration). The running program
// lives on a real local file system, so /proc/self/exe is a fair sample.
std::string registration_test(const DriverSession& session) {
  std::string exe;
  try {
    exe = std::filesystem::read_symlink("/proc/self/exe").string();
    const File file = File::open(exe, OpenMode::read);
    const CufileTransferPlan plan = plan_cufile_transfer(CufileDriverFacts::of(session), file, DirectIo::on, 0, 0);
    shim::FileHandle handle;
    const CUfileError_t status = shim::FileHandle::register_fd(session.api(), plan.fd, handle);
    if (status.err != shim::CU_FILE_SUCCESS)
      return "registering a test file failed, so cufile transfers will fail too: " + explain_register_failure(file, plan, status);
    return {};
  } catch (const std::exception& e) {
    return fmt::format("could not run the registration test on {}: {}", exe, e.what());
  }
}

}  // namespace

std::optional<std::string> cufile_dma_ruled_out(const File& file, const platform::Root& root) {
  // nvidia-fs loaded (its module, or its /proc entry, which `hbmio doctor` reads), or a
  // /sys/module that cannot be read (a container may mask it): only the driver can say.
  if (!root.is_directory("sys/module") || root.exists("sys/module/nvidia_fs") || root.exists("proc/driver/nvidia-fs"))
    return std::nullopt;
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) return std::nullopt;
  const dev_t dev = S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev;  // a block device file is its own device
  const unsigned maj = major(dev), min = minor(dev);
  if (maj == 0)
    return fmt::format("{} is on {} (no block device) and nvidia-fs is not loaded: no DMA path", file.path(),
                       file_system_type(file.path()));
  // The device's place in the sysfs tree: sys/devices/.../nvme/nvme0/nvme0n1/nvme0n1p1 for PCIe
  // NVMe, .../nvme-fabrics/... or .../nvme-subsystem/... for NVMe-oF and multipath,
  // .../virtio3/block/vda for virtio.
  const std::optional<std::string> place = root.resolve(fmt::format("sys/dev/block/{}:{}", maj, min));
  if (!place) return std::nullopt;
  const std::string name = platform::name_of(*place);
  if (place->find("nvme") != std::string::npos || name.starts_with("md") || name.starts_with("dm-")) return std::nullopt;
  return fmt::format("{} is on {}, not NVMe, and nvidia-fs is not loaded: no DMA path", file.path(), name);
}

CufileVerdict cufile_verdict(const File& file, int device) {
  CufileVerdict verdict;
  try {
    const DriverSession& session = DriverSession::acquire(device);
    if (!session.ok()) {
      verdict.reason = session.reason();
      return verdict;
    }
    if (file.fd() < 0) {
      verdict.reason = "file is not open";
      return verdict;
    }
    const CufileTransferPlan plan = plan_cufile_transfer(CufileDriverFacts::of(session), file, DirectIo::on, 0, 0);
    HandleLease handle;
    const CUfileError_t status = HandleLease::acquire(session.api(), plan.fd, handle);
    if (status.err != shim::CU_FILE_SUCCESS) {
      verdict.reason = explain_register_failure(file, plan, status);
      return verdict;
    }
    verdict.usable = true;
    verdict.direct = plan.dma;
    verdict.mode = plan.mode;
  } catch (const std::exception& e) {
    verdict = {};
    verdict.reason = fmt::format("cuFile check of {} failed: {}", file.path(), e.what());
  }
  return verdict;
}

AutoChoice choose_auto(const File& file, int device, const BackendStatus& uring) {
  // Without opening cuFile's driver where sysfs already rules DMA out: its set-up would be paid by
  // the first load only to learn that cuFile would pread + copy.
  CufileVerdict verdict;
  if (std::optional<std::string> why = cufile_dma_ruled_out(file)) verdict.reason = *why + " (cuFile not asked)";
  else verdict = cufile_verdict(file, device);
  return choose_auto(verdict, uring);
}

AutoChoice choose_auto(const CufileVerdict& verdict, const BackendStatus& uring) {
  AutoChoice choice;
  if (verdict.usable && verdict.direct) {
    choice.backend = "cufile";
    choice.cufile_mode = verdict.mode;
    return choice;
  }
  choice.passed_over = "cufile: " + (verdict.usable ? verdict.mode + ", no faster than uring" : verdict.reason);
  if (uring.available) {
    choice.backend = "uring";
  } else {
    choice.backend = "posix";
    choice.passed_over += "; uring: " + uring.detail;
  }
  return choice;
}

std::unique_ptr<Engine> make_cufile_engine(const Options& options, std::shared_ptr<FaultHook> faults, int device) {
  options.validate();
  const DriverSession& session = DriverSession::acquire(device);
  if (!session.ok())
    throw Error(errno_code(ENOTSUP), ErrorContext{.op = "open backend", .path = {}, .offset = 0, .length = 0, .backend = "cufile"},
                session.reason());
  return std::make_unique<CufileEngine>(options, std::move(faults), session);
}

BackendStatus probe_cufile() {
  BackendStatus status{.name = "cufile", .available = false, .detail = {}};
  try {
    const shim::CufileApi& api = shim::CufileApi::instance();
    const DriverSession& session = DriverSession::acquire();
    if (!session.ok()) {
      status.detail = session.reason();
      if (api.loaded()) status.detail += fmt::format(" [libcufile {} at {}]", api.version_string(), api.library_path());
      return status;
    }
    status.available = true;
    status.detail = fmt::format("libcufile {} ({}); driver open; {}", api.version_string(), api.library_path(), driver_mode(CufileDriverFacts::of(session)));
    if (const std::string problem = registration_test(session); !problem.empty()) status.detail += "; warning: " + problem;
  } catch (const std::exception& e) {
    status.available = false;
    status.detail = std::string("cuFile probe failed: ") + e.what();
  }
  return status;
}

}  // namespace hbmio::detail
