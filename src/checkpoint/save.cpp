// Saving checkpoints crash-safely: temporary file in the target directory, fsync, rename,
// fsync of the directory. A crash at any point leaves either the old file or the new one under
// the final name, never a mix (rename is atomic; the data is durable before it).
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "checkpoint/integrity.hpp"
#include "checkpoint/staging.hpp"
#include "core/error_boundary.hpp"
#include "core/positional_io.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file_system.hpp"
#include "io/engine_internal.hpp"

namespace hbmio {
namespace fs = std::filesystem;
namespace st = safetensors;

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
fs::path temp_name(const fs::path& target, std::random_device& random) {
  return target.parent_path() / fmt::format("{}{:08x}{:08x}", own_prefix(target), random(), random());
}

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

// A descriptor with an exclusive flock(2): on a save's temporary file or directory, so a second
// save of the same name, from this process or another, sees the lock and leaves that temporary
// alone (the lock dies with the process, so a crashed save's temporary is unlocked and is removed
// by the next save); on a file being rewritten in place (add_checksums), so that two rewrites and
// a save of the same file take turns.
class FileLock {
 public:
  FileLock() = default;
  // Takes a lock on a descriptor that nobody else can have locked (a file just made).
  explicit FileLock(int fd) : fd_(fd) {
    hold_descriptor(fd_);
    if (fd_ >= 0) (void)::flock(fd_, LOCK_EX | LOCK_NB);
  }
  // Waits for the lock on the file open as `fd` (a descriptor of its own is made).
  static FileLock wait_for(int fd) {
    FileLock lock(::fcntl(fd, F_DUPFD_CLOEXEC, 0), 0);
    while (lock.fd_ >= 0 && ::flock(lock.fd_, LOCK_EX) != 0 && errno == EINTR) {}
    return lock;
  }
  ~FileLock() {
    if (fd_ >= 0) close_held_descriptor(fd_, [this] { ::close(fd_); });
  }
  FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileLock& operator=(FileLock&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }

 private:
  FileLock(int fd, int /*no lock yet*/) : fd_(fd) { hold_descriptor(fd_); }
  int fd_ = -1;
};

// Removes the temporaries of earlier saves of `target` that no running save holds. (Where the file
// system has no unnamed files, one window remains: a save that has created its temporary but not
// yet locked it, a few microseconds. A removal there makes that save fail at its rename, with the
// old checkpoint intact.)
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

// What a mode is, for messages.
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The name a save replaces. A symbolic link there is followed, so that the link stays and the file
// it names is replaced (the Hugging Face cache's snapshot entries are links to blobs); a rename
// over the link itself would swap the link for a copy. Only a regular file is ever replaced: a
// device node, FIFO or socket at the name is refused (a save run as root turned /dev/null into a
// regular file), and so is a directory where a file is saved (`directory` false) or anything but
// a directory where a sharded checkpoint is (`directory` true).
fs::path final_target(const std::string& path, bool directory, const ErrorContext& context) {
  fs::path p = fs::absolute(path);
  std::error_code ec;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    if (hops == 40) throw Error(errno_code(ELOOP), context, "too many levels of symbolic links");
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) throw Error(ec, {.op = context.op, .path = p.string()}, "readlink");
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
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

// Checked before any byte is written, so that the error names what the user gave (and its
// directory), not a temporary name, and comes at once rather than after the data.
void check_directory_of(const fs::path& target, const ErrorContext& context) {
  const fs::path dir = target.parent_path();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw Error(errno_code(errno), context, fmt::format("its directory {}", dir.string()));
  if (!S_ISDIR(st.st_mode)) throw Error(errno_code(ENOTDIR), context, fmt::format("{} is not a directory", dir.string()));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error(errno_code(errno), context, fmt::format("cannot create files in its directory {}", dir.string()));
}

// The file system a save makes its file operations through (SaveOptions::file_system).
FileSystem& files_of(const SaveOptions& options) { return options.file_system ? *options.file_system : *FileSystem::posix(); }

// A save stops at its safe points, before anything is published, once `cancel` reads true.
void check_cancel(const std::atomic<bool>* cancel, const ErrorContext& context) {
  if (cancel != nullptr && cancel->load(std::memory_order_relaxed))
    throw Error(errno_code(ECANCELED), context, "stopped on request before anything was published: the path keeps what it held");
}

// The new file takes the mode, owner and group of the one it replaces (SaveOptions::keep_attributes).
// Owner first: chown clears the set-user-ID bits that chmod then restores. Not permitted to chown
// (the file was someone else's): the file is the caller's, with the old mode.
void take_attributes(const fs::path& from, int fd, const ErrorContext& context) {
  struct stat old {};
  if (::stat(from.c_str(), &old) != 0) return;  // nothing replaced
  if ((old.st_uid != ::geteuid() || old.st_gid != ::getegid()) && ::fchown(fd, old.st_uid, old.st_gid) != 0 && errno != EPERM)
    throw Error(errno_code(errno), context, "fchown of the temporary file to the replaced file's owner");
  if (::fchmod(fd, old.st_mode & 07777) != 0) throw Error(errno_code(errno), context, "fchmod of the temporary file to the replaced file's mode");
}

// The directory entry made by rename is durable only once the directory itself is fsynced
// (fsync(2); PostgreSQL's durable_rename and RocksDB #10573 lost files without it).
void sync_directory(FileSystem& files, const fs::path& dir, const std::string& target) {
  files.sync_directory(dir.string(), {.op = "save", .path = target});
}

// The fsync of the directory after the rename: the save has published by then, so a failure here
// is not "nothing happened". It says what is true: the new file is in place, and whether its name
// survives a power loss is unknown. `kept`: where the previous checkpoint still is (a sharded
// save keeps it then: if the rename were lost, the name would lead back to it).
void sync_published(FileSystem& files, const fs::path& dir, const std::string& target, const fs::path& kept = {}) {
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

// The file a save replaces, held (O_PATH: no read permission needed, never blocks on a FIFO)
// across the rename so that freeing its blocks, which takes the kernel seconds for a large file,
// happens at our close instead of inside rename(2); the close runs on a thread of its own, so it
// need not delay the caller either. At process exit the kernel finishes the job itself.
class ReplacedFile {
 public:
  explicit ReplacedFile(const fs::path& target) : fd_(::open(target.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC)) {}
  ~ReplacedFile() {
    if (fd_ < 0) return;
    try {
      std::thread([fd = fd_] { ::close(fd); }).detach();
    } catch (...) {  // no thread to be had: close here, the caller waits a little longer
      ::close(fd_);
    }
  }
  ReplacedFile(const ReplacedFile&) = delete;
  ReplacedFile& operator=(const ReplacedFile&) = delete;

 private:
  int fd_;
};

}  // namespace

namespace detail {

std::uint64_t expected_size(const TensorToSave& t) {
  std::uint64_t elements = 1;
  for (std::uint64_t d : t.shape)
    if (__builtin_mul_overflow(elements, d, &elements))
      throw Error(errno_code(EOVERFLOW), {.op = "save"}, fmt::format("tensor '{}': shape overflows", t.name));
  std::uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, std::uint64_t{st::bits_per_element(t.dtype)}, &bits))
    throw Error(errno_code(EOVERFLOW), {.op = "save"}, fmt::format("tensor '{}': shape overflows", t.name));
  return (bits + 7) / 8;
}

