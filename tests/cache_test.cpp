// The resident cache (hbmio/cache.hpp): a server process (`hbmio cache serve`, spawned here) and
// this process as its client. Every load is compared byte for byte with plain preads of the file.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cache/client.hpp"
#include "cache/protocol.hpp"
#include "test_support.hpp"

extern char** environ;

namespace hbmio {
namespace {

using test::TempDir;

// The command that serves: $HBMIO_CLI where set (the GPU machine runs these tests from another
// folder than they were built in), else the one built beside them.
const char* cli() {
  const char* set = std::getenv("HBMIO_CLI");
  return set && *set ? set : HBMIO_CLI_BIN;
}

// `hbmio cache serve` in a process of its own, stopped (SIGTERM) by the destructor.
class ServerProcess {
 public:
  ServerProcess(const std::string& socket, const std::string& host_memory, std::vector<std::string> extra = {}) : socket_(socket) {
    std::vector<std::string> args{cli(), "cache", "serve", "--socket", socket, "--host-memory", host_memory};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (::posix_spawn(&pid_, cli(), nullptr, nullptr, argv.data(), environ) != 0) throw std::runtime_error("spawn the server");
    for (int i = 0; i < 500; ++i) {  // up to 10 s for it to answer
      try {
        cache_status(socket_);
        return;
      } catch (const Error&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    throw std::runtime_error("the cache server did not answer on " + socket_);
  }
  ~ServerProcess() { stop(SIGTERM); }
  void stop(int signal) {
    if (pid_ <= 0) return;
    ::kill(pid_, signal);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  std::string socket_;
  pid_t pid_ = -1;
};

// A checkpoint of `count` U8 tensors of `size` random bytes (seeded), saved by hbmio.
void save_sample(const std::string& path, std::uint64_t seed, std::size_t count = 4, std::size_t size = 256 << 10) {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorToSave> tensors;
  for (std::size_t k = 0; k < count; ++k) bytes.push_back(test::random_bytes(size, seed * 100 + k));
  for (std::size_t k = 0; k < count; ++k)
    tensors.push_back({fmt::format("t{}", k), safetensors::Dtype::U8, {size}, {bytes[k].data(), size, {}}});
  save_checkpoint(path, tensors);
}

struct Loaded {
  Stats stats;
  bool from_cache = false;
};

// Loads `path` into host memory, checks every tensor against preads of the file, and says whether
// its bytes came from the cache.
Loaded load_and_check(const std::string& path, CacheUse use, const std::string& socket) {
  const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {}, .cache = use, .cache_socket = socket});
  for (const LoadedTensor& t : loaded.tensors()) {
    const std::vector<std::byte> expected = test::pread_range(t.file, t.file_offset, t.data.size);
    EXPECT_EQ(0, std::memcmp(expected.data(), t.data.data, t.data.size)) << t.name << " of " << t.file;
  }
  Loaded out{loaded.stats()};
  for (const TransferPath& p : out.stats.paths) out.from_cache = out.from_cache || p.path == DataPath::cache_host;
  return out;
}

// CUDA IPC handles travel as hex: every byte value comes back as it went.
TEST(ResidentCache, HandlesTravelAsHexAndBack) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(cache_detail::to_hex(std::string("\x00\xff\x3b", 3)), "00ff3b");
  EXPECT_EQ(cache_detail::from_hex(cache_detail::to_hex(all)), all);
  EXPECT_EQ(cache_detail::from_hex("00FF3b"), std::string("\x00\xff\x3b", 3));
}

TEST(ResidentCache, AHitIsTheFileByteForByteAndSaysSo) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 1);
  ServerProcess server(socket, "64MiB");
  EXPECT_FALSE(load_and_check(file, CacheUse::use, socket).from_cache);  // not held: read from the file
  EXPECT_EQ(cache_add(socket, {file}, /*wait=*/true), std::vector<std::string>{"held"});
  const Loaded hit = load_and_check(file, CacheUse::use, socket);
  EXPECT_TRUE(hit.from_cache) << hit.stats.note;
  ASSERT_EQ(hit.stats.paths.size(), 1u);
  EXPECT_EQ(hit.stats.paths[0].file, file);
  EXPECT_NE(hit.stats.note.find("1 of 1 file(s) from the resident cache"), std::string::npos) << hit.stats.note;
  EXPECT_FALSE(load_and_check(file, CacheUse::off, socket).from_cache);
  const CacheStatus status = cache_status(socket);
  ASSERT_EQ(status.entries.size(), 1u);
  EXPECT_EQ(status.entries[0].path, std::filesystem::canonical(file).string());
  EXPECT_EQ(status.entries[0].bytes, std::filesystem::file_size(file));
  EXPECT_EQ(status.entries[0].state, "ready");
  EXPECT_GE(status.entries[0].hits, 1u);
  EXPECT_EQ(status.host_bytes, std::filesystem::file_size(file));
  // The first load and the add's first ask missed; the add's asks while it waited are no load's.
  EXPECT_EQ(status.misses, 2u);
  EXPECT_EQ(status.adds, 1u);
}

TEST(ResidentCache, ALoadThatAddsIsServedFromTheCacheNextTime) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 2);
  ServerProcess server(socket, "64MiB");
  EXPECT_FALSE(load_and_check(file, CacheUse::add, socket).from_cache);
  bool hit = false;
  for (int i = 0; i < 250 && !hit; ++i) {  // the server reads it in the background
    hit = load_and_check(file, CacheUse::use, socket).from_cache;
    if (!hit) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(hit);
}

