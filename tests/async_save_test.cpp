// Background saves (save_checkpoint_async): the call's snapshot is what the file holds, byte for
// byte the file a synchronous save writes; the pinned pool is reused and bounded; one save per
// path; errors reach wait(), the next save of the path, or wait_for_all_saves().
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "hbmio/async_save.hpp"
#include "testing/fault_injection_file_system.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {
namespace fs = std::filesystem;
namespace st = safetensors;

std::vector<std::byte> read_all(const std::string& path) { return pread_range(path, 0, static_cast<std::size_t>(fs::file_size(path))); }

constexpr std::uint64_t pool_blocks(std::uint64_t n) { return n * (std::uint64_t{64} << 20); }  // StagingPool's 64 MiB blocks

// Tensors of several sizes in `where`, one of them larger than a staging block (a tensor cut
// across blocks) and several smaller (blocks shared by tensors), plus an empty one.
struct State {
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;

  // big: with a tensor of 70 MiB, larger than a staging block; otherwise about 10 MiB in all.
  State(MemoryLocation where, std::uint64_t seed, bool big = true) {
    std::vector<std::pair<std::string, std::uint64_t>> specs = {
        {"a", 1000}, {"b", 3 << 20}, {"empty", 0}, {"c", 12345}, {"d", (std::uint64_t{9} << 20) / 2}};
    if (big) specs.insert(specs.begin(), {"big", (std::uint64_t{70} << 20) / 2});
    for (const auto& [name, elements] : specs) {
      const std::size_t size = static_cast<std::size_t>(elements * 2);
      buffers.push_back(Buffer::allocate(where, std::max<std::size_t>(size, 1)));
      tensors.push_back({name, st::Dtype::BF16, {elements}, buffers.back().span().subspan(0, size)});
    }
    fill(seed);
  }
  // New values in every tensor (what a training step does to the state).
  void fill(std::uint64_t seed) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].data.size == 0) continue;
      const auto bytes = random_bytes(tensors[i].data.size, seed * 100 + i);
      copy_memory(tensors[i].data, {const_cast<std::byte*>(bytes.data()), bytes.size(), {}});
    }
  }
};

TEST(AsyncSave, TheFileHoldsTheSnapshotByteForByteAsASynchronousSaveWritesIt) {
  for (const char* memory : {"host", "pinned"}) {
    SCOPED_TRACE(memory);
    TempDir dir;
    State state(MemoryLocation::parse(memory), 1);
    save_checkpoint(dir.file("sync.safetensors"), state.tensors, {.metadata = {{"step", "1"}}});
    const auto expected = read_all(dir.file("sync.safetensors"));
    // A pool of two blocks for a 83 MiB state: the snapshot waits for the writer to drain it.
    SaveInProgress save = save_checkpoint_async(dir.file("async.safetensors"), state.tensors, {.metadata = {{"step", "1"}}},
                                                {.pool_bytes = 2 * (std::uint64_t{64} << 20)});
    state.fill(2);  // the caller changes every tensor as soon as the call returns
    const Stats stats = save.wait();
    EXPECT_GT(stats.bytes, 0u);
    EXPECT_TRUE(read_all(dir.file("async.safetensors")) == expected) << "the file differs from the synchronous save of the snapshot";
    EXPECT_FALSE(verify_checkpoint(dir.file("async.safetensors")).first_bad.has_value());
    const AsyncSaveReport report = save.report();
    EXPECT_EQ(report.staging, Staging::pinned);
    EXPECT_EQ(report.staged_bytes, (std::uint64_t{70} << 20) + 2000 + (6u << 20) + 24690 + (std::uint64_t{9} << 20));
    EXPECT_GT(report.persist_seconds, 0);
    const StagingPoolStats pool = staging_pool_stats();
    EXPECT_LE(pool.allocated, pool.capacity);
    EXPECT_EQ(pool.in_use, 0u);
  }
}

