// The uring backend's plan (src/io/uring_plan.hpp), without any I/O: how requests become parts
// and chunks, where O_DIRECT is used, and where each chunk lies.
#include <gtest/gtest.h>

#include "io/uring_plan.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {

struct Files {
  TempDir dir;
  File a, b;
  std::vector<std::byte> memory = std::vector<std::byte>(32 << 20);  // destinations (plans only: no I/O)
  Files() {
    write_file(dir.file("a"), random_bytes(1 << 20, 1));
    write_file(dir.file("b"), random_bytes(1 << 20, 2));
    a = File::open(dir.file("a"), OpenMode::read_write);
    b = File::open(dir.file("b"), OpenMode::read_write);
  }
  IoRequest at(IoOp op, const File& f, std::uint64_t offset, std::size_t size, std::size_t memory_offset = 0) {
    return {.op = op, .file = &f, .offset = offset, .memory = {memory.data() + memory_offset, size, {}}};
  }
};

Options with_chunks(std::size_t chunk, DirectIo direct = DirectIo::automatic) {
  Options o;
  o.chunk_size = chunk;
  o.direct_io = direct;
  return o;
}

TEST(UringPlan, ReadsAreAPartEachAndEmptyOnesAreDropped) {
  Files f;
  const std::vector<IoRequest> reads = {f.at(IoOp::read, f.a, 100, 5000), f.at(IoOp::read, f.a, 5100, 0),
                                        f.at(IoOp::read, f.a, 5100, 3000), f.at(IoOp::read, f.b, 0, 70000)};
  const detail::UringPlan plan = detail::plan_batch(reads, with_chunks(64 << 10), "uring");
  ASSERT_EQ(plan.parts.size(), 3u) << "reads laid end to end stay separate parts; the empty one is dropped";
  EXPECT_EQ(plan.bytes, 5000u + 3000u + 70000u);
  EXPECT_EQ(plan.device, -1);
  EXPECT_EQ(plan.parts[0].grid_base, 0u);
  EXPECT_EQ(plan.parts[1].grid_base, 4096u) << "chunks start on the 4 KiB grid below the part";
  EXPECT_EQ(plan.parts[2].chunks, 2u) << "70,000 bytes from offset 0 in 64 KiB chunks";
  EXPECT_EQ(plan.chunks, 1u + 1u + 2u);
  EXPECT_EQ(plan.parts[2].first_chunk, 2u);
}

TEST(UringPlan, WritesEndToEndInOneFileJoinOnePartInFileOrder) {
  Files f;
  // Given out of order, across two files, with a gap in file a.
  const std::vector<IoRequest> writes = {f.at(IoOp::write, f.a, 8192, 4096, 8192), f.at(IoOp::write, f.b, 0, 100),
                                         f.at(IoOp::write, f.a, 0, 8192, 0), f.at(IoOp::write, f.a, 20000, 10)};
  const detail::UringPlan plan = detail::plan_batch(writes, with_chunks(1 << 20), "uring");
  std::size_t joined = 0;
  for (const detail::Part& part : plan.parts) {
    for (std::size_t i = 1; i < part.requests.size(); ++i)
      EXPECT_EQ(part.requests[i - 1]->offset + part.requests[i - 1]->memory.size, part.requests[i]->offset) << "not end to end";
    if (part.requests.size() > 1) {
      ++joined;
      EXPECT_EQ(part.offset(), 0u);
      EXPECT_EQ(part.end(), 12288u);
      EXPECT_EQ(part.context.length, 12288u) << "an error without a piece names the whole run";
    }
  }
  EXPECT_EQ(joined, 1u);
  EXPECT_EQ(plan.parts.size(), 3u) << "a..12288 joined; a@20000 and b apart";
}

