#include "checkpoint/commit.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/executor.hpp"

namespace hbmio::detail {
namespace fs = std::filesystem;

namespace {

// Temporary names are ".<final name>.hbmio-tmp-<pid>-<random>" beside the final file: the same
// file system (so rename is atomic), hidden, recognisable for clean-up after a crash, and, by the
// pid, for remove_own_save_temporaries. A final name too long to take the suffix within NAME_MAX
// (255 bytes) is shortened to its first 128 bytes and a hash of the whole name, which keeps the
// prefix the same for every save of that name.
std::string temp_prefix(const fs::path& target) {
  const std::string name = target.filename().string();
  if (name.size() <= 180) return "." + name + ".hbmio-tmp-";
  return fmt::format(".{}~{:016x}.hbmio-tmp-", name.substr(0, 128), XXH3_64bits(name.data(), name.size()));
}
std::string own_prefix(const fs::path& target) { return fmt::format("{}{}-", temp_prefix(target), ::getpid()); }

// Descriptors whose open file descriptions carry a save's flock (FileLock's, and the new file's own,
// which shares the lock's description). A child of fork() inherits them, and the lock with them,
// but not the threads that would close them: the lock would outlive the parent's save, and a save
// of the same path in the child (which waits for the lock of the file at the path before it
// publishes) would wait for itself forever. The child closes them. The mutex is held across fork()
// and every registered descriptor is closed under it, so none is missed or closed twice.
struct HeldDescriptors {
  std::mutex mutex;
  std::set<int> fds;
};
HeldDescriptors& held_descriptors() {
  static HeldDescriptors* held = [] {
    auto* made = new HeldDescriptors();  // never destroyed: saves may finish during static destruction
    ::pthread_atfork([] { held_descriptors().mutex.lock(); }, [] { held_descriptors().mutex.unlock(); },
                     [] {
                       HeldDescriptors& h = held_descriptors();
                       for (const int fd : h.fds) ::close(fd);  // the parent's saves': none is this thread's
                       h.fds.clear();
                       h.mutex.unlock();
                     });
    return made;
  }();
  return *held;
}
void hold_descriptor(int fd) {
  if (fd < 0) return;
  HeldDescriptors& h = held_descriptors();
  std::lock_guard lock(h.mutex);
  h.fds.insert(fd);
}
// Forgets `fd` and runs `close` (which closes it) under the same lock.
template <class Close>
void close_held_descriptor(int fd, Close close) {
  HeldDescriptors& h = held_descriptors();
  std::lock_guard lock(h.mutex);
  h.fds.erase(fd);
  close();
}

// What a mode is, for messages.
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

FileLock lock_current(const fs::path& target, const std::atomic<bool>* cancel) {
  const int fd = ::open(target.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return {};
  FileLock lock = FileLock::wait_for(fd, cancel);
  ::close(fd);
  return lock;
}

}  // namespace

fs::path temp_name(const fs::path& target, std::random_device& random) {
  return target.parent_path() / fmt::format("{}{:08x}{:08x}", own_prefix(target), random(), random());
}

FileLock::FileLock(int fd) : fd_(fd) {
  hold_descriptor(fd_);
  locked_ = fd_ >= 0 && ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
}

FileLock FileLock::wait_for(int fd, const std::atomic<bool>* cancel) {
  FileLock lock(::fcntl(fd, F_DUPFD_CLOEXEC, 0), 0);
  if (lock.fd_ < 0) return lock;
  if (cancel == nullptr) {
    int r;
    while ((r = ::flock(lock.fd_, LOCK_EX)) != 0 && errno == EINTR) {}
    lock.locked_ = r == 0;
    return lock;
  }
  // A holder may keep the lock for long (another process's rewrite, or anything that flocks the
  // file): a stop request must not wait for it.
  while (!cancel->load()) {
    if (::flock(lock.fd_, LOCK_EX | LOCK_NB) == 0) {
      lock.locked_ = true;
      return lock;
    }
    if (errno != EWOULDBLOCK && errno != EINTR) return lock;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return lock;
}

FileLock::~FileLock() {
  if (fd_ >= 0) close_held_descriptor(fd_, [this] { ::close(fd_); });
}

FileLock::FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)), locked_(std::exchange(other.locked_, false)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  std::swap(fd_, other.fd_);
  std::swap(locked_, other.locked_);
  return *this;
}

FileLock::FileLock(int fd, int /*no lock yet*/) : fd_(fd) { hold_descriptor(fd_); }

void remove_stale_temporaries(FileSystem& files, const fs::path& target) {
  const std::string prefix = temp_prefix(target);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(target.parent_path(), ec)) {
    if (!entry.path().filename().string().starts_with(prefix)) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno != ELOOP) continue;  // gone, or not ours to judge
    const bool in_use = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (!in_use) files.remove_all(entry.path().string());  // (a symbolic link there is removed, not followed)
    if (fd >= 0) ::close(fd);
  }
}

