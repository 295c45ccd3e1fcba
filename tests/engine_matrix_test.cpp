// Every backend x memory kind x O_DIRECT mode x offsets and lengths around every boundary the
// engines care about (4 KiB blocks, bounce buffers, chunks), compared byte for byte with pread.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <tuple>

#include "test_support.hpp"

namespace hbmio::test {
namespace {

constexpr std::size_t kBounce = 64 << 10, kChunk = 256 << 10;

std::vector<std::size_t> lengths() {
  return {0, 1, 4095, 4096, 4097, kBounce - 1, kBounce, kBounce + 1, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 12345};
}
std::vector<std::uint64_t> offsets() { return {0, 1, 4096, 4097, kBounce - 1, kChunk + 512}; }

using Case = std::tuple<std::string, std::string, DirectIo>;  // backend, memory, direct

std::string case_name(const testing::TestParamInfo<Case>& info) {
  std::string memory = std::get<1>(info.param);
  for (auto& c : memory)
    if (c == ':') c = '_';
  return fmt::format("{}_{}_direct_{}", std::get<0>(info.param), memory, to_string(std::get<2>(info.param)));
}

// Reads every (offset, length) with one engine and compares with pread.
void read_matrix(const Case& param) {
  const auto& [backend, memory, direct] = param;
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const std::size_t file_size = 4 * kChunk + kChunk / 2 + 777;  // not a block multiple
  write_file(path, random_bytes(file_size, 42));
  auto engine = make_engine(backend, small_options(direct));
  File file = File::open(path, OpenMode::read);
  const MemoryLocation where = MemoryLocation::parse(memory);
  for (std::uint64_t offset : offsets()) {
    for (std::size_t length : lengths()) {
      if (offset + length > file_size) continue;
      SCOPED_TRACE(fmt::format("offset {} length {}", offset, length));
      // One byte of slack on each side, poisoned: a read must not write outside its span.
      Buffer buffer = Buffer::allocate(where, length + 2);
      fill_memory(buffer.span(), std::byte{0xA5});
      const MemorySpan span = buffer.span().subspan(1, length);
      const Stats stats = engine->read(file, offset, span);
      EXPECT_EQ(stats.bytes, length);
      EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, length);
      const auto got = to_host(buffer.span());
      ASSERT_EQ(first_mismatch(std::vector<std::byte>(got.begin() + 1, got.end() - 1), pread_range(path, offset, length)), -1);
      ASSERT_EQ(got.front(), std::byte{0xA5});
      ASSERT_EQ(got.back(), std::byte{0xA5});
      if (backend == "uring" && direct == DirectIo::off) {
        EXPECT_EQ(stats.bytes_direct, 0u);
      }
    }
  }
}

// Writes every (offset, length) into a prefilled file; bytes around the range must stay.
void write_matrix(const Case& param) {
  const auto& [backend, memory, direct] = param;
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const std::size_t file_size = 4 * kChunk + 777;
  auto engine = make_engine(backend, small_options(direct));
  const MemoryLocation where = MemoryLocation::parse(memory);
  std::uint64_t seed = 1;
  for (std::uint64_t offset : offsets()) {
    for (std::size_t length : lengths()) {
      if (offset + length > file_size) continue;
      SCOPED_TRACE(fmt::format("offset {} length {}", offset, length));
      auto expected = random_bytes(file_size, seed++);
      write_file(path, expected);
      const auto data = random_bytes(length, seed++);
      std::copy(data.begin(), data.end(), expected.begin() + static_cast<std::ptrdiff_t>(offset));
      Buffer buffer = Buffer::allocate(where, length);
      copy_memory(buffer.span(), {const_cast<std::byte*>(data.data()), data.size(), {}});
      {
        File file = File::open(path, OpenMode::read_write);
        const Stats stats = engine->write(file, offset, buffer.span());
        EXPECT_EQ(stats.bytes, length);
      }
      ASSERT_EQ(first_mismatch(pread_range(path, 0, file_size), expected), -1);
    }
  }
}

// A batch (Engine::submit_batch) of reads over three files, at offsets and lengths around every
// boundary, into sub-spans of one buffer separated by poisoned gaps; then a batch of writes of
// adjacent unaligned ranges, as a checkpoint save issues them. Both compared with pread.
void batch_matrix(const Case& param) {
  const auto& [backend, memory, direct] = param;
  TempDir dir;
  std::vector<std::string> paths;
  std::vector<std::size_t> sizes = {3 * kChunk + 999, kBounce + 5, 2 * kChunk};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    paths.push_back(dir.file(fmt::format("data{}.bin", i)));
    write_file(paths.back(), random_bytes(sizes[i], 100 + i));
  }
  auto engine = make_engine(backend, small_options(direct));
  std::vector<File> files;
  for (const auto& path : paths) files.push_back(File::open(path, OpenMode::read));
  struct Range {
    std::size_t file;
    std::uint64_t offset;
    std::size_t length, at;
  };
  std::vector<Range> ranges;
  std::size_t total = 1;
  for (std::size_t f = 0; f < files.size(); ++f)
    for (std::uint64_t offset : offsets())
      for (std::size_t length : {std::size_t{0}, std::size_t{1}, std::size_t{4097}, kBounce + 1, kChunk + 1}) {
        if (offset + length > sizes[f]) continue;
        ranges.push_back({f, offset, length, total});
        total += length + 1;  // one poisoned byte after each range
      }
  const MemoryLocation where = MemoryLocation::parse(memory);
  Buffer buffer = Buffer::allocate(where, total);
  fill_memory(buffer.span(), std::byte{0xA5});
  // Every read is told once as it lands (LandedSink), and its bytes are in place when it is.
  struct Sink final : LandedSink {
    std::function<bool(std::uint64_t)> in_place;
    std::mutex mutex;
    std::vector<int> told;
    std::vector<std::uint64_t> early;  // told before its bytes were all there
    void landed(std::uint64_t tag) noexcept override {
      const bool ok = in_place(tag);
      std::lock_guard lock(mutex);
      ++told.at(tag);
      if (!ok) early.push_back(tag);
    }
  } sink;
  sink.told.assign(ranges.size(), 0);
  sink.in_place = [&](std::uint64_t tag) {
    const Range& r = ranges[tag];
    try {
      const auto now = to_host(buffer.span().subspan(r.at, r.length));
      return now == pread_range(paths[r.file], r.offset, r.length);
    } catch (...) {
      return false;
    }
  };
  std::vector<IoRequest> requests;
  std::size_t bytes = 0;
  for (const Range& r : ranges) {
    requests.push_back({.op = IoOp::read, .file = &files[r.file], .offset = r.offset, .memory = buffer.span().subspan(r.at, r.length),
                        .landed = &sink, .landed_tag = requests.size()});
    bytes += r.length;
  }
  const Stats stats = engine->submit_batch(requests);
  EXPECT_EQ(sink.told, std::vector<int>(ranges.size(), 1)) << "each read told landed exactly once";
  EXPECT_TRUE(sink.early.empty()) << sink.early.size() << " reads told landed before their bytes were in place, the first "
                                  << (sink.early.empty() ? 0 : sink.early.front());
  EXPECT_EQ(stats.bytes, bytes);
  EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, bytes);
  const auto got = to_host(buffer.span());
  ASSERT_EQ(got[0], std::byte{0xA5});
  for (const Range& r : ranges) {
    SCOPED_TRACE(fmt::format("file {} offset {} length {}", r.file, r.offset, r.length));
    const auto expected = pread_range(paths[r.file], r.offset, r.length);
    if (r.length > 0) ASSERT_EQ(std::memcmp(got.data() + r.at, expected.data(), r.length), 0);
    ASSERT_EQ(got[r.at + r.length], std::byte{0xA5}) << "a read wrote past its span";
  }

  // Writes: a 9-byte "header" and then ranges packed back to back from an unaligned offset.
  const std::string out = dir.file("out.bin");
  std::vector<std::byte> expected = random_bytes(9, 7);
  std::vector<std::size_t> lengths_out = {kBounce + 3, 1, 4096, kChunk + 17, 0, 5000};
  for (std::size_t i = 0; i < lengths_out.size(); ++i) {
    const auto more = random_bytes(lengths_out[i], 200 + i);
    expected.insert(expected.end(), more.begin(), more.end());
  }
  Buffer source = Buffer::allocate(where, expected.size());
  copy_memory(source.span(), {expected.data(), expected.size(), {}});
  {
    File file = File::open(out, OpenMode::create_new);
    std::vector<IoRequest> writes{{.op = IoOp::write, .file = &file, .offset = 0, .memory = source.span().subspan(0, 9)}};
    std::size_t at = 9;
    for (std::size_t length : lengths_out) {
      writes.push_back({.op = IoOp::write, .file = &file, .offset = at, .memory = source.span().subspan(at, length)});
      at += length;
    }
    std::reverse(writes.begin(), writes.end());  // order within a batch does not matter
    {
      std::vector<IoRequest> told = writes;
      told.back().landed = &sink;  // only reads are told as they land
      try {
        engine->submit_batch(told);
        ADD_FAILURE() << "a write naming a LandedSink was taken";
      } catch (const Error& e) {
        EXPECT_EQ(e.code().value(), EINVAL) << e.what();
      }
    }
    const Stats stats = engine->submit_batch(writes);
    EXPECT_EQ(stats.bytes, expected.size());
    // uring gathers writes laid end to end into full pieces: of the whole range only its
    // unaligned end goes through the page cache, however unaligned the requests inside are.
    const DirectIoInfo& dio = file.direct_io();
    const std::size_t a = std::max<std::size_t>({dio.memory_alignment, dio.offset_alignment,
                                                 std::min<std::size_t>(dio.block_size, 4096)});
    if (backend == "uring" && direct != DirectIo::off && dio.supported && a <= 4096) {
      EXPECT_EQ(stats.bytes_buffered, expected.size() % a);
      EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, expected.size());
    }
  }
  ASSERT_EQ(first_mismatch(pread_range(out, 0, expected.size()), expected), -1);
}

