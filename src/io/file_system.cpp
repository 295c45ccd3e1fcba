// FileSystem::posix(): a save's file operations as the system calls themselves.
#include "hbmio/file_system.hpp"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include <fmt/format.h>

#include "core/positional_io.hpp"
#include "hbmio/engine.hpp"

namespace hbmio {

namespace {

class PosixFileSystem final : public FileSystem {
 public:
  File open(const std::string& path, const std::string& shown, OpenMode mode, bool with_direct_io) override {
    return File::open_at(AT_FDCWD, path, shown, mode, with_direct_io);
  }

  void write(const File& file, std::span<const std::byte> bytes, std::uint64_t offset, const ErrorContext& context) override {
    detail::write_fully(file.fd(), bytes, offset, context);
  }

  void sync(const File& file, const ErrorContext&) override { file.sync(); }

  void sync_directory(const std::string& dir, const ErrorContext& context) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throw Error(errno_code(errno), context, "open of its directory to fsync it");
    const int r = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (r != 0) throw Error(errno_code(err), context, "fsync of its directory");
  }

  int link(const File& file, const std::string& path) override {
    // Through /proc (no privilege needed), else AT_EMPTY_PATH (needs CAP_DAC_READ_SEARCH).
    const std::string self = fmt::format("/proc/self/fd/{}", file.fd());
    if (::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, path.c_str(), AT_SYMLINK_FOLLOW) == 0 ||
        ::linkat(file.fd(), "", AT_FDCWD, path.c_str(), AT_EMPTY_PATH) == 0)
      return 0;
    return errno;
  }

  int rename(const std::string& from, const std::string& to) override {
    return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
  }

  int exchange(const std::string& a, const std::string& b) override {
    return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0 ? 0 : errno;
  }

  int make_directory(const std::string& path) override { return ::mkdir(path.c_str(), 0777) == 0 ? 0 : errno; }

  void remove_all(const std::string& path) noexcept override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

const std::shared_ptr<FileSystem>& FileSystem::posix() {
  // Never destroyed: background saves may finish during static destruction.
  static const auto* system = new std::shared_ptr<FileSystem>(std::make_shared<PosixFileSystem>());
  return *system;
}

std::unique_ptr<Engine> FileSystem::make_engine(std::string_view, const std::optional<Options>&) { return nullptr; }

}  // namespace hbmio