// Tensors of odd sizes (U8), so that the writer's rounds end inside tensors and off the 4 KiB
// grid; their values come from `seed` alone, so a test can say what each should hold.
struct OddState {
  static constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
  explicit OddState(std::uint64_t seed) {
    const std::vector<std::uint64_t> sizes = {1,         4095, 4097, 3 * kMiB + 17, 64 * kMiB - 5, 1000,
                                              65 * kMiB + 3, 0, 12345, 8 * kMiB + 1, 31 * kMiB + 4093};
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      buffers.push_back(Buffer::allocate({MemoryKind::host}, std::max<std::size_t>(sizes[i], 1)));
      tensors.push_back({fmt::format("t{:02}", i), st::Dtype::U8, {sizes[i]}, buffers.back().span().subspan(0, sizes[i])});
    }
    fill(seed);
  }
  static std::vector<std::byte> values(std::uint64_t size, std::uint64_t seed, std::size_t i) {
    return random_bytes(static_cast<std::size_t>(size), seed * 1000 + i);
  }
  void fill(std::uint64_t seed) {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].data.size > 0) {
        const auto bytes = values(tensors[i].data.size, seed, i);
        std::memcpy(tensors[i].data.data, bytes.data(), bytes.size());
      }
  }
};

// Each tensor of `path` read back on its own, with the header parsed here (not by the library),
// against the values of `seed`.
void expect_tensors_hold(const std::string& path, const OddState& state, std::uint64_t seed) {
  const auto length_bytes = pread_range(path, 0, 8);
  std::uint64_t length = 0;
  for (int b = 7; b >= 0; --b) length = length << 8 | static_cast<std::uint8_t>(length_bytes[static_cast<std::size_t>(b)]);
  const auto text = pread_range(path, 8, static_cast<std::size_t>(length));
  const auto header = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(text.data()), text.size()));
  for (std::size_t i = 0; i < state.tensors.size(); ++i) {
    const TensorToSave& t = state.tensors[i];
    SCOPED_TRACE(t.name);
    const auto offsets = header.at(t.name).at("data_offsets");
    const std::uint64_t begin = offsets.at(0), end = offsets.at(1);
    ASSERT_EQ(end - begin, t.data.size);
    EXPECT_TRUE(pread_range(path, 8 + length + begin, static_cast<std::size_t>(end - begin)) == OddState::values(t.data.size, seed, i))
        << "the file does not hold the tensor's values at the call";
  }
}

// The writer takes what the snapshot has staged, a round at a time, while the snapshot goes on:
// with a pool of one block (rounds of one block, the snapshot waiting for each) and of three,
// with and without checksums, every byte lands where it belongs (read back independently), none
// of what the caller wrote after the call returned does, and the file is the blocking save's.
TEST(AsyncSave, WritesOverlappingTheSnapshotPutEveryByteWhereItBelongs) {
  for (const std::uint64_t pool : {pool_blocks(1), pool_blocks(3)})
    for (const bool checksums : {true, false}) {
      SCOPED_TRACE(fmt::format("pool {} MiB, checksums {}", pool >> 20, checksums));
      TempDir dir;
      OddState state(5);
      SaveInProgress save = save_checkpoint_async(dir.file("async.safetensors"), state.tensors,
                                                  {.metadata = {{"note", "x"}}, .checksums = checksums}, {.pool_bytes = pool});
      state.fill(6);  // the caller changes every tensor as soon as the call returns
      save.wait();
      expect_tensors_hold(dir.file("async.safetensors"), state, 5);
      OddState expected(5);
      save_checkpoint(dir.file("sync.safetensors"), expected.tensors, {.metadata = {{"note", "x"}}, .checksums = checksums});
      EXPECT_TRUE(read_all(dir.file("async.safetensors")) == read_all(dir.file("sync.safetensors")));
      if (checksums) EXPECT_FALSE(verify_checkpoint(dir.file("async.safetensors")).first_bad.has_value());
      EXPECT_EQ(staging_pool_stats().in_use, 0u);
    }
}

