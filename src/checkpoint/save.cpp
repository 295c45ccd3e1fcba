// Saving checkpoints crash-safely: temporary file in the target directory, fsync, rename,
// fsync of the directory. A crash at any point leaves either the old file or the new one under
// the final name, never a mix (rename is atomic; the data is durable before it).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdio.h>  // renameat2
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "checkpoint/integrity.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "io/engine_internal.hpp"

namespace hbmio {
namespace fs = std::filesystem;
namespace st = safetensors;

namespace {

// Temporary files are ".<final name>.hbmio-tmp-<pid>-<random>" beside the final file: the same
// file system (so rename is atomic), hidden, recognisable for clean-up after a crash, and, by the
// pid, for remove_own_save_temporaries when this process is stopped by a signal.
std::string temp_prefix(const fs::path& target) { return "." + target.filename().string() + ".hbmio-tmp-"; }
std::string own_prefix(const fs::path& target) { return fmt::format("{}{}-", temp_prefix(target), ::getpid()); }
fs::path temp_name(const fs::path& target, std::random_device& random) {
  return target.parent_path() / fmt::format("{}{:08x}{:08x}", own_prefix(target), random(), random());
}

// A descriptor held for the whole save, with an exclusive flock(2) on the temporary file or
// directory: a second save of the same name, from this process or another, sees the lock and
// leaves that temporary alone. The lock dies with the process, so a crashed save's temporary is
// unlocked and is removed by the next save.
class TempLock {
 public:
  explicit TempLock(int fd) : fd_(fd) {
    if (fd_ >= 0) (void)::flock(fd_, LOCK_EX | LOCK_NB);  // just made by us: nobody else holds it
  }
  ~TempLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  TempLock(const TempLock&) = delete;
  TempLock& operator=(const TempLock&) = delete;

 private:
  int fd_;
};

// Removes the temporaries of earlier saves of `target` that no running save holds. (The one
// window: a save that has created its temporary but not yet locked it, a few microseconds. A
// removal there makes that save fail at its rename, with the old checkpoint intact.)
void remove_stale_temporaries(const fs::path& target) {
  const std::string prefix = temp_prefix(target);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(target.parent_path(), ec)) {
    if (!entry.path().filename().string().starts_with(prefix)) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno != ELOOP) continue;  // gone, or not ours to judge
    const bool in_use = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (!in_use) fs::remove_all(entry.path(), ec);  // (a symbolic link there is removed, not followed)
    if (fd >= 0) ::close(fd);
  }
}

// The name a save replaces. A symbolic link there is followed, so that the link stays and the file
// it names is replaced (the Hugging Face cache's snapshot entries are links to blobs); a rename
// over the link itself would swap the link for a copy.
fs::path final_target(const std::string& path) {
  fs::path p = fs::absolute(path);
  std::error_code ec;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    if (hops == 40) throw Error(errno_code(ELOOP), {.op = "save", .path = path}, "too many levels of symbolic links");
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) throw Error(ec, {.op = "save", .path = p.string()}, "readlink");
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
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
void sync_directory(const fs::path& dir, const std::string& target, FaultInjector* faults) {
  if (const int err = detail::inject(faults, FaultSite::io, "fsync of the directory"))
    throw Error(errno_code(err), {.op = "save", .path = target}, "fsync of its directory (injected)");
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(errno_code(errno), {.op = "save", .path = target}, "open of its directory to fsync it");
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw Error(errno_code(err), {.op = "save", .path = target}, "fsync of its directory");
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

}  // namespace

namespace {
Stats save_sharded(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options);
}

