#include "testing/fault_injection_file_system.hpp"

#include <utility>

#include "hbmio/engine.hpp"
#include "io/engine_internal.hpp"

namespace hbmio {

namespace {
bool is_index(const File& file) { return file.path().ends_with(".index.json"); }
}  // namespace

FaultInjectionFileSystem::FaultInjectionFileSystem(std::shared_ptr<FaultInjector> faults, std::shared_ptr<FileSystem> base)
    : faults_(std::move(faults)), base_(std::move(base)) {}

File FaultInjectionFileSystem::open(const std::string& path, const std::string& shown, OpenMode mode, bool with_direct_io) {
  return base_->open(path, shown, mode, with_direct_io);
}

void FaultInjectionFileSystem::write(const File& file, std::span<const std::byte> bytes, std::uint64_t offset,
                                     const ErrorContext& context) {
  if (const int err = faults_->check(FaultSite::io, is_index(file) ? "write of the index" : "write"))
    throw Error(errno_code(err), context, "write (injected)");
  base_->write(file, bytes, offset, context);
}

void FaultInjectionFileSystem::sync(const File& file, const ErrorContext& context) {
  if (const int err = faults_->check(FaultSite::io, is_index(file) ? "fsync of the index" : "fsync"))
    throw Error(errno_code(err), context, "fsync (injected)");
  base_->sync(file, context);
}

void FaultInjectionFileSystem::sync_directory(const std::string& dir, const ErrorContext& context) {
  if (const int err = faults_->check(FaultSite::io, "fsync of the directory"))
    throw Error(errno_code(err), context, "fsync of its directory (injected)");
  base_->sync_directory(dir, context);
}

int FaultInjectionFileSystem::link(const File& file, const std::string& path) { return base_->link(file, path); }
int FaultInjectionFileSystem::rename(const std::string& from, const std::string& to) { return base_->rename(from, to); }
int FaultInjectionFileSystem::exchange(const std::string& a, const std::string& b) { return base_->exchange(a, b); }
int FaultInjectionFileSystem::make_directory(const std::string& path) { return base_->make_directory(path); }
void FaultInjectionFileSystem::remove_all(const std::string& path) noexcept { base_->remove_all(path); }

std::unique_ptr<Engine> FaultInjectionFileSystem::make_engine(std::string_view backend, const std::optional<Options>& options) {
  return detail::make_engine_with_faults(backend, options.value_or(Options::from_env()), faults_);
}

}  // namespace hbmio