// The overlapped writer takes a blocking save's write path, however its rounds fell: the same
// bytes direct (O_DIRECT, where the file system takes it) and the same few through the page cache
// (the unaligned head and tail of the data and of the header), with pools of one block and three.
TEST(AsyncSave, TheOverlappedWriterWritesDirectWhereABlockingSaveDoes) {
  if (!backend_available("uring")) GTEST_SKIP() << "the uring backend is not available here";
  for (const std::uint64_t pool : {pool_blocks(1), pool_blocks(3)}) {
    SCOPED_TRACE(fmt::format("pool {} MiB", pool >> 20));
    TempDir dir;
    OddState state(11);
    const Stats blocking = save_checkpoint(dir.file("sync.safetensors"), state.tensors, {.backend = "uring"});
    const Stats background =
        save_checkpoint_async(dir.file("async.safetensors"), state.tensors, {.backend = "uring"}, {.pool_bytes = pool}).wait();
    EXPECT_EQ(background.bytes, blocking.bytes);
    EXPECT_EQ(background.bytes_direct, blocking.bytes_direct);
    EXPECT_EQ(background.bytes_buffered, blocking.bytes_buffered);
    EXPECT_TRUE(read_all(dir.file("async.safetensors")) == read_all(dir.file("sync.safetensors")));
  }
}

// A write failing while the snapshot is still copying: a state of three pool blocks, a pool of
// one, and the write of a byte in the first block or the second failing (the snapshot cannot take
// the next block while a piece of the one before is unwritten). wait() throws the write's error
// (or the call does, if the snapshot met the failure first), the path holds its previous file
// byte for byte, no temporary is left, the snapshot stopped instead of copying the rest for
// nobody, and every staging block came back.
TEST(AsyncSave, AWriteFailingMidSnapshotFailsTheSaveAndKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  OddState old(7);
  save_checkpoint(path, old.tensors);
  const auto old_bytes = read_all(path);
  std::uint64_t total = 0;
  for (const auto& t : old.tensors) total += t.data.size;
  for (const char* backend : {"posix", "uring"})
    for (const std::uint64_t offset : {std::uint64_t{40} << 20, std::uint64_t{100} << 20}) {
      SCOPED_TRACE(fmt::format("{}, the write of byte {}", backend, offset));
      if (std::string(backend) == "uring" && !backend_available("uring")) continue;
      OddState state(8);
      auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_errno = EIO, .fail_offset = offset});
      try {
        SaveInProgress save = save_checkpoint_async(
            path, state.tensors, {.backend = backend, .file_system = std::make_shared<FaultInjectionFileSystem>(faults)},
            {.pool_bytes = pool_blocks(1)});
        state.fill(9);
        try {
          save.wait();
          ADD_FAILURE() << "a save whose write failed reported success";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), std::errc::io_error) << e.what();
        }
        EXPECT_LT(save.report().staged_bytes, total);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), std::errc::io_error) << e.what();
      }
      EXPECT_TRUE(faults->fired());
      EXPECT_TRUE(read_all(path) == old_bytes);
      std::size_t temporaries = 0;
      for (const auto& e : fs::directory_iterator(dir.path())) temporaries += e.path().filename().string().find(".hbmio-tmp-") != std::string::npos;
      EXPECT_EQ(temporaries, 0u);
      EXPECT_EQ(staging_pool_stats().in_use, 0u);
    }
  // And the path saves again.
  OddState fresh(10);
  save_checkpoint_async(path, fresh.tensors).wait();
  expect_tensors_hold(path, fresh, 10);
}

