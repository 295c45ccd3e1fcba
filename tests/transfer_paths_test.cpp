// Stats::paths: every transfer says, per file, which way its bytes took and why. Host memory and
// the host backends here (they run anywhere); the cuFile decision is tested in cufile_tests.cpp
// (plan_cufile_transfer on stated driver facts) and on a GPU in GpuTransferPaths below.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "hbmio/hbmio.hpp"
#include "test_support.hpp"

namespace hbmio {
namespace {

using test::TempDir;

// The one entry of `stats` for `file`; fails the test when there is not exactly one.
const TransferPath& only_path(const Stats& stats, const std::string& file) {
  const auto n = std::count_if(stats.paths.begin(), stats.paths.end(), [&](const TransferPath& p) { return p.file == file; });
  EXPECT_EQ(n, 1) << "entries for " << file << " among " << stats.paths.size();
  static const TransferPath none;
  const auto it = std::find_if(stats.paths.begin(), stats.paths.end(), [&](const TransferPath& p) { return p.file == file; });
  return it == stats.paths.end() ? none : *it;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

bool uring_runs_here() {
  for (const auto& b : probe_backends())
    if (b.name == "uring") return b.available;
  return false;
}

TEST(TransferPaths, AddPathMergesOneFileAndWayAndKeepsOthersApart) {
  Stats s;
  s.add_path({.file = "a", .path = DataPath::uring, .reason = "O_DIRECT", .bytes = 10, .bytes_direct = 10});
  s.add_path({.file = "a", .path = DataPath::uring, .reason = "O_DIRECT", .bytes = 5, .bytes_direct = 5});
  s.add_path({.file = "a", .path = DataPath::uring, .reason = "page cache: unaligned edges", .bytes = 1});
  s.add_path({.file = "a", .path = DataPath::posix, .reason = "pread", .bytes = 2});
  s.add_path({.file = "b", .path = DataPath::uring, .reason = "O_DIRECT", .bytes = 3, .bytes_direct = 3});
  ASSERT_EQ(s.paths.size(), 3u);
  EXPECT_EQ(s.paths[0].bytes, 16u);
  EXPECT_EQ(s.paths[0].bytes_direct, 15u);
  // The second way of the same entry is named once, after the first.
  EXPECT_EQ(s.paths[0].reason, "O_DIRECT; page cache: unaligned edges");
  EXPECT_EQ(s.paths[1].path, DataPath::posix);
  EXPECT_EQ(s.paths[2].file, "b");

  Stats total;
  total.add_part(s);
  total.add_part(s);
  ASSERT_EQ(total.paths.size(), 3u);
  EXPECT_EQ(total.paths[0].bytes, 32u);
  EXPECT_EQ(total.paths[0].reason, "O_DIRECT; page cache: unaligned edges");
  EXPECT_EQ(to_string(DataPath::gds_p2pdma), "gds-p2pdma");
  EXPECT_EQ(to_string(DataPath::cufile_compat), "cufile-compat");
}

TEST(TransferPaths, PosixReadsAndWritesThroughThePageCache) {
  TempDir dir;
  const std::string path = dir.file("data");
  test::write_file(path, test::random_bytes(100000, 1));
  const File file = File::open(path, OpenMode::read);
  std::vector<std::byte> out(100000);
  const Stats s = make_engine("posix", test::small_options())->read(file, 0, {out.data(), out.size(), {}});
  const TransferPath& p = only_path(s, path);
  EXPECT_EQ(p.path, DataPath::posix);
  EXPECT_EQ(p.bytes, 100000u);
  EXPECT_EQ(p.bytes_direct, 0u);
  EXPECT_EQ(p.reason, "pread through the page cache");

  const std::string written = dir.file("written");
  const File out_file = File::open(written, OpenMode::write);
  const Stats w = make_engine("posix", test::small_options())->write(out_file, 0, {out.data(), out.size(), {}});
  EXPECT_EQ(only_path(w, written).reason, "pwrite through the page cache");
}

TEST(TransferPaths, UringSaysWhyNotODirect) {
  if (!uring_runs_here()) GTEST_SKIP() << "io_uring unavailable here";
  TempDir dir;
  const std::string path = dir.file("data");
  test::write_file(path, test::random_bytes(1 << 20, 2));
  std::vector<std::byte> out(1 << 20);
  const MemorySpan host{out.data(), out.size(), {}};

  // Opened without an O_DIRECT descriptor: the file's own reason is given.
  {
    const File file = File::open(path, OpenMode::read, /*with_direct_io=*/false);
    const TransferPath p = only_path(make_engine("uring", test::small_options(DirectIo::on))->read(file, 0, host), path);
    EXPECT_EQ(p.path, DataPath::uring);
    EXPECT_EQ(p.bytes, out.size());
    EXPECT_EQ(p.bytes_direct, 0u);
    EXPECT_EQ(p.reason, "page cache: O_DIRECT refused: opened without O_DIRECT");
  }
  // O_DIRECT off by option.
  {
    const File file = File::open(path, OpenMode::read);
    const TransferPath p = only_path(make_engine("uring", test::small_options(DirectIo::off))->read(file, 0, host), path);
    EXPECT_EQ(p.bytes_direct, 0u);
    EXPECT_TRUE(has(p.reason, "O_DIRECT off by option")) << p.reason;
  }
  const File file = File::open(path, OpenMode::read);
  if (!file.direct_io().supported) GTEST_SKIP() << "no O_DIRECT here: " << file.direct_io().reason;
  // O_DIRECT forced on: every byte bypasses the page cache, the unaligned tail included (its
  // aligned superset is read into a bounce buffer).
  {
    std::vector<std::byte> odd(out.size() - 100);
    const TransferPath p = only_path(make_engine("uring", test::small_options(DirectIo::on))->read(file, 0, {odd.data(), odd.size(), {}}), path);
    EXPECT_EQ(p.bytes, odd.size());
    EXPECT_EQ(p.bytes_direct, odd.size());
    EXPECT_EQ(p.reason, "O_DIRECT");
  }
  // auto, on a file just written (in the page cache): read from memory, and said so.
  {
    const TransferPath p = only_path(make_engine("uring", test::small_options(DirectIo::automatic))->read(file, 0, host), path);
    EXPECT_LT(p.bytes_direct, p.bytes);
    EXPECT_TRUE(has(p.reason, "already cached")) << p.reason;
  }
}

TEST(TransferPaths, UringWritesNameTheirUnalignedEdges) {
  if (!uring_runs_here()) GTEST_SKIP() << "io_uring unavailable here";
  TempDir dir;
  const std::string path = dir.file("written");
  const File file = File::open(path, OpenMode::write);
  if (!file.direct_io().supported) GTEST_SKIP() << "no O_DIRECT here: " << file.direct_io().reason;
  const std::vector<std::byte> data = test::random_bytes((1 << 20) + 100, 3);  // a tail under one block
  const Stats s = make_engine("uring", test::small_options(DirectIo::on))->write(file, 0, {const_cast<std::byte*>(data.data()), data.size(), {}});
  const TransferPath& p = only_path(s, path);
  EXPECT_EQ(p.bytes, data.size());
  EXPECT_EQ(p.bytes_direct, std::uint64_t{1} << 20);
  // Two ways, each with its share.
  EXPECT_TRUE(has(p.reason, "1.00 MiB O_DIRECT")) << p.reason;
  EXPECT_TRUE(has(p.reason, "100 B page cache: unaligned edges")) << p.reason;
}

TEST(TransferPaths, AutoSaysWhatItChoseForHostMemoryAndEachFileOfABatch) {
  TempDir dir;
  const std::string a = dir.file("a"), b = dir.file("b");
  test::write_file(a, test::random_bytes(300000, 4));
  test::write_file(b, test::random_bytes(200000, 5));
  const File fa = File::open(a, OpenMode::read), fb = File::open(b, OpenMode::read);
  std::vector<std::byte> out(500000);
  const IoRequest requests[] = {
      {.op = IoOp::read, .file = &fa, .offset = 0, .memory = {out.data(), 300000, {}}},
      {.op = IoOp::read, .file = &fb, .offset = 0, .memory = {out.data() + 300000, 200000, {}}},
  };
  const Stats s = make_engine("auto", test::small_options())->submit_batch(requests);
  ASSERT_EQ(s.paths.size(), 2u);
  const std::string picked = uring_runs_here() ? "uring" : "posix";
  for (const auto& [file, bytes] : {std::pair{a, 300000u}, std::pair{b, 200000u}}) {
    const TransferPath& p = only_path(s, file);
    EXPECT_EQ(p.bytes, bytes);
    EXPECT_EQ(p.path, uring_runs_here() ? DataPath::uring : DataPath::posix);
    EXPECT_TRUE(p.reason.starts_with("auto chose " + picked + ": host memory, which cuFile does not move; ")) << p.reason;
  }
}

TEST(TransferPaths, LoadsAndSavesReportEveryFileByItsName) {
  TempDir dir;
  std::vector<float> weights(4096, 1.5f), bias(100, 2.0f);
  const std::vector<TensorToSave> tensors = {
      {.name = "w", .dtype = safetensors::Dtype::F32, .shape = {4096}, .data = {reinterpret_cast<std::byte*>(weights.data()), weights.size() * 4, {}}},
      {.name = "b", .dtype = safetensors::Dtype::F32, .shape = {100}, .data = {reinterpret_cast<std::byte*>(bias.data()), bias.size() * 4, {}}},
  };
  // A save writes to a temporary (unnamed, or a hidden name) and renames it: the path names the
  // file where it ends up, for every shard.
  const std::string sharded = dir.file("sharded");
  const Stats saved = save_checkpoint(sharded, tensors, {.backend = "posix", .max_shard_size = 1000});
  ASSERT_EQ(saved.paths.size(), 2u);
  for (const TransferPath& p : saved.paths) {
    EXPECT_TRUE(p.file.starts_with(sharded + "/model-0000")) << p.file;
    EXPECT_EQ(p.path, DataPath::posix);
  }

  const std::string single = dir.file("model.safetensors");
  save_checkpoint(single, tensors, {.backend = "posix"});
  const LoadedCheckpoint loaded = load_checkpoint(single, {.backend = "posix"});
  const TransferPath& p = only_path(loaded.stats(), single);
  EXPECT_EQ(p.bytes, loaded.stats().bytes);
  EXPECT_EQ(p.path, DataPath::posix);

  const LoadedCheckpoint shards = load_checkpoint(sharded, {.backend = "posix"});
  EXPECT_EQ(shards.stats().paths.size(), 2u);

  // A lazy read reports the same way.
  const OpenedCheckpoint opened(single);
  std::vector<std::byte> into(16);
  const auto engine = make_engine("posix");
  const Stats read = opened.read({{.tensor = *opened.find("w"), .offset = 0, .length = 16, .into = {into.data(), 16, {}}}}, *engine);
  EXPECT_EQ(only_path(read, single).bytes, 16u);
}

// The real cuFile path (lead: run with ctest -L gpu on the GPU machine): a read into GPU memory
// through cufile names one of cuFile's three ways, and auto says why it chose what it chose.
TEST(GpuTransferPaths, CufileAndAutoNameTheirWayIntoDeviceMemory) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda_unavailable_reason();
  TempDir dir;
  const std::string path = dir.file("data");
  test::write_file(path, test::random_bytes(4 << 20, 6));
  const File file = File::open(path, OpenMode::read);
  Buffer gpu = Buffer::allocate({MemoryKind::device, 0}, 4 << 20);

  const Stats via_auto = make_engine("auto")->read(file, 0, gpu.span());
  const TransferPath& a = only_path(via_auto, path);
  EXPECT_EQ(a.bytes, std::uint64_t{4} << 20);
  EXPECT_TRUE(a.reason.starts_with("auto chose ")) << a.reason;
  // auto takes cufile only where it moves the file by DMA; otherwise it names what it passed over.
  if (a.path == DataPath::gds_nvidia_fs || a.path == DataPath::gds_p2pdma) EXPECT_TRUE(has(a.reason, "by DMA")) << a.reason;
  else EXPECT_TRUE(has(a.reason, "GPU memory, and it passed over cufile: ")) << a.reason;

  std::unique_ptr<Engine> cufile;
  try {
    cufile = make_engine("cufile");
  } catch (const Error& e) {
    GTEST_SKIP() << "cufile backend unavailable: " << e.what();
  }
  Stats via_cufile;
  try {
    via_cufile = cufile->read(file, 0, gpu.span());
  } catch (const Error& e) {
    GTEST_SKIP() << "cuFile could not read the file (see gds.verdict in hbmio doctor): " << e.what();
  }
  const TransferPath& c = only_path(via_cufile, path);
  EXPECT_TRUE(c.path == DataPath::gds_nvidia_fs || c.path == DataPath::gds_p2pdma || c.path == DataPath::cufile_compat);
  if (c.path == DataPath::cufile_compat) EXPECT_TRUE(c.reason.starts_with("cuFile opened the file in compatibility mode")) << c.reason;
  else EXPECT_TRUE(c.reason.starts_with("cuFile registered the file for DMA")) << c.reason;
}

}  // namespace
}  // namespace hbmio