TEST(ResidentCache, AReplacedOrRewrittenFileIsNeverServed) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 3);
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  ASSERT_TRUE(load_and_check(file, CacheUse::use, socket).from_cache);
  save_sample(file, 4);  // a new file renamed over the name: another inode
  EXPECT_FALSE(load_and_check(file, CacheUse::use, socket).from_cache);

  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  ASSERT_TRUE(load_and_check(file, CacheUse::use, socket).from_cache);
  // The same inode and size, other bytes: the modification time moves (past the clock's tick:
  // a write within the tick of the caching is what checksums are for, docs/cache.md).
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  {
    const int fd = ::open(file.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const std::vector<std::byte> other = test::random_bytes(4096, 99);
    ASSERT_EQ(::pwrite(fd, other.data(), other.size(), static_cast<off_t>(std::filesystem::file_size(file) - 4096)), 4096);
    ::close(fd);
  }
  EXPECT_FALSE(load_and_check(file, CacheUse::use, socket).from_cache);
  EXPECT_GE(cache_status(socket).stale, 2u);
}

TEST(ResidentCache, EvictsTheLeastRecentlyUsedUnderItsLimitAndRefusesWhatCannotFit) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock");
  const std::string a = dir.file("a.safetensors"), b = dir.file("b.safetensors"), big = dir.file("big.safetensors");
  save_sample(a, 5, 4, 512 << 10);    // 2 MiB and a header
  save_sample(b, 6, 4, 512 << 10);
  save_sample(big, 7, 8, 512 << 10);  // 4 MiB: more than the cache holds
  ServerProcess server(socket, "3MiB");
  ASSERT_EQ(cache_add(socket, {a}, true), std::vector<std::string>{"held"});
  ASSERT_EQ(cache_add(socket, {b}, true), std::vector<std::string>{"held"});
  CacheStatus status = cache_status(socket);
  ASSERT_EQ(status.entries.size(), 1u);
  EXPECT_EQ(status.entries[0].path, std::filesystem::canonical(b).string());
  EXPECT_EQ(status.evictions, 1u);
  EXPECT_FALSE(load_and_check(a, CacheUse::use, socket).from_cache);
  EXPECT_TRUE(load_and_check(b, CacheUse::use, socket).from_cache);
  const std::vector<std::string> said = cache_add(socket, {big}, true);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("more than the cache holds"), std::string::npos) << said[0];
  EXPECT_FALSE(load_and_check(big, CacheUse::use, socket).from_cache);
  EXPECT_EQ(cache_status(socket).entries.size(), 1u);  // b stays: nothing was evicted for a refusal
}

TEST(ResidentCache, AUsersQuotaEvictsThatUsersFilesAndAllowKeepsOthersOut) {
  TempDir dir, other, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  const std::string a = dir.file("a.safetensors"), b = dir.file("b.safetensors"), outside = other.file("c.safetensors");
  save_sample(a, 13, 4, 512 << 10);  // 2 MiB and a header each
  save_sample(b, 14, 4, 512 << 10);
  save_sample(outside, 15, 4, 512 << 10);
  // Room for both in the cache, not for both under one user's quota.
  ServerProcess server(socket, "64MiB", {"--user-memory", "3MiB", "--allow", dir.path()});
  ASSERT_EQ(cache_add(socket, {a}, true), std::vector<std::string>{"held"});
  ASSERT_EQ(cache_add(socket, {b}, true), std::vector<std::string>{"held"});
  const CacheStatus status = cache_status(socket);
  ASSERT_EQ(status.entries.size(), 1u);
  EXPECT_EQ(status.entries[0].path, std::filesystem::canonical(b).string());
  EXPECT_EQ(status.entries[0].owner, ::getuid());
  EXPECT_EQ(status.user_bytes_limit, 3u << 20);
  EXPECT_EQ(status.evictions, 1u);
  const std::vector<std::string> said = cache_add(socket, {outside}, true);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("outside the directories this cache serves"), std::string::npos) << said[0];
  EXPECT_FALSE(load_and_check(outside, CacheUse::add, socket).from_cache);
  EXPECT_EQ(cache_status(socket).entries.size(), 1u);
}

// Files are bounded by number too (each is a descriptor of the server's): many small files of one
// user evict that user's oldest once past --user-files, anyone's past --max-files.
TEST(ResidentCache, FilesAreBoundedInNumberPerUserAndInAll) {
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  std::vector<std::string> files;
  for (int k = 0; k < 4; ++k) {
    files.push_back(dir.file(fmt::format("f{}.safetensors", k)));
    save_sample(files.back(), 40 + k, 1, 4096);
  }
  {
    ServerProcess server(socket, "64MiB", {"--user-files", "2"});
    for (const std::string& f : files) ASSERT_EQ(cache_add(socket, {f}, true), std::vector<std::string>{"held"}) << f;
    const CacheStatus status = cache_status(socket);
    EXPECT_EQ(status.user_files_limit, 2u);
    EXPECT_GT(status.files_limit, 2u);  // from the descriptor limit
    ASSERT_EQ(status.entries.size(), 2u);
    std::set<std::string> held;
    for (const CacheEntryStatus& e : status.entries) held.insert(e.path);
    EXPECT_EQ(held, (std::set<std::string>{std::filesystem::canonical(files[2]).string(), std::filesystem::canonical(files[3]).string()}));
    EXPECT_EQ(status.evictions, 2u);
  }
  ServerProcess server(socket, "64MiB", {"--max-files", "3"});
  for (const std::string& f : files) ASSERT_EQ(cache_add(socket, {f}, true), std::vector<std::string>{"held"}) << f;
  const CacheStatus status = cache_status(socket);
  EXPECT_EQ(status.files_limit, 3u);
  EXPECT_EQ(status.user_files_limit, 3u);
  EXPECT_EQ(status.entries.size(), 3u);
  EXPECT_EQ(status.evictions, 1u);
  // The one evicted is read from the file again, byte for byte.
  EXPECT_FALSE(load_and_check(files[0], CacheUse::use, socket).from_cache);
}