TEST(AsyncSave, ShardedSavesStreamEveryShardAndTheIndex) {
  TempDir dir;
  State state({MemoryKind::host}, 3);
  save_checkpoint(dir.file("sync"), state.tensors, {.max_shard_size = 20 << 20});
  SaveInProgress save = save_checkpoint_async(dir.file("async"), state.tensors, {.max_shard_size = 20 << 20}, {.pool_bytes = 64 << 20});
  state.fill(4);
  save.wait();
  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir.file("sync"))) {
    const std::string name = entry.path().filename().string();
    SCOPED_TRACE(name);
    EXPECT_TRUE(read_all(entry.path().string()) == read_all(dir.file("async/" + name)));
    ++files;
  }
  EXPECT_GE(files, 4u);  // three shards (big, the rest) and the index
}

// The same state saved 50 times from one buffer set that changes after every call: each file
// holds the values of its own call (a staging block reused while still being written would mix
// them), and the pool holds no more than its capacity, none of it lent once the saves are done.
TEST(AsyncSave, FiftySavesReuseThePoolAndEachHoldsItsOwnSnapshot) {
  TempDir dir;
  State state({MemoryKind::host}, 10, false);
  State expected({MemoryKind::host}, 10, false);
  const std::uint64_t capacity = std::uint64_t{64} << 20;  // one block: every save reuses it
  std::vector<SaveInProgress> saves;
  std::vector<std::vector<std::byte>> wanted;
  for (int i = 0; i < 50; ++i) {
    const std::string path = dir.file(fmt::format("step{}.safetensors", i % 5));
    if (saves.size() == 5) {  // five paths in rotation: the sixth save of a path waits for the first
      saves.front().wait();
      saves.erase(saves.begin());
    }
    saves.push_back(save_checkpoint_async(path, state.tensors, {.checksums = i % 2 == 0}, {.pool_bytes = capacity}));
    state.fill(static_cast<std::uint64_t>(i) + 11);
    EXPECT_LE(staging_pool_stats().allocated, capacity);
    if (i >= 45) {
      saves.back().wait();
      expected.fill(static_cast<std::uint64_t>(i) + 10);
      save_checkpoint(dir.file("check.safetensors"), expected.tensors, {.checksums = i % 2 == 0});
      EXPECT_TRUE(read_all(path) == read_all(dir.file("check.safetensors"))) << "save " << i;
    }
  }
  for (auto& s : saves) s.wait();
  EXPECT_EQ(staging_pool_stats().in_use, 0u);
  EXPECT_LE(staging_pool_stats().allocated, capacity);
}

// One save per path: while one is in flight (held here at its rename, which waits for the lock
// of the file it replaces), a second one with wait_if_busy=false is refused with EBUSY; one that
// waits starts when the first has finished, and the path then holds the second.
TEST(AsyncSave, OneSaveOfAPathAtATime) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State first({MemoryKind::host}, 20), second({MemoryKind::host}, 21);
  save_checkpoint(path, first.tensors);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  SaveInProgress held = save_checkpoint_async(path, first.tensors);
  EXPECT_FALSE(held.wait_for(std::chrono::milliseconds(200)));
  try {
    save_checkpoint_async(path, second.tensors, {}, {.wait_if_busy = false});
    ADD_FAILURE() << "a second save of a path in flight was started";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::device_or_resource_busy) << e.what();
  }
  // Another path is not held up.
  SaveInProgress other = save_checkpoint_async(dir.file("other.safetensors"), second.tensors);
  other.wait();
  // A blocking save of the path waits for the background one (else the older state could
  // publish last), and so does a background one.
  std::thread blocking([&] { save_checkpoint(path, second.tensors); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::close(fd);  // the first save publishes, then the blocking one
  blocking.join();
  EXPECT_TRUE(held.done());
  EXPECT_TRUE(read_all(path) == read_all(dir.file("other.safetensors")));
  SaveInProgress next = save_checkpoint_async(path, first.tensors);
  next.wait();
  save_checkpoint(dir.file("first.safetensors"), first.tensors);
  EXPECT_TRUE(read_all(path) == read_all(dir.file("first.safetensors")));
}

// The POSIX file system, whose publishing steps (link, rename, exchange) wait until open_gate().
class GatedFileSystem final : public FileSystem {
 public:
  void open_gate() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    changed_.notify_all();
  }
  File open(const std::string& path, const std::string& shown, OpenMode mode, bool direct) override {
    return base_->open(path, shown, mode, direct);
  }
  void write(const File& f, std::span<const std::byte> b, std::uint64_t o, const ErrorContext& c) override { base_->write(f, b, o, c); }
  void sync(const File& f, const ErrorContext& c) override { base_->sync(f, c); }
  void sync_directory(const std::string& d, const ErrorContext& c) override { base_->sync_directory(d, c); }
  int link(const File& f, const std::string& p) override { return wait(), base_->link(f, p); }
  int rename(const std::string& a, const std::string& b) override { return wait(), base_->rename(a, b); }
  int exchange(const std::string& a, const std::string& b) override { return wait(), base_->exchange(a, b); }
  int make_directory(const std::string& p) override { return base_->make_directory(p); }
  void remove_all(const std::string& p) noexcept override { base_->remove_all(p); }

 private:
  void wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return open_; });
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
  std::shared_ptr<FileSystem> base_ = FileSystem::posix();
};

