#include "hbmio/file.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "core/positional_io.hpp"
#include "hbmio/error.hpp"

namespace hbmio {
namespace {

// statx through the raw system call: glibc 2.36's struct statx predates the DIO fields.
bool direct_io_alignment(int fd, std::uint32_t& memory, std::uint32_t& offset) {
#ifdef STATX_DIOALIGN
  struct ::statx sx {};
  if (::syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align != 0) {
    memory = sx.stx_dio_mem_align;
    offset = sx.stx_dio_offset_align;
    return true;
  }
#endif
  (void)fd, (void)memory, (void)offset;
  return false;
}

}  // namespace

File File::open(const std::string& path, OpenMode mode, bool with_direct_io) {
  return open_at(AT_FDCWD, path, path, mode, with_direct_io);
}

File File::adopt(int fd, std::string path) {
  File file;
  file.path_ = std::move(path);
  file.mode_ = OpenMode::read;
  file.fd_ = fd;  // closed by `file` from here on, also when a check below throws
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(errno_code(errno), {.op = "open", .path = file.path_}, "fstat");
  if (!S_ISREG(st.st_mode)) throw Error(errno_code(EINVAL), {.op = "open", .path = file.path_}, "not a regular file");
  file.identity_ = {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
  file.size_at_open_ = static_cast<std::uint64_t>(st.st_size);
  file.direct_.reason = "a descriptor taken over, without O_DIRECT";
  return file;
}

File File::open_at(int dir_fd, const std::string& name, const std::string& path, OpenMode mode, bool with_direct_io) {
  const ErrorContext context{.op = "open", .path = path};
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::read: flags |= O_RDONLY; break;
    case OpenMode::write: flags |= O_WRONLY | O_CREAT | O_TRUNC; break;
    case OpenMode::read_write: flags |= O_RDWR | O_CREAT; break;
    case OpenMode::create_new: flags |= O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW; break;
    case OpenMode::create_unnamed: flags |= O_WRONLY | O_TMPFILE; break;
  }
  // A FIFO's open would wait for the other end (O_NONBLOCK would avoid that but makes open fail
  // where a file lease is held): refuse it before opening. The fstat below checks again.
  if (struct stat before {}; mode != OpenMode::create_unnamed && ::fstatat(dir_fd, name.c_str(), &before, 0) == 0 &&
                              (S_ISFIFO(before.st_mode) || S_ISSOCK(before.st_mode)))
    throw Error(errno_code(EINVAL), context, "not a regular file or block device");
  File file;
  file.path_ = path;
  file.mode_ = mode;
  file.fd_ = ::openat(dir_fd, name.c_str(), flags, 0666);  // 0666: the umask decides, as users expect
  if (file.fd_ < 0) throw Error(errno_code(errno), context);
  struct stat st {};
  if (::fstat(file.fd_, &st) != 0) throw Error(errno_code(errno), context, "fstat");
  file.identity_ = {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
  if (S_ISDIR(st.st_mode)) throw Error(errno_code(EISDIR), context);
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode))
    throw Error(errno_code(EINVAL), context, "not a regular file or block device");
  if (S_ISREG(st.st_mode)) file.size_at_open_ = static_cast<std::uint64_t>(st.st_size);