// A file whose name has 255 bytes is taken in (the memfd's name is cut; it is for /proc only).
TEST(ResidentCache, AFileOfTheLongestNameIsTakenIn) {
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  const std::string file = dir.file(std::string(255 - std::string(".safetensors").size(), 'n') + ".safetensors");
  save_sample(file, 50, 2, 4096);
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  EXPECT_TRUE(load_and_check(file, CacheUse::use, socket).from_cache);
}

// A hit stays what it was even when a later file of the same request evicts it: the reply carries
// the sealed copy of that file, never a descriptor number reused meanwhile.
TEST(ResidentCache, AHitEvictedLaterInItsOwnRequestIsStillItsFile) {
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), a = dir.file("a.safetensors"), b = dir.file("b.safetensors");
  save_sample(a, 16, 4, 512 << 10);
  save_sample(b, 17, 4, 512 << 10);
  ServerProcess server(socket, "3MiB");  // room for one of them
  ASSERT_EQ(cache_add(socket, {a}, true), std::vector<std::string>{"held"});
  const int fds[] = {::open(a.c_str(), O_RDONLY | O_CLOEXEC), ::open(b.c_str(), O_RDONLY | O_CLOEXEC)};
  const std::string names[] = {a, b};
  const cache_detail::Lookup found = cache_detail::lookup(socket, fds, names, /*add=*/true);  // a hit, then b evicts a
  ::close(fds[0]);
  ::close(fds[1]);
  ASSERT_EQ(found.copies.size(), 2u);
  ASSERT_NE(found.copies[0], nullptr) << found.warning;
  EXPECT_EQ(found.copies[1], nullptr);
  const std::uint64_t size = std::filesystem::file_size(a);
  std::vector<std::byte> copy(size);
  ASSERT_EQ(found.copies[0]->read_at(copy, 0), size);
  EXPECT_EQ(copy, test::pread_range(a, 0, size));
  EXPECT_EQ(cache_status(socket).evictions, 1u);
}

// A client trusts only a server of its own user or root: another user could have put a socket at
// the path first and would hand out bytes of its choosing.
TEST(ResidentCache, AServerOfAnotherUserIsNotTrusted) {
  if (::geteuid() != 0) GTEST_SKIP() << "a second user needs root to become one";
  TempDir dir("/tmp");
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string socket = dir.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 18);
  ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    if (::access(cli(), X_OK) != 0) ::_exit(12);  // a parent folder of the build the other user may not enter
    ::execl(cli(), cli(), "cache", "serve", "--socket", socket.c_str(), "--host-memory", "64MiB", "--mode", "0666", static_cast<char*>(nullptr));
    ::_exit(11);
  }
  // Up once it answers: a status request is refused as "not trusted" (EPERM) then, not unreachable.
  bool up = false;
  int exited = -1;
  for (int i = 0; i < 500 && !up && exited < 0; ++i) {
    try {
      cache_status(socket);
      ADD_FAILURE() << "the status of another user's server was taken";
      up = true;
    } catch (const Error& e) {
      if (e.code().value() == EPERM) {
        EXPECT_NE(e.detail().find("not trusted"), std::string::npos) << e.what();
        up = true;
      } else if (int status = 0; ::waitpid(pid, &status, WNOHANG) == pid) {
        exited = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  if (exited == 12) GTEST_SKIP() << "the other user cannot run " << cli() << " (a parent folder is not searchable by it)";
  ASSERT_LT(exited, 0) << "the other user's server exited with " << exited;
  if (up) {
    const Loaded loaded = load_and_check(file, CacheUse::add, socket);
    EXPECT_FALSE(loaded.from_cache);
    EXPECT_NE(loaded.stats.note.find("not trusted"), std::string::npos) << loaded.stats.note;
    // `hbmio cache add` sends descriptors: never to another user's server, which could read the files.
    try {
      cache_add(socket, {file}, true);
      ADD_FAILURE() << "a file was handed to another user's server";
    } catch (const Error& e) {
      EXPECT_EQ(e.code().value(), EPERM) << e.what();
      EXPECT_NE(e.detail().find("not trusted"), std::string::npos) << e.what();
    }
  }
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  ASSERT_TRUE(up) << "the other user's server did not answer";
}

// Another mount namespace (a container, `unshare -m`) sees the same file through mounts of its own:
// not served there (the mount is part of a copy's identity), and not dropped for everyone either.
TEST(ResidentCache, ALookupThroughAnotherMountMissesWithoutDroppingTheCopy) {
  if (::geteuid() != 0) GTEST_SKIP() << "a mount namespace needs root";
  TempDir dir("/tmp");
  const std::string socket = dir.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 8);
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  const auto hit = [&] {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    const cache_detail::Lookup found = cache_detail::lookup(socket, {&fd, 1}, {&file, 1}, false);
    ::close(fd);
    return found.copies.size() == 1 && found.copies[0] != nullptr;
  };
  ASSERT_TRUE(hit());
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0) ::_exit(10);
    ::_exit(hit() ? 11 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 10) GTEST_SKIP() << "unshare(CLONE_NEWNS) is not allowed here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "11: served through another mount";
  EXPECT_TRUE(hit()) << "the lookup from the other mount namespace dropped the copy";
  EXPECT_EQ(cache_status(socket).stale, 0u);
}