class HostReadMatrix : public testing::TestWithParam<Case> {};
TEST_P(HostReadMatrix, MatchesPread) { read_matrix(GetParam()); }
class HostWriteMatrix : public testing::TestWithParam<Case> {};
TEST_P(HostWriteMatrix, ReadsBackIdentical) { write_matrix(GetParam()); }
class HostBatchMatrix : public testing::TestWithParam<Case> {};
TEST_P(HostBatchMatrix, ReadsAndWritesMatchPread) { batch_matrix(GetParam()); }

const auto kHostCases = testing::Combine(testing::Values("posix", "uring", "auto"), testing::Values("host", "pinned"),
                                         testing::Values(DirectIo::off, DirectIo::on, DirectIo::automatic));
INSTANTIATE_TEST_SUITE_P(Backends, HostReadMatrix, kHostCases, case_name);
INSTANTIATE_TEST_SUITE_P(Backends, HostWriteMatrix, kHostCases, case_name);
INSTANTIATE_TEST_SUITE_P(Backends, HostBatchMatrix, kHostCases, case_name);

// The same on GPU memory (ctest label "gpu"); skipped with the reason where there is no GPU.
class GpuReadMatrix : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  }
};
TEST_P(GpuReadMatrix, MatchesPread) { read_matrix(GetParam()); }
class GpuWriteMatrix : public GpuReadMatrix {};
TEST_P(GpuWriteMatrix, ReadsBackIdentical) { write_matrix(GetParam()); }
class GpuBatchMatrix : public GpuReadMatrix {};
TEST_P(GpuBatchMatrix, ReadsAndWritesMatchPread) { batch_matrix(GetParam()); }