// A load of a path this process is saving in the background reads what the save publishes, not
// the file it replaces (read your own writes), whichever way the path is named; a failed save
// leaves the old file to read. The save is held by a lock on the file it replaces.
TEST(AsyncSave, ALoadOfAPathBeingSavedReadsWhatTheSavePublishes) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State old_state({MemoryKind::host}, 40, false), new_state({MemoryKind::host}, 41, false);
  save_checkpoint(path, old_state.tensors);
  using Bytes = std::map<std::string, std::vector<std::byte>>;  // by name: a load gives file order
  const auto bytes_of = [](const LoadedCheckpoint& loaded) {
    Bytes out;
    for (const auto& t : loaded.tensors()) out[t.name].assign(t.data.data, t.data.data + t.data.size);
    return out;
  };
  const auto expected = [&](const State& s) {
    Bytes out;
    for (const auto& t : s.tensors) out[t.name].assign(t.data.data, t.data.data + t.data.size);
    return out;
  };
  // The file, another spelling of it, and its directory (which resolves to it).
  for (const std::string& named : {path, dir.path() + "/./model.safetensors", dir.path(), dir.path() + "/"}) {
    SCOPED_TRACE(named);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX), 0);
    SaveInProgress save = save_checkpoint_async(path, new_state.tensors);
    std::atomic<bool> loaded{false};
    Bytes got;
    std::thread reader([&] {
      got = bytes_of(load_checkpoint(named, {.into = {MemoryKind::host}}));
      loaded = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_FALSE(loaded.load()) << "the load did not wait for the save in flight";
    ::close(fd);
    reader.join();
    save.wait();
    EXPECT_TRUE(got == expected(new_state)) << "the load read the file the save replaced";
    std::swap(old_state, new_state);  // the next round saves the other state over this one
  }
  // A first save through a link to a file not there yet: the save's target is where the link
  // points, and a load through the link waits for it (it failed with ENOENT meanwhile). No file
  // to lock: the save is held at its publishing step instead.
  {
    fs::create_directory(dir.file("real"));
    fs::create_symlink("real/m.safetensors", dir.file("link.safetensors"));
    auto gate = std::make_shared<GatedFileSystem>();
    SaveInProgress save = save_checkpoint_async(dir.file("link.safetensors"), new_state.tensors, {.file_system = gate});
    std::atomic<bool> loaded{false};
    Bytes got;
    std::thread reader([&] {
      try {
        got = bytes_of(load_checkpoint(dir.file("link.safetensors"), {.into = {MemoryKind::host}}));
      } catch (const Error& e) {
        ADD_FAILURE() << "a load through the link while its first save was in flight: " << e.what();
      }
      loaded = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_FALSE(loaded.load()) << "the load through the link did not wait for the save in flight";
    gate->open_gate();
    reader.join();
    save.wait();
    EXPECT_TRUE(got == expected(new_state));
  }
  // A failed save: the load reads the file it left (old_state's, after the swap above).
  auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = 2, .fail_errno = EIO});
  SaveInProgress failing = save_checkpoint_async(
      path, new_state.tensors, {.backend = "posix", .file_system = std::make_shared<FaultInjectionFileSystem>(faults)});
  EXPECT_TRUE(bytes_of(load_checkpoint(path, {.into = {MemoryKind::host}})) == expected(old_state));
  EXPECT_THROW(failing.wait(), Error);
}

