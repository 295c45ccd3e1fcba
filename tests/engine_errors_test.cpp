// Bad input and faults: each gives an hbmio::Error naming op, path, offset, length and backend
// with the system's own message, and nothing leaks (descriptors, rings, pinned memory).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fmt/format.h>

#include "io/engine_internal.hpp"
#include "testing/fault_injection.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {

class Errors : public testing::TestWithParam<std::string> {
 protected:
  // auto hands host-memory requests to uring, and errors name the backend that failed.
  std::string served_by() const { return GetParam() == "auto" ? "uring" : GetParam(); }
  TempDir dir_;
  std::string path_ = dir_.file("data.bin");
  void SetUp() override { write_file(path_, random_bytes(1 << 20, 7)); }
};

template <typename F>
Error expect_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no hbmio::Error thrown";
  return Error(errno_code(0), {});
}

TEST_P(Errors, MissingFileNamesPathAndErrno) {
  const Error e = expect_error([&] { File::open(dir_.file("missing.bin"), OpenMode::read); });
  EXPECT_EQ(e.code(), std::errc::no_such_file_or_directory);
  EXPECT_NE(std::string(e.what()).find("missing.bin"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
}

TEST_P(Errors, DirectoryIsRefused) {
  const Error e = expect_error([&] { File::open(dir_.path(), OpenMode::read); });
  EXPECT_EQ(e.code(), std::errc::is_a_directory);
}

TEST_P(Errors, NoPermission) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: file permissions do not apply";
  ::chmod(path_.c_str(), 0);
  const Error e = expect_error([&] { File::open(path_, OpenMode::read); });
  EXPECT_EQ(e.code(), std::errc::permission_denied);
}

TEST_P(Errors, ReadPastEndOfFile) {
  auto engine = make_engine(GetParam(), small_options());
  File file = File::open(path_, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, 4096);
  const Error e = expect_error([&] { engine->read(file, (1 << 20) - 100, buffer.span()); });
  EXPECT_EQ(e.code(), std::errc::invalid_argument);
  EXPECT_EQ(e.context().offset, (1u << 20) - 100);
  EXPECT_EQ(e.context().length, 4096u);
  EXPECT_EQ(e.context().backend, served_by());
  EXPECT_NE(std::string(e.what()).find("past the end of the file"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find(path_), std::string::npos) << e.what();
}

TEST_P(Errors, ZeroLengthIsANoOp) {
  auto engine = make_engine(GetParam(), small_options());
  File file = File::open(path_, OpenMode::read);
  const Stats stats = engine->read(file, 1 << 20, MemorySpan{});
  EXPECT_EQ(stats.bytes, 0u);
}

TEST_P(Errors, WrongOpenMode) {
  auto engine = make_engine(GetParam(), small_options());
  File file = File::open(path_, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, 4096);
  const Error e = expect_error([&] { engine->write(file, 0, buffer.span()); });
  EXPECT_EQ(e.code(), std::errc::bad_file_descriptor);
}

TEST_P(Errors, DeviceMemoryWithoutGpuSaysSo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  const Error e = expect_error([&] { Buffer::allocate({MemoryKind::device, 0}, 4096); });
  EXPECT_NE(std::string(e.what()).find(built_with_cuda() ? "no CUDA device" : "built without CUDA"), std::string::npos)
      << e.what();
}

TEST_P(Errors, FileEndsDuringRead) {
  // The injector makes an I/O find the end of the file, as if it shrank under us (posix reads
  // host memory with one pread, so its first I/O; uring's third of sixteen pieces).
  auto faults = std::make_shared<FaultInjector>(FaultPlan{.end_of_file_io = GetParam() == "posix" ? 1u : 3u});
  auto engine = detail::make_engine_with_faults(GetParam(), small_options(DirectIo::off), faults);
  File file = File::open(path_, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, 1 << 20);
  const Error e = expect_error([&] { engine->read(file, 0, buffer.span()); });
  EXPECT_NE(std::string(e.what()).find("file ended at byte"), std::string::npos) << e.what();
}

TEST_P(Errors, ShortTransfersAndRetriesStillDeliverEveryByte) {
  for (DirectIo direct : {DirectIo::off, DirectIo::on}) {
    auto faults = std::make_shared<FaultInjector>(
        FaultPlan{.seed = 99, .short_probability = 0.5, .eagain_count = 5, .eintr_count = 5});
    auto engine = detail::make_engine_with_faults(GetParam(), small_options(direct), faults);
    File file = File::open(path_, OpenMode::read);
    Buffer buffer = Buffer::allocate({MemoryKind::host}, (1 << 20) - 4097);
    engine->read(file, 4097, buffer.span());
    EXPECT_EQ(first_mismatch(to_host(buffer.span()), pread_range(path_, 4097, buffer.size())), -1);
    EXPECT_GT(faults->log().size(), 10u);  // the faults really happened
  }
}

TEST_P(Errors, ShortWritesStillWriteEveryByte) {
  auto faults = std::make_shared<FaultInjector>(FaultPlan{.seed = 5, .short_probability = 0.5, .eagain_count = 3});
  auto engine = detail::make_engine_with_faults(GetParam(), small_options(DirectIo::on), faults);
  const auto data = random_bytes(700000, 3);
  Buffer buffer = Buffer::allocate({MemoryKind::pinned}, data.size());
  std::memcpy(buffer.data(), data.data(), data.size());
  {
    File file = File::open(path_, OpenMode::write);
    engine->write(file, 0, buffer.span());
  }
  EXPECT_EQ(first_mismatch(pread_range(path_, 0, data.size()), data), -1);
  EXPECT_FALSE(faults->log().empty());
}

// SQLite's loop: fail call N for N = 1, 2, ... until the transfer succeeds. Every failure must
// be a clear error, and after each nothing may be left open or allocated.
TEST_P(Errors, EveryCallFailingInTurnLeavesNoLeak) {
  for (IoOp op : {IoOp::read, IoOp::write}) {
    const int fds_before = open_fd_count();
    const MemoryCounters memory_before = memory_counters();
    bool succeeded = false;
    for (std::uint64_t n = 1; n < 500 && !succeeded; ++n) {
      SCOPED_TRACE(fmt::format("{} failing call {}", op == IoOp::read ? "read" : "write", n));
      {
        auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = n, .fail_errno = EIO});
        auto engine = detail::make_engine_with_faults(GetParam(), small_options(DirectIo::on), faults);
        File file = File::open(path_, op == IoOp::read ? OpenMode::read : OpenMode::read_write);
        Buffer buffer = Buffer::allocate({MemoryKind::pinned}, (1 << 20) - 1);
        try {
          engine->submit({.op = op, .file = &file, .offset = 1, .memory = buffer.span()});
          succeeded = true;
          EXPECT_FALSE(faults->fired());
        } catch (const Error& e) {
          EXPECT_TRUE(faults->fired());
          EXPECT_EQ(e.context().backend, served_by());
          EXPECT_EQ(e.context().path, path_);
          EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
          // The same engine serves the next request exactly: nothing of the failed one lingers.
          Buffer poisoned = Buffer::allocate({MemoryKind::host}, 1 << 20);
          fill_memory(poisoned.span(), std::byte{0x5A});
          File reader = File::open(path_, OpenMode::read);
          engine->read(reader, 4096, poisoned.span().subspan(8192, 4096));
          const auto got = to_host(poisoned.span());
          EXPECT_EQ(std::memcmp(got.data() + 8192, pread_range(path_, 4096, 4096).data(), 4096), 0);
          for (std::size_t i = 0; i < got.size(); ++i) {
            if ((i < 8192 || i >= 8192 + 4096) && got[i] != std::byte{0x5A}) {
              ADD_FAILURE() << "byte " << i << " outside the span was written";
              break;
            }
          }
        }
      }
      EXPECT_EQ(open_fd_count(), fds_before);
      const MemoryCounters now = memory_counters();
      EXPECT_EQ(now.pinned_buffers, memory_before.pinned_buffers);
      EXPECT_EQ(now.host_buffers, memory_before.host_buffers);
    }
    EXPECT_TRUE(succeeded);
  }
}