// Names (none empty, none "__metadata__", none twice) and sizes (each span the size its dtype and
// shape call for), checked before anything touches the disk.
void check_tensors(const std::vector<TensorToSave>& tensors, const ErrorContext& context) {
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    if (t.name.empty()) throw Error(errno_code(EINVAL), context, "a tensor has an empty name");
    if (t.name == "__metadata__") throw Error(errno_code(EINVAL), context, "'__metadata__' cannot name a tensor");
    if (!names.insert(t.name).second) throw Error(errno_code(EINVAL), context, fmt::format("tensor '{}' given twice", t.name));
    if (expected_size(t) != t.data.size)
      throw Error(errno_code(EINVAL), context,
                  fmt::format("tensor '{}': {} bytes in memory, but {} {} needs {}", t.name, t.data.size,
                              st::to_string(t.dtype), fmt::join(t.shape, "x"), expected_size(t)));
  }
}

}  // namespace detail

namespace {

using detail::check_tensors;

// Waits for, then holds, the lock of the file now at `target` (if any): add_checksums holds it
// while it rewrites that file, and a save that published meanwhile would be overwritten by the
// rewrite's older data. A file the caller may not read is not locked (nor rewritten by others).
FileLock lock_current(const fs::path& target) {
  const int fd = ::open(target.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return {};
  FileLock lock = FileLock::wait_for(fd);
  ::close(fd);
  return lock;
}

// The new file of a save until it is published. Unnamed (O_TMPFILE) where the file system allows
// it: a save killed at any point, by SIGKILL or a power cut included, leaves nothing behind, and
// no other save can see it. Elsewhere a hidden temporary name beside the target, locked (see
// FileLock). publish() gives it the target's name in one atomic rename; until then the destructor
// removes whatever name it was given.
class PendingFile {
 public:
  // `shown` names the file in errors: the name the caller gave, not a temporary one.
  PendingFile(FileSystem& files, const fs::path& target, const std::string& shown) : files_(files), target_(target) {
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
  ~PendingFile() {
    const int fd = file_.fd();
    if (fd >= 0) close_held_descriptor(fd, [this] { file_ = File(); });
    if (!published_ && !temp_.empty()) files_.remove_all(temp_.string());
  }
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  File& file() noexcept { return file_; }

  // Gives the file (written and fsynced) the target's name, atomically. `lock_target`: wait for a
  // rewrite of the file there to finish first (see lock_current); add_checksums, which holds that
  // lock itself, passes false.
  void publish(const ErrorContext& context, bool lock_target) {
    if (temp_.empty()) {
      // A name for the unnamed file, beside the target.
      std::random_device random;
      const fs::path name = temp_name(target_, random);
      if (const int err = files_.link(file_, name.string()))
        throw Error(errno_code(err), context, fmt::format("linkat of the new file to {}", name.string()));
      temp_ = name;
    }
    const FileLock held = lock_target ? lock_current(target_) : FileLock{};
    if (const int err = files_.rename(temp_.string(), target_.string()))
      throw Error(errno_code(err), context, "rename of the new file over the old");
    published_ = true;
  }

 private:
  FileSystem& files_;
  fs::path target_;
  fs::path temp_;  // empty while the file has no name
  File file_;
  FileLock lock_;
  bool published_ = false;
};

}  // namespace

namespace {
// `staged`: where the tensors' bytes come from when not from their own memory (a background save's
// staging, save_checkpoint_async); null for save_checkpoint.
Stats save_sharded(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options,
                   detail::StagedStream* staged);
Stats save_file(const fs::path& target, const std::string& shown, const std::vector<TensorToSave>& tensors,
                const SaveOptions& options, bool top_level, detail::StagedStream* staged);
}

Stats save_checkpoint(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  return detail::errors_as_hbmio({.op = "save", .path = path}, [&] {
    if (is_remote_url(path)) return detail::save_remote(path, tensors, options);
    // A background save of the same path still in flight goes first: otherwise the older state
    // could publish after this newer one.
    detail::wait_for_background_save(final_target(path, options.max_shard_size > 0, {.op = "save", .path = path}).string());
    return detail::save_now(path, tensors, options, nullptr);
  });
}

namespace detail {

Stats save_now(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options, StagedStream* staged) {
  return errors_as_hbmio({.op = "save", .path = path}, [&] {
    if (options.max_shard_size > 0) return save_sharded(path, tensors, options, staged);
    return save_file(final_target(path, false, {.op = "save", .path = path}), path, tensors, options, true, staged);
  });
}

std::string check_save(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  return errors_as_hbmio({.op = "save", .path = path}, [&] {
    const ErrorContext context{.op = "save", .path = path};
    if (is_remote_url(path))
      throw Error(errno_code(ENOTSUP), context,
                  "background saves write local paths; save to a URL with a blocking save (save_checkpoint, "
                  "save_file(..., blocking=True)), or save locally in the background and upload the result");
    check_tensors(tensors, context);
    const fs::path target = final_target(path, options.max_shard_size > 0, context);
    check_directory_of(target, context);
    return target.string();
  });
}

std::map<std::string, std::string> metadata_to_save(const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  std::map<std::string, std::string> metadata = options.metadata;
  for (auto it = metadata.begin(); it != metadata.end();)  // stale checksums would lie
    it = it->first.starts_with(kChecksumPrefix) || it->first == kChecksumAlgorithmKey || it->first == kHeaderChecksumKey
             ? metadata.erase(it)
             : std::next(it);
  if (options.checksums) {
    metadata[kChecksumAlgorithmKey] = kChecksumAlgorithm;
    metadata[kHeaderChecksumKey] = to_hex(0);  // sealed once the tensors' are in
    for (const auto& t : tensors) metadata[kChecksumPrefix + t.name] = to_hex(0);
  }
  return metadata;
}

std::string sealed_header(std::vector<st::TensorInfo> infos, std::map<std::string, std::string> metadata,
                          const std::vector<TensorToSave>& tensors, const std::vector<std::uint64_t>& checksums,
                          std::uint64_t placeholder_size, const ErrorContext& context) {
  for (std::size_t i = 0; i < tensors.size(); ++i) metadata[kChecksumPrefix + tensors[i].name] = to_hex(checksums[i]);
  std::string header = st::serialize_header(infos, metadata);
  seal_header(header);
  // The placeholders fixed where the data went: the sealed header must keep their size.
  if (header.size() != placeholder_size)
    throw Error(errno_code(EPROTO), context,
                fmt::format("header changed size with its checksums ({} -> {} bytes)", placeholder_size, header.size()));
  return header;
}

ShardPlan plan_shards(const std::vector<TensorToSave>& tensors, std::uint64_t max_shard_size) {
  // Greedy shards in the reference writer's tensor order.
  std::vector<st::TensorInfo> order;
  for (const auto& t : tensors) order.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(order);
  std::map<std::string_view, const TensorToSave*> by_name;
  for (const auto& t : tensors) by_name.emplace(t.name, &t);
  ShardPlan plan;
  plan.shards.resize(1);
  std::uint64_t shard_bytes = 0;
  for (const auto& info : order) {
    if (shard_bytes > 0 && shard_bytes + info.size() > max_shard_size) {
      plan.shards.emplace_back();
      shard_bytes = 0;
    }
    plan.shards.back().push_back(*by_name.at(info.name));
    shard_bytes += info.size();
    plan.total_bytes += info.size();
  }
  for (std::size_t k = 0; k < plan.shards.size(); ++k)
    plan.names.push_back(fmt::format("model-{:05}-of-{:05}.safetensors", k + 1, plan.shards.size()));
  return plan;
}

std::vector<std::size_t> file_order(const std::vector<TensorToSave>& tensors) {
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(infos);
  std::map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  std::vector<std::size_t> order;
  for (const auto& info : infos) order.push_back(index.at(info.name));
  return order;
}

}  // namespace detail

namespace {

// Bytes taken from the staging per round: enough to keep every worker of the engine busy, while
// the snapshot refills the pool behind it.
constexpr std::uint64_t kStagedRound = std::uint64_t{256} << 20;

// The tensors' bytes from a background save's staging: pieces arrive in file order (the snapshot
// walks the tensors so) and are written a round at a time through the engine, each round hashed
// beside its writes (XXH3's streaming state gives the digest of the whole tensor). The round's
// pieces, and with them their staging blocks, are dropped once written and hashed. Returns each
// tensor's checksum in the order of `tensors` (none without checksums).
std::vector<std::uint64_t> write_staged(detail::StagedStream& stream, Engine& engine, File& file, std::uint64_t data_start,
                                        const std::vector<TensorToSave>& tensors, const std::vector<st::TensorInfo>& infos,
                                        const SaveOptions& options, Stats& total, double& hashing, const ErrorContext& context) {
  struct Place {
    std::size_t index = 0;
    std::uint64_t file_offset = 0;
    std::uint64_t left = 0;  // bytes not yet staged
  };
  std::map<std::string_view, Place> place;
  std::uint64_t left = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    place[tensors[i].name] = {.index = i, .left = tensors[i].data.size};
    left += tensors[i].data.size;
  }
  for (const auto& info : infos) place[info.name].file_offset = data_start + info.begin;
  using State = std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)>;
  std::vector<State> states;
  for (std::size_t i = 0; options.checksums && i < tensors.size(); ++i) {
    states.emplace_back(XXH3_createState(), &XXH3_freeState);
    if (!states.back() || XXH3_64bits_reset(states.back().get()) != XXH_OK) throw Error(errno_code(ENOMEM), context, "XXH3_createState");
  }
  while (left > 0) {
    // At most what this file still needs: the queue holds this file's pieces first, then the next
    // file's (a sharded save), and a prefix of `left` bytes is this file's alone.
    const std::vector<detail::StagedPiece> round = stream.take(std::min(kStagedRound, left));
    if (round.empty())
      throw Error(errno_code(ECANCELED), context,
                  stream.abandoned() ? "the snapshot stopped before every tensor was copied; nothing was published"
                                     : "the staging ended before every tensor arrived (an internal error); nothing was published");
    std::vector<IoRequest> writes;
    std::vector<XXH3_state_t*> hash_into;
    for (const auto& piece : round) {
      const auto it = place.find(piece.tensor);
      if (it == place.end() || piece.memory.size > it->second.left)
        throw Error(errno_code(EPROTO), context, fmt::format("a staged piece of '{}' that this file does not expect (an internal error)", piece.tensor));
      writes.push_back({.op = IoOp::write, .file = &file, .offset = it->second.file_offset + piece.offset, .memory = piece.memory,
                        .progress = options.progress, .cancel = options.cancel});
      if (options.checksums) hash_into.push_back(states[it->second.index].get());
      it->second.left -= piece.memory.size;
      left -= piece.memory.size;
    }
    std::future<void> hashed;  // its destructor waits on every path: no hashing of a dropped block
    if (options.checksums)
      hashed = std::async(std::launch::async, [&round, &hash_into, &hashing] {
        const auto start = std::chrono::steady_clock::now();
        for (std::size_t i = 0; i < round.size(); ++i) XXH3_64bits_update(hash_into[i], round[i].memory.data, round[i].memory.size);
        hashing += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
    total.add_part(engine.submit_batch(writes));
    if (hashed.valid()) hashed.get();
  }
  std::vector<std::uint64_t> sums;
  for (const auto& state : states) sums.push_back(XXH3_64bits_digest(state.get()));
  return sums;
}

// One safetensors file at `target` (a regular file's path or nothing, links resolved), named
// `shown` in errors and notes.
Stats save_file(const fs::path& target, const std::string& shown, const std::vector<TensorToSave>& tensors,
                const SaveOptions& options, bool top_level, detail::StagedStream* staged) {
  // top_level: `target` is the caller's path, not a shard in a sharded save's temporary directory.
  // Only there does the rename wait for a rewrite of the file in place, and only there is it a
  // publication (a failure after it is reported as such).
  detail::TransferTimer timer;
  const ErrorContext context{.op = "save", .path = shown};

  // Check everything before touching the disk.
  check_tensors(tensors, context);
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(infos);

  // Checksums are computed while the tensors are written (both only read the tensors' memory),
  // and the header, which holds them, is written last.
  std::map<std::string, std::string> metadata = detail::metadata_to_save(tensors, options);
  std::vector<MemorySpan> spans;
  if (options.checksums)
    for (const auto& t : tensors) spans.push_back(t.data);
  std::string header = st::serialize_header(infos, metadata);

  check_directory_of(target, context);
  FileSystem& files = files_of(options);
  remove_stale_temporaries(files, target);
  check_cancel(options.cancel, context);
  const detail::EngineInUse chosen(options.engine, options.backend, options.engine_options,
                                   options.engine ? nullptr : files.make_engine(options.backend, options.engine_options));
  Engine* const engine = chosen.get();
  Stats total;
  std::optional<ReplacedFile> previous;  // released (in the background) when the save returns or fails
  // Where the time goes, for the Stats note: a save is its writes plus what makes them durable.
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const Clock::time_point started = Clock::now();
  double hashing = 0, data = 0, wait = 0, header_write = 0, fsync = 0;
  {
    PendingFile pending(files, target, shown);
    File& file = pending.file();
    std::vector<std::uint64_t> computed;  // each tensor's checksum, in the order of `tensors`
    if (staged != nullptr) {
      const Clock::time_point phase = Clock::now();
      computed = write_staged(*staged, *engine, file, header.size(), tensors, infos, options, total, hashing, context);
      data = seconds_since(phase);
    } else {
      // Hashing runs beside the writes; the future's destructor waits for it on every path, so
      // no hashing thread reads the tensors after a failed save returns.
      std::future<std::vector<std::uint64_t>> sums;
      if (options.checksums)
        sums = std::async(std::launch::async, [&spans, &hashing, &seconds_since] {
          const Clock::time_point start = Clock::now();
          // A quarter of the cores: hashing on all of them starved the writers' threads (saves
          // with checksums ran slower than without, though hashing took a small part of the
          // writes' time; bench/RESULTS.md, "Saves"). A quarter still finishes well within the
          // writes.
          auto result = detail::xxh3_of_each(spans, std::max(1u, std::thread::hardware_concurrency() / 4));
          hashing = seconds_since(start);
          return result;
        });
      // Every tensor in one batch, so the engine's workers write them all at once.
      std::vector<IoRequest> writes;
      std::map<std::string_view, MemorySpan> data_of;
      for (const auto& t : tensors) data_of.emplace(t.name, t.data);
      for (const auto& info : infos)
        writes.push_back({.op = IoOp::write, .file = &file, .offset = header.size() + info.begin, .memory = data_of.at(info.name),
                          .progress = options.progress, .cancel = options.cancel});
      Clock::time_point phase = Clock::now();
      total.add_part(engine->submit_batch(writes));
      data = seconds_since(phase);
      if (options.checksums) {
        phase = Clock::now();
        computed = sums.get();
        wait = seconds_since(phase);
      }
    }
    if (options.checksums) header = detail::sealed_header(infos, metadata, tensors, computed, header.size(), context);
    Buffer header_buffer = Buffer::allocate({MemoryKind::host}, header.size());
    std::memcpy(header_buffer.data(), header.data(), header.size());
    const IoRequest header_request{.op = IoOp::write, .file = &file, .offset = 0, .memory = header_buffer.span()};
    Clock::time_point phase = Clock::now();
    total.add_part(engine->submit_batch({&header_request, 1}));
    header_write = seconds_since(phase);
    if (options.keep_attributes) take_attributes(target, file.fd(), context);
    check_cancel(options.cancel, context);
    phase = Clock::now();
    files.sync(file, context);  // throws on failure: never retried, the old checkpoint stays
    fsync = seconds_since(phase);
    // The last point a stop request is heeded: from the rename on, the new file is the checkpoint.
    check_cancel(options.cancel, context);
    previous.emplace(target);
    pending.publish(context, top_level);
  }
  if (top_level) sync_published(files, target.parent_path(), shown);
  else sync_directory(files, target.parent_path(), shown);
  const double all = seconds_since(started);
  std::string engine_note = total.note;
  total.note = fmt::format("{} tensors, durable (fsync, rename, directory fsync){}; data writes {:.3f} s{}, header {:.3f} s, "
                           "fsync {:.3f} s, the rest (rename, directory fsync, set-up) {:.3f} s{}{}",
                           tensors.size(), options.checksums ? ", with XXH3-64 checksums" : "", data,
                           options.checksums ? fmt::format(" (hashing beside them {:.3f} s, then waited {:.3f} s)", hashing, wait) : "",
                           header_write, fsync, all - data - wait - header_write - fsync, engine_note.empty() ? "" : "; ", engine_note);
  timer.finish(total);
  return total;
}

}  // namespace

namespace {

bool is_checkpoint_file(const std::string& name) {
  return name == "model.safetensors" || name == "model.safetensors.index.json" ||
         (name.starts_with("model-") && name.ends_with(".safetensors"));
}

// Writes small bytes (the index) to a new file and makes them durable; `shown` names it in errors.
void write_durably(FileSystem& files, const fs::path& file, const std::string& shown, const std::string& bytes) {
  const ErrorContext context{.op = "save", .path = shown};
  File out = files.open(file.string(), shown, OpenMode::create_new, true);
  files.write(out, std::as_bytes(std::span(bytes)), 0, context);
  files.sync(out, context);
}

Stats save_sharded(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options,
                   detail::StagedStream* staged) {
  detail::TransferTimer timer;
  const ErrorContext context{.op = "save sharded checkpoint", .path = path};
  const fs::path target = final_target(path, true, context);

  const auto [shards, shard_names, total_bytes] = detail::plan_shards(tensors, options.max_shard_size);

  check_directory_of(target, context);
  FileSystem& files = files_of(options);
  remove_stale_temporaries(files, target);  // directories too
  check_cancel(options.cancel, context);
  std::random_device random;
  const fs::path temp = temp_name(target, random);
  Stats total;
  std::vector<std::string> dropped;  // checkpoint files of the old directory that the new one does not have
  try {
    // A name already there (even a symlink to a directory) is never built into: the random
    // suffix makes that a sign of interference, not a leftover (those were removed above).
    if (const int err = files.make_directory(temp.string()))
      throw Error(errno_code(err), context,
                  err == EEXIST ? fmt::format("temporary directory {} already exists", temp.string())
                                : fmt::format("mkdir of the temporary directory {}", temp.string()));
    const FileLock lock(::open(temp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    nlohmann::json weight_map = nlohmann::json::object();
    SaveOptions single = options;
    single.max_shard_size = 0;
    const detail::EngineInUse chosen(options.engine, options.backend, options.engine_options,
                                     options.engine ? nullptr : files.make_engine(options.backend, options.engine_options));
    single.engine = chosen.get();  // one engine writes every shard
    for (std::size_t k = 0; k < shards.size(); ++k) {
      // Errors name the shard where it will be (PATH/model-...), not inside the temporary directory.
      total.add_part(save_file(temp / shard_names[k], (fs::path(path) / shard_names[k]).string(), shards[k], single, false, staged));
      for (const auto& t : shards[k]) weight_map[t.name] = shard_names[k];
    }
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    write_durably(files, temp / "model.safetensors.index.json", (fs::path(path) / "model.safetensors.index.json").string(),
                  index.dump(2) + "\n");
    // Whatever else the directory holds (config.json, tokenizer files) comes along. The old
    // checkpoint's own files do not: a model.safetensors beside the new index would be loaded in
    // its place by loaders that look for it first, and a shard of another count is stale. They
    // are named in the result's note.
    if (fs::exists(target))
      for (const auto& entry : fs::directory_iterator(target)) {
        const std::string name = entry.path().filename().string();
        if (!is_checkpoint_file(name))
          fs::copy(entry.path(), temp / entry.path().filename(), fs::copy_options::recursive | fs::copy_options::create_hard_links);
        else if (name != "model.safetensors.index.json" && std::find(shard_names.begin(), shard_names.end(), name) == shard_names.end())
          dropped.push_back(name);
      }
    sync_directory(files, temp, path);
    // The last point a stop request is heeded: the swap below publishes the new checkpoint.
    check_cancel(options.cancel, context);
    if (fs::exists(target)) {
      // One atomic step: the new directory takes the name, the old one takes the temporary name.
      if (const int err = files.exchange(temp.string(), target.string()))
        throw Error(errno_code(err), context, "renameat2(RENAME_EXCHANGE) of the new directory");
    } else if (const int err = files.rename(temp.string(), target.string())) {
      throw Error(errno_code(err), context, "rename of the new directory");
    }
  } catch (...) {
    files.remove_all(temp.string());
    throw;
  }
  sync_published(files, target.parent_path(), path, temp);
  files.remove_all(temp.string());  // the old checkpoint, after the exchange
  std::sort(dropped.begin(), dropped.end());
  total.note = fmt::format("{} tensors in {} shard(s) + index, swapped in atomically{}", tensors.size(), shards.size(),
                           dropped.empty() ? ""
                                           : fmt::format("; the old checkpoint's {} (not part of the new one) went with it",
                                                         fmt::join(dropped, ", ")));
  timer.finish(total);
  return total;
}

}  // namespace

namespace {

// Reads exactly `n` bytes at `offset` of the file being rewritten; a file that ends early has
// been changed (truncated) by someone else since its header was read.
void read_source(int fd, std::byte* into, std::size_t n, std::uint64_t offset, std::uint64_t expected_size,
                 const ErrorContext& context) {
  const std::size_t got = detail::read_fully(fd, {into, n}, offset, {.op = context.op, .path = context.path});
  if (got < n) {
    struct stat st {};
    const std::uint64_t now = ::fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : offset + got;
    throw Error(errno_code(EIO), {.op = context.op, .path = context.path, .offset = offset + got},
                fmt::format("the file changed while being read: it now ends at byte {}, its header says {}; nothing "
                            "was rewritten",
                            now, expected_size));
  }
}

constexpr std::size_t kRewritePiece = std::size_t{8} << 20;

// XXH3-64 of each tensor of `file`, read in pieces through `fd` (memory use does not grow with
// the file: a rewrite of a file larger than memory works).
std::vector<std::uint64_t> hash_tensors(int fd, const CheckpointFile& file, const ErrorContext& context,
                                        const std::atomic<bool>* cancel) {
  const std::uint64_t size = file.header.data_offset + file.header.data_size;
  std::vector<std::byte> piece(kRewritePiece);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state) throw Error(errno_code(ENOMEM), context, "XXH3_createState");
  std::vector<std::uint64_t> sums;
  for (const auto& t : file.header.tensors) {
    XXH3_64bits_reset(state.get());
    for (std::uint64_t at = 0; at < t.size();) {
      check_cancel(cancel, context);
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), t.size() - at));
      read_source(fd, piece.data(), n, file.header.data_offset + t.begin + at, size, context);
      XXH3_64bits_update(state.get(), piece.data(), n);
      at += n;
    }
    sums.push_back(XXH3_64bits_digest(state.get()));
  }
  return sums;
}

// Rewrites one file with checksums: a new file (PendingFile) gets a header with the checksums and
// the data section copied piece by piece from `fd`, hashed on the way; then fsync, rename (the
// caller holds the lock on the old file, see add_checksums), directory fsync. The data section is
// copied as it is (the tensors keep their order and offsets), so only the header changes.
void rewrite_with_checksums(int fd, const CheckpointFile& file, const fs::path& target, const ErrorContext& context,
                            const std::atomic<bool>* cancel) {
  const st::Header& old = file.header;
  const std::uint64_t size = old.data_offset + old.data_size;
  std::vector<st::TensorInfo> infos = old.tensors;
  std::sort(infos.begin(), infos.end(), [](const st::TensorInfo& a, const st::TensorInfo& b) { return a.begin < b.begin; });
  std::map<std::string, std::string> metadata = old.metadata;
  for (auto it = metadata.begin(); it != metadata.end();)
    it = it->first.starts_with(kChecksumPrefix) || it->first == detail::kChecksumAlgorithmKey || it->first == detail::kHeaderChecksumKey
             ? metadata.erase(it)
             : std::next(it);
  metadata[detail::kChecksumAlgorithmKey] = detail::kChecksumAlgorithm;
  metadata[detail::kHeaderChecksumKey] = detail::to_hex(0);
  for (const auto& t : infos) metadata[kChecksumPrefix + t.name] = detail::to_hex(0);
  std::string header = st::serialize_header(infos, metadata);  // placeholders: the final size

  check_directory_of(target, context);
  FileSystem& files = *FileSystem::posix();
  remove_stale_temporaries(files, target);
  PendingFile pending(files, target, context.path);
  const int out = pending.file().fd();
  std::vector<std::byte> piece(kRewritePiece);
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (!state) throw Error(errno_code(ENOMEM), context, "XXH3_createState");
  const auto write_all = [&](const void* data, std::size_t n, std::uint64_t offset) {
    detail::write_fully(out, {static_cast<const std::byte*>(data), n}, offset, {.op = context.op, .path = context.path},
                        {.what = "write of the new file"});
  };
  for (const auto& t : infos) {
    XXH3_64bits_reset(state.get());
    for (std::uint64_t at = 0; at < t.size();) {
      check_cancel(cancel, context);
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), t.size() - at));
      read_source(fd, piece.data(), n, old.data_offset + t.begin + at, size, context);
      XXH3_64bits_update(state.get(), piece.data(), n);
      write_all(piece.data(), n, header.size() + t.begin + at);
      at += n;
    }
    metadata[kChecksumPrefix + t.name] = detail::to_hex(XXH3_64bits_digest(state.get()));
  }
  // A file that grew past what its header describes has been changed too.
  struct stat st {};
  if (::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) != size)
    throw Error(errno_code(EIO), context,
                fmt::format("the file changed while being read: {} bytes, its header says {}; nothing was rewritten", st.st_size, size));
  std::string final_header = st::serialize_header(infos, metadata);
  detail::seal_header(final_header);
  if (final_header.size() != header.size())
    throw Error(errno_code(EPROTO), context, "the header changed size with its checksums");
  write_all(final_header.data(), final_header.size(), 0);
  take_attributes(target, out, context);
  check_cancel(cancel, context);
  files.sync(pending.file(), context);
  check_cancel(cancel, context);
  pending.publish(context, /*lock_target=*/false);
  sync_published(files, target.parent_path(), context.path);
}

}  // namespace

