// Data-loss regression tests through the C++ API: loads and verifies racing replacements of the
// checkpoint they read never see anything but one published checkpoint, whole (or fail cleanly
// with hbmio::Error), and a load of many shards does not need a descriptor per shard at once.
//
// Two checkpoints A and B have the same tensor names, dtypes and shapes but different bytes and
// metadata of different lengths (so their headers, and every tensor's offset in the file, differ).
// One thread saves A and B in turn at one path; the other loads and verifies that path: each
// load must be byte for byte A or byte for byte B (every tensor and the metadata from the same
// one), and a verify must never report a bad checksum (every file ever published was valid).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {

constexpr std::size_t kTensors = 6;
constexpr std::size_t kTensorBytes = 256 << 10;
constexpr int kIterations = 200;
constexpr auto kTimeLimit = std::chrono::seconds(8);

// One version of the checkpoint, in host memory.
struct Content {
  std::string tag;  // "A" or "B"
  std::map<std::string, std::string> metadata;
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
};

Content make_content(const std::string& tag, std::size_t metadata_length, std::uint64_t seed) {
  Content c;
  c.tag = tag;
  c.metadata = {{"v", std::string(metadata_length, tag == "A" ? 'a' : 'b')}};
  for (std::size_t i = 0; i < kTensors; ++i) {
    const auto bytes = random_bytes(kTensorBytes, seed * 1000 + i);
    c.buffers.push_back(Buffer::allocate({MemoryKind::host}, kTensorBytes));
    std::memcpy(c.buffers.back().data(), bytes.data(), kTensorBytes);
    c.tensors.push_back({fmt::format("layers.{}.weight", i), safetensors::Dtype::F32, {kTensorBytes / 4}, c.buffers.back().span()});
  }
  return c;
}

// Whether `loaded` is exactly `c`: the same tensors (names, dtypes, shapes, bytes) and metadata.
bool same(const LoadedCheckpoint& loaded, const Content& c) {
  if (loaded.tensors().size() != c.tensors.size()) return false;
  const auto v = loaded.metadata().find("v");
  if (v == loaded.metadata().end() || v->second != c.metadata.at("v")) return false;
  for (const TensorToSave& want : c.tensors) {
    const LoadedTensor* got = loaded.find(want.name);
    if (got == nullptr || got->dtype != want.dtype || got->shape != want.shape || got->data.size != want.data.size ||
        got->data.kind() != MemoryKind::host || std::memcmp(got->data.data, want.data.data, want.data.size) != 0)
      return false;
  }
  return true;
}

// For a failure message: what each tensor (and the metadata) matches.
std::string describe(const LoadedCheckpoint& loaded, const Content& a, const Content& b) {
  std::string out = fmt::format("{} tensors;", loaded.tensors().size());
  const auto v = loaded.metadata().find("v");
  out += v == loaded.metadata().end() ? " metadata v: missing;"
                                      : fmt::format(" metadata v: {} bytes of '{}';", v->second.size(), v->second.substr(0, 1));
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const LoadedTensor* got = loaded.find(a.tensors[i].name);
    const auto matches = [&](const TensorToSave& want) {
      return got != nullptr && got->data.size == want.data.size && std::memcmp(got->data.data, want.data.data, want.data.size) == 0;
    };
    out += fmt::format(" {}={}", a.tensors[i].name, got == nullptr ? "missing" : matches(a.tensors[i]) ? "A" : matches(b.tensors[i]) ? "B" : "neither");
  }
  return out;
}

// Where the races run: in memory (/dev/shm) where there is one, so that a save costs no disk
// flush and the writer replaces the checkpoint many times while the loads run (more chances to
// hit a window); else TempDir's default ($HBMIO_TEST_DIR).
std::string race_parent() {
  struct stat st {};
  return ::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "";
}

struct RaceCounts {
  int loads = 0, loads_a = 0, loads_b = 0, load_errors = 0;
  int verifies = 0, verify_errors = 0;
  int saves = 0;
  std::string first_error;
};