// --allow is the directories as the server sees them: a client in a mount namespace of its own
// that mounts a file system over an allowed directory sends files whose paths are inside it, and
// none of them is taken in.
TEST(ResidentCache, AFileSystemMountedOverAnAllowedDirectoryInAnotherNamespaceIsNotServed) {
  if (::geteuid() != 0) GTEST_SKIP() << "a mount namespace needs root";
  TempDir dir("/tmp"), sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 9);
  ServerProcess server(socket, "64MiB", {"--allow", dir.path()});
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});  // the allowed file itself
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0) ::_exit(10);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 || ::mount("tmpfs", dir.path().c_str(), "tmpfs", 0, "size=16m") != 0)
      ::_exit(10);
    const std::string other = dir.file("b.safetensors");
    save_sample(other, 10);
    const std::vector<std::string> said = cache_add(socket, {other}, true);
    ::_exit(said.size() == 1 && said[0].find("mounts of its own") != std::string::npos ? 0 : 11);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 10) GTEST_SKIP() << "unshare(CLONE_NEWNS) or a tmpfs mount is not allowed here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "11: a file of the client's own mount was taken in (or refused for another reason)";
  EXPECT_EQ(cache_status(socket).entries.size(), 1u);
}

// A client that asks for a large reply and reads it a trickle at a time holds the one serving
// thread for a bounded time only (about 2 s), however long it goes on reading: another client's
// status is answered within its own timeout (5 s).
TEST(ResidentCache, AClientThatReadsItsReplySlowlyDoesNotHoldTheServer) {
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  std::vector<std::string> files;
  for (int k = 0; k < 1500; ++k) {  // a status of ~1,500 entries with long paths: ~550 KB, more than a socket buffer
    files.push_back(dir.file(fmt::format("{:0>200}.safetensors", k)));
    save_sample(files.back(), 60, 1, 64);
  }
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, files, true).size(), files.size());
  cache_detail::OwnedFd slow = cache_detail::connect_to(socket, 1000);
  cache_detail::send_message(slow.get(), {{"op", "status"}}, {}, socket);
  std::atomic<bool> done{false};
  std::thread trickle([&] {  // 48 KiB a second: each send finds room again within its socket timeout
    std::vector<char> buffer(48 << 10);
    while (!done && ::recv(slow.get(), buffer.data(), buffer.size(), MSG_DONTWAIT) != 0) std::this_thread::sleep_for(std::chrono::seconds(1));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto start = std::chrono::steady_clock::now();
  std::size_t held = 0;
  EXPECT_NO_THROW(held = cache_status(socket).entries.size()) << "the slow reader held the server past the status's timeout";
  EXPECT_EQ(held, files.size());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  done = true;
  trickle.join();
}

TEST(ResidentCache, DescriptorsWithoutReadAccessGetNothing) {
  // Both in /tmp: the other user below must reach them, and the build folder's parents may be 0700.
  TempDir dir("/tmp");
  const std::string socket = dir.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 8);
  ServerProcess server(socket, "64MiB", {"--mode", "0666"});
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  // O_PATH needs no read permission: such a descriptor must not fetch the bytes.
  const int path_only = ::open(file.c_str(), O_PATH | O_CLOEXEC);
  ASSERT_GE(path_only, 0);
  const std::string name = file;
  cache_detail::Lookup found = cache_detail::lookup(socket, {&path_only, 1}, {&name, 1}, false);
  ::close(path_only);
  ASSERT_EQ(found.copies.size(), 1u);
  EXPECT_EQ(found.copies[0], nullptr);
  EXPECT_GE(cache_status(socket).refused, 1u);

  if (::geteuid() != 0) GTEST_SKIP() << "a second user needs root to become one";
  // Another user, who may not read the file: neither a plain open nor an O_PATH one gets its bytes.
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    if (::open(file.c_str(), O_RDONLY) >= 0) ::_exit(11);  // the file system lets nobody in
    const int fd = ::open(file.c_str(), O_PATH);
    if (fd < 0) ::_exit(12);
    const cache_detail::Lookup got = cache_detail::lookup(socket, {&fd, 1}, {&name, 1}, false);
    if (got.copies.size() != 1) ::_exit(13);
    ::_exit(got.copies[0] ? 14 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: setuid, 11: could open, 12: no O_PATH, 13: no answer, 14: got the bytes";
}

TEST(ResidentCache, AServerThatDiesMeansAPlainLoadOrTheCopyAlreadyHeld) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 9);
  auto server = std::make_unique<ServerProcess>(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  // A handle that found the copy keeps it: the server killed before the read changes nothing.
  OpenedCheckpoint opened(file, std::nullopt, CacheUse::use, socket);
  server->stop(SIGKILL);
  std::vector<std::byte> into(opened.tensors()[0].info->size());
  const Stats stats = opened.read({{.tensor = 0, .offset = 0, .length = into.size(), .into = {into.data(), into.size(), {}}}}, *make_engine("posix"));
  EXPECT_EQ(into, test::pread_range(file, opened.tensors()[0].file_offset, into.size()));
  ASSERT_EQ(stats.paths.size(), 1u);
  EXPECT_EQ(stats.paths[0].path, DataPath::cache_host);
  // A load after it: read from the file, with the reason in its note.
  const Loaded after = load_and_check(file, CacheUse::use, socket);
  EXPECT_FALSE(after.from_cache);
  EXPECT_NE(after.stats.note.find("the resident cache could not help"), std::string::npos) << after.stats.note;
}