const auto kGpuCases = testing::Combine(testing::Values("posix", "uring", "auto"), testing::Values("cuda:0"),
                                        testing::Values(DirectIo::off, DirectIo::on, DirectIo::automatic));
INSTANTIATE_TEST_SUITE_P(Backends, GpuReadMatrix, kGpuCases, case_name);
INSTANTIATE_TEST_SUITE_P(Backends, GpuWriteMatrix, kGpuCases, case_name);
INSTANTIATE_TEST_SUITE_P(Backends, GpuBatchMatrix, kGpuCases, case_name);

// The default options (8 MiB O_DIRECT pieces, page-cache pieces capped at 4 MiB, 16 MiB chunks),
// which the matrices above, with their small buffers, do not reach: a read and a write of 40 MiB
// at unaligned positions in memory and file, each O_DIRECT mode, compared with pread.
void default_options_round_trip(const std::string& memory) {
  TempDir dir;
  const std::string path = dir.file("data.bin");
  const std::size_t file_size = (std::size_t{40} << 20) + 777;
  const auto bytes = random_bytes(file_size, 7);
  write_file(path, bytes);
  const MemoryLocation where = MemoryLocation::parse(memory);
  for (DirectIo direct : {DirectIo::on, DirectIo::off, DirectIo::automatic}) {
    SCOPED_TRACE(to_string(direct));
    Options options;
    options.direct_io = direct;
    auto engine = make_engine("uring", options);
    const std::uint64_t offset = 4097;
    const std::size_t length = file_size - offset - 1000;
    Buffer buffer = Buffer::allocate(where, length + 2);
    const MemorySpan span = buffer.span().subspan(1, length);  // unaligned: through the slots
    {
      File file = File::open(path, OpenMode::read);
      const Stats stats = engine->read(file, offset, span);
      EXPECT_EQ(stats.bytes, length);
      const auto got = to_host(span);
      ASSERT_EQ(first_mismatch(got, pread_range(path, offset, length)), -1);
    }
    // Write it back one byte further on: the file must then hold the shifted bytes there.
    {
      File file = File::open(path, OpenMode::read_write);
      engine->write(file, offset + 1, span);
      file.sync();
    }
    std::vector<std::byte> expected = bytes;
    std::copy(bytes.begin() + static_cast<std::ptrdiff_t>(offset), bytes.begin() + static_cast<std::ptrdiff_t>(offset + length),
              expected.begin() + static_cast<std::ptrdiff_t>(offset + 1));
    ASSERT_EQ(first_mismatch(pread_range(path, 0, file_size), expected), -1);
    write_file(path, bytes);
  }
}
TEST(DefaultOptions, UringReadsAndWritesHostMemory) { default_options_round_trip("host"); }
TEST(GpuDefaultOptions, UringReadsAndWritesDeviceMemory) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  default_options_round_trip("cuda:0");
}