// Saves A and B in turn at `path` (a file, or with max_shard_size a directory of shards) while
// this thread loads and verifies it up to kIterations times each, within kTimeLimit.
RaceCounts race(const std::string& path, std::uint64_t max_shard_size) {
  const Content a = make_content("A", 1, 1);
  const Content b = make_content("B", 3000, 2);
  const auto save = [&](const Content& c) {
    save_checkpoint(path, c.tensors, {.metadata = c.metadata, .backend = "posix", .max_shard_size = max_shard_size});
  };
  save(a);
  if (max_shard_size > 0) {
    EXPECT_GE(open_checkpoint(path).size(), 3u) << "the sharded race needs several shards";
  }

  std::atomic<bool> stop{false};
  std::atomic<int> saves{0};
  std::mutex writer_mutex;
  std::string writer_error;
  std::thread writer([&] {
    try {
      for (int i = 0; !stop.load(); ++i) {
        save(i % 2 == 0 ? b : a);
        saves.fetch_add(1);
      }
    } catch (const std::exception& e) {
      const std::lock_guard lock(writer_mutex);
      writer_error = e.what();
    }
  });

  RaceCounts n;
  const auto deadline = std::chrono::steady_clock::now() + kTimeLimit;
  for (int i = 0; i < kIterations && std::chrono::steady_clock::now() < deadline; ++i) {
    try {
      const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {MemoryKind::host}, .backend = "posix"});
      ++n.loads;
      if (same(loaded, a)) {
        ++n.loads_a;
      } else if (same(loaded, b)) {
        ++n.loads_b;
      } else {
        ADD_FAILURE() << "load " << i << " returned neither A nor B: " << describe(loaded, a, b);
      }
    } catch (const Error& e) {  // a clean failure is allowed (never wrong data)
      ++n.load_errors;
      if (n.first_error.empty()) n.first_error = e.what();
    }
    try {
      const VerifyResult r = verify_checkpoint(path);
      ++n.verifies;
      EXPECT_TRUE(r.has_checksums) << "verify " << i;
      EXPECT_FALSE(r.first_bad.has_value()) << "verify " << i << " reported a bad checksum, but every published checkpoint is valid: "
                                           << r.first_bad.value_or("");
      EXPECT_EQ(r.tensors_checked, kTensors) << "verify " << i;
    } catch (const Error& e) {
      ++n.verify_errors;
      if (n.first_error.empty()) n.first_error = e.what();
    }
    if (::testing::Test::HasFailure()) break;  // one mixed load says it; the rest would repeat it
  }
  stop = true;
  writer.join();
  n.saves = saves.load();
  EXPECT_EQ(writer_error, "") << "a save failed";
  // The outcome after the race: the last save is whole.
  const LoadedCheckpoint last = load_checkpoint(path, {.into = {MemoryKind::host}, .backend = "posix", .verify = true});
  EXPECT_TRUE(same(last, a) || same(last, b)) << describe(last, a, b);
  return n;
}

void report(const RaceCounts& n) {
  std::printf("%d loads (%d A, %d B, %d errors), %d verifies (%d errors), %d saves%s%s\n", n.loads, n.loads_a, n.loads_b,
              n.load_errors, n.verifies, n.verify_errors, n.saves, n.first_error.empty() ? "" : "; first error: ",
              n.first_error.c_str());
  if (::testing::Test::HasFailure()) return;  // stopped at the first wrong result: not a full run
  // The race ran: loads saw both versions (a writer too slow for that would test nothing).
  EXPECT_GT(n.loads_a, 0);
  EXPECT_GT(n.loads_b, 0);
  EXPECT_GT(n.saves, 2);
}

TEST(ReplaceRace, SingleFileLoadsAreOldOrNew) {
  TempDir dir(race_parent());
  const RaceCounts n = race(dir.file("model.safetensors"), 0);
  report(n);
  // One file is replaced by one rename, so every verify sees one whole, valid file: a thrown
  // error would be as false a failure as a bad checksum (the CLI's verify exits 1 on either).
  // Loads may fail cleanly (counted above); they must never return wrong bytes.
  EXPECT_EQ(n.verify_errors, 0) << n.first_error;
}

TEST(ReplaceRace, ShardedLoadsAreOldOrNewNeverAMix) {
  TempDir dir(race_parent());
  // Two tensors a shard: 3 shards, each of a different header length in A and in B.
  const RaceCounts n = race(dir.file("model"), 2 * kTensorBytes);
  report(n);
}

// A load of a checkpoint of 40 shards under a soft RLIMIT_NOFILE of 32, in a forked child (the
// limit stays there): it must not need a descriptor for every shard at once.
TEST(ReplaceRace, ManyShardsLoadUnderALowOpenFileLimit) {
  TempDir dir;
  const std::string path = dir.file("model");
  constexpr std::size_t shards = 40, bytes = 4096;
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
  std::vector<std::vector<std::byte>> expected;
  for (std::size_t i = 0; i < shards; ++i) {
    expected.push_back(random_bytes(bytes, 100 + i));
    buffers.push_back(Buffer::allocate({MemoryKind::host}, bytes));
    std::memcpy(buffers.back().data(), expected.back().data(), bytes);
    tensors.push_back({fmt::format("layers.{}.weight", i), safetensors::Dtype::U8, {bytes}, buffers.back().span()});
  }
  save_checkpoint(path, tensors, {.backend = "posix", .max_shard_size = bytes});
  ASSERT_EQ(open_checkpoint(path).size(), shards);

  std::fflush(nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    // In the child: only async-signal-safe habits would be strictly right after fork() in a
    // threaded process, but this process has no other threads here (gtest runs tests on one).
    rlimit limit{};
    if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(10);
    limit.rlim_cur = 32;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) ::_exit(11);
    int status = 0;
    try {
      const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {MemoryKind::host}, .backend = "posix"});
      if (loaded.tensors().size() != shards) {
        std::fprintf(stderr, "child: %zu tensors loaded, not %zu\n", loaded.tensors().size(), shards);
        status = 2;
      }
      for (std::size_t i = 0; i < shards && status == 0; ++i) {
        const LoadedTensor* t = loaded.find(tensors[i].name);
        if (t == nullptr || t->data.size != bytes || std::memcmp(t->data.data, expected[i].data(), bytes) != 0) {
          std::fprintf(stderr, "child: tensor %s is missing or differs\n", tensors[i].name.c_str());
          status = 2;
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: load under RLIMIT_NOFILE 32 failed: %s\n", e.what());
      status = 1;
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the load failed (see the child's message above), 2: wrong data, 10/11: "
                                       "getrlimit/setrlimit failed";
}

}  // namespace
}  // namespace hbmio::test
