// An open file, as engines use it: one buffered descriptor, plus an O_DIRECT descriptor where the
// file system accepts one. Move-only; the destructor closes both descriptors.
//
// Thread-safety: a File may be used by many transfers at once (pread/pwrite do not share a file
// position); open/close are not concurrent with use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace hbmio {

enum class OpenMode {
  read,        // existing file, read only
  write,       // create or truncate, write only
  read_write,  // create if missing, keep contents
  create_new,  // create a file that must not exist yet, write only; never follows a symlink
               // (O_CREAT | O_EXCL | O_NOFOLLOW): for temporary files that nobody may swap
  create_unnamed,  // a new file without a name in the directory given as the path (O_TMPFILE),
                   // write only: it vanishes with its last descriptor unless linked (a save's
                   // data, which a killed process must not leave behind)
};

// What O_DIRECT needs on this file, from statx(STATX_DIOALIGN) where the kernel reports it.
struct DirectIoInfo {
  bool supported = false;
  std::uint32_t memory_alignment = 0;  // buffer address alignment
  std::uint32_t offset_alignment = 0;  // file offset and length alignment
  // The file system's block size (st_blksize). A direct write that is aligned to the device's
  // logical block (offset_alignment, often 512) but not to this block is legal, yet ext4 and XFS
  // serialise it: exclusive inode lock and a wait for every direct I/O in flight. Writers align
  // to this instead.
  std::uint32_t block_size = 0;
  std::string reason;                  // why not supported (e.g. "tmpfs refuses O_DIRECT: EINVAL")
};

// Which file a descriptor refers to: the same (device, inode) is the same file, whatever its name
// is now. A file replaced by rename(2) has another inode.
struct FileIdentity {
  std::uint64_t device = 0, inode = 0;
  bool operator==(const FileIdentity&) const = default;
};

class File {
 public:
  File() = default;
  // Throws Error (op "open") naming the path and the system's message. `with_direct_io = false`
  // skips the O_DIRECT descriptor: every transfer then goes through the page cache.
  static File open(const std::string& path, OpenMode mode, bool with_direct_io = true);
  // The same, for `name` relative to the directory open as `dir_fd` (openat(2); AT_FDCWD: the
  // working directory): a checkpoint's shards are opened from the directory it was opened in, even
  // if another directory takes its name meanwhile. `path` names the file in errors.
  static File open_at(int dir_fd, const std::string& name, const std::string& path, OpenMode mode, bool with_direct_io = true);
  // Takes over `fd`, open for reading (a memfd, a descriptor received from another process), with
  // no O_DIRECT descriptor; `path` names it in errors. Throws Error (closing `fd`) when fstat fails
  // or it is not a regular file.
  static File adopt(int fd, std::string path);
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const noexcept { return path_; }
  OpenMode mode() const noexcept { return mode_; }
  int fd() const noexcept { return fd_; }
  int direct_fd() const noexcept { return direct_fd_; }  // -1 when O_DIRECT is unavailable
  const DirectIoInfo& direct_io() const noexcept { return direct_; }
  const FileIdentity& identity() const noexcept { return identity_; }
  bool readable() const noexcept { return mode_ == OpenMode::read || mode_ == OpenMode::read_write; }
  bool writable() const noexcept { return mode_ != OpenMode::read; }

  std::uint64_t size() const;        // current size (fstat); throws Error
  // The size fstat gave at open (0 for a block device). Engines check a read against it and ask
  // size() only for a read beyond it; a file that shrank later ends the read early, which the
  // engines report as such.
  std::uint64_t size_at_open() const noexcept { return size_at_open_; }
  void sync() const;                 // fsync; an error is final and thrown, never retried
  // Reads into `data` from `offset` through the page cache until `data` is full or the file
  // ends; returns the bytes read. Short reads are resumed, EINTR and (a bounded number of) EAGAIN
  // retried; throws Error naming the path and the offset that failed.
  std::size_t read_at(std::span<std::byte> data, std::uint64_t offset) const;
  void truncate(std::uint64_t size) const;

 private:
  void close() noexcept;
  std::string path_;
  OpenMode mode_ = OpenMode::read;
  int fd_ = -1;
  int direct_fd_ = -1;
  DirectIoInfo direct_{};
  FileIdentity identity_{};
  std::uint64_t size_at_open_ = 0;
};

// The file system type of a path ("ext4", "tmpfs", ...), from statfs; "unknown" when unmapped.
std::string file_system_type(const std::string& path);

}  // namespace hbmio