// Where a transfer's time went (Stats::wake_seconds, drain_seconds, copy_wait_seconds): uring
// says it, each within the transfer's wall time (copy waits summed over its workers: within wall
// time times workers; none into host memory, which takes no copy to a GPU); posix says none.
void time_breakdown(const std::string& where) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  const std::size_t size = 48u << 20;
  write_file(path, random_bytes(size, 9));
  Buffer buffer = Buffer::allocate(MemoryLocation::parse(where), size + 1);
  const MemorySpan span = buffer.span().subspan(1, size);  // unaligned: through the slots
  File file = File::open(path, OpenMode::read);
  const Stats uring = make_engine("uring", Options{})->read(file, 0, span);
  EXPECT_EQ(uring.bytes, size);
  EXPECT_GE(uring.wake_seconds, 0.0);
  EXPECT_LE(uring.wake_seconds, uring.seconds);
  EXPECT_GE(uring.drain_seconds, 0.0);
  EXPECT_LE(uring.drain_seconds, uring.seconds);
  EXPECT_LE(uring.copy_wait_seconds, uring.seconds * uring.workers);
  if (where == "host") EXPECT_EQ(uring.copy_wait_seconds, 0.0) << "no copy to a GPU";
  ASSERT_EQ(first_mismatch(to_host(span), pread_range(path, 0, size)), -1);
  const Stats posix = make_engine("posix", Options{})->read(file, 0, span);
  EXPECT_EQ(posix.wake_seconds + posix.drain_seconds + posix.copy_wait_seconds, 0.0);
}
TEST(Stats, UringSaysWhereItsTimeWent) { time_breakdown("host"); }
TEST(GpuStats, UringSaysWhereItsTimeWent) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  time_breakdown("cuda:0");
}