// A blocking save waiting for its turn behind a background save of the path stops on its stop
// request (Ctrl-C in Python), publishing nothing; a save refused for a blocking save in flight
// says that it is a blocking one.
TEST(AsyncSave, ABlockingSaveWaitingForItsTurnStopsOnRequest) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State first({MemoryKind::host}, 50, false), second({MemoryKind::host}, 51, false);
  save_checkpoint(path, first.tensors);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  SaveInProgress held = save_checkpoint_async(path, first.tensors);
  std::atomic<bool> stop{false};
  std::thread blocking([&] {
    try {
      save_checkpoint(path, second.tensors, {.cancel = &stop});
      ADD_FAILURE() << "a stopped save went on";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::operation_canceled) << e.what();
      EXPECT_NE(std::string(e.what()).find("earlier background save"), std::string::npos) << e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop = true;
  blocking.join();  // returns while the background save is still held
  EXPECT_FALSE(held.done());
  ::close(fd);
  held.wait();
  // A blocking save in flight (held by the lock), and a background save refused behind it.
  fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  std::thread second_blocking([&] { save_checkpoint(path, second.tensors); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // registered, then held by the lock
  try {
    save_checkpoint_async(path, first.tensors, {}, {.wait_if_busy = false}).wait();
    ADD_FAILURE() << "a background save started beside a blocking save of its path";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::device_or_resource_busy) << e.what();
    EXPECT_NE(std::string(e.what()).find("a blocking save of this path"), std::string::npos) << e.what();
  }
  ::close(fd);
  second_blocking.join();
  EXPECT_TRUE(wait_for_all_saves().empty());
  save_checkpoint(dir.file("check.safetensors"), second.tensors);
  EXPECT_TRUE(read_all(path) == read_all(dir.file("check.safetensors")));
}

// A write or fsync failing in the background: wait() throws it, the previous checkpoint is intact
// and no temporary is left. Not waited for, the error is thrown by the next save of the path,
// which does not start, and a save after that one works.
TEST(AsyncSave, BackgroundFailuresAreNeverLost) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State state({MemoryKind::host}, 30);
  save_checkpoint(path, state.tensors);
  const auto old_bytes = read_all(path);
  State changed({MemoryKind::host}, 31);
  for (std::uint64_t call : {1, 3}) {
    SCOPED_TRACE(call);
    auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = call, .fail_errno = ENOSPC});
    SaveInProgress save = save_checkpoint_async(
        path, changed.tensors, {.backend = "posix", .file_system = std::make_shared<FaultInjectionFileSystem>(faults)},
        {.pool_bytes = 64 << 20});
    try {
      save.wait();
      ADD_FAILURE() << "a save whose call " << call << " failed reported success";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::no_space_on_device) << e.what();
    }
    EXPECT_TRUE(read_all(path) == old_bytes);
    // The writer failed at its first write, while the snapshot waited for the pool's one block:
    // the snapshot stopped there instead of copying the rest for nobody.
    if (call == 1) {
      std::uint64_t total = 0;
      for (const auto& t : changed.tensors) total += t.data.size;
      EXPECT_LT(save.report().staged_bytes, total);
    }
  }
  {
    auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = 2, .fail_errno = EIO});
    save_checkpoint_async(path, changed.tensors, {.backend = "posix", .file_system = std::make_shared<FaultInjectionFileSystem>(faults)})
        .detach();
  }
  try {
    save_checkpoint_async(path, changed.tensors).wait();
    ADD_FAILURE() << "an unseen background failure was lost";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::io_error) << e.what();
    EXPECT_NE(std::string(e.what()).find("never waited for"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(read_all(path) == old_bytes);
  {
    auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = 2, .fail_errno = EIO});
    save_checkpoint_async(dir.file("elsewhere.safetensors"), changed.tensors,
                          {.backend = "posix", .file_system = std::make_shared<FaultInjectionFileSystem>(faults)})
        .detach();
  }
  const std::vector<std::string> unseen = wait_for_all_saves();
  ASSERT_EQ(unseen.size(), 1u);
  EXPECT_NE(unseen[0].find("elsewhere.safetensors"), std::string::npos) << unseen[0];
  save_checkpoint_async(path, changed.tensors).wait();
  save_checkpoint(dir.file("check.safetensors"), changed.tensors);
  EXPECT_TRUE(read_all(path) == read_all(dir.file("check.safetensors")));
  std::size_t temporaries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) temporaries += e.path().filename().string().find(".hbmio-tmp-") != std::string::npos;
  EXPECT_EQ(temporaries, 0u);
  EXPECT_EQ(staging_pool_stats().in_use, 0u);
}

