// A save's commit, through the FileSystem seam (hbmio/file_system.hpp): the new file beside the
// target, unnamed or under a locked temporary name (PendingFile); fsync; one atomic rename over the
// target; fsync of the directory. A crash at any point leaves either the old file or the new one
// under the final name, never a mix (rename is atomic; the data is durable before it). Shared by
// the persist step of every save (persist.cpp) and by the rewrite that adds checksums (save.cpp).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <string>

#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/file_system.hpp"

namespace hbmio::detail {

// The file system a save makes its file operations through (SaveOptions::file_system).
FileSystem& files_of(const SaveOptions& options);

// A hidden temporary name beside `target`, for its new file or directory: recognisable for
// clean-up after a crash (remove_stale_temporaries), and random.
std::filesystem::path temp_name(const std::filesystem::path& target, std::random_device& random);

// A descriptor with an exclusive flock(2): on a save's temporary file or directory, so a second
// save of the same name, from this process or another, sees the lock and leaves that temporary
// alone (the lock dies with the process, so a crashed save's temporary is unlocked and is removed
// by the next save); on a file being rewritten in place (add_checksums), so that two rewrites and
// a save of the same file take turns.
class FileLock {
 public:
  FileLock() = default;
  // Takes a lock on a descriptor that nobody else can have locked (a file just made).
  explicit FileLock(int fd);
  // Waits for the lock on the file open as `fd` (a descriptor of its own is made). With `cancel`,
  // looks every 10 ms and gives up (an unlocked FileLock) once it is set.
  static FileLock wait_for(int fd, const std::atomic<bool>* cancel = nullptr);
  bool locked() const noexcept { return locked_; }
  ~FileLock();
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;

 private:
  FileLock(int fd, int /*no lock yet*/);
  int fd_ = -1;
  bool locked_ = false;
};

// Removes the temporaries of earlier saves of `target` that no running save holds. (Where the file
// system has no unnamed files, one window remains: a save that has created its temporary but not
// yet locked it, a few microseconds. A removal there makes that save fail at its rename, with the
// old checkpoint intact.)
void remove_stale_temporaries(FileSystem& files, const std::filesystem::path& target);

// The name a save replaces. A symbolic link there is followed, so that the link stays and the file
// it names is replaced (the Hugging Face cache's snapshot entries are links to blobs); a rename
// over the link itself would swap the link for a copy. Only a regular file is ever replaced: a
// device node, FIFO or socket at the name is refused (a save run as root turned /dev/null into a
// regular file), and so is a directory where a file is saved (`directory` false) or anything but
// a directory where a sharded checkpoint is (`directory` true).
std::filesystem::path final_target(const std::string& path, bool directory, const ErrorContext& context);
// final_target without its checks of what is there: the absolute path with "dir/" and "dir/." as
// "dir" and a symbolic link at the end followed (throws ELOOP past 40 links, or readlink's error).
std::filesystem::path followed_target(const std::string& path, const ErrorContext& context);
// The key of "one save of a path at a time" for a final_target: its directory with every symbolic
// link and "." or ".." resolved, and its name, so that "x", "./x" and "link/x" (link -> .) are one.
std::string save_key(const std::filesystem::path& target);

// Checked before any byte is written, so that the error names what the user gave (and its
// directory), not a temporary name, and comes at once rather than after the data.
void check_directory_of(const std::filesystem::path& target, const ErrorContext& context);

// A save stops at its safe points, before anything is published, once `cancel` reads true.
void check_cancel(const std::atomic<bool>* cancel, const ErrorContext& context);

// The new file takes the mode, owner and group of the one it replaces (SaveOptions::keep_attributes).
void take_attributes(const std::filesystem::path& from, int fd, const ErrorContext& context);

// The directory entry made by rename is durable only once the directory itself is fsynced
// (fsync(2); PostgreSQL's durable_rename and RocksDB #10573 lost files without it).
void sync_directory(FileSystem& files, const std::filesystem::path& dir, const std::string& target);

// The fsync of the directory after the rename: the save has published by then, so a failure here
// is not "nothing happened". It says what is true: the new file is in place, and whether its name
// survives a power loss is unknown. `kept`: where the previous checkpoint still is (a sharded
// save keeps it then: if the rename were lost, the name would lead back to it).
void sync_published(FileSystem& files, const std::filesystem::path& dir, const std::string& target,
                    const std::filesystem::path& kept = {});

// The file a save replaces, held (O_PATH: no read permission needed, never blocks on a FIFO)
// across the rename so that freeing its blocks, which takes the kernel seconds for a large file,
// happens at our close instead of inside rename(2); the close runs on a thread of the pool, so it
// need not delay the caller either. At process exit the kernel finishes the job itself.
class ReplacedFile {
 public:
  explicit ReplacedFile(const std::filesystem::path& target);
  ~ReplacedFile();
  ReplacedFile(const ReplacedFile&) = delete;
  ReplacedFile& operator=(const ReplacedFile&) = delete;

 private:
  int fd_;
};

// The new file of a save until it is published. Unnamed (O_TMPFILE) where the file system allows
// it: a save killed at any point, by SIGKILL or a power cut included, leaves nothing behind, and
// no other save can see it. Elsewhere a hidden temporary name beside the target, locked (see
// FileLock). publish() gives it the target's name in one atomic rename; until then the destructor
// removes whatever name it was given.
class PendingFile {
 public:
  // `shown` names the file in errors: the name the caller gave, not a temporary one.
  PendingFile(FileSystem& files, const std::filesystem::path& target, const std::string& shown);
  ~PendingFile();
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  File& file() noexcept { return file_; }

  // Gives the file (written and fsynced) the target's name, atomically. `lock_target`: wait for a
  // rewrite of the file there to finish first (add_checksums holds that lock while it rewrites the
  // file, and a save that published meanwhile would be overwritten by the rewrite's older data);
  // add_checksums, which holds that lock itself, passes false. A stop request (`cancel`) is heeded
  // while it waits, and once more before the rename: ECANCELED, the old file in place.
  void publish(const ErrorContext& context, bool lock_target, const std::atomic<bool>* cancel = nullptr);

 private:
  FileSystem& files_;
  std::filesystem::path target_;
  std::filesystem::path temp_;  // empty while the file has no name
  File file_;
  FileLock lock_;
  bool published_ = false;
};

}  // namespace hbmio::detail