// One write batch laid end to end whose requests come in runs of GPU, pageable and pinned host
// memory (a save of tensors from all three): uring gathers each run of one kind into a range of
// its own, so however small its tensors, only the two ends of each run can go through the page
// cache. The last run (four tensors within one block) is a single edge spanning several
// requests in GPU memory. The file must hold every byte where it belongs.
TEST(GpuMixedBatch, UringGathersRunsOfDeviceAndHostRequests) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  struct Run {
    MemoryKind kind;
    std::vector<std::size_t> lengths;
  };
  std::vector<Run> runs = {{MemoryKind::host, {5000, 3}},  // a host run first: it must not absorb GPU memory
                           {MemoryKind::device, {3 << 20, 1, (8 << 20) + 3, 4096, 777}},
                           {MemoryKind::pinned, {(2 << 20) + 5}},
                           {MemoryKind::device, std::vector<std::size_t>(64, 3000)},  // each under a block
                           {MemoryKind::host, {1}},
                           {MemoryKind::device, {1000, 300, 200, 100}}};
  std::size_t total = 0;
  for (const Run& run : runs)
    for (std::size_t n : run.lengths) total += n;
  const auto expected = random_bytes(total, 31);
  Buffer device = Buffer::allocate(MemoryLocation::parse("cuda:0"), total);
  Buffer pageable = Buffer::allocate({MemoryKind::host}, total);
  Buffer pinned = Buffer::allocate({MemoryKind::pinned}, total);
  copy_memory(device.span(), {const_cast<std::byte*>(expected.data()), total, {}});
  std::memcpy(pageable.data(), expected.data(), total);
  std::memcpy(pinned.data(), expected.data(), total);
  TempDir dir;
  const std::string path = dir.file("mixed.bin");
  for (DirectIo direct : {DirectIo::on, DirectIo::off}) {
    SCOPED_TRACE(to_string(direct));
    Options options;
    options.direct_io = direct;
    auto engine = make_engine("uring", options);
    File file = File::open(path, OpenMode::write);
    std::vector<IoRequest> writes;
    std::size_t at = 0;
    for (const Run& run : runs) {
      const Buffer& from = run.kind == MemoryKind::device ? device : run.kind == MemoryKind::pinned ? pinned : pageable;
      for (std::size_t n : run.lengths) {
        writes.push_back({.op = IoOp::write, .file = &file, .offset = at, .memory = from.span().subspan(at, n)});
        at += n;
      }
    }
    std::reverse(writes.begin(), writes.end());  // order within a batch does not matter
    const Stats stats = engine->submit_batch(writes);
    EXPECT_EQ(stats.bytes, total);
    EXPECT_EQ(stats.bytes_direct + stats.bytes_buffered, total);
    const DirectIoInfo& dio = file.direct_io();
    const std::size_t a = std::max<std::size_t>({dio.memory_alignment, dio.offset_alignment,
                                                 std::min<std::size_t>(dio.block_size, 4096)});
    if (direct == DirectIo::on && dio.supported && a <= 4096) {
      // Two ends per run at most; unjoined, the 64 tensors of 3,000 bytes alone would be 192,000.
      EXPECT_LE(stats.bytes_buffered, 2 * runs.size() * a);
    }
    file.sync();
    ASSERT_EQ(first_mismatch(pread_range(path, 0, total), expected), -1);
    std::filesystem::remove(path);
  }
}

// Past 2 GiB and 4 GiB offsets: a sparse file with random data at the places that matter.
class LargeFile : public testing::TestWithParam<std::string> {};
TEST_P(LargeFile, SparseMultiGiBReadMatchesPread) {
  TempDir dir;
  const std::string path = dir.file("sparse.bin");
  const std::uint64_t size = (std::uint64_t{5} << 30) / 2 + 4097;  // 2.5 GiB + 4097
  {
    File file = File::open(path, OpenMode::write);
    file.truncate(size);
    for (std::uint64_t at : {std::uint64_t{0}, (std::uint64_t{1} << 31) - 5000, std::uint64_t{1} << 31, size - 9000}) {
      const auto block = random_bytes(9000, at);
      ASSERT_EQ(::pwrite(file.fd(), block.data(), block.size(), static_cast<off_t>(at)), 9000);
    }
  }
  Options options;
  options.direct_io = DirectIo::on;
  auto engine = make_engine(GetParam(), options);
  File file = File::open(path, OpenMode::read);
  Buffer buffer = Buffer::allocate({MemoryKind::host}, size - 1);
  engine->read(file, 1, buffer.span());
  const std::size_t step = 64 << 20;
  for (std::uint64_t at = 1; at < size; at += step) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(step, size - at));
    const auto expected = pread_range(path, at, n);
    ASSERT_EQ(std::memcmp(buffer.data() + (at - 1), expected.data(), n), 0) << "in the 64 MiB block at " << at;
  }
}
INSTANTIATE_TEST_SUITE_P(Backends, LargeFile, testing::Values("posix", "uring"));

}  // namespace
}  // namespace hbmio::test