// A batch is checked whole before any I/O: one bad request fails it, naming that request.
TEST_P(Errors, BatchIsCheckedBeforeAnyIo) {
  auto engine = make_engine(GetParam(), small_options(DirectIo::on));
  const std::string other = dir_.file("other.bin");
  write_file(other, random_bytes(4096, 3));
  File a = File::open(path_, OpenMode::read), b = File::open(other, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, 8192);
  fill_memory(buffer.span(), std::byte{0x5A});
  const std::vector<IoRequest> past_end{{.op = IoOp::read, .file = &a, .offset = 0, .memory = buffer.span().subspan(0, 4096)},
                                        {.op = IoOp::read, .file = &b, .offset = 1, .memory = buffer.span().subspan(4096, 4096)}};
  Error e = expect_error([&] { engine->submit_batch(past_end); });
  EXPECT_EQ(e.code(), std::errc::invalid_argument);
  EXPECT_EQ(e.context().path, other);
  EXPECT_EQ(to_host(buffer.span())[0], std::byte{0x5A}) << "the valid request ran before the batch was checked";
  const std::vector<IoRequest> mixed{{.op = IoOp::read, .file = &a, .offset = 0, .memory = buffer.span().subspan(0, 4096)},
                                     {.op = IoOp::write, .file = &a, .offset = 0, .memory = buffer.span().subspan(0, 4096)}};
  e = expect_error([&] { engine->submit_batch(mixed); });
  EXPECT_NE(std::string(e.what()).find("mixes reads and writes"), std::string::npos) << e.what();
  EXPECT_EQ(engine->submit_batch({}).bytes, 0u);
}