namespace {
AddChecksumsResult add_checksums_unguarded(const std::string& path, bool force, const std::atomic<bool>* cancel) {
  // Each file on its own, crash-safe: after a crash every shard holds either its old bytes or its
  // bytes with checksums, and both load. The index does not change (it maps names to shards).
  AddChecksumsResult result;
  for (CheckpointFile file : open_checkpoint(path)) {
    const ErrorContext context{.op = "add checksums", .path = file.path};
    const fs::path target = final_target(file.path, false, context);
    // One rewrite of a file at a time, across processes: the lock of the file as opened. Another
    // rewrite may have replaced it while this one waited: then the file now there is the one to
    // judge (it most likely has its checksums already).
    std::shared_ptr<const File> handle = reopen(file);
    FileLock lock = FileLock::wait_for(handle->fd());
    for (int tries = 0;; ++tries) {
      struct stat now {};
      if (::stat(target.c_str(), &now) != 0) throw Error(errno_code(errno), context, "stat");
      if (FileIdentity{static_cast<std::uint64_t>(now.st_dev), static_cast<std::uint64_t>(now.st_ino)} == handle->identity()) break;
      if (tries == 8) throw Error(errno_code(ESTALE), context, "the file kept being replaced while waiting to rewrite it");
      handle = std::make_shared<const File>(File::open(target.string(), OpenMode::read, false));
      lock = FileLock::wait_for(handle->fd());
    }
    // The whole header of the file as it is now, under the lock: every tensor of the file is
    // rewritten, also one that a sharded index does not assign to it.
    file.header = st::read_header(handle->fd(), file.path);
    file.file = handle;
    file.identity = handle->identity();
    struct stat st {};
    if (::fstat(handle->fd(), &st) != 0) throw Error(errno_code(errno), context, "fstat");
    if (st.st_nlink > 1)
      throw Error(errno_code(EMLINK), context,
                  fmt::format("the file has {} hard links, and a crash-safe rewrite would give only this name the new "
                              "file: copy it, then add checksums to the copy",
                              st.st_nlink));
    const std::uint64_t expected = file.header.data_offset + file.header.data_size;
    if (static_cast<std::uint64_t>(st.st_size) != expected)
      throw Error(errno_code(EIO), context,
                  fmt::format("the file changed while being read: {} bytes, its header says {}", st.st_size, expected));
    if (detail::has_checksums(file.header.metadata)) {
      // Checksums already there: either they hold (nothing to do) or the data or header no longer
      // matches them, and new ones would certify the damage.
      std::optional<std::string> bad = detail::check_header(file);
      const std::vector<std::uint64_t> sums = bad ? std::vector<std::uint64_t>{} : hash_tensors(handle->fd(), file, context, cancel);
      for (std::size_t i = 0; !bad && i < sums.size(); ++i)
        bad = detail::check_tensor(file.header.metadata, file.header.tensors[i].name, file.path,
                                   file.header.data_offset + file.header.tensors[i].begin, sums[i]);
      if (!bad) {
        ++result.files_already_valid;
        continue;
      }
      if (!force)
        throw Error(make_error_code(Errc::verify_failed), context,
                    fmt::format("its stored checksums do not match ({}); new ones would certify damaged data "
                                "(force recomputes them)",
                                *bad));
    }
    rewrite_with_checksums(handle->fd(), file, target, context, cancel);
    ++result.files_rewritten;
  }
  return result;
}
}  // namespace

AddChecksumsResult add_checksums(const std::string& path, bool force, const std::atomic<bool>* cancel) {
  return detail::errors_as_hbmio({.op = "add checksums", .path = path}, [&] { return add_checksums_unguarded(path, force, cancel); });
}

}  // namespace hbmio