TEST(AsyncSave, BadArgumentsAreThrownByTheCall) {
  TempDir dir;
  State state({MemoryKind::host}, 40);
  std::vector<TensorToSave> bad = state.tensors;
  bad[1].shape = {7};
  EXPECT_THROW(save_checkpoint_async(dir.file("x.safetensors"), bad), Error);
  EXPECT_THROW(save_checkpoint_async(dir.file("missing/x.safetensors"), state.tensors), Error);
  fs::create_directory(dir.file("adir"));
  EXPECT_THROW(save_checkpoint_async(dir.file("adir"), state.tensors), Error);
  EXPECT_TRUE(wait_for_all_saves().empty());
}

class GpuAsyncSave : public testing::Test {
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  }
};

// Device tensors, staged in pinned memory and on the device: the file holds the snapshot.
TEST_F(GpuAsyncSave, DeviceTensorsStagedOnTheHostOrTheDevice) {
  for (Staging staging : {Staging::pinned, Staging::device}) {
    TempDir dir;
    State state({MemoryKind::device, 0}, 50);
    save_checkpoint(dir.file("sync.safetensors"), state.tensors);
    SaveInProgress save = save_checkpoint_async(dir.file("async.safetensors"), state.tensors, {}, {.staging = staging});
    state.fill(51);
    save.wait();
    EXPECT_EQ(save.report().staging, staging);
    EXPECT_TRUE(read_all(dir.file("async.safetensors")) == read_all(dir.file("sync.safetensors")));
  }
  EXPECT_EQ(memory_counters().device_buffers, 0);
}