Stats save_checkpoint(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  if (options.max_shard_size > 0) return save_sharded(path, tensors, options);
  detail::TransferTimer timer;
  const fs::path target = final_target(path);
  const ErrorContext context{.op = "save", .path = path};

  // Check everything before touching the disk.
  std::set<std::string> names;
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) {
    if (t.name.empty()) throw Error(errno_code(EINVAL), context, "a tensor has an empty name");
    if (t.name == "__metadata__") throw Error(errno_code(EINVAL), context, "'__metadata__' cannot name a tensor");
    if (!names.insert(t.name).second) throw Error(errno_code(EINVAL), context, fmt::format("tensor '{}' given twice", t.name));
    if (expected_size(t) != t.data.size)
      throw Error(errno_code(EINVAL), context,
                  fmt::format("tensor '{}': {} bytes in memory, but {} {} needs {}", t.name, t.data.size,
                              st::to_string(t.dtype), fmt::join(t.shape, "x"), expected_size(t)));
    infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  }
  st::order_like_reference(infos);

  std::map<std::string, std::string> metadata = options.metadata;
  for (auto it = metadata.begin(); it != metadata.end();)  // stale checksums would lie
    it = it->first.starts_with(kChecksumPrefix) || it->first == detail::kChecksumAlgorithmKey || it->first == detail::kHeaderChecksumKey
             ? metadata.erase(it)
             : std::next(it);
  // Checksums are computed while the tensors are written (both only read the tensors' memory),
  // and the header, which holds them, is written last. Checksums have a fixed width, so a header
  // with placeholders has the final header's size and fixes where the data goes.
  std::vector<MemorySpan> spans;
  if (options.checksums) {
    metadata[detail::kChecksumAlgorithmKey] = detail::kChecksumAlgorithm;
    metadata[detail::kHeaderChecksumKey] = detail::to_hex(0);  // sealed once the tensors' are in
    for (const auto& t : tensors) {
      metadata[kChecksumPrefix + t.name] = detail::to_hex(0);
      spans.push_back(t.data);
    }
  }
  std::string header = st::serialize_header(infos, metadata);

  check_directory_of(target, context);
  if (fs::is_directory(target))
    throw Error(errno_code(EISDIR), context, "a directory is there, not a file: a sharded checkpoint is saved with a maximum shard size");
  remove_stale_temporaries(target);
  std::random_device random;
  const fs::path temp = temp_name(target, random);
  auto engine = make_engine(options.backend, options.engine_options.value_or(Options::from_env()), options.faults);
  Stats total;
  std::optional<ReplacedFile> previous;  // released (in the background) when the save returns or fails
  std::optional<TempLock> lock;
  // Where the time goes, for the Stats note: a save is its writes plus what makes them durable.
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const Clock::time_point started = Clock::now();
  double hashing = 0, data = 0, wait = 0, header_write = 0, fsync = 0;
  try {
    {
      File file = File::open(temp.string(), OpenMode::create_new);
      lock.emplace(::fcntl(file.fd(), F_DUPFD_CLOEXEC, 0));  // a descriptor of its own: held past the file's close, to the rename
      // Hashing runs beside the writes; the future's destructor waits for it on every path, so
      // no hashing thread reads the tensors after a failed save returns.
      std::future<std::vector<std::uint64_t>> sums;
      if (options.checksums)
        sums = std::async(std::launch::async, [&spans, &hashing, &seconds_since] {
          const Clock::time_point start = Clock::now();
          // A quarter of the cores: hashing on all of them starved the writers' threads (6 GiB
          // from cuda:0 on 16 cores saved 10% slower with checksums than without, while hashing
          // took 0.33 s of the 3.9 s of writes; bench/RESULTS.md). A quarter still finishes
          // well within the writes.
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
                          .progress = options.progress});
      Clock::time_point phase = Clock::now();
      total.add_part(engine->submit_batch(writes));
      data = seconds_since(phase);
      if (options.checksums) {
        phase = Clock::now();
        const std::vector<std::uint64_t> computed = sums.get();
        wait = seconds_since(phase);
        for (std::size_t i = 0; i < tensors.size(); ++i) metadata[kChecksumPrefix + tensors[i].name] = detail::to_hex(computed[i]);
        std::string final_header = st::serialize_header(infos, metadata);
        detail::seal_header(final_header);
        if (final_header.size() != header.size())
          throw Error(errno_code(EPROTO), context, fmt::format("header changed size with its checksums ({} -> {} bytes)",
                                                               header.size(), final_header.size()));
        header = std::move(final_header);
      }
      Buffer header_buffer = Buffer::allocate({MemoryKind::host}, header.size());
      std::memcpy(header_buffer.data(), header.data(), header.size());
      const IoRequest header_request{.op = IoOp::write, .file = &file, .offset = 0, .memory = header_buffer.span()};
      phase = Clock::now();
      total.add_part(engine->submit_batch({&header_request, 1}));
      header_write = seconds_since(phase);
      if (options.keep_attributes) take_attributes(target, file.fd(), context);
      if (const int err = detail::inject(options.faults.get(), FaultSite::io, "fsync"))
        throw Error(errno_code(err), context, "fsync (injected)");
      phase = Clock::now();
      file.sync();  // throws on failure: never retried, the old checkpoint stays
      fsync = seconds_since(phase);
    }
    previous.emplace(target);
    if (::rename(temp.c_str(), target.c_str()) != 0) throw Error(errno_code(errno), context, "rename of the temporary file");
  } catch (...) {
    std::error_code ec;
    fs::remove(temp, ec);
    throw;
  }
  sync_directory(target.parent_path(), path, options.faults.get());
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