TEST(ResidentCache, ClientsKilledMidLoadOrLoadingAtOnceLeaveTheServerAsItWas) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 10, 16, 1 << 20);
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  const CacheStatus before = cache_status(socket);
  // Clients of their own (the command), killed while they load from the cache over and over.
  for (int round = 0; round < 3; ++round) {
    std::string env = "HBMIO_CACHE=" + socket;
    std::vector<std::string> args{cli(), "ckpt", "load", file, "--runs", "200"};
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (char** e = environ; *e; ++e) envp.push_back(*e);
    envp.push_back(env.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t quiet;
    ::posix_spawn_file_actions_init(&quiet);
    ::posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    const int spawned = ::posix_spawn(&pid, cli(), &quiet, nullptr, argv.data(), envp.data());
    ::posix_spawn_file_actions_destroy(&quiet);
    ASSERT_EQ(spawned, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + 100 * round));
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  // Two loads at once, several times each, every one from the cache.
  std::vector<std::thread> clients;
  std::atomic<int> hits{0};
  for (int c = 0; c < 2; ++c)
    clients.emplace_back([&] {
      for (int i = 0; i < 5; ++i) hits += load_and_check(file, CacheUse::use, socket).from_cache ? 1 : 0;
    });
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(hits.load(), 10);
  const CacheStatus after = cache_status(socket);
  EXPECT_EQ(after.host_bytes, before.host_bytes);
  ASSERT_EQ(after.entries.size(), 1u);
  EXPECT_EQ(after.entries[0].state, "ready");
  EXPECT_GT(after.hits, before.hits + 10);  // the killed clients were served too
  EXPECT_EQ(after.clients, 1u);             // this status request's own connection only
}

TEST(ResidentCache, UnreachableOrUnsetMeansAPlainLoad) {
  TempDir dir, sockets("/tmp");
  const std::string file = dir.file("a.safetensors");
  save_sample(file, 11);
  const Loaded nowhere = load_and_check(file, CacheUse::use, sockets.file("nobody.sock"));
  EXPECT_FALSE(nowhere.from_cache);
  EXPECT_NE(nowhere.stats.note.find("No such file or directory"), std::string::npos) << nowhere.stats.note;
  ::unsetenv("HBMIO_CACHE");
  const Loaded unset = load_and_check(file, CacheUse::configured, "");
  EXPECT_EQ(unset.stats.note.find("resident cache"), std::string::npos) << unset.stats.note;
}

TEST(ResidentCache, AClientThatStallsMidRequestOrSpeaksNonsenseLosesOnlyItsConnection) {
  TempDir sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  ServerProcess server(socket, "1MiB");
  // Half a frame's length, then nothing: the one serving thread gives up on it (2 s), not on others.
  cache_detail::OwnedFd stalled = cache_detail::connect_to(socket, 10000);
  ASSERT_EQ(::send(stalled.get(), "\x10\x00", 2, MSG_NOSIGNAL), 2);
  // A frame that is not JSON, and one that asks for something unknown.
  cache_detail::OwnedFd garbled = cache_detail::connect_to(socket, 10000);
  const char frame[] = {3, 0, 0, 0, '{', '{', '{'};
  ASSERT_EQ(::send(garbled.get(), frame, sizeof frame, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof frame));
  cache_detail::OwnedFd unknown = cache_detail::connect_to(socket, 10000);
  cache_detail::send_message(unknown.get(), {{"op", "steal"}}, {}, socket);
  const std::optional<cache_detail::Message> reply = cache_detail::receive_message(unknown.get(), socket);
  ASSERT_TRUE(reply.has_value());
  EXPECT_NE(reply->body.value("error", "").find("unknown request"), std::string::npos) << reply->body.dump();
  const CacheStatus status = cache_status(socket);  // still answers
  EXPECT_EQ(status.entries.size(), 0u);
  EXPECT_LE(status.clients, 2u);  // this request and `unknown`: the stalled and the garbled ones were dropped
}

// A frame of nothing but brackets is refused once it nests past the protocol's depth, before its
// tree is built (a node per bracket: many times the frame in memory, held by the server).
TEST(ResidentCache, AFrameNestedTooDeeplyIsRefusedBeforeItsTreeIsBuilt) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  const cache_detail::OwnedFd writer(pair[0]), reader(pair[1]);
  const std::string text(1 << 16, '[');
  std::string frame(4, '\0');
  for (int k = 0; k < 4; ++k) frame[static_cast<std::size_t>(k)] = static_cast<char>((text.size() >> (8 * k)) & 0xff);
  frame += text;
  std::thread send([&] { (void)::send(writer.get(), frame.data(), frame.size(), MSG_NOSIGNAL); });
  try {
    cache_detail::receive_message(reader.get(), "pair");
    ADD_FAILURE() << "a frame nested 65,536 deep was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code().value(), EPROTO) << e.what();
    EXPECT_NE(e.detail().find("nested deeper"), std::string::npos) << e.what();
  }
  send.join();
  // The protocol's own messages still pass: a copy request's nesting.
  cache_detail::send_message(writer.get(), {{"op", "copy"}, {"copies", {{0, 0, 1, 0, 0}}}, {"allocations", {{{"handle", "00"}}}}}, {}, "pair");
  const std::optional<cache_detail::Message> back = cache_detail::receive_message(reader.get(), "pair");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->body.at("copies").at(0).at(2), 1);
}