  // A second descriptor with O_DIRECT, through /proc/self/fd so it is the very same inode even
  // if the path is renamed meanwhile. Some file systems (tmpfs, some FUSE) refuse O_DIRECT.
  if (!with_direct_io) {
    file.direct_.reason = "opened without O_DIRECT";
    return file;
  }
  const int direct_flags = (flags & ~(O_CREAT | O_TRUNC | O_EXCL | O_NOFOLLOW | O_TMPFILE)) | O_DIRECT;
  const std::string self = fmt::format("/proc/self/fd/{}", file.fd_);
  file.direct_fd_ = ::open(self.c_str(), direct_flags);
  if (file.direct_fd_ < 0) {
    // No /proc: the path again, but only if it still names the file opened above (a file or a
    // symlink swapped in meanwhile must not receive the writes meant for the opened one).
    if (mode == OpenMode::create_unnamed) {  // no name to open it by
      file.direct_.reason = "no /proc to open the unnamed file again with O_DIRECT";
      return file;
    }
    file.direct_fd_ = ::openat(dir_fd, name.c_str(), direct_flags);
    struct stat again {};
    if (file.direct_fd_ >= 0 && (::fstat(file.direct_fd_, &again) != 0 || again.st_dev != st.st_dev || again.st_ino != st.st_ino)) {
      ::close(file.direct_fd_);
      file.direct_fd_ = -1;
      file.direct_.reason = "the path names another file than the one opened: O_DIRECT not used";
      return file;
    }
  }
  if (file.direct_fd_ < 0) {
    file.direct_.reason = fmt::format("{} refuses O_DIRECT: {}", file_system_type(path), std::strerror(errno));
  } else {
    file.direct_.supported = true;
    file.direct_.block_size = static_cast<std::uint32_t>(st.st_blksize);
    if (!direct_io_alignment(file.direct_fd_, file.direct_.memory_alignment, file.direct_.offset_alignment)) {
      // Kernels before 6.1 do not report it; the logical block size of today's devices is at
      // most 4 KiB, so 4 KiB alignment is always accepted.
      file.direct_.memory_alignment = 4096;
      file.direct_.offset_alignment = 4096;
    }
  }
  return file;
}

File::~File() { close(); }

void File::close() noexcept {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (fd_ >= 0) ::close(fd_);
  direct_fd_ = fd_ = -1;
}

File::File(File&& other) noexcept
    : path_(std::move(other.path_)),
      mode_(other.mode_),
      fd_(std::exchange(other.fd_, -1)),
      direct_fd_(std::exchange(other.direct_fd_, -1)),
      direct_(std::move(other.direct_)),
      identity_(other.identity_),
      size_at_open_(other.size_at_open_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    mode_ = other.mode_;
    fd_ = std::exchange(other.fd_, -1);
    direct_fd_ = std::exchange(other.direct_fd_, -1);
    direct_ = std::move(other.direct_);
    identity_ = other.identity_;
    size_at_open_ = other.size_at_open_;
  }
  return *this;
}

std::size_t File::read_at(std::span<std::byte> data, std::uint64_t offset) const {
  return detail::read_fully(fd_, data, offset, {.op = "read", .path = path_});
}

std::uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw Error(errno_code(errno), {.op = "stat", .path = path_});
  if (S_ISBLK(st.st_mode)) {
    const off_t end = ::lseek(fd_, 0, SEEK_END);
    if (end < 0) throw Error(errno_code(errno), {.op = "stat", .path = path_}, "lseek(SEEK_END)");
    return static_cast<std::uint64_t>(end);
  }
  return static_cast<std::uint64_t>(st.st_size);
}

void File::sync() const {
  // fsync failures are final: the kernel may already have dropped the dirty pages, so a retry
  // that succeeds proves nothing (PostgreSQL's "fsyncgate").
  if (::fsync(fd_) != 0) throw Error(errno_code(errno), {.op = "fsync", .path = path_});
}

void File::truncate(std::uint64_t size) const {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
    throw Error(errno_code(errno), {.op = "truncate", .path = path_, .length = size});
}

std::string file_system_type(const std::string& path) {
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return "unknown";
  switch (static_cast<unsigned long>(fs.f_type)) {
    case EXT4_SUPER_MAGIC: return "ext4";
    case XFS_SUPER_MAGIC: return "xfs";
    case BTRFS_SUPER_MAGIC: return "btrfs";
    case TMPFS_MAGIC: return "tmpfs";
    case NFS_SUPER_MAGIC: return "nfs";
    case OVERLAYFS_SUPER_MAGIC: return "overlayfs";
    case 0x65735546: return "fuse";
    case 0x6a656a63: return "virtiofs";  // not in older linux/magic.h
    case 0x0bd00bd0: return "lustre";
    case 0x47504653: return "gpfs";
    case 0x19830326: return "beegfs";
    case 0x2fc12fc1: return "zfs";
    default: return fmt::format("unknown (0x{:x})", static_cast<unsigned long>(fs.f_type));
  }
}

}  // namespace hbmio