std::string save_key(const fs::path& target) {
  std::error_code ec;
  const fs::path directory = fs::weakly_canonical(target.parent_path(), ec);
  return ((ec ? target.parent_path().lexically_normal() : directory) / target.filename()).string();
}

fs::path followed_target(const std::string& path, const ErrorContext& context) {
  fs::path p = fs::absolute(path);
  // "out/", "out/." and "." name the directory itself: its parent is where the temporary goes
  // (the parent of "out/" is "out", which would build the new directory inside the old one).
  while ((!p.has_filename() || p.filename() == ".") && p != p.root_path()) p = p.parent_path();
  if (p.filename() == "..") p = fs::weakly_canonical(p);
  std::error_code ec;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    if (hops == 40) throw Error(errno_code(ELOOP), context, "too many levels of symbolic links");
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) throw Error(ec, {.op = context.op, .path = p.string()}, "readlink");
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  return p;
}

fs::path final_target(const std::string& path, bool directory, const ErrorContext& context) {
  const fs::path p = followed_target(path, context);
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) return p;  // nothing there yet
  if (directory && !S_ISDIR(st.st_mode))
    throw Error(errno_code(ENOTDIR), context,
                S_ISREG(st.st_mode) ? std::string("a sharded checkpoint is saved into a directory, and this is a file")
                                    : fmt::format("{} is {}: a sharded checkpoint is saved into a directory", p.string(), kind_of(st.st_mode)));
  if (!directory && S_ISDIR(st.st_mode))
    throw Error(errno_code(EISDIR), context, "a directory is there, not a file: a sharded checkpoint is saved with a maximum shard size");
  if (!directory && !S_ISREG(st.st_mode))
    throw Error(errno_code(EINVAL), context,
                fmt::format("{} is {}, not a regular file: a save replaces only regular files", p.string(), kind_of(st.st_mode)));
  return p;
}

void check_directory_of(const fs::path& target, const ErrorContext& context) {
  const fs::path dir = target.parent_path();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw Error(errno_code(errno), context, fmt::format("its directory {}", dir.string()));
  if (!S_ISDIR(st.st_mode)) throw Error(errno_code(ENOTDIR), context, fmt::format("{} is not a directory", dir.string()));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error(errno_code(errno), context, fmt::format("cannot create files in its directory {}", dir.string()));
}

FileSystem& files_of(const SaveOptions& options) { return options.file_system ? *options.file_system : *FileSystem::posix(); }

void check_cancel(const std::atomic<bool>* cancel, const ErrorContext& context) {
  if (cancel != nullptr && cancel->load(std::memory_order_relaxed))
    throw Error(errno_code(ECANCELED), context, "stopped on request before anything was published: the path keeps what it held");
}