// A copy request is served off the serving thread and answers on its own connection, which serves
// the next request after it: one for a file not held, one missing its fields, and one naming no
// GPU this server has all get an error (the client then reads the file), never a lost connection.
TEST(ResidentCache, CopyRequestsAnswerOnTheirConnectionWhichThenServesTheNext) {
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 4, 4, 4096);
  ServerProcess server(socket, "1MiB");
  cache_detail::OwnedFd connection = cache_detail::connect_to(socket, 10000);
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::vector<int> fds{fd};
  const nlohmann::json requests[] = {
      {{"op", "copy"}, {"device", "0000:00:00.0"}, {"allocations", nlohmann::json::array()}, {"copies", nlohmann::json::array()}},
      {{"op", "copy"}},
  };
  for (const nlohmann::json& request : requests) {
    cache_detail::send_message(connection.get(), request, fds, socket);
    const std::optional<cache_detail::Message> reply = cache_detail::receive_message(connection.get(), socket);
    ASSERT_TRUE(reply.has_value()) << request.dump();
    EXPECT_TRUE(reply->body.contains("error")) << reply->body.dump();
  }
  ::close(fd);
  cache_detail::send_message(connection.get(), {{"op", "status"}}, {}, socket);
  const std::optional<cache_detail::Message> status = cache_detail::receive_message(connection.get(), socket);
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->body.value("socket", ""), socket) << status->body.dump();
  EXPECT_EQ(cache_status(socket).clients, 2u);  // this connection and the status request's
}

// `hbmio doctor` says whether loads here ask a cache and whether it answers.
TEST(ResidentCache, TheDoctorSaysWhetherTheConfiguredCacheAnswers) {
  TempDir sockets("/tmp");
  const std::string socket = sockets.file("cache.sock");
  const auto cache_check = [] {
    for (const Check& c : run_doctor({})) if (c.id == "summary.cache") return c;
    throw std::runtime_error("no summary.cache check");
  };
  ::unsetenv("HBMIO_CACHE");
  EXPECT_EQ(cache_check().status, CheckStatus::info);
  ::setenv("HBMIO_CACHE", socket.c_str(), 1);
  const Check down = cache_check();
  EXPECT_EQ(down.status, CheckStatus::warn);
  EXPECT_NE(down.fix.find("hbmio cache serve --socket " + socket), std::string::npos) << down.fix;
  {
    ServerProcess server(socket, "1MiB");
    const Check up = cache_check();
    EXPECT_EQ(up.status, CheckStatus::pass) << up.found;
    EXPECT_NE(up.found.find("0 file(s)"), std::string::npos) << up.found;
  }
  ::unsetenv("HBMIO_CACHE");
}

TEST(ResidentCache, ASecondServerOnTheSameSocketIsRefused) {
  TempDir dir, sockets("/tmp");  // a socket's path has at most 107 bytes: not under a long build path
  const std::string socket = sockets.file("cache.sock");
  ServerProcess server(socket, "1MiB");
  try {
    CacheServer second({.socket = socket, .host_bytes = 1 << 20});
    FAIL() << "a second server took the socket";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EADDRINUSE));
  }
  EXPECT_NO_THROW(cache_status(socket));  // the first still answers
}

// Into GPU memory, a hit is DMA'd by the server from its pinned copy (CUDA IPC into this process's
// allocation), verified against the file's checksums as it lands, and equal to the file.
TEST(GpuResidentCache, AHitIntoGpuMemoryIsTheServersDmaAndEqualsTheFile) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 12, 12, 1 << 20);
  ServerProcess server(socket, "64MiB");
  ASSERT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  const CacheStatus status = cache_status(socket);
  ASSERT_EQ(status.entries.size(), 1u);
  EXPECT_TRUE(status.entries[0].pinned);
  for (const bool verify : {false, true}) {
    const LoadedCheckpoint loaded =
        load_checkpoint(file, {.into = MemoryLocation::parse("cuda:0"), .verify = verify, .cache = CacheUse::use, .cache_socket = socket});
    ASSERT_EQ(loaded.stats().paths.size(), 1u) << loaded.stats().note;
    EXPECT_EQ(loaded.stats().paths[0].path, DataPath::cache_host);
    EXPECT_NE(loaded.stats().paths[0].reason.find("DMA"), std::string::npos) << loaded.stats().paths[0].reason;
    // The note gives the server's share of the time: opening the IPC handles, then the copies.
    EXPECT_NE(loaded.stats().note.find("s opening the destination's IPC handles"), std::string::npos) << loaded.stats().note;
    EXPECT_EQ(loaded.verified(), verify);
    for (const LoadedTensor& t : loaded.tensors()) {
      std::vector<std::byte> back(t.data.size);
      copy_memory({back.data(), back.size(), {}}, t.data);
      EXPECT_EQ(back, test::pread_range(file, t.file_offset, t.data.size)) << t.name;
    }
  }
  // A tensor walk's read into device memory takes the same way.
  OpenedCheckpoint opened(file, std::nullopt, CacheUse::use, socket);
  Buffer into = Buffer::allocate(MemoryLocation::parse("cuda:0"), opened.tensors()[3].info->size());
  const Stats stats = opened.read({{.tensor = 3, .offset = 0, .length = into.span().size, .into = into.span()}}, *make_engine("auto"));
  EXPECT_EQ(stats.paths.at(0).path, DataPath::cache_host);
  std::vector<std::byte> back(into.span().size);
  copy_memory({back.data(), back.size(), {}}, into.span());
  EXPECT_EQ(back, test::pread_range(file, opened.tensors()[3].file_offset, back.size()));
}

}  // namespace