namespace {

bool is_checkpoint_file(const std::string& name) {
  return name == "model.safetensors" || name == "model.safetensors.index.json" ||
         (name.starts_with("model-") && name.ends_with(".safetensors"));
}

// Writes small bytes (the index) to a new file and makes them durable.
void write_durably(const fs::path& file, const std::string& bytes, FaultInjector* faults) {
  File out = File::open(file.string(), OpenMode::create_new);
  if (const int err = detail::inject(faults, FaultSite::io, "write of the index"))
    throw Error(errno_code(err), {.op = "save", .path = file.string()}, "write (injected)");
  for (std::size_t done = 0; done < bytes.size();) {
    const ssize_t r = ::pwrite(out.fd(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(errno_code(r < 0 ? errno : ENOSPC), {.op = "save", .path = file.string(), .offset = done});
    done += static_cast<std::size_t>(r);
  }
  if (const int err = detail::inject(faults, FaultSite::io, "fsync of the index"))
    throw Error(errno_code(err), {.op = "save", .path = file.string()}, "fsync (injected)");
  out.sync();
}

Stats save_sharded(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  detail::TransferTimer timer;
  const fs::path target = final_target(path);
  const ErrorContext context{.op = "save sharded checkpoint", .path = path};
  if (fs::exists(target) && !fs::is_directory(target))
    throw Error(errno_code(ENOTDIR), context, "a sharded checkpoint is saved into a directory, and this is a file");

  // Greedy shards in the reference writer's tensor order.
  std::vector<st::TensorInfo> order;
  for (const auto& t : tensors) order.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(order);
  std::map<std::string_view, const TensorToSave*> by_name;
  for (const auto& t : tensors) by_name.emplace(t.name, &t);
  std::vector<std::vector<TensorToSave>> shards(1);
  std::uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& info : order) {
    if (shard_bytes > 0 && shard_bytes + info.size() > options.max_shard_size) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(*by_name.at(info.name));
    shard_bytes += info.size();
    total_bytes += info.size();
  }

  check_directory_of(target, context);
  remove_stale_temporaries(target);  // directories too: fs::remove_all below
  std::random_device random;
  const fs::path temp = temp_name(target, random);
  Stats total;
  try {
    // A name already there (even a symlink to a directory) is never built into: the random
    // suffix makes that a sign of interference, not a leftover (those were removed above).
    if (!fs::create_directory(temp))
      throw Error(errno_code(EEXIST), context, fmt::format("temporary directory {} already exists", temp.string()));
    const TempLock lock(::open(temp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    nlohmann::json weight_map = nlohmann::json::object();
    SaveOptions single = options;
    single.max_shard_size = 0;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const std::string name = fmt::format("model-{:05}-of-{:05}.safetensors", k + 1, shards.size());
      total.add_part(save_checkpoint((temp / name).string(), shards[k], single));
      for (const auto& t : shards[k]) weight_map[t.name] = name;
    }
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    write_durably(temp / "model.safetensors.index.json", index.dump(2) + "\n", options.faults.get());
    // Whatever else the directory holds (config.json, tokenizer files) comes along.
    if (fs::exists(target))
      for (const auto& entry : fs::directory_iterator(target))
        if (!is_checkpoint_file(entry.path().filename().string()))
          fs::copy(entry.path(), temp / entry.path().filename(), fs::copy_options::recursive | fs::copy_options::create_hard_links);
    sync_directory(temp, path, options.faults.get());
    if (fs::exists(target)) {
      // One atomic step: the new directory takes the name, the old one takes the temporary name.
      if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0)
        throw Error(errno_code(errno), context, "renameat2(RENAME_EXCHANGE) of the new directory");
    } else if (::rename(temp.c_str(), target.c_str()) != 0) {
      throw Error(errno_code(errno), context, "rename of the new directory");
    }
  } catch (...) {
    std::error_code ec;
    fs::remove_all(temp, ec);
    throw;
  }
  sync_directory(target.parent_path(), path, options.faults.get());
  std::error_code ec;
  fs::remove_all(temp, ec);  // the old checkpoint, after the exchange
  total.note = fmt::format("{} tensors in {} shard(s) + index, swapped in atomically", tensors.size(), shards.size());
  timer.finish(total);
  return total;
}

}  // namespace

namespace {

// A file mapped read-only: the source of a rewrite, read through the page cache, so a file larger
// than memory can be rewritten (the kernel evicts pages as it goes) and nothing is copied twice.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const ErrorContext context{.op = "add checksums", .path = path};
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(errno_code(errno), context, "open");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw Error(errno_code(err), context, "fstat");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    void* map = size_ == 0 ? nullptr : ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file
    if (map == MAP_FAILED) throw Error(errno_code(err), context, "mmap");
    data_ = static_cast<std::byte*>(map);
    if (data_ != nullptr) (void)::madvise(data_, size_, MADV_SEQUENTIAL);
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace

void remove_own_save_temporaries(const std::string& path) noexcept {
  try {
    const fs::path target = final_target(path);
    const std::string prefix = own_prefix(target);
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(target.parent_path(), ec))
      if (entry.path().filename().string().starts_with(prefix)) fs::remove_all(entry.path(), ec);
  } catch (...) {  // best effort: what is left is removed by the next save of `path`
  }
}

AddChecksumsResult add_checksums(const std::string& path, bool force) {
  // Each file on its own, crash-safe: after a crash every shard holds either its old bytes or its
  // bytes with checksums, and both load. The index does not change (it maps names to shards).
  AddChecksumsResult result;
  for (const CheckpointFile& file : open_checkpoint(path)) {
    const ErrorContext context{.op = "add checksums", .path = file.path};
    struct stat st {};
    if (::stat(file.path.c_str(), &st) != 0) throw Error(errno_code(errno), context, "stat");
    if (st.st_nlink > 1)
      throw Error(errno_code(EMLINK), context,
                  fmt::format("the file has {} hard links, and a crash-safe rewrite would give only this name the new "
                              "file: copy it, then add checksums to the copy",
                              st.st_nlink));
    const MappedFile source(file.path);
    const std::uint64_t expected = file.header.data_offset + file.header.data_size;
    if (source.size() != expected)
      throw Error(errno_code(EIO), context,
                  fmt::format("the file changed while being read: {} bytes, its header says {}", source.size(), expected));
    std::vector<TensorToSave> tensors;
    std::vector<MemorySpan> spans;
    for (const auto& t : file.header.tensors) {
      spans.push_back({source.data() + file.header.data_offset + t.begin, t.size(), {MemoryKind::host}});
      tensors.push_back({t.name, t.dtype, t.shape, spans.back()});
    }
    if (detail::has_checksums(file.header.metadata)) {
      // Checksums already there: either they hold (nothing to do) or the data or header no longer
      // matches them, and new ones would certify the damage.
      std::optional<std::string> bad = detail::check_header(file);
      const std::vector<std::uint64_t> sums = bad ? std::vector<std::uint64_t>{} : detail::xxh3_of_each(spans);
      for (std::size_t i = 0; !bad && i < sums.size(); ++i)
        bad = detail::check_tensor(file.header.metadata, file.header.tensors[i].name, file.path,
                                   file.header.data_offset + file.header.tensors[i].begin, sums[i]);
      if (!bad) {
        ++result.files_already_valid;
        continue;
      }
      if (!force)
        throw Error(errno_code(EBADMSG), context,
                    fmt::format("its stored checksums do not match ({}); new ones would certify damaged data "
                                "(force recomputes them)",
                                *bad));
    }
    save_checkpoint(file.path, tensors, {.metadata = file.header.metadata, .checksums = true, .keep_attributes = true});
    ++result.files_rewritten;
  }
  return result;
}

}  // namespace hbmio