// Owner first: chown clears the set-user-ID bits that chmod then restores. Not permitted to chown
// (the file was someone else's): the file is the caller's, with the old mode.
void take_attributes(const fs::path& from, int fd, const ErrorContext& context) {
  struct stat old {};
  if (::stat(from.c_str(), &old) != 0) return;  // nothing replaced
  if ((old.st_uid != ::geteuid() || old.st_gid != ::getegid()) && ::fchown(fd, old.st_uid, old.st_gid) != 0 && errno != EPERM)
    throw Error(errno_code(errno), context, "fchown of the temporary file to the replaced file's owner");
  if (::fchmod(fd, old.st_mode & 07777) != 0) throw Error(errno_code(errno), context, "fchmod of the temporary file to the replaced file's mode");
}

void sync_directory(FileSystem& files, const fs::path& dir, const std::string& target) {
  files.sync_directory(dir.string(), {.op = "save", .path = target});
}

void sync_published(FileSystem& files, const fs::path& dir, const std::string& target, const fs::path& kept) {
  try {
    sync_directory(files, dir, target);
  } catch (const Error& e) {
    throw Error(e.code(), {.op = "make the save durable", .path = target},
                fmt::format("the new {} is in place, but the fsync of its directory failed ({}), so whether it "
                            "survives a power loss is unknown{}",
                            kept.empty() ? "file" : "checkpoint", e.detail(),
                            kept.empty() ? std::string()
                                         : fmt::format("; the previous checkpoint is kept at {} until the next save", kept.string())));
  }
}

ReplacedFile::ReplacedFile(const fs::path& target) : fd_(::open(target.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC)) {}

ReplacedFile::~ReplacedFile() {
  if (fd_ < 0) return;
  try {
    Executor::shared().post([fd = fd_] { ::close(fd); });
  } catch (...) {  // no thread to be had: close here, the caller waits a little longer
    ::close(fd_);
  }
}

PendingFile::PendingFile(FileSystem& files, const fs::path& target, const std::string& shown) : files_(files), target_(target) {
  try {
    file_ = files_.open(target.parent_path().string(), shown, OpenMode::create_unnamed, true);
  } catch (const Error& e) {
    // No O_TMPFILE on this file system (EOPNOTSUPP; EISDIR or EINVAL from older kernels and
    // some FUSE file systems): a named temporary instead.
    const int err = e.code().value();
    if (e.code().category() != std::generic_category() || (err != EOPNOTSUPP && err != EISDIR && err != EINVAL)) throw;
    std::random_device random;
    temp_ = temp_name(target, random);
    file_ = files_.open(temp_.string(), shown, OpenMode::create_new, true);
  }
  lock_ = FileLock(::fcntl(file_.fd(), F_DUPFD_CLOEXEC, 0));  // held past the file's close, to the rename
  hold_descriptor(file_.fd());  // it shares the lock's description (see HeldDescriptors)
}

PendingFile::~PendingFile() {
  const int fd = file_.fd();
  if (fd >= 0) close_held_descriptor(fd, [this] { file_ = File(); });
  if (!published_ && !temp_.empty()) files_.remove_all(temp_.string());
}

void PendingFile::publish(const ErrorContext& context, bool lock_target, const std::atomic<bool>* cancel) {
  if (temp_.empty()) {
    // A name for the unnamed file, beside the target.
    std::random_device random;
    const fs::path name = temp_name(target_, random);
    if (const int err = files_.link(file_, name.string()))
      throw Error(errno_code(err), context, fmt::format("linkat of the new file to {}", name.string()));
    temp_ = name;
  }
  const FileLock held = lock_target ? lock_current(target_, cancel) : FileLock{};
  if (cancel != nullptr && cancel->load())
    throw Error(errno_code(ECANCELED), context, "stopped on request before the rename: the old file is in place");
  if (const int err = files_.rename(temp_.string(), target_.string()))
    throw Error(errno_code(err), context, "rename of the new file over the old");
  published_ = true;
}

}  // namespace hbmio::detail