// The device tier: a file added with a GPU is kept in that GPU's memory too, and a load into that
// GPU gets it device to device (path cache-device), equal to the file; a second file that does
// not fit beside it evicts the first one's GPU copy (the host copy stays and serves by DMA).
TEST(GpuResidentCache, TheDeviceTierServesDeviceToDeviceAndEvictsLeastRecentlyUsed) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), a = dir.file("a.safetensors"), b = dir.file("b.safetensors");
  save_sample(a, 21, 8, 1 << 20);
  save_sample(b, 22, 8, 1 << 20);
  ServerProcess server(socket, "64MiB", {"--gpu-memory", "12MiB"});  // room for one 8 MiB file per GPU
  const std::vector<std::string> said = cache_add(socket, {a}, true, {0});
  ASSERT_EQ(said.size(), 1u);
  EXPECT_TRUE(said[0].starts_with("held; on ")) << said[0];
  CacheStatus status = cache_status(socket);
  ASSERT_EQ(status.entries.size(), 1u);
  EXPECT_EQ(status.entries[0].gpus.size(), 1u);
  EXPECT_EQ(status.gpu_bytes, status.entries[0].bytes);
  const auto load_and_check = [&](const std::string& file, DataPath expected) {
    const LoadedCheckpoint loaded = load_checkpoint(file, {.into = MemoryLocation::parse("cuda:0"), .cache = CacheUse::use, .cache_socket = socket});
    ASSERT_EQ(loaded.stats().paths.size(), 1u) << loaded.stats().note;
    EXPECT_EQ(loaded.stats().paths[0].path, expected) << loaded.stats().paths[0].reason;
    for (const LoadedTensor& t : loaded.tensors()) {
      std::vector<std::byte> back(t.data.size);
      copy_memory({back.data(), back.size(), {}}, t.data);
      EXPECT_EQ(back, test::pread_range(file, t.file_offset, t.data.size)) << t.name;
    }
  };
  load_and_check(a, DataPath::cache_device);
  const std::vector<std::string> second = cache_add(socket, {b}, true, {0});
  EXPECT_TRUE(second[0].starts_with("held; on ")) << second[0];
  status = cache_status(socket);
  for (const CacheEntryStatus& e : status.entries) EXPECT_EQ(e.gpus.size(), e.path == b ? 1u : 0u) << e.path;
  load_and_check(b, DataPath::cache_device);
  load_and_check(a, DataPath::cache_host);  // its GPU copy was evicted: DMA'd from the pinned one
}

// A shared load (LoadOptions::share) gets the cache's own copy in the GPU's memory, mapped here:
// nothing copied, the bytes the file's, checked against its checksums on request; the server
// keeps the copy (never evicts it) while a load shares it, and lets it go once the last is gone.
// A file the cache does not hold on that GPU loads as usual and the note says why.
TEST(GpuResidentCache, ASharedLoadMapsTheCachesCopyWhichStaysWhileShared) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  TempDir dir, sockets("/tmp");
  const std::string socket = sockets.file("cache.sock"), a = dir.file("a.safetensors"), b = dir.file("b.safetensors");
  save_sample(a, 31, 8, 1 << 20);
  save_sample(b, 32, 8, 1 << 20);
  ServerProcess server(socket, "64MiB", {"--gpu-memory", "12MiB"});  // room for one 8 MiB file per GPU
  ASSERT_TRUE(cache_add(socket, {a}, true, {0})[0].starts_with("held; on ")) << "a on GPU 0";
  const auto shares = [&] { return cache_status(socket).shares; };
  // The server sees a share end when its connection closes: after the load is gone, soon.
  const auto shares_become = [&](std::uint64_t n) {
    for (int i = 0; i < 250 && shares() != n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return shares();
  };
  const LoadOptions share{.into = MemoryLocation::parse("cuda:0"), .verify = true, .cache = CacheUse::use, .cache_socket = socket, .share = true};
  std::vector<const std::byte*> first_data;
  {
    const LoadedCheckpoint one = load_checkpoint(a, share);
    ASSERT_EQ(one.stats().paths.size(), 1u) << one.stats().note;
    EXPECT_EQ(one.stats().paths[0].path, DataPath::cache_shared) << one.stats().paths[0].reason;
    EXPECT_EQ(one.stats().bytes, 0u) << "nothing is copied";
    EXPECT_TRUE(one.verified()) << "the shared copy was checked against the file's checksums";
    for (const LoadedTensor& t : one.tensors()) {
      std::vector<std::byte> back(t.data.size);
      copy_memory({back.data(), back.size(), {}}, t.data);
      EXPECT_EQ(back, test::pread_range(a, t.file_offset, t.data.size)) << t.name;
      first_data.push_back(t.data.data);
    }
    EXPECT_EQ(shares(), 1u);
    {
      // A second share in this process maps the same copy once more: the same memory.
      const LoadedCheckpoint two = load_checkpoint(a, share);
      for (std::size_t k = 0; k < two.tensors().size(); ++k) EXPECT_EQ(two.tensors()[k].data.data, first_data[k]);
      EXPECT_EQ(shares(), 2u);
    }
    EXPECT_EQ(shares_become(1), 1u);
    // b needs a's room on the GPU, which a shared copy does not give up.
    const std::string said = cache_add(socket, {b}, true, {0})[0];
    EXPECT_NE(said.find("shared with clients"), std::string::npos) << said;
    // The first load's memory is still the file's.
    const LoadedTensor& t = one.tensors().back();
    std::vector<std::byte> back(t.data.size);
    copy_memory({back.data(), back.size(), {}}, t.data);
    EXPECT_EQ(back, test::pread_range(a, t.file_offset, t.data.size));
  }
  EXPECT_EQ(shares_become(0), 0u);
  EXPECT_TRUE(cache_add(socket, {b}, true, {0})[0].starts_with("held; on ")) << "a's copy evicted once unshared";
  // a is no longer on the GPU: a shared load of it is the server's DMA from its host copy, saying why.
  const LoadedCheckpoint plain = load_checkpoint(a, share);
  ASSERT_EQ(plain.stats().paths.size(), 1u);
  EXPECT_EQ(plain.stats().paths[0].path, DataPath::cache_host);
  EXPECT_NE(plain.stats().note.find("not in the memory of GPU"), std::string::npos) << plain.stats().note;
  for (const LoadedTensor& t : plain.tensors()) {
    std::vector<std::byte> back(t.data.size);
    copy_memory({back.data(), back.size(), {}}, t.data);
    EXPECT_EQ(back, test::pread_range(a, t.file_offset, t.data.size)) << t.name;
  }
}

