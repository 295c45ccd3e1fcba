// The file operations a crash-safe save makes, behind one interface (RocksDB's FileSystem,
// LevelDB's Env): a save opens its new file, writes small files, fsyncs, names and renames, fsyncs
// the directory and removes what it abandoned only through the FileSystem in
// SaveOptions::file_system. FileSystem::posix() makes them with the system calls, in the order
// docs/checkpoints.md gives; a test wraps it (the testing layer's FaultInjectionFileSystem) to
// fail any of them, and production code never asks whether it is wrapped.
//
// Contracts: methods that act on a file's contents (open, write, sync, sync_directory) throw
// Error with `context` (op and the path as the caller names it) and the failed call; methods that
// act on names (link, rename, exchange, make_directory) return 0 or the errno, and the caller
// names the failure; remove_all never fails (clean-up). A failed sync is final: never retried.
// Thread-safety: posix() is safe for concurrent use, and so must a wrapper be (background saves
// run beside the caller's).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/options.hpp"

namespace hbmio {

class Engine;

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // The system's file operations; shared by every save that names no other.
  static const std::shared_ptr<FileSystem>& posix();

  // File::open_at(AT_FDCWD, path, shown, mode, with_direct_io): `shown` names the file in errors.
  virtual File open(const std::string& path, const std::string& shown, OpenMode mode, bool with_direct_io) = 0;
  // Writes all of `bytes` at `offset` through the page cache (a small file: a sharded index).
  virtual void write(const File& file, std::span<const std::byte> bytes, std::uint64_t offset, const ErrorContext& context) = 0;
  // fsync(2) of the file.
  virtual void sync(const File& file, const ErrorContext& context) = 0;
  // fsync(2) of the directory `dir`: what makes a rename, link or new entry in it durable.
  virtual void sync_directory(const std::string& dir, const ErrorContext& context) = 0;
  // Gives a file opened OpenMode::create_unnamed the name `path` (linkat(2)).
  virtual int link(const File& file, const std::string& path) = 0;
  // rename(2) of `from` over `to`.
  virtual int rename(const std::string& from, const std::string& to) = 0;
  // Swaps the names `a` and `b` in one atomic step (renameat2(2) RENAME_EXCHANGE).
  virtual int exchange(const std::string& a, const std::string& b) = 0;
  // mkdir(2); EEXIST where anything has the name already.
  virtual int make_directory(const std::string& path) = 0;
  // Removes `path` and what is under it, without following a symbolic link; best effort.
  virtual void remove_all(const std::string& path) noexcept = 0;

  // The engine that writes a save's data when the save names none (SaveOptions::engine): a
  // wrapper gives its own; null (posix()'s answer) lets the save make or lease one as usual.
  virtual std::unique_ptr<Engine> make_engine(std::string_view backend, const std::optional<Options>& options);
};

}  // namespace hbmio
