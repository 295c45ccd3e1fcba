// The public saves: save_checkpoint (a blocking save: it waits for the path's background save,
// then runs the persist step of persist.hpp) and add_checksums (each file rewritten with its
// checksums through the same commit, commit.hpp).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <xxhash.h>

#include "checkpoint/background_saves.hpp"
#include "checkpoint/commit.hpp"
#include "checkpoint/integrity.hpp"
#include "checkpoint/persist.hpp"
#include "checkpoint/remote_save.hpp"
#include "core/error_boundary.hpp"
#include "core/positional_io.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file_system.hpp"

namespace hbmio {
namespace fs = std::filesystem;
namespace st = safetensors;

using detail::check_cancel;
using detail::check_directory_of;
using detail::FileLock;
using detail::final_target;
using detail::PendingFile;
using detail::remove_stale_temporaries;
using detail::sync_published;
using detail::take_attributes;
Stats save_checkpoint(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  return detail::errors_as_hbmio({.op = "save", .path = path}, [&] {
    if (is_remote_url(path)) return detail::save_remote(path, tensors, options);
    // A background save of the same path still in flight goes first, and one started meanwhile
    // waits for this one: otherwise an older state could publish after a newer one.
    const detail::BlockingSaveTurn turn(detail::save_key(final_target(path, options.max_shard_size > 0, {.op = "save", .path = path})),
                                        path, options.cancel);
    return detail::persist(path, tensors, options, nullptr);
  });
}

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
    std::shared_ptr<const File> handle = file.open();
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