// A copy shared with one user (CUDA IPC maps it writable) is given to no other: another user's
// share of it is refused, and its loads copy from the sealed host copy instead of the GPU's.
TEST(GpuResidentCache, ACopySharedWithOneUserIsGivenToNoOther) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  if (::geteuid() != 0) GTEST_SKIP() << "a second user needs root to become one";
  TempDir dir("/tmp");
  ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
  const std::string socket = dir.file("cache.sock"), file = dir.file("a.safetensors");
  save_sample(file, 41, 8, 1 << 20);
  ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
  ServerProcess server(socket, "64MiB", {"--gpu-memory", "12MiB", "--mode", "0666"});
  ASSERT_TRUE(cache_add(socket, {file}, true, {0})[0].starts_with("held; on "));
  // The other user (uid 65534) shares it, through the command.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    if (::access(cli(), X_OK) != 0) ::_exit(12);  // a parent folder of the build the other user may not enter
    ::setenv("HBMIO_CACHE", socket.c_str(), 1);
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::execl(cli(), cli(), "ckpt", "load", file.c_str(), "--into", "cuda:0", "--share", static_cast<char*>(nullptr));
    ::_exit(11);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 12) GTEST_SKIP() << "the other user cannot run " << cli();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the other user's shared load failed: " << status;
  const LoadedCheckpoint copied = load_checkpoint(file, {.into = MemoryLocation::parse("cuda:0"), .cache = CacheUse::use, .cache_socket = socket});
  ASSERT_EQ(copied.stats().paths.size(), 1u);
  EXPECT_EQ(copied.stats().paths[0].path, DataPath::cache_host) << "not from the copy another user mapped";
  const LoadedCheckpoint shared = load_checkpoint(
      file, {.into = MemoryLocation::parse("cuda:0"), .cache = CacheUse::use, .cache_socket = socket, .share = true});
  ASSERT_EQ(shared.stats().paths.size(), 1u);
  EXPECT_EQ(shared.stats().paths[0].path, DataPath::cache_host);
  EXPECT_NE(shared.stats().note.find("shared with another user"), std::string::npos) << shared.stats().note;
  for (const LoadedCheckpoint* loaded : {&copied, &shared})
    for (const LoadedTensor& t : loaded->tensors()) {
      std::vector<std::byte> back(t.data.size);
      copy_memory({back.data(), back.size(), {}}, t.data);
      EXPECT_EQ(back, test::pread_range(file, t.file_offset, t.data.size)) << t.name;
    }
}

// A server asked for a device tier on a machine without a GPU refuses to start, saying why; a
// client asking for a GPU copy it has no GPU for is refused before it asks.
TEST(ResidentCache, ADeviceTierNeedsAGpuOnBothSides) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU: the refusals are for machines without one";
  TempDir dir, sockets("/tmp");
  try {
    CacheServer server({.socket = sockets.file("cache.sock"), .host_bytes = 1 << 20, .gpu_bytes = 1 << 20});
    ADD_FAILURE() << "a device tier without a GPU was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(ENODEV)) << e.what();
  }
  const std::string socket = sockets.file("cache2.sock"), file = dir.file("a.safetensors");
  save_sample(file, 3);
  ServerProcess server(socket, "4MiB");
  EXPECT_THROW(cache_add(socket, {file}, true, {0}), Error);
  EXPECT_EQ(cache_add(socket, {file}, true), std::vector<std::string>{"held"});
  // A share asked of it is answered per file, no: it has no device tier; a file it does not hold
  // is "not held". The connection stays open for what was shared, and serves the next request.
  const cache_detail::OwnedFd connection = cache_detail::connect_to(socket, 2000);
  const cache_detail::OwnedFd held(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  const std::string other = dir.file("b.safetensors");
  save_sample(other, 4);
  const cache_detail::OwnedFd not_held(::open(other.c_str(), O_RDONLY | O_CLOEXEC));
  const int fds[] = {held.get(), not_held.get()};
  cache_detail::send_message(connection.get(), {{"op", "share"}, {"device", "0000:00:00.0"}}, fds, socket);
  const std::optional<cache_detail::Message> reply = cache_detail::receive_message(connection.get(), socket);
  ASSERT_TRUE(reply.has_value());
  const nlohmann::json results = reply->body.at("results");
  ASSERT_EQ(results.size(), 2u) << reply->body.dump();
  EXPECT_FALSE(results[0].at("shared").get<bool>());
  EXPECT_NE(results[0].at("reason").get<std::string>().find("no device tier"), std::string::npos) << results[0].dump();
  EXPECT_EQ(results[1].at("reason").get<std::string>(), "not held") << results[1].dump();
  EXPECT_EQ(cache_status(socket).shares, 0u);
  // A load that asks to share into host memory, or into several locations, is refused before
  // anything is read.
  const auto refused = [&](const LoadRequest& request, const std::string& said) {
    try {
      load(request);
      ADD_FAILURE() << "accepted: " << said;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), errno_code(EINVAL)) << e.what();
      EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << e.what();
    }
  };
  const LoadOptions share{.cache = CacheUse::use, .cache_socket = socket, .share = true};
  refused({.path = file, .options = share}, "load into a GPU");
  refused({.path = file, .options = share, .locations = {{MemoryKind::host}, {MemoryKind::host}}}, "not with several locations");
}

}  // namespace hbmio