// A stop request (Ctrl-C in Python) while the snapshot blocks: the call throws ECANCELED, nothing
// is published, and the path holds the previous file. The request is made before the call, so
// the snapshot meets it at its first piece whatever the timing; the writer, already started,
// must end without publishing.
TEST(AsyncSave, AStopRequestDuringTheSnapshotPublishesNothing) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State old({MemoryKind::host}, 1, false);
  save_checkpoint(path, old.tensors);
  const auto before = read_all(path);
  State state({MemoryKind::host}, 2);  // 83 MiB over a pool of one block
  std::atomic<bool> stop{true};
  try {
    save_checkpoint_async(path, state.tensors, {}, {.pool_bytes = std::uint64_t{64} << 20, .cancel = &stop});
    ADD_FAILURE() << "a save stopped during its snapshot returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code().value(), ECANCELED) << e.what();
    EXPECT_NE(std::string(e.what()).find("nothing was published"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(read_all(path) == before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  EXPECT_TRUE(wait_for_all_saves().empty()) << "the caller saw the error: the exit handler must not report it";
  EXPECT_EQ(staging_pool_stats().in_use, 0u);
  // The path is free again: the next save of it runs.
  save_checkpoint_async(path, state.tensors).wait();
  EXPECT_TRUE(read_all(path) != before);
}

// cancel() after the call: the save stops before it publishes (wait() throws ECANCELED and the
// path holds the previous file) or had published already (wait() returns and the path holds the
// new file). Either is right; a mix, or ECANCELED with the new file, is not.
TEST(AsyncSave, CancelStopsTheSaveBeforeItPublishesOrNotAtAll) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State old({MemoryKind::host}, 1, false);
  save_checkpoint(path, old.tensors);
  const auto before = read_all(path);
  State state({MemoryKind::host}, 2);
  save_checkpoint(dir.file("expected.safetensors"), state.tensors);
  const auto expected = read_all(dir.file("expected.safetensors"));
  SaveInProgress save = save_checkpoint_async(path, state.tensors);
  save.cancel();
  try {
    save.wait();
    EXPECT_TRUE(read_all(path) == expected);
  } catch (const Error& e) {
    EXPECT_EQ(e.code().value(), ECANCELED) << e.what();
    EXPECT_TRUE(read_all(path) == before);
  }
}

// fork() while a save is in flight: the child has none of its threads. It starts with no saves
// in flight (saves_inherited_at_fork names the inherited one when it was still running), a fresh
// staging pool and engine pool: it saves to the same path and another, with a pool smaller than
// its state, and exits. alarm() bounds a hang in the child (it then dies by SIGALRM). Whether
// the parent's save is still in flight at the fork is timing; the test holds either way.
TEST(AsyncSave, AChildOfForkStartsWithNoSavesInFlight) {
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer cannot start threads in a child of a multi-threaded fork (it dies there); the
  // default, nocuda and ASan builds run this test.
  GTEST_SKIP() << "ThreadSanitizer does not support threads after a multi-threaded fork";
#endif
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  State state({MemoryKind::host}, 3);
  SaveInProgress save = save_checkpoint_async(path, state.tensors, {}, {.pool_bytes = std::uint64_t{64} << 20});
  const bool gpu = cuda_device_count() > 0;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);
    int code = 0;
    try {
      const std::vector<std::string> inherited = saves_inherited_at_fork();
      if (inherited.size() > 1 || (inherited.size() == 1 && inherited[0] != path)) code = 2;
      // A child of fork() may not use CUDA once the parent has (CUDA's rule), and the staging pool is
      // pinned through CUDA where a GPU is present: there the child only checks that it starts
      // clean and exits; its own saves are tested where there is no GPU (CI).
      if (!gpu) {
        State mine({MemoryKind::host}, 4);
        save_checkpoint_async(path, mine.tensors, {}, {.pool_bytes = std::uint64_t{64} << 20}).wait();
        save_checkpoint_async(dir.file("child.safetensors"), mine.tensors, {}, {.pool_bytes = std::uint64_t{64} << 20}).wait();
      }
      if (!wait_for_all_saves().empty()) code = 3;
      // The parent's handle, in the child: it raises instead of waiting for a thread that is not here.
      if (!inherited.empty()) {
        try {
          save.wait();
          code = 4;
        } catch (const Error& e) {
          if (e.code().value() != ECHILD) code = 5;
        }
      }
    } catch (...) {
      code = 6;
    }
    save.detach();  // (the parent's save: never waited for here)
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status)) << "the child did not exit (SIGALRM: it hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  save.wait();
  EXPECT_TRUE(saves_inherited_at_fork().empty()) << "the parent is no child";
  if (gpu) return;
  State expected({MemoryKind::host}, 4);
  save_checkpoint(dir.file("expected.safetensors"), expected.tensors);
  EXPECT_TRUE(read_all(dir.file("child.safetensors")) == read_all(dir.file("expected.safetensors")));
}

}  // namespace
}  // namespace hbmio::test
