// Test support: a FileSystem (hbmio/file_system.hpp) that asks a FaultInjector before each write,
// fsync and directory fsync of a save, and gives the save an engine that asks the same injector
// about each of its calls, so that one seeded plan counts every call of a save that can fail
// (RocksDB's FaultInjectionTestFS over its FileSystem). What the injector lets through goes to
// the wrapped file system. Opens, links, renames and removals pass through untouched: a failure
// there is not an I/O error of the data.
//
//   auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = n});
//   save_checkpoint(path, tensors, {.file_system = std::make_shared<FaultInjectionFileSystem>(faults)});
#pragma once

#include <memory>

#include "hbmio/file_system.hpp"
#include "testing/fault_injection.hpp"

namespace hbmio {

class FaultInjectionFileSystem final : public FileSystem {
 public:
  explicit FaultInjectionFileSystem(std::shared_ptr<FaultInjector> faults, std::shared_ptr<FileSystem> base = FileSystem::posix());

  File open(const std::string& path, const std::string& shown, OpenMode mode, bool with_direct_io) override;
  // Logged as "write", or "write of the index" for a sharded checkpoint's index.
  void write(const File& file, std::span<const std::byte> bytes, std::uint64_t offset, const ErrorContext& context) override;
  // Logged as "fsync", or "fsync of the index".
  void sync(const File& file, const ErrorContext& context) override;
  // Logged as "fsync of the directory".
  void sync_directory(const std::string& dir, const ErrorContext& context) override;
  int link(const File& file, const std::string& path) override;
  int rename(const std::string& from, const std::string& to) override;
  int exchange(const std::string& a, const std::string& b) override;
  int make_directory(const std::string& path) override;
  void remove_all(const std::string& path) noexcept override;
  // An engine of `backend` (with `options`, else Options::from_env()) that asks the injector.
  std::unique_ptr<Engine> make_engine(std::string_view backend, const std::optional<Options>& options) override;

 private:
  std::shared_ptr<FaultInjector> faults_;
  std::shared_ptr<FileSystem> base_;
};

}  // namespace hbmio