// A failure in the middle of a batch names the file of the request that failed, and the engine
// serves the next batch exactly.
TEST_P(Errors, BatchFailureNamesItsRequest) {
  const std::string other = dir_.file("other.bin");
  write_file(other, random_bytes(1 << 20, 3));
  for (std::uint64_t n = 1; n < 200; ++n) {
    SCOPED_TRACE(fmt::format("failing call {}", n));
    auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = n, .fail_errno = EIO});
    auto engine = detail::make_engine_with_faults(GetParam(), small_options(DirectIo::on), faults);
    File a = File::open(path_, OpenMode::read), b = File::open(other, OpenMode::read);
    Buffer buffer = Buffer::allocate({MemoryKind::pinned}, 2 << 20);
    const std::vector<IoRequest> batch{{.op = IoOp::read, .file = &a, .offset = 3, .memory = buffer.span().subspan(0, (1 << 20) - 3)},
                                       {.op = IoOp::read, .file = &b, .offset = 0, .memory = buffer.span().subspan(1 << 20, 1 << 20)}};
    try {
      engine->submit_batch(batch);
      EXPECT_FALSE(faults->fired());
      EXPECT_EQ(first_mismatch(to_host(buffer.span().subspan(1 << 20, 1 << 20)), pread_range(other, 0, 1 << 20)), -1);
      return;
    } catch (const Error& e) {
      EXPECT_TRUE(e.context().path == path_ || e.context().path == other) << e.what();
      EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
    }
  }
  ADD_FAILURE() << "the batch never succeeded";
}

INSTANTIATE_TEST_SUITE_P(Backends, Errors, testing::Values("posix", "uring", "auto"));

TEST(Engines, UnknownBackendIsAClearError) {
  try {
    make_engine("fastest");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("unknown backend"), std::string::npos);
  }
}

// A direct write that is aligned to the device's logical block but not to the file system's
// block is legal, yet ext4 and XFS serialise it; uring writes such heads and tails through the
// page cache instead, so only whole file-system blocks go direct.
TEST(Engines, UringDirectWritesCoverWholeFileSystemBlocks) {
  TempDir dir;
  const std::string path = dir.file("blocks.bin");
  File file = File::open(path, OpenMode::write);
  const DirectIoInfo& dio = file.direct_io();
  if (!dio.supported) GTEST_SKIP() << "no O_DIRECT here: " << dio.reason;
  const std::uint64_t block = std::min<std::uint64_t>(dio.block_size, 4096);
  if (dio.offset_alignment >= block) GTEST_SKIP() << "the device's O_DIRECT alignment is the block size here";
  const std::uint64_t offset = dio.offset_alignment;  // legal for O_DIRECT, not on a block
  const auto data = random_bytes(std::size_t{1} << 20, 7);
  auto engine = make_engine("uring", small_options(DirectIo::on));
  const Stats stats = engine->write(file, offset, {const_cast<std::byte*>(data.data()), data.size(), {}});
  const std::uint64_t end = offset + data.size();
  EXPECT_EQ(stats.bytes_buffered, (block - offset) + (end - end / block * block));
  EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, data.size());
  file.sync();
  EXPECT_EQ(first_mismatch(pread_range(path, offset, data.size()), data), -1);
}