TEST(UringPlan, DirectIoOffLeavesEveryPartBufferedAndChunksCoverEachPartOnce) {
  Files f;
  const std::vector<IoRequest> reads = {f.at(IoOp::read, f.a, 1000, 300000), f.at(IoOp::read, f.b, 65536, 131072)};
  for (const DirectIo mode : {DirectIo::off, DirectIo::on}) {
    const detail::UringPlan plan = detail::plan_batch(reads, with_chunks(64 << 10, mode), "uring");
    for (const detail::Part& part : plan.parts) {
      if (mode == DirectIo::off) EXPECT_EQ(part.alignment, 0u);
      else if (part.first().file->direct_io().supported) EXPECT_GT(part.alignment, 0u);
    }
    // Every byte of every part lies in exactly one chunk, in order.
    std::vector<std::uint64_t> covered(plan.parts.size(), 0);
    for (std::uint64_t i = 0; i < plan.chunks; ++i) {
      const detail::ChunkRange c = detail::chunk_range(plan.parts, i, 64 << 10);
      const auto k = static_cast<std::size_t>(c.part - plan.parts.data());
      EXPECT_EQ(c.begin, c.part->offset() + covered[k]) << "chunk " << i << " does not follow the one before";
      EXPECT_LT(c.begin, c.end);
      EXPECT_TRUE(c.end == c.part->end() || c.end % (64 << 10) == 0) << "an interior chunk end off the grid";
      covered[k] += c.end - c.begin;
    }
    for (std::size_t k = 0; k < plan.parts.size(); ++k) EXPECT_EQ(covered[k], plan.parts[k].end() - plan.parts[k].offset());
  }
}

TEST(UringPlan, AJobSmallerThanTwoChunksPerWorkerIsSharedByTheWorkers) {
  Files f;
  Options o;  // 16 MiB chunks
  o.workers = 4;
  const std::vector<IoRequest> one = {f.at(IoOp::read, f.a, 0, 1 << 20)};
  detail::UringPlan plan = detail::plan_batch(one, o, "uring");
  EXPECT_EQ(plan.chunk_size, 256u << 10) << "1 MiB over 4 workers: the smallest share";
  EXPECT_EQ(plan.chunks, 4u);
  const std::vector<IoRequest> group = {f.at(IoOp::read, f.a, 0, 32 << 20)};
  plan = detail::plan_batch(group, o, "uring");
  EXPECT_EQ(plan.chunk_size, 4u << 20) << "32 MiB over 4 workers: two chunks each";
  EXPECT_EQ(plan.chunks, 8u);

  const std::vector<IoRequest> small = {f.at(IoOp::read, f.a, 4096, 100000)};
  plan = detail::plan_batch(small, o, "uring");
  EXPECT_EQ(plan.chunk_size, detail::kMinSharedChunk) << "never below the smallest share";
  EXPECT_EQ(plan.chunks, 1u);

  o.workers = 1;
  plan = detail::plan_batch(one, o, "uring");
  EXPECT_EQ(plan.chunk_size, 1u << 20) << "one worker: the job in one chunk";
  EXPECT_EQ(plan.chunks, 1u);

  o.workers = 3;  // 3.5 MiB / 6 rounds up to 768 KiB
  const std::vector<IoRequest> three = {f.at(IoOp::read, f.a, 0, 7 << 19)};
  plan = detail::plan_batch(three, o, "uring");
  EXPECT_EQ(plan.chunk_size, 768u << 10);
  EXPECT_EQ(plan.chunks, 5u);
  for (std::uint64_t i = 0; i < plan.chunks; ++i)
    EXPECT_EQ(detail::chunk_range(plan.parts, i, plan.chunk_size).end % (4 << 10), 0u) << "chunks stay on the 4 KiB grid";

  o.workers = 2;
  o.chunk_size = o.bounce_buffer_size;
  const std::vector<IoRequest> big(64, f.at(IoOp::read, f.a, 0, 1 << 20));  // 64 MiB in all
  plan = detail::plan_batch(big, o, "uring");
  EXPECT_EQ(plan.chunk_size, o.chunk_size) << "a job of a chunk or more per worker keeps Options::chunk_size";
}

}  // namespace
}  // namespace hbmio::test