// Where a file has no O_DIRECT descriptor, uring reads through the page cache and says so.
void expect_buffered_fallback(const File& file, const std::vector<std::byte>& data) {
  auto engine = make_engine("uring", small_options(DirectIo::on));
  Buffer buffer = Buffer::allocate({MemoryKind::pinned}, data.size() - 3);
  const Stats stats = engine->read(file, 3, buffer.span());
  EXPECT_EQ(stats.bytes_direct, 0u);
  EXPECT_EQ(stats.bytes_buffered, data.size() - 3);
  EXPECT_NE(stats.note.find("O_DIRECT unavailable"), std::string::npos) << stats.note;
  EXPECT_EQ(std::memcmp(buffer.data(), data.data() + 3, data.size() - 3), 0);
}

TEST(Engines, UringFallsBackWhereODirectIsRefused) {
  if (file_system_type("/dev/shm") != "tmpfs") GTEST_SKIP() << "/dev/shm is not tmpfs here";
  TempDir dir("/dev/shm");
  const std::string path = dir.file("data.bin");
  const auto data = random_bytes(300000, 11);
  write_file(path, data);
  File file = File::open(path, OpenMode::read);
  if (file.direct_io().supported) GTEST_SKIP() << "tmpfs accepts O_DIRECT on this kernel (Linux >= 6.6)";
  EXPECT_NE(file.direct_io().reason.find("tmpfs"), std::string::npos) << file.direct_io().reason;
  expect_buffered_fallback(file, data);
}

TEST(Engines, UringFallsBackWithoutADirectDescriptor) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const auto data = random_bytes(300000, 12);
  write_file(path, data);
  File file = File::open(path, OpenMode::read, /*with_direct_io=*/false);
  EXPECT_FALSE(file.direct_io().supported);
  expect_buffered_fallback(file, data);
}

TEST(Engines, TinyRingAndOneBounceBuffer) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const auto data = random_bytes(1 << 20, 5);
  write_file(path, data);
  Options options = small_options(DirectIo::on);
  options.queue_depth = 1;
  options.bounce_buffers = 1;
  options.workers = 1;
  auto engine = make_engine("uring", options);
  File file = File::open(path, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, data.size() - 10);
  engine->read(file, 5, buffer.span());
  EXPECT_EQ(std::memcmp(buffer.data(), data.data() + 5, buffer.size()), 0);
}

TEST(Engines, AutoDirectIoFollowsThePageCache) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  write_file(path, random_bytes(4 << 20, 8));
  auto engine = make_engine("uring", small_options(DirectIo::automatic));
  File file = File::open(path, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, 4 << 20);
  // Just written: the pages are cached, so auto reads through the cache.
  const Stats warm = engine->read(file, 0, buffer.span());
  EXPECT_EQ(warm.bytes_direct, 0u) << warm.note;
  // Dropped from the cache: auto bypasses it.
  ASSERT_EQ(::fdatasync(file.fd()), 0);
  ASSERT_EQ(::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED), 0);
  const Stats cold = engine->read(file, 0, buffer.span());
  EXPECT_GT(cold.bytes_direct, 0u) << cold.note;
  EXPECT_NE(cold.note.find("chunks cold"), std::string::npos) << cold.note;
}

TEST(Engines, FuturesDeliverTheSameBytes) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const auto data = random_bytes(1 << 20, 9);
  write_file(path, data);
  File file = File::open(path, OpenMode::read);
  auto a = make_engine("uring", small_options());
  auto b = make_engine("posix", small_options());
  Buffer x = Buffer::allocate({MemoryKind::host}, 1 << 19), y = Buffer::allocate({MemoryKind::host}, 1 << 19);
  auto fx = a->submit_async({.op = IoOp::read, .file = &file, .offset = 0, .memory = x.span()});
  auto fy = b->submit_async({.op = IoOp::read, .file = &file, .offset = 1 << 19, .memory = y.span()});
  EXPECT_EQ(fx.get().bytes, 1u << 19);
  EXPECT_EQ(fy.get().bytes, 1u << 19);
  EXPECT_EQ(std::memcmp(x.data(), data.data(), 1 << 19), 0);
  EXPECT_EQ(std::memcmp(y.data(), data.data() + (1 << 19), 1 << 19), 0);
}

}  // namespace
}  // namespace hbmio::test
