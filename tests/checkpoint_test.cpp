// Checkpoints: the reference implementation's fixtures load exactly as its MANIFEST.json says;
// save -> load round trips across memory kinds and backends; saving is crash-safe under injected
// write and fsync failures; verify catches flipped, swapped and truncated data.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "source/source.hpp"
#include "core/executor.hpp"
#include "hbmio/checkpoint.hpp"
#include "testing/fault_injection_file_system.hpp"
#include "shim/nccl_api.hpp"
#include "sha256.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {
namespace fs = std::filesystem;
namespace st = safetensors;

std::string fixtures() {
  const char* env = std::getenv("HBMIO_FIXTURES");
  return env && *env ? std::string(env) + "/safetensors" : std::string();
}

std::string tensor_sha(const LoadedTensor& t) {
  const auto bytes = to_host(t.data);
  return sha256_hex(bytes.data(), bytes.size());
}

// Every tensor of every fixture file, loaded into `where`, has the manifest's dtype, shape and
// sha256; the sharded fixture loads through its index.
void check_fixtures(MemoryLocation where, const std::string& backend, TensorLayout layout) {
  const std::string dir = fixtures();
  if (dir.empty() || !fs::exists(dir + "/MANIFEST.json")) GTEST_SKIP() << "no fixtures at '" << dir << "' (set HBMIO_FIXTURES)";
  const auto manifest = nlohmann::json::parse(std::ifstream(dir + "/MANIFEST.json"));
  std::size_t files = 0;
  for (const auto& [file, tensors] : manifest.items()) {
    SCOPED_TRACE(file);
    const LoadedCheckpoint loaded = load_checkpoint(dir + "/" + file, {.into = where, .backend = backend, .layout = layout});
    std::size_t count = 0;
    for (const auto& [name, expected] : tensors.items()) {
      if (name == "__metadata__") {
        for (const auto& [k, v] : expected.items()) EXPECT_EQ(loaded.metadata().at(k), v.get<std::string>()) << k;
        continue;
      }
      SCOPED_TRACE(name);
      const LoadedTensor* t = loaded.find(name);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(st::to_string(t->dtype), expected["dtype"].get<std::string>());
      EXPECT_EQ(t->shape, expected["shape"].get<std::vector<std::uint64_t>>());
      EXPECT_EQ(t->data.size, expected["data_offsets"][1].get<std::uint64_t>() - expected["data_offsets"][0].get<std::uint64_t>());
      EXPECT_EQ(tensor_sha(*t), expected["sha256"].get<std::string>());
      if (layout == TensorLayout::single_allocation && t->data.size > 0)
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t->data.data) % 256, 0u);
      ++count;
    }
    EXPECT_EQ(loaded.tensors().size(), count);
    ++files;
  }
  EXPECT_GE(files, 5u);

  // The sharded checkpoint: every tensor of every shard, through the index and through the directory.
  for (const std::string path : {dir + "/sharded/model.safetensors.index.json", dir + "/sharded"}) {
    const LoadedCheckpoint sharded = load_checkpoint(path, {.into = where, .backend = backend, .layout = layout});
    std::size_t total = 0;
    for (const auto& shard : fs::directory_iterator(dir + "/sharded")) {
      if (shard.path().extension() != ".safetensors") continue;
      const LoadedCheckpoint one = load_checkpoint(shard.path().string(), {.into = {MemoryKind::host}});
      for (const auto& t : one.tensors()) {
        const LoadedTensor* s = sharded.find(t.name);
        ASSERT_NE(s, nullptr) << t.name;
        EXPECT_EQ(tensor_sha(*s), tensor_sha(t)) << t.name;
        ++total;
      }
    }
    EXPECT_EQ(sharded.tensors().size(), total);
  }
}

class Fixtures : public testing::TestWithParam<std::tuple<std::string, std::string>> {};
TEST_P(Fixtures, LoadAsTheManifestSays) {
  const auto& [memory, backend] = GetParam();
  check_fixtures(MemoryLocation::parse(memory), backend, TensorLayout::single_allocation);
  check_fixtures(MemoryLocation::parse(memory), backend, TensorLayout::per_tensor);
}
INSTANTIATE_TEST_SUITE_P(Host, Fixtures, testing::Combine(testing::Values("host", "pinned"), testing::Values("posix", "uring", "auto")));

class GpuFixtures : public Fixtures {
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  }
};
TEST_P(GpuFixtures, LoadAsTheManifestSays) {
  const auto& [memory, backend] = GetParam();
  check_fixtures(MemoryLocation::parse(memory), backend, TensorLayout::single_allocation);
}
INSTANTIATE_TEST_SUITE_P(Gpu, GpuFixtures, testing::Combine(testing::Values("cuda:0"), testing::Values("posix", "uring", "auto")));

// Tensors of every dtype and odd sizes, including scalars and empty ones, in `where`.
struct Sample {
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
  std::vector<std::vector<std::byte>> bytes;
};
Sample make_sample(MemoryLocation where) {
  Sample s;
  const std::vector<std::tuple<std::string, st::Dtype, std::vector<std::uint64_t>>> specs = {
      {"embed.weight", st::Dtype::BF16, {300, 129}}, {"norm", st::Dtype::F32, {77}},     {"scalar", st::Dtype::F64, {}},
      {"empty", st::Dtype::I32, {0, 5}},              {"mask", st::Dtype::BOOL, {13}},   {"q8", st::Dtype::I8, {4097}},
      {"big", st::Dtype::F16, {1024, 513}},           {"idx", st::Dtype::I64, {3, 3}}, {"u16", st::Dtype::U16, {5}},
      {"e5m2", st::Dtype::F8_E5M2, {31}},             {"e4m3", st::Dtype::F8_E4M3, {2, 17}},
      {"e8m0", st::Dtype::F8_E8M0, {9}},              {"e4m3fnuz", st::Dtype::F8_E4M3FNUZ, {3}},
      {"e5m2fnuz", st::Dtype::F8_E5M2FNUZ, {1}},      {"i16", st::Dtype::I16, {7, 1}},
      {"u32", st::Dtype::U32, {11}},                   {"c64", st::Dtype::C64, {2, 3}},
      {"u64", st::Dtype::U64, {}},                     {"f4", st::Dtype::F4, {6}},  // packed: 3 bytes
      {"f6a", st::Dtype::F6_E2M3, {4, 3}},             {"f6b", st::Dtype::F6_E3M2, {8}},
      {"f32_empty", st::Dtype::F32, {7, 0}},          {"u8", st::Dtype::U8, {1}}};
  std::uint64_t seed = 1;
  // Every dtype of the format appears at least once.
  std::set<st::Dtype> seen;
  for (const auto& spec : specs) seen.insert(std::get<1>(spec));
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(st::Dtype::F6_E3M2) + 1);  // the enum's last
  for (const auto& [name, dtype, shape] : specs) {
    std::uint64_t elements = 1;
    for (auto d : shape) elements *= d;
    const std::size_t size = elements * st::bits_per_element(dtype) / 8;
    s.bytes.push_back(random_bytes(size, seed++));
    s.buffers.push_back(Buffer::allocate(where, size));
    copy_memory(s.buffers.back().span(), {s.bytes.back().data(), size, {}});
    s.tensors.push_back({name, dtype, shape, s.buffers.back().span()});
  }
  return s;
}

void round_trip(MemoryLocation where, const std::string& backend) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const Sample sample = make_sample(where);
  save_checkpoint(path, sample.tensors, {.metadata = {{"format", "pt"}}, .backend = backend});
  const LoadedCheckpoint loaded = load_checkpoint(path, {.into = where, .backend = backend, .verify = true});
  EXPECT_TRUE(loaded.verified());
  EXPECT_EQ(loaded.metadata().at("format"), "pt");
  ASSERT_EQ(loaded.tensors().size(), sample.tensors.size());
  for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
    const LoadedTensor* t = loaded.find(sample.tensors[i].name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, sample.tensors[i].dtype);
    EXPECT_EQ(t->shape, sample.tensors[i].shape);
    EXPECT_EQ(first_mismatch(to_host(t->data), sample.bytes[i]), -1) << t->name;
  }
  EXPECT_FALSE(verify_checkpoint(path).first_bad.has_value());
  // A subset by name.
  const LoadedCheckpoint two = load_checkpoint(path, {.into = where, .backend = backend, .names = {"norm", "q8"}});
  EXPECT_EQ(two.tensors().size(), 2u);
  try {
    load_checkpoint(path, {.names = {"nope"}});
    ADD_FAILURE() << "an unknown name was loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("no tensor named 'nope'"), std::string::npos) << e.what();
  }

  // Into the caller's memory, twice (the second load overwrites the first in place): byte for
  // byte the same, every tensor inside the given span, nothing past plan_load().bytes touched.
  const LoadOptions into_mine{.into = where, .backend = backend};
  const std::uint64_t need = plan_load({.path = path, .options = into_mine}).bytes;
  Buffer mine = Buffer::allocate(where, need + 1);
  fill_memory(mine.span(), std::byte{0x5A});
  LoadOptions reuse = into_mine;
  reuse.destination = mine.span();
  for (int run = 0; run < 2; ++run) {
    const LoadedCheckpoint again = load_checkpoint(path, reuse);
    for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
      const LoadedTensor* t = again.find(sample.tensors[i].name);
      ASSERT_NE(t, nullptr);
      EXPECT_TRUE(t->data.size == 0 || (t->data.data >= mine.data() && t->data.data + t->data.size <= mine.data() + need)) << t->name;
      EXPECT_EQ(first_mismatch(to_host(t->data), sample.bytes[i]), -1) << t->name;
    }
  }
  EXPECT_EQ(to_host(mine.span()).back(), std::byte{0x5A});
  // plan_load says where each tensor lands: exactly where the load put it.
  {
    const LoadedCheckpoint again = load_checkpoint(path, reuse);
    const auto plan = plan_load({.path = path, .options = into_mine}).tensors;
    ASSERT_EQ(plan.size(), again.tensors().size());
    for (std::size_t i = 0; i < plan.size(); ++i) {
      EXPECT_EQ(plan[i].name, again.tensors()[i].name);
      EXPECT_EQ(plan[i].size, again.tensors()[i].data.size);
      if (plan[i].size > 0) EXPECT_EQ(plan[i].memory_offset, static_cast<std::uint64_t>(again.tensors()[i].data.data - mine.data()));
    }
    EXPECT_EQ(plan.back().memory_offset + plan.back().size, need);
    // Opened once, planned and loaded from the same parsed headers: the same layout and bytes.
    const std::vector<CheckpointFile> files = open_checkpoint(path);
    const auto plan_again = plan_load({.path = path, .files = &files, .options = into_mine}).tensors;
    ASSERT_EQ(plan_again.size(), plan.size());
    for (std::size_t i = 0; i < plan.size(); ++i) EXPECT_EQ(plan_again[i].memory_offset, plan[i].memory_offset) << plan[i].name;
    fill_memory(mine.span(), std::byte{0x5A});
    const LoadResult result = load({.path = path, .files = &files, .options = reuse});
    ASSERT_EQ(result.locations.size(), 1u);
    const LoadedCheckpoint& opened = result.locations.front();
    EXPECT_EQ(result.bytes_from_storage, opened.stats().bytes);
    ASSERT_EQ(opened.tensors().size(), sample.tensors.size());
    for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
      const LoadedTensor* t = opened.find(sample.tensors[i].name);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(first_mismatch(to_host(t->data), sample.bytes[i]), -1) << t->name;
    }
    const std::vector<CheckpointFile> none;
    EXPECT_THROW(load({.path = path, .files = &none, .options = reuse}), Error);
  }
  reuse.destination = mine.span().subspan(0, need - 1);
  try {
    load_checkpoint(path, reuse);
    ADD_FAILURE() << "a destination one byte short was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::no_space_on_device) << e.what();
  }
  reuse.destination = mine.span();
  reuse.layout = TensorLayout::per_tensor;
  EXPECT_THROW(load_checkpoint(path, reuse), Error);
}

class RoundTrip : public testing::TestWithParam<std::tuple<std::string, std::string>> {};
TEST_P(RoundTrip, SaveThenLoadIsByteIdentical) {
  const auto& [memory, backend] = GetParam();
  round_trip(MemoryLocation::parse(memory), backend);
}
INSTANTIATE_TEST_SUITE_P(Host, RoundTrip, testing::Combine(testing::Values("host", "pinned"), testing::Values("posix", "uring", "auto")));

class GpuRoundTrip : public RoundTrip {
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  }
};
TEST_P(GpuRoundTrip, SaveThenLoadIsByteIdentical) {
  const auto& [memory, backend] = GetParam();
  round_trip(MemoryLocation::parse(memory), backend);
}
INSTANTIATE_TEST_SUITE_P(Gpu, GpuRoundTrip, testing::Combine(testing::Values("cuda:0"), testing::Values("posix", "uring", "auto")));

std::vector<std::byte> read_all(const std::string& path) {
  return pread_range(path, 0, static_cast<std::size_t>(fs::file_size(path)));
}

std::size_t temporaries_in(const std::string& dir) {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().find(".hbmio-tmp-") != std::string::npos;
  return n;
}

// An engine with one worker, for the fault loops below: with several, the workers set up their
// rings in parallel and the order of calls varies from run to run, so "fail call n for every n"
// could skip the data writes altogether (it did on a 16-core machine).
Options one_worker() {
  Options options = Options::from_env();
  options.workers = 1;
  return options;
}

// Every call of a save that can fail (each write, the file's fsync, the directory's fsync) failing
// in turn, with EIO and with ENOSPC: the save throws that error, never reports success once a
// fault fired, and the name holds the complete old or (a failure after the rename: the
// directory's fsync) the complete new checkpoint. Temporary files are gone after the next save.
TEST(CrashSafety, InjectedWriteAndFsyncFailuresKeepTheOldCheckpoint) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const Sample old_sample = make_sample({MemoryKind::host});
  Sample new_sample = make_sample({MemoryKind::host});
  for (auto& b : new_sample.buffers) fill_memory(b.span(), std::byte{0x42});
  save_checkpoint(path, new_sample.tensors);
  const auto new_bytes = read_all(path);
  save_checkpoint(path, old_sample.tensors);
  const auto old_bytes = read_all(path);
  for (int err : {EIO, ENOSPC}) {
    bool succeeded = false;
    int after_rename = 0;
    std::set<std::string> failed;  // what the injected faults hit
    for (std::uint64_t n = 1; n < 200 && !succeeded; ++n) {
      SCOPED_TRACE(fmt::format("errno {} at call {}", err, n));
      auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = n, .fail_errno = err});
      try {
        save_checkpoint(path, new_sample.tensors,
                        {.backend = "uring", .engine_options = one_worker(), .file_system = std::make_shared<FaultInjectionFileSystem>(faults)});
        succeeded = true;
        EXPECT_FALSE(faults->fired()) << "a save whose call " << n << " failed reported success";
      } catch (const Error& e) {
        EXPECT_TRUE(faults->fired()) << e.what();
        EXPECT_EQ(e.code().value(), err) << e.what();
        const auto now = read_all(path);
        // Before the rename: the old file, untouched. After it (the directory's fsync): the new one
        // is in place, and the error says so rather than "nothing happened".
        if (e.context().op == "make the save durable") {
          EXPECT_TRUE(now == new_bytes) << "published, yet not the new checkpoint: " << e.what();
          EXPECT_NE(std::string(e.what()).find("is in place"), std::string::npos) << e.what();
          ++after_rename;
        } else {
          EXPECT_TRUE(now == old_bytes) << "a failure before the rename changed the file: " << e.what();
        }
        for (const std::string& line : faults->log()) failed.insert(line.substr(line.find(':') + 2));
      }
      save_checkpoint(path, old_sample.tensors);  // the old one again for the next call
    }
    EXPECT_TRUE(succeeded);
    const auto hit = [&](const std::string& what) {
      return std::any_of(failed.begin(), failed.end(), [&](const std::string& f) { return f.starts_with(what + " "); });
    };
    EXPECT_TRUE(hit("fsync")) << "the file's fsync was never failed";
    EXPECT_TRUE(hit("fsync of the directory")) << "the directory's fsync was never failed";
    EXPECT_EQ(after_rename, 1) << "the failure after the rename was not reported as such";
    EXPECT_TRUE(hit("io_uring write")) << "no data write was failed";
    EXPECT_EQ(temporaries_in(dir.path()), 0u);
  }
}

TEST(CrashSafety, StaleTemporariesAreRemovedAndModeFollowsTheUmask) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_file(dir.file(".m.safetensors.hbmio-tmp-deadbeef"), random_bytes(100, 1));
  const Sample sample = make_sample({MemoryKind::host});
  const mode_t old_mask = ::umask(022);
  save_checkpoint(path, sample.tensors);
  ::umask(old_mask);
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  // Two masks (so no fixed mode passes), for a file and for every file of a sharded checkpoint.
  for (const mode_t mask : {mode_t{022}, mode_t{077}, mode_t{002}}) {
    SCOPED_TRACE(fmt::format("umask {:03o}", mask));
    const std::string one = dir.file(fmt::format("u{:03o}.safetensors", mask));
    const std::string sharded = dir.file(fmt::format("u{:03o}", mask));
    const mode_t previous = ::umask(mask);
    save_checkpoint(one, sample.tensors);
    save_checkpoint(sharded, sample.tensors, {.max_shard_size = 600000});
    ::umask(previous);
    const auto mode = [](const std::string& p) { return static_cast<mode_t>(fs::status(p).permissions() & fs::perms::all); };
    EXPECT_EQ(mode(one), 0666 & ~mask);
    EXPECT_EQ(mode(sharded), 0777 & ~mask) << "the checkpoint directory";
    std::size_t files = 0;
    for (const auto& entry : fs::directory_iterator(sharded)) {
      EXPECT_EQ(mode(entry.path().string()), 0666 & ~mask) << entry.path();
      ++files;
    }
    EXPECT_GT(files, 2u);
  }
}

TEST(CrashSafety, RefusesASymlinkSwappedInForTheTemporaryName) {
  // O_EXCL | O_NOFOLLOW: opening a name that exists (even as a dangling symlink) fails.
  TempDir dir;
  const std::string target = dir.file("victim");
  fs::create_symlink(target, dir.file("tmp-link"));
  EXPECT_THROW(File::open(dir.file("tmp-link"), OpenMode::create_new), Error);
  EXPECT_FALSE(fs::exists(target));
}

// Corruption: each is detected by verify, naming the tensor.
class Corruption : public testing::Test {
 protected:
  TempDir dir_;
  std::string path_ = dir_.file("c.safetensors");
  st::Header header_;
  void SetUp() override {
    const Sample sample = make_sample({MemoryKind::host});
    save_checkpoint(path_, sample.tensors, {.metadata = {{"format", "pt"}}});
    header_ = st::read_header(path_);
    ASSERT_FALSE(verify_checkpoint(path_).first_bad.has_value());
  }
  void patch(std::uint64_t offset, const std::vector<std::byte>& bytes) {
    File f = File::open(path_, OpenMode::read_write, false);
    ASSERT_EQ(::pwrite(f.fd(), bytes.data(), bytes.size(), static_cast<off_t>(offset)), static_cast<ssize_t>(bytes.size()));
  }
};

TEST_F(Corruption, FlippedDataByteNamesTheTensor) {
  const st::TensorInfo* t = header_.find("embed.weight");
  const std::uint64_t at = header_.data_offset + t->begin + 1000;
  auto byte = pread_range(path_, at, 1);
  byte[0] ^= std::byte{1};
  patch(at, byte);
  const VerifyResult r = verify_checkpoint(path_);
  ASSERT_TRUE(r.first_bad.has_value());
  const std::string named = fmt::format("tensor 'embed.weight' in {} starting at byte {}", path_, header_.data_offset + t->begin);
  EXPECT_NE(r.first_bad->find(named), std::string::npos) << *r.first_bad;
  try {
    load_checkpoint(path_, {.verify = true});
    ADD_FAILURE() << "a load with verify accepted a flipped byte";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
  }
}

TEST_F(Corruption, SwappedTensorsAreDetected) {
  // The 72 bytes of "idx" trade places with the first 72 bytes of "big": every size stays valid,
  // only the bytes move, so only the checksums can tell. The first of the two in the file is named.
  const st::TensorInfo* a = header_.find("idx");
  const st::TensorInfo* b = header_.find("big");
  const auto a_bytes = pread_range(path_, header_.data_offset + a->begin, a->size());
  const auto b_bytes = pread_range(path_, header_.data_offset + b->begin, a->size());
  patch(header_.data_offset + a->begin, b_bytes);
  patch(header_.data_offset + b->begin, a_bytes);
  const VerifyResult r = verify_checkpoint(path_);
  ASSERT_TRUE(r.first_bad.has_value());
  const st::TensorInfo* first = a->begin < b->begin ? a : b;
  EXPECT_NE(r.first_bad->find(fmt::format("tensor '{}' in {} starting at byte {}", first->name, path_, header_.data_offset + first->begin)),
            std::string::npos)
      << *r.first_bad;
}

// The source's reads told as the engine lands them, on the pool or (landed_quick) on the engine's
// threads, through each backend that runs here: every byte of every read is told once, in pieces
// that tile the read (a read of more than 64 MiB is told in pieces), each with its bytes in place;
// a throw from landed fails the call with that exception.
class SourceLanded : public testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(SourceLanded, TellsEveryByteOnceWithItsBytes) {
  const auto& [backend, quick] = GetParam();
  if (backend == "uring" && !backend_available("uring")) GTEST_SKIP() << "the uring backend is not available here";
  TempDir dir;
  const std::string path = dir.file("s.safetensors");
  Sample sample = make_sample({MemoryKind::host});
  // One tensor of 80 MiB: a read told in two pieces.
  Buffer large = Buffer::allocate({MemoryKind::host}, std::size_t{80} << 20);
  for (std::size_t i = 0; i < large.size(); ++i) large.data()[i] = static_cast<std::byte>(i * 7 + i / 4096);
  sample.tensors.push_back({"large", st::Dtype::U8, {large.size()}, large.span()});
  save_checkpoint(path, sample.tensors);
  const std::vector<CheckpointFile> files = open_checkpoint(path);
  std::vector<std::vector<std::byte>> into;
  std::vector<detail::RangeRead> reads;
  for (const auto& t : files.front().header.tensors) {
    into.emplace_back(t.size());
    reads.push_back({0, files.front().header.data_offset + t.begin, {into.back().data(), into.back().size(), {}}});
  }
  std::mutex mutex;
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> told(reads.size());
  const auto lease = EnginePool::shared().acquire(backend);
  detail::ReadRangesOptions options{.engine = [&]() -> Engine& { return *lease; }, .landed_quick = quick};
  options.landed = [&](std::size_t i, std::uint64_t at, std::uint64_t length) {
    const auto on_disk = pread_range(path, reads[i].offset + at, static_cast<std::size_t>(length));
    EXPECT_EQ(std::memcmp(into[i].data() + at, on_disk.data(), on_disk.size()), 0)
        << "read " << i << " bytes " << at << ".." << at + length << " told before they were in";
    std::lock_guard lock(mutex);
    told[i].emplace_back(at, length);
  };
  const Stats stats = detail::read_ranges(files, reads, options);
  EXPECT_EQ(stats.note.find("batches"), std::string::npos) << "one engine batch: " << stats.note;
  std::size_t pieces = 0, nonempty = 0;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    nonempty += reads[i].into.size > 0 ? 1 : 0;
    std::sort(told[i].begin(), told[i].end());
    std::uint64_t next = 0;
    for (const auto& [at, length] : told[i]) {
      EXPECT_EQ(at, next) << "read " << i << ": a gap or an overlap in what was told";
      next = at + length;
    }
    EXPECT_EQ(next, reads[i].into.size) << "read " << i;
    pieces += told[i].size();
  }
  EXPECT_EQ(pieces, nonempty + 1) << "every read in one piece but the 80 MiB one, in two";

  // A check that fails fails the call with its own exception, after the reads in flight are done.
  const std::size_t bad = reads.size() - 1;
  options.landed = [&](std::size_t i, std::uint64_t, std::uint64_t) {
    if (i == bad) throw Error(make_error_code(Errc::verify_failed), {.op = "verify", .path = path}, "the last read");
  };
  try {
    detail::read_ranges(files, reads, options);
    ADD_FAILURE() << "a throw from landed was lost";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the last read"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, SourceLanded,
                         testing::Combine(testing::Values("posix", "uring"), testing::Bool()),
                         [](const testing::TestParamInfo<std::tuple<std::string, bool>>& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_quick" : "_on_pool");
                         });

// A directory opens as its index, or as its one .safetensors file, except where that file names
// itself one shard of several (model-00001-of-00004.safetensors without the index: a sharded
// checkpoint another tool is still writing, or copied in part): then an error naming it, never
// a quarter of the model loaded as the whole.
// A single-file save into a directory that held a sharded checkpoint: loading the directory gives
// the new model.safetensors (as transformers, which looks for it first), not the old index's shards.
TEST(Directories, ModelSafetensorsBesideAnIndexIsTheCheckpoint) {
  TempDir dir;
  const std::string target = dir.file("model");
  fs::create_directory(target);
  const Sample old = make_sample({MemoryKind::host});
  save_checkpoint(target, old.tensors, {.max_shard_size = 300000});
  Sample now = make_sample({MemoryKind::host});  // the same tensors with other bytes
  for (std::size_t i = 0; i < now.bytes.size(); ++i) {
    for (std::byte& b : now.bytes[i]) b ^= std::byte{0x5A};
    copy_memory(now.buffers[i].span(), {now.bytes[i].data(), now.bytes[i].size(), {}});
  }
  save_checkpoint(target + "/model.safetensors", now.tensors);
  ASSERT_TRUE(fs::exists(target + "/model.safetensors.index.json"));
  const LoadedCheckpoint loaded = load_checkpoint(target, {.verify = true});
  ASSERT_EQ(loaded.tensors().size(), now.tensors.size());
  for (std::size_t i = 0; i < now.tensors.size(); ++i)
    EXPECT_EQ(first_mismatch(to_host(loaded.find(now.tensors[i].name)->data), now.bytes[i]), -1) << now.tensors[i].name;
}

TEST(Directories, OneShardOfSeveralWithoutItsIndexIsRefused) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string partial = dir.file("partial");
  fs::create_directories(partial);
  save_checkpoint(partial + "/model-00001-of-00004.safetensors", sample.tensors);
  try {
    (void)open_checkpoint(partial);
    ADD_FAILURE() << "one shard of 4 opened as a whole checkpoint";
  } catch (const Error& e) {
    EXPECT_EQ(e.code().value(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("model-00001-of-00004.safetensors, shard 00001 of 00004"), std::string::npos) << e.what();
  }
  EXPECT_EQ(open_checkpoint(partial + "/model-00001-of-00004.safetensors").size(), 1u) << "named, it opens alone";
  for (const char* name : {"model-00001-of-00001.safetensors", "model.safetensors", "weights-v2.safetensors", "a-1-of-x.safetensors"}) {
    const std::string one = dir.file(std::string("one-") + name);
    fs::create_directories(one);
    save_checkpoint(one + "/" + name, sample.tensors);
    EXPECT_EQ(open_checkpoint(one).size(), 1u) << name << ": the directory's one file";
  }
}

// Which source reads what: read_ranges hands each read to the first source that serves it. A local
// file is the engine's (LocalFiles); the resident cache's DMA (ResidentDma) takes only reads into
// GPU memory of files the cache holds; objects at URLs are RemoteObjects' alone.
TEST(Source, EachReadGoesToTheSourceThatServesIt) {
  TempDir dir;
  const std::string path = dir.file("s.safetensors");
  const Sample sample = make_sample({MemoryKind::host});
  save_checkpoint(path, sample.tensors);
  const std::vector<CheckpointFile> files = open_checkpoint(path);
  detail::LocalFiles local;
  detail::RemoteObjects remote;
  detail::ResidentDma resident(local);
  std::byte byte{};
  const detail::RangeRead to_host{0, files.front().header.data_offset, {&byte, 1, {MemoryKind::host}}};
  // serves() looks at the destination's kind only: no GPU is needed to ask.
  const detail::RangeRead to_gpu{0, files.front().header.data_offset, {&byte, 1, {MemoryKind::device, 0}}};
  const detail::ReadRangesOptions plain;
  EXPECT_TRUE(local.serves(files.front(), to_host, plain));
  EXPECT_FALSE(remote.serves(files.front(), to_host, plain)) << "a local file is no object at a URL";
  EXPECT_FALSE(resident.serves(files.front(), to_gpu, plain)) << "no resident cache was asked";
  detail::ResidentCopies copies;
  copies.files = {files.front().file};  // as if the cache held this file
  copies.held = 1;
  const detail::ReadRangesOptions with_cache{.resident = &copies};
  EXPECT_TRUE(resident.serves(files.front(), to_gpu, with_cache)) << "into GPU memory: the cache's server DMAs it";
  EXPECT_FALSE(resident.serves(files.front(), to_host, with_cache)) << "into host memory: the local source reads the cache's copy";
  copies.files = {nullptr};
  copies.held = 0;
  EXPECT_FALSE(resident.serves(files.front(), to_gpu, with_cache)) << "a file the cache does not hold";
}

// A load started on the pool (what Python's load_file does while it builds views) gives the same
// result as load(), rethrows what the load throws, and waits for the load when dropped.
TEST(Source, ALoadStartedOnThePoolIsALoad) {
  TempDir dir;
  const std::string path = dir.file("b.safetensors");
  const Sample sample = make_sample({MemoryKind::host});
  save_checkpoint(path, sample.tensors);
  const std::uint64_t size = plan_load({.path = path}).bytes;
  Buffer dest = Buffer::allocate({MemoryKind::host}, static_cast<std::size_t>(size));
  const LoadRequest request{.path = path, .options = {.destination = dest.span()}};
  LoadInProgress started = load_started(request);
  const LoadResult result = started.wait();
  ASSERT_EQ(result.locations.size(), 1u);
  const LoadedCheckpoint& loaded = result.locations.front();
  ASSERT_EQ(loaded.tensors().size(), sample.tensors.size());
  for (const auto& t : sample.tensors) {
    const LoadedTensor* got = loaded.find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    ASSERT_EQ(got->data.size, t.data.size) << t.name;
    if (t.data.size > 0)  // an empty tensor has no bytes (and may have no address)
      EXPECT_EQ(std::memcmp(got->data.data, t.data.data, t.data.size), 0) << t.name << ": the bytes saved";
  }
  EXPECT_THROW(started.wait(), Error) << "waited for once";
  const LoadRequest missing{.path = dir.file("none.safetensors")};
  LoadInProgress failing = load_started(missing);
  try {
    failing.wait();
    ADD_FAILURE() << "a missing file loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code().value(), ENOENT) << e.what();
  }
  { LoadInProgress dropped = load_started(request); }  // waits: `dest` is not written after this
  // A load told to stop (LoadOptions::cancel) throws ECANCELED, on each backend.
  for (const char* backend : {"posix", "uring"}) {
    std::atomic<bool> cancel{true};
    try {
      load({.path = path, .options = {.backend = backend, .destination = dest.span(), .cancel = &cancel}});
      ADD_FAILURE() << backend << ": a cancelled load returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code().value(), ECANCELED) << backend << ": " << e.what();
    }
  }
  // A temporary request: the job reads its own copy (under ASan, a job that kept a reference
  // would read a request gone out of scope).
  std::memset(dest.span().data, 0, dest.span().size);
  LoadInProgress from_temporary = load_started(LoadRequest{.path = path, .options = {.destination = dest.span()}});
  const LoadResult again = from_temporary.wait();
  for (const auto& t : sample.tensors) {
    const LoadedTensor* got = again.locations.front().find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    if (t.data.size > 0) EXPECT_EQ(std::memcmp(got->data.data, t.data.data, t.data.size), 0) << t.name;
  }
}

// A verified load of one file whose tensors lie back to back in one read is checked piece by
// piece, and a flipped byte in its last tensor is still named.
TEST(Source, AVerifiedLoadOfOneLargeReadNamesAFlippedByte) {
  TempDir dir;
  const std::string path = dir.file("v.safetensors");
  std::vector<Buffer> buffers;
  std::vector<TensorToSave> tensors;
  for (int k = 0; k < 5; ++k) {
    buffers.push_back(Buffer::allocate({MemoryKind::host}, std::size_t{24} << 20));
    for (std::size_t i = 0; i < buffers.back().size(); i += 4096) buffers.back().data()[i] = static_cast<std::byte>(i / 4096 + k);
    tensors.push_back({fmt::format("t{}", k), st::Dtype::U8, {buffers.back().size()}, buffers.back().span()});
  }
  save_checkpoint(path, tensors);
  EXPECT_TRUE(load_checkpoint(path, {.verify = true}).verified());
  const st::Header header = st::read_header(path);
  const st::TensorInfo* last = header.find("t4");
  const std::uint64_t at = header.data_offset + last->begin + last->size() - 1;
  auto byte = pread_range(path, at, 1);
  byte[0] ^= std::byte{0x40};
  {
    File f = File::open(path, OpenMode::read_write, false);
    ASSERT_EQ(::pwrite(f.fd(), byte.data(), 1, static_cast<off_t>(at)), 1);
  }
  try {
    load_checkpoint(path, {.verify = true});
    ADD_FAILURE() << "a verified load accepted a flipped byte";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 't4'"), std::string::npos) << e.what();
  }
}

// Every single-bit flip anywhere in the header (length, JSON, padding; two different bits per
// byte) is caught: refused by the parser, or named by verify through the header's own checksum,
// which also sees what the tensors' checksums cannot (a metadata value, a checksum's letter case).
TEST_F(Corruption, EveryFlippedHeaderBitIsDetected) {
  const auto original = read_all(path_);
  EXPECT_EQ(verify_checkpoint(path_).headers_checked, 1u);
  std::size_t refused = 0, named = 0;
  for (std::uint64_t at = 0; at < header_.data_offset; ++at)
    for (const std::byte bit : {std::byte{0x01}, std::byte{0x20}}) {
      auto flipped = original;
      flipped[at] ^= bit;
      write_file(path_, flipped);
      try {
        const VerifyResult r = verify_checkpoint(path_);
        ASSERT_TRUE(r.first_bad.has_value()) << "flip of bit " << std::to_integer<int>(bit) << " at byte " << at << " undetected";
        ++named;
      } catch (const Error&) {
        ++refused;
      }
    }
  EXPECT_GT(named, 0u);  // both ways of catching a flip were exercised
  EXPECT_GT(refused, 0u);
  // A metadata value changed in case only: valid JSON, same sizes; the header checksum names it.
  auto edited = original;
  const std::string text(reinterpret_cast<const char*>(original.data()), header_.data_offset);
  const std::size_t value = text.find("\"format\":\"pt\"") + 10;
  ASSERT_NE(value, std::string::npos + 10);
  edited[value] = static_cast<std::byte>(std::toupper(static_cast<int>(edited[value])));
  ASSERT_NE(edited[value], original[value]);
  write_file(path_, edited);
  const VerifyResult r = verify_checkpoint(path_);
  ASSERT_TRUE(r.first_bad.has_value());
  EXPECT_NE(r.first_bad->find(fmt::format("header of {} (bytes 0 to {})", path_, header_.data_offset)), std::string::npos) << *r.first_bad;
  EXPECT_THROW(load_checkpoint(path_, {.verify = true}), Error);
  EXPECT_NO_THROW(load_checkpoint(path_)) << "without verify the header is only parsed";
}

TEST_F(Corruption, TruncationIsRefused) {
  const auto original = read_all(path_);
  for (const std::size_t cut : {std::size_t{1}, std::size_t{7}, original.size() - header_.data_offset}) {
    write_file(path_, std::vector<std::byte>(original.begin(), original.end() - static_cast<std::ptrdiff_t>(cut)));
    EXPECT_THROW(verify_checkpoint(path_), Error) << cut;
    EXPECT_THROW(load_checkpoint(path_), Error) << cut;
  }
}

// A header rewritten without its own checksum: refused while "hbmio.checksum" says it is there
// (a damaged entry name must not pass), accepted with the tensors-only algorithm of files hbmio
// wrote before headers had a checksum.
TEST_F(Corruption, AHeaderChecksumIsRequiredWhereTheAlgorithmSaysSo) {
  const auto original = read_all(path_);
  const auto rewrite = [&](const std::map<std::string, std::string>& metadata) {
    std::vector<st::TensorInfo> infos = header_.tensors;
    const std::string header = st::serialize_header(infos, metadata);
    std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(header.data()),
                                 reinterpret_cast<const std::byte*>(header.data()) + header.size());
    bytes.insert(bytes.end(), original.begin() + static_cast<std::ptrdiff_t>(header_.data_offset), original.end());
    write_file(path_, bytes);
  };
  std::map<std::string, std::string> metadata = header_.metadata;
  EXPECT_EQ(metadata.at("hbmio.checksum"), "xxh3-64+header");
  ASSERT_EQ(metadata.erase("hbmio.header_xxh3"), 1u);
  rewrite(metadata);
  VerifyResult r = verify_checkpoint(path_);
  ASSERT_TRUE(r.first_bad.has_value());
  EXPECT_NE(r.first_bad->find("\"hbmio.header_xxh3\" is missing"), std::string::npos) << *r.first_bad;
  EXPECT_THROW(load_checkpoint(path_, {.verify = true}), Error);

  metadata["hbmio.checksum"] = "xxh3-64";
  rewrite(metadata);
  r = verify_checkpoint(path_);
  EXPECT_FALSE(r.first_bad.has_value()) << *r.first_bad;
  EXPECT_EQ(r.headers_checked, 0u);
  EXPECT_EQ(r.tensors_checked, header_.tensors.size());
  EXPECT_TRUE(load_checkpoint(path_, {.verify = true}).verified());

  metadata["hbmio.checksum"] = "crc32";
  rewrite(metadata);
  r = verify_checkpoint(path_);
  ASSERT_TRUE(r.first_bad.has_value());
  EXPECT_NE(r.first_bad->find("unknown checksum algorithm \"crc32\""), std::string::npos) << *r.first_bad;
}

TEST(Checkpoints, ChecksumsCanBeAddedToAReferenceFile) {
  const std::string dir = fixtures();
  if (dir.empty() || !fs::exists(dir + "/layers.safetensors")) GTEST_SKIP() << "no fixtures at '" << dir << "' (set HBMIO_FIXTURES)";
  TempDir tmp;
  const std::string path = tmp.file("layers.safetensors");
  fs::copy_file(dir + "/layers.safetensors", path);
  fs::permissions(path, fs::perms::owner_write, fs::perm_options::add);
  EXPECT_FALSE(verify_checkpoint(path).has_checksums);
  // Before: verify loads the reference's file and names it as unchecked; strict refuses it before
  // reading anything.
  {
    const LoadedCheckpoint unchecked = load_checkpoint(path, {.verify = true});
    EXPECT_FALSE(unchecked.verified());
    EXPECT_EQ(unchecked.unverified_files(), std::vector<std::string>{path});
    EXPECT_FALSE(unchecked.tensors().empty());
    try {
      (void)load_checkpoint(path, {.verify = true, .require_checksums = true});
      ADD_FAILURE() << "a file without checksums passed a strict verify";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), make_error_code(Errc::no_checksums)) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  add_checksums(path);
  EXPECT_TRUE(load_checkpoint(path, {.verify = true, .require_checksums = true}).unverified_files().empty());
  const VerifyResult r = verify_checkpoint(path);
  EXPECT_TRUE(r.has_checksums);
  EXPECT_FALSE(r.first_bad.has_value());
  const LoadedCheckpoint a = load_checkpoint(dir + "/layers.safetensors"), b = load_checkpoint(path, {.verify = true});
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& t : a.tensors()) EXPECT_EQ(tensor_sha(t), tensor_sha(*b.find(t.name))) << t.name;
}

// Temporaries that a running save holds (a flock on the file, or on the directory of a sharded
// save) are left alone by another save of the same name; unheld ones are removed.
TEST(CrashSafety, ARunningSavesTemporaryIsLeftAlone) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string held_file = dir.file(".m.safetensors.hbmio-tmp-0000000000000001");
  const std::string stale_file = dir.file(".m.safetensors.hbmio-tmp-0000000000000002");
  const std::string held_dir = dir.file(".model.hbmio-tmp-0000000000000003");
  write_file(held_file, random_bytes(10, 1));
  write_file(stale_file, random_bytes(10, 2));
  fs::create_directory(held_dir);
  write_file(held_dir + "/model-00001-of-00002.safetensors", random_bytes(10, 3));
  const int file_fd = ::open(held_file.c_str(), O_RDWR | O_CLOEXEC);
  const int dir_fd = ::open(held_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(file_fd, 0);
  ASSERT_GE(dir_fd, 0);
  ASSERT_EQ(::flock(file_fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::flock(dir_fd, LOCK_EX | LOCK_NB), 0);
  save_checkpoint(dir.file("m.safetensors"), sample.tensors);
  save_checkpoint(dir.file("model"), sample.tensors, {.max_shard_size = 600000});
  EXPECT_TRUE(fs::exists(held_file)) << "a held temporary file was removed";
  EXPECT_TRUE(fs::exists(held_dir + "/model-00001-of-00002.safetensors")) << "a held temporary directory was removed";
  EXPECT_FALSE(fs::exists(stale_file)) << "an unheld temporary was kept";
  ::close(file_fd);  // the "save" ends without cleaning up (a crash): the next save removes both
  ::close(dir_fd);
  save_checkpoint(dir.file("m.safetensors"), sample.tensors);
  save_checkpoint(dir.file("model"), sample.tensors, {.max_shard_size = 600000});
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
}

// A save to a symbolic link (the Hugging Face cache's snapshots are links to blobs) replaces the
// file it names and keeps the link. `add_checksums` keeps the mode (and, as root, the owner) of
// what it rewrites; refuses a file with other hard links; refuses to certify damaged data unless
// forced; leaves files whose checksums hold alone.
TEST(Checkpoints, ChecksumRewritesKeepLinksModeAndOwnerAndRefuseDamage) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  fs::create_directory(dir.file("blobs"));
  fs::create_directory(dir.file("snapshot"));
  const std::string blob = dir.file("blobs/abc123"), link = dir.file("snapshot/model.safetensors");
  fs::create_symlink("../blobs/abc123", link);
  save_checkpoint(link, sample.tensors, {.checksums = false});  // through the link, dangling until now
  ASSERT_TRUE(fs::is_symlink(link));
  ASSERT_TRUE(fs::is_regular_file(blob));
  ASSERT_EQ(::chmod(blob.c_str(), 0640), 0);
  const bool root = ::geteuid() == 0;
  if (root) ASSERT_EQ(::chown(blob.c_str(), 65534, 65534), 0);

  // Another hard link: refused, nothing changed.
  fs::create_hard_link(blob, dir.file("other-link"));
  try {
    add_checksums(link);
    ADD_FAILURE() << "a file with two hard links was rewritten";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::too_many_links) << e.what();
    EXPECT_NE(std::string(e.what()).find("2 hard links"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(verify_checkpoint(link).has_checksums);
  fs::remove(dir.file("other-link"));

  AddChecksumsResult r = add_checksums(link);
  EXPECT_EQ(r.files_rewritten, 1u);
  EXPECT_TRUE(fs::is_symlink(link)) << "the link was replaced by a file";
  struct stat st {};
  ASSERT_EQ(::stat(blob.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  if (root) EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_nlink, 1u);
  EXPECT_FALSE(verify_checkpoint(link).first_bad.has_value());
  EXPECT_TRUE(verify_checkpoint(link).has_checksums);

  // Checksums that hold: nothing rewritten (the same inode stays).
  const ino_t before = st.st_ino;
  r = add_checksums(link);
  EXPECT_EQ(r.files_rewritten, 0u);
  EXPECT_EQ(r.files_already_valid, 1u);
  ASSERT_EQ(::stat(blob.c_str(), &st), 0);
  EXPECT_EQ(st.st_ino, before);

  // A damaged byte: refused, naming the tensor; forced, recomputed.
  const CheckpointFile file = open_checkpoint(link).front();
  const auto& victim = file.header.tensors.back();
  ASSERT_GT(victim.size(), 0u);
  {
    std::fstream f(blob, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(file.header.data_offset + victim.begin);
    f.seekg(at);
    const char c = static_cast<char>(f.get());
    f.seekp(at);
    f.put(static_cast<char>(c ^ 1));
  }
  ASSERT_TRUE(verify_checkpoint(link).first_bad.has_value());
  try {
    add_checksums(link);
    ADD_FAILURE() << "checksums were recomputed over damaged data";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), make_error_code(Errc::verify_failed)) << e.what();
    EXPECT_NE(std::string(e.what()).find(victim.name), std::string::npos) << e.what();
  }
  ASSERT_TRUE(verify_checkpoint(link).first_bad.has_value()) << "a refused rewrite changed the file";
  r = add_checksums(link, /*force=*/true);
  EXPECT_EQ(r.files_rewritten, 1u);
  EXPECT_FALSE(verify_checkpoint(link).first_bad.has_value());
}

TEST(Checkpoints, BadPathsAreClearErrors) {
  TempDir dir;
  EXPECT_THROW(open_checkpoint(dir.file("missing.safetensors")), Error);
  try {
    open_checkpoint(dir.path());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no .safetensors file"), std::string::npos) << e.what();
  }
  std::ofstream(dir.file("model.safetensors.index.json")) << R"({"weight_map": {"a": "missing-shard.safetensors"}})";
  try {
    open_checkpoint(dir.path());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing-shard.safetensors"), std::string::npos) << e.what();
  }
  // Saves: the error names the path given and its directory, before anything is written.
  const Sample sample = make_sample({MemoryKind::host});
  const auto save_error = [&](const std::string& path, std::uint64_t shard) {
    try {
      save_checkpoint(path, sample.tensors, {.max_shard_size = shard});
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("hbmio-tmp"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      return e.code();
    }
    ADD_FAILURE() << path << " was saved";
    return std::error_code{};
  };
  EXPECT_EQ(save_error(dir.file("no/such/m.safetensors"), 0), std::errc::no_such_file_or_directory);
  EXPECT_EQ(save_error(dir.file("no/such/model"), 1 << 20), std::errc::no_such_file_or_directory);
  EXPECT_EQ(save_error(dir.file("model.safetensors.index.json/m.safetensors"), 0), std::errc::not_a_directory);
  fs::create_directory(dir.file("a-directory"));
  EXPECT_EQ(save_error(dir.file("a-directory"), 0), std::errc::is_a_directory);
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
}

}  // namespace
}  // namespace hbmio::test

namespace hbmio::test {
namespace {

// Sharded saves: shards + index into a directory, swapped in whole; other files stay.
TEST(ShardedSave, RoundTripsAndReplacesTheWholeDirectory) {
  TempDir dir;
  const std::string target = dir.file("model");
  fs::create_directory(target);
  std::ofstream(target + "/config.json") << "{\"hidden_size\": 8}";
  const Sample first = make_sample({MemoryKind::host});
  save_checkpoint(target, first.tensors, {.max_shard_size = 600000});
  const auto shards_of = [&] {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(target)) n += e.path().extension() == ".safetensors";
    return n;
  };
  EXPECT_GE(shards_of(), 2u);
  EXPECT_TRUE(fs::exists(target + "/config.json"));
  EXPECT_TRUE(fs::exists(target + "/model.safetensors.index.json"));
  const LoadedCheckpoint loaded = load_checkpoint(target, {.verify = true});
  ASSERT_EQ(loaded.tensors().size(), first.tensors.size());
  for (std::size_t i = 0; i < first.tensors.size(); ++i)
    EXPECT_EQ(first_mismatch(to_host(loaded.find(first.tensors[i].name)->data), first.bytes[i]), -1);

  // A second save with one big shard: the old shards do not linger beside the new ones.
  save_checkpoint(target, first.tensors, {.max_shard_size = std::uint64_t{1} << 30});
  EXPECT_EQ(shards_of(), 1u);
  EXPECT_TRUE(fs::exists(target + "/config.json"));
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
  EXPECT_FALSE(verify_checkpoint(target).first_bad.has_value());
}

// The same for a sharded checkpoint, whose save has more calls that can fail (every shard's
// writes and fsyncs, the index's write and fsync, the new directory's fsync, the parent's after
// the swap): after each failure the directory holds all old or all new shards, never a mix, and
// loads with every checksum right.
// The one plan of a distributed load (the NCCL load and the Python torch.distributed one both use
// it): contiguous runs in layout order that cover every tensor once, ranges that match them, a
// shard_map applied and checked, and a digest that changes with anything the ranks must agree on.
TEST(DistributedPlans, RunsCoverTheLayoutAndTheDigestNamesEverythingAgreedOn) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  const Sample sample = make_sample({MemoryKind::host});
  save_checkpoint(path, sample.tensors);
  const std::vector<CheckpointFile> files = open_checkpoint(path);
  const auto plan_of = [&](int world, Placement placement, std::map<std::string, int> shard_map = {}, LoadOptions options = {}) {
    return plan_load({.path = path, .files = &files, .options = options, .placement = placement, .shard_map = std::move(shard_map)}, world);
  };
  for (int world : {1, 2, 3, 7}) {
    SCOPED_TRACE(fmt::format("world {}", world));
    const LoadPlan plan = plan_of(world, Placement::replicate);
    ASSERT_EQ(plan.reader.size(), plan.tensors.size());
    ASSERT_EQ(plan.range.size(), static_cast<std::size_t>(world));
    for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
      EXPECT_TRUE(plan.reader[i] >= 0 && plan.reader[i] < world);
      if (i > 0) EXPECT_GE(plan.reader[i], plan.reader[i - 1]) << "runs are contiguous in layout order";
      const auto [begin, end] = plan.range[static_cast<std::size_t>(plan.reader[i])];
      EXPECT_LE(begin, plan.tensors[i].memory_offset);
      EXPECT_GE(end, plan.tensors[i].memory_offset + plan.tensors[i].size);
    }
    EXPECT_EQ(plan_of(world, Placement::replicate).digest, plan.digest) << "not deterministic";
    EXPECT_NE(plan_of(world, Placement::shard).digest, plan.digest) << "placement not in the digest";
    EXPECT_NE(plan_of(world, Placement::replicate, {}, {.verify = true}).digest, plan.digest)
        << "verify not in the digest";
  }
  const LoadPlan mapped = plan_of(2, Placement::shard, {{"norm", 1}, {"big", 0}});
  for (std::size_t i = 0; i < mapped.tensors.size(); ++i) {
    if (mapped.tensors[i].name == "norm") EXPECT_EQ(mapped.reader[i], 1);
    if (mapped.tensors[i].name == "big") EXPECT_EQ(mapped.reader[i], 0);
  }
  // A replicated load ignores shard maps (every rank gets everything).
  EXPECT_EQ(plan_of(2, Placement::replicate, {{"norm", 1}}).digest,
            plan_of(2, Placement::replicate).digest);
  try {
    plan_of(2, Placement::shard, {{"norm", 2}});
    ADD_FAILURE() << "a rank out of range was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EINVAL)) << e.what();
  }
  try {
    plan_of(2, Placement::shard, {{"nonexistent", 0}});
    ADD_FAILURE() << "an unknown name was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), errno_code(EINVAL)) << e.what();  // a wrong argument, not a missing file
  }
}

TEST(ShardedSave, AFailureLeavesTheOldDirectoryIntact) {
  TempDir dir;
  const std::string target = dir.file("model");
  const Sample old_sample = make_sample({MemoryKind::host});
  Sample new_sample = make_sample({MemoryKind::host});
  for (auto& b : new_sample.buffers) fill_memory(b.span(), std::byte{0x42});
  for (auto& b : new_sample.bytes) std::fill(b.begin(), b.end(), std::byte{0x42});
  const auto holds = [&](const Sample& sample) {
    const LoadedCheckpoint loaded = load_checkpoint(target, {.verify = true});
    for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
      const LoadedTensor* t = loaded.find(sample.tensors[i].name);
      if (t == nullptr || t->data.size != sample.bytes[i].size()) return false;
      if (t->data.size > 0 && std::memcmp(t->data.data, sample.bytes[i].data(), t->data.size) != 0) return false;
    }
    return true;
  };
  save_checkpoint(target, old_sample.tensors, {.max_shard_size = 600000});
  std::set<std::string> failed;
  bool succeeded = false;
  for (std::uint64_t n = 1; n < 400 && !succeeded; ++n) {
    SCOPED_TRACE(fmt::format("call {}", n));
    auto faults = std::make_shared<FaultInjector>(FaultPlan{.fail_call = n, .fail_errno = ENOSPC});
    try {
      save_checkpoint(target, new_sample.tensors,
                      {.backend = "uring",
                       .engine_options = one_worker(),
                       .file_system = std::make_shared<FaultInjectionFileSystem>(faults),
                       .max_shard_size = 300000});
      succeeded = true;
      EXPECT_FALSE(faults->fired());
      EXPECT_TRUE(holds(new_sample));
    } catch (const Error& e) {
      EXPECT_TRUE(faults->fired()) << e.what();
      EXPECT_EQ(e.code().value(), ENOSPC) << e.what();
      if (e.context().op == "make the save durable") {
        // The swap happened: the new checkpoint is in place and the old one is kept, named.
        EXPECT_TRUE(holds(new_sample)) << e.what();
        EXPECT_NE(std::string(e.what()).find("the previous checkpoint is kept at"), std::string::npos) << e.what();
        EXPECT_EQ(temporaries_in(dir.path()), 1u) << "the previous checkpoint was not kept";
      } else {
        EXPECT_TRUE(holds(old_sample)) << "not the old checkpoint after a failure before the swap: " << e.what();
      }
      for (const std::string& line : faults->log()) failed.insert(line.substr(line.find(':') + 2));
      save_checkpoint(target, old_sample.tensors, {.max_shard_size = 600000});
    }
  }
  EXPECT_TRUE(succeeded);
  for (const char* what : {"fsync ", "fsync of the directory ", "write of the index ", "fsync of the index ", "io_uring write "})
    EXPECT_TRUE(std::any_of(failed.begin(), failed.end(), [&](const std::string& f) { return f.starts_with(what); })) << what;
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
}

// A stop request (SaveOptions::cancel, what Ctrl-C sets in `hbmio ckpt generate`): set before the
// save, or from another thread at many moments during one, the save either throws ECANCELED with
// the old checkpoint whole and nothing of its own left, or returns with the new one published.
// Never a mix, never neither.
TEST(CrashSafety, AStopRequestLeavesTheOldOrTheNewCheckpoint) {
  TempDir dir;
  const Sample old_sample = make_sample({MemoryKind::host});
  Sample new_sample = make_sample({MemoryKind::host});
  for (auto& b : new_sample.buffers) fill_memory(b.span(), std::byte{0x42});
  for (const std::uint64_t shard : {std::uint64_t{0}, std::uint64_t{300000}}) {
    SCOPED_TRACE(shard ? "sharded" : "one file");
    const std::string target = dir.file(shard ? "model" : "m.safetensors");
    const auto digest = [&] {
      std::string all;
      for (const CheckpointFile& f : open_checkpoint(target)) {
        const auto bytes = read_all(f.path);
        all += fs::path(f.path).filename().string() + xxh3_hex(bytes.data(), bytes.size());
      }
      return all;
    };
    save_checkpoint(target, new_sample.tensors, {.max_shard_size = shard});
    const std::string new_digest = digest();
    save_checkpoint(target, old_sample.tensors, {.max_shard_size = shard});
    const std::string old_digest = digest();
    std::atomic<bool> stop{true};
    try {
      save_checkpoint(target, new_sample.tensors, {.max_shard_size = shard, .cancel = &stop});
      ADD_FAILURE() << "a save asked to stop before it began went on";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::operation_canceled) << e.what();
    }
    EXPECT_EQ(digest(), old_digest);
    EXPECT_EQ(temporaries_in(dir.path()), 0u);
    std::size_t stopped = 0, finished = 0;
    for (int delay_us = 0; delay_us <= 3000; delay_us += 150) {
      SCOPED_TRACE(fmt::format("stop after {} us", delay_us));
      stop = false;
      std::thread stopper([&] {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        stop = true;
      });
      bool published = true;
      try {
        save_checkpoint(target, new_sample.tensors, {.backend = "uring", .max_shard_size = shard, .cancel = &stop});
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), std::errc::operation_canceled) << e.what();
        published = false;
      }
      stopper.join();
      EXPECT_EQ(digest(), published ? new_digest : old_digest) << (published ? "returned, but the path holds the old one" : "stopped, but the path changed");
      EXPECT_EQ(temporaries_in(dir.path()), 0u);
      ++(published ? finished : stopped);
      save_checkpoint(target, old_sample.tensors, {.max_shard_size = shard});
    }
    EXPECT_GT(stopped, 0u) << "no stop request arrived in time to stop a save";
  }
}

// Only a regular file (or nothing) is replaced: a FIFO, a device node (made here, never a system
// one) and, for a sharded save, a file are refused before anything is written, and stay as they were.
TEST(CrashSafety, SavesReplaceOnlyRegularFiles) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string fifo = dir.file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto refused = [&](const std::string& path, std::uint64_t shard, const char* says) {
    try {
      save_checkpoint(path, sample.tensors, {.max_shard_size = shard});
      ADD_FAILURE() << path << " was replaced";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_EQ(e.context().path, path) << "the error names another path: " << e.what();
    }
  };
  refused(fifo, 0, "a FIFO, not a regular file");
  EXPECT_TRUE(fs::is_fifo(fifo));
  refused(fifo, 300000, "a FIFO");
  EXPECT_TRUE(fs::is_fifo(fifo));
  fs::create_symlink(fifo, dir.file("link-to-fifo"));
  refused(dir.file("link-to-fifo"), 0, "a FIFO, not a regular file");
  EXPECT_TRUE(fs::is_fifo(fifo));
  const std::string node = dir.file("null");
  if (::mknod(node.c_str(), S_IFCHR | 0600, ::makedev(1, 3)) == 0) {
    refused(node, 0, "a character device, not a regular file");
    EXPECT_TRUE(fs::is_character_file(node));
  } else {
    std::cout << "(no device node test: mknod is not permitted here)\n";
  }
  save_checkpoint(dir.file("f.safetensors"), sample.tensors);
  refused(dir.file("f.safetensors"), 300000, "this is a file");
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
}

// A name of 250 bytes leaves no room for a temporary suffix within NAME_MAX: the save still works
// (the temporary's name is shortened), and replacing it again cleans up as usual.
TEST(CrashSafety, LongNamesSave) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string name = std::string(238, 'n') + ".safetensors";
  save_checkpoint(dir.file(name), sample.tensors);
  save_checkpoint(dir.file(name), sample.tensors);
  EXPECT_FALSE(verify_checkpoint(dir.file(name)).first_bad.has_value());
  const std::string sharded = std::string(250, 'd');
  save_checkpoint(dir.file(sharded), sample.tensors, {.max_shard_size = 300000});
  save_checkpoint(dir.file(sharded), sample.tensors, {.max_shard_size = 300000});
  EXPECT_FALSE(verify_checkpoint(dir.file(sharded)).first_bad.has_value());
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
}

// A sharded save into a directory that held a single-file checkpoint: the model.safetensors goes
// with the old checkpoint (a loader would prefer it to the new index), and the note says so.
TEST(ShardedSave, SaysWhichOfTheOldCheckpointsFilesWentWithIt) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string target = dir.file("model");
  fs::create_directory(target);
  save_checkpoint(target + "/model.safetensors", sample.tensors);
  write_file(target + "/config.json", random_bytes(10, 1));
  const Stats s = save_checkpoint(target, sample.tensors, {.max_shard_size = 300000});
  EXPECT_NE(s.note.find("model.safetensors"), std::string::npos) << s.note;
  EXPECT_FALSE(fs::exists(target + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(target + "/config.json"));
}

// A sharded save of a state without tensors writes what loads accept: one empty model.safetensors
// and no index (an index naming no shard is refused: AnIndexWithoutShardsIsRefused), replacing the
// sharded checkpoint that was there and keeping the directory's other files; its metadata is kept.
TEST(ShardedSave, AnEmptyStateIsOneEmptyFileThatLoads) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string target = dir.file("model");
  save_checkpoint(target, sample.tensors, {.max_shard_size = 300000});
  write_file(target + "/config.json", random_bytes(10, 1));
  const Stats s = save_checkpoint(target, {}, {.metadata = {{"step", "7"}}, .max_shard_size = 300000});
  EXPECT_NE(s.note.find("no tensors"), std::string::npos) << s.note;
  EXPECT_NE(s.note.find("model.safetensors.index.json"), std::string::npos) << s.note;  // named as gone
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(target)) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"config.json", "model.safetensors"}));
  for (const std::string& path : {target, target + "/model.safetensors"}) {
    SCOPED_TRACE(path);
    const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {MemoryKind::host}});
    EXPECT_TRUE(loaded.tensors().empty());
  }
  const OpenedCheckpoint opened(target);
  EXPECT_EQ(opened.tensors().size(), 0u);
  EXPECT_EQ(opened.metadata().at("step"), "7");
  // And back to a sharded state: the empty file goes with the new shards' index in.
  save_checkpoint(target, sample.tensors, {.max_shard_size = 300000});
  EXPECT_FALSE(fs::exists(target + "/model.safetensors"));
  EXPECT_EQ(load_checkpoint(target, {.into = {MemoryKind::host}}).tensors().size(), sample.tensors.size());
}

// A file system that, at the moment a sharded save swaps its new directory in, plays a process
// still writing into the old one: a file created and one replaced (by rename) after the save
// listed the directory.
class LateWriterFileSystem final : public FileSystem {
 public:
  explicit LateWriterFileSystem(std::string dir) : dir_(std::move(dir)) {}
  File open(const std::string& path, const std::string& shown, OpenMode mode, bool direct) override {
    return base_->open(path, shown, mode, direct);
  }
  void write(const File& f, std::span<const std::byte> b, std::uint64_t o, const ErrorContext& c) override { base_->write(f, b, o, c); }
  void sync(const File& f, const ErrorContext& c) override { base_->sync(f, c); }
  void sync_directory(const std::string& d, const ErrorContext& c) override { base_->sync_directory(d, c); }
  int link(const File& f, const std::string& p) override { return base_->link(f, p); }
  int rename(const std::string& a, const std::string& b) override { return base_->rename(a, b); }
  int exchange(const std::string& a, const std::string& b) override {
    std::ofstream(dir_ + "/late.txt") << "written during the save";
    // A file under a name the new checkpoint has (a concurrent sharded save's shard, say): never
    // moved over the new one.
    std::ofstream(dir_ + "/model-00001-of-00002.safetensors") << "not a shard of this save";
    std::ofstream(dir_ + "/config.json.tmp") << "{\"hidden_size\": 16}";
    fs::rename(dir_ + "/config.json.tmp", dir_ + "/config.json");
    return base_->exchange(a, b);
  }
  int make_directory(const std::string& p) override { return base_->make_directory(p); }
  void remove_all(const std::string& p) noexcept override { base_->remove_all(p); }

 private:
  std::string dir_;
  std::shared_ptr<FileSystem> base_ = FileSystem::posix();
};

// What a sharded save keeps of the directory it replaces: every file that is not the old
// checkpoint's (model-ema.safetensors is the user's; model-00001-of-00003.safetensors and the
// shards the old index names are the checkpoint's), files written into it while the save ran, a
// dangling symlink, and the directory's mode; and "dir/" or "dir/." name the directory itself.
TEST(ShardedSave, KeepsEverythingButTheOldCheckpointAndWhatWasWrittenMeanwhile) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string target = dir.file("model");
  fs::create_directory(target);
  ::chmod(target.c_str(), 02750);
  save_checkpoint(target, sample.tensors, {.max_shard_size = 300000});
  // The user's files beside the checkpoint, a shard of another count, and one the index names.
  std::ofstream(target + "/model-ema.safetensors") << "user's";
  std::ofstream(target + "/model-best-step1000.safetensors") << "user's too";
  std::ofstream(target + "/model-00007-of-00009.safetensors") << "a stale shard";
  std::ofstream(target + "/config.json") << "{\"hidden_size\": 8}";
  fs::create_symlink("nowhere", target + "/latest");
  SaveOptions options{.max_shard_size = 600000};
  options.file_system = std::make_shared<LateWriterFileSystem>(target);
  const Stats s = save_checkpoint(target + "/", sample.tensors, options);
  EXPECT_TRUE(fs::exists(target + "/model-ema.safetensors"));
  EXPECT_TRUE(fs::exists(target + "/model-best-step1000.safetensors"));
  EXPECT_FALSE(fs::exists(target + "/model-00007-of-00009.safetensors"));
  EXPECT_NE(s.note.find("model-00007-of-00009.safetensors"), std::string::npos) << s.note;
  EXPECT_TRUE(fs::is_symlink(target + "/latest"));
  const auto text = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  EXPECT_EQ(text(target + "/late.txt"), "written during the save");
  EXPECT_EQ(text(target + "/config.json"), "{\"hidden_size\": 16}");  // the replacement, not the copy
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 02750u);
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
  EXPECT_FALSE(verify_checkpoint(target).first_bad.has_value());
  // "." from inside the directory saves into the directory.
  const fs::path cwd = fs::current_path();
  fs::current_path(target);
  save_checkpoint(".", sample.tensors, {.max_shard_size = 300000});
  fs::current_path(cwd);
  EXPECT_EQ(temporaries_in(dir.path()), 0u);
  EXPECT_TRUE(fs::exists(target + "/model-ema.safetensors"));
  EXPECT_FALSE(verify_checkpoint(target).first_bad.has_value());
}

// A load or verify racing saves that replace the file (rename) sees one file throughout: the
// header it parsed and the bytes it reads come from the same descriptor. Different metadata
// lengths move the data: a header read from one file steering reads of the other returned
// shifted bytes before. Every load is the old or the new checkpoint, every verify passes.
TEST(ConcurrentLoads, ALoadRacingReplacementsSeesOneFile) {
  TempDir dir;
  const std::string path = dir.file("r.safetensors");
  Sample a = make_sample({MemoryKind::host});
  Sample b = make_sample({MemoryKind::host});
  for (auto& buffer : b.buffers) fill_memory(buffer.span(), std::byte{0x5a});
  for (auto& bytes : b.bytes) std::fill(bytes.begin(), bytes.end(), std::byte{0x5a});
  save_checkpoint(path, a.tensors, {.metadata = {{"v", "a"}}});
  std::atomic<bool> done{false};
  std::thread saver([&] {
    for (int i = 0; !done; ++i)
      save_checkpoint(path, (i % 2 ? a : b).tensors, {.metadata = {{"v", i % 2 ? "a" : std::string(3000, 'b')}}, .backend = "posix"});
  });
  const auto equals = [](const LoadedCheckpoint& loaded, const Sample& sample) {
    for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
      const LoadedTensor* t = loaded.find(sample.tensors[i].name);
      if (t == nullptr || t->data.size != sample.bytes[i].size()) return false;
      if (t->data.size > 0 && std::memcmp(t->data.data, sample.bytes[i].data(), t->data.size) != 0) return false;
    }
    return true;
  };
  std::size_t as_a = 0, as_b = 0;
  for (int i = 0; i < 200; ++i) {
    const LoadedCheckpoint loaded = load_checkpoint(path, {.backend = i % 2 ? "posix" : "uring", .verify = i % 4 == 0});
    const bool is_a = equals(loaded, a), is_b = equals(loaded, b);
    EXPECT_TRUE(is_a || is_b) << "load " << i << " returned bytes of neither published file";
    EXPECT_EQ(loaded.metadata().at("v").size(), is_a ? 1u : 3000u) << "load " << i << ": data of one file, metadata of the other";
    as_a += is_a;
    as_b += is_b;
    const VerifyResult v = verify_checkpoint(path);
    EXPECT_FALSE(v.first_bad.has_value()) << *v.first_bad;
  }
  done = true;
  saver.join();
  EXPECT_GT(as_a + as_b, 0u);
}

// An opened checkpoint reads any tensor, or any byte range of one, in any order and in batches,
// through the descriptors opened once: byte-identical to the saved tensors; a range past a
// tensor's end is refused naming it; a file replaced after opening is still read as opened.
TEST(OpenedCheckpoints, ReadTensorsAndRangesInAnyOrder) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  for (const std::uint64_t shard : {std::uint64_t{0}, std::uint64_t{300000}}) {
    SCOPED_TRACE(shard ? "sharded" : "one file");
    const std::string path = dir.file(shard ? "model" : "m.safetensors");
    save_checkpoint(path, sample.tensors, {.max_shard_size = shard});
    const OpenedCheckpoint opened(path);
    ASSERT_EQ(opened.tensors().size(), sample.tensors.size());
    auto engine = make_engine("uring", small_options());
    for (std::size_t i = 0; i < opened.tensors().size(); ++i)  // file order
      if (i > 0) {
        const auto& a = opened.tensors()[i - 1];
        const auto& b = opened.tensors()[i];
        EXPECT_TRUE(a.file < b.file || (a.file == b.file && a.file_offset <= b.file_offset));
      }
    // Every tensor, in reverse order, one batch; then the middle third of each, one read each.
    std::vector<Buffer> whole, parts;
    std::vector<TensorRead> batch;
    for (std::size_t k = sample.tensors.size(); k-- > 0;) {
      const auto i = opened.find(sample.tensors[k].name);
      ASSERT_TRUE(i.has_value());
      whole.push_back(Buffer::allocate({MemoryKind::host}, std::max<std::size_t>(sample.bytes[k].size(), 1)));
      batch.push_back({.tensor = *i, .offset = 0, .length = sample.bytes[k].size(), .into = whole.back().span()});
    }
    opened.read(batch, *engine);
    for (std::size_t j = 0; j < batch.size(); ++j) {
      const std::size_t k = sample.tensors.size() - 1 - j;
      if (!sample.bytes[k].empty())  // (an empty vector's data() may be null, which memcmp must not get)
        EXPECT_EQ(std::memcmp(whole[j].data(), sample.bytes[k].data(), sample.bytes[k].size()), 0) << sample.tensors[k].name;
    }
    for (std::size_t k = 0; k < sample.tensors.size(); ++k) {
      const std::uint64_t size = sample.bytes[k].size(), from = size / 3, length = size / 3;
      Buffer part = Buffer::allocate({MemoryKind::host}, std::max<std::uint64_t>(length, 1));
      opened.read({{.tensor = *opened.find(sample.tensors[k].name), .offset = from, .length = length, .into = part.span()}}, *engine);
      if (length > 0) EXPECT_EQ(std::memcmp(part.data(), sample.bytes[k].data() + from, length), 0) << sample.tensors[k].name;
    }
    Buffer one = Buffer::allocate({MemoryKind::host}, 16);
    const std::size_t norm = *opened.find("norm");
    try {
      opened.read({{.tensor = norm, .offset = 300, .length = 16, .into = one.span()}}, *engine);
      ADD_FAILURE() << "a range past the tensor's end was read";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'norm'"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(opened.find("no such tensor").has_value());
    // Replaced after opening: still the file as opened.
    Sample other = make_sample({MemoryKind::host});
    for (auto& b : other.buffers) fill_memory(b.span(), std::byte{0x33});
    save_checkpoint(path, other.tensors, {.max_shard_size = shard});
    Buffer again = Buffer::allocate({MemoryKind::host}, sample.bytes[0].size());
    opened.read({{.tensor = *opened.find(sample.tensors[0].name), .offset = 0, .length = sample.bytes[0].size(), .into = again.span()}},
                *engine);
    EXPECT_EQ(std::memcmp(again.data(), sample.bytes[0].data(), sample.bytes[0].size()), 0);
  }
}

// Reads laid out in memory as their tensors lie in the file (a prefetch's batch in one allocation)
// are read as one range, and each is still told landed once, with its bytes in place when told;
// ranges that stop being adjacent (another shard, a gap in memory, part of a tensor) split it.
// Hands its requests on to another engine, counting them.
class CountingEngine final : public Engine {
 public:
  explicit CountingEngine(Engine& inner) : inner_(inner) {}
  std::string_view name() const noexcept override { return inner_.name(); }
  Stats submit(const IoRequest& request) override {
    ++requests;
    return inner_.submit(request);
  }
  Stats submit_batch(std::span<const IoRequest> batch) override {
    requests += batch.size();
    return inner_.submit_batch(batch);
  }
  std::atomic<std::size_t> requests{0};

 private:
  Engine& inner_;
};

// Reads join where they continue each other in one file and in one allocation, never across
// allocations that merely lie next to each other (one copy into a GPU must not span two
// cudaMalloc'd blocks): the per-tensor layout reads each tensor on its own, the single allocation
// joins neighbours.
TEST(Source, ReadsJoinOnlyWithinOneAllocation) {
  std::vector<std::byte> memory(4096);
  const MemorySpan all{memory.data(), memory.size(), {MemoryKind::host}};
  std::vector<detail::RangeRead> ranges;
  EXPECT_FALSE(detail::add_read(ranges, 0, 100, all.subspan(0, 1024), true));
  EXPECT_TRUE(detail::add_read(ranges, 0, 1124, all.subspan(1024, 1024), true)) << "next in the file and in one allocation";
  EXPECT_FALSE(detail::add_read(ranges, 0, 2148, all.subspan(2048, 1024), false)) << "next, but another allocation";
  EXPECT_FALSE(detail::add_read(ranges, 1, 3172, all.subspan(3072, 512), true)) << "another file";
  EXPECT_FALSE(detail::add_read(ranges, 1, 4000, all.subspan(3584, 512), true)) << "a gap in the file";
  EXPECT_FALSE(detail::add_read(ranges, 1, 4512, all.subspan(0, 0), true)) << "no bytes: nothing added";
  ASSERT_EQ(ranges.size(), 4u);
  EXPECT_EQ(ranges[0].into.size, 2048u);

  TempDir dir;
  const std::string path = dir.file("j.safetensors");
  const Sample sample = make_sample({MemoryKind::host});
  save_checkpoint(path, sample.tensors);
  std::size_t non_empty = 0;
  for (const auto& b : sample.bytes) non_empty += !b.empty();
  for (const TensorLayout layout : {TensorLayout::per_tensor, TensorLayout::single_allocation}) {
    auto inner = make_engine("posix", small_options());
    CountingEngine engine(*inner);
    const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {MemoryKind::host}, .layout = layout, .engine = &engine});
    if (layout == TensorLayout::per_tensor)
      EXPECT_EQ(engine.requests.load(), non_empty) << "one read per tensor: each is an allocation of its own";
    else
      EXPECT_LT(engine.requests.load(), non_empty) << "neighbours in the one allocation are read together";
    for (std::size_t k = 0; k < sample.tensors.size(); ++k) {
      const LoadedTensor* t = loaded.find(sample.tensors[k].name);
      ASSERT_NE(t, nullptr);
      ASSERT_EQ(t->data.size, sample.bytes[k].size());
      if (t->data.size) EXPECT_EQ(std::memcmp(t->data.data, sample.bytes[k].data(), t->data.size), 0) << t->name;
    }
  }
}

// On a GPU, allocations of a few hundred KiB made one after another usually lie back to back
// (where host ones never do, which leaves the test above unable to see a join across them): the
// per-tensor layout of 64 such tensors must load, each tensor right, through every backend.
TEST(Source, PerTensorLoadsIntoAdjacentGpuAllocations) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  TempDir dir;
  const std::string path = dir.file("adjacent.safetensors");
  std::vector<std::vector<std::byte>> bytes(64, std::vector<std::byte>(512 << 10));
  std::vector<TensorToSave> tensors;
  for (std::size_t k = 0; k < bytes.size(); ++k) {
    for (std::size_t i = 0; i < bytes[k].size(); ++i) bytes[k][i] = static_cast<std::byte>((i * 131 + k * 7) >> 3);
    tensors.push_back({fmt::format("t{:02}", k), st::Dtype::U8, {bytes[k].size()},
                       {bytes[k].data(), bytes[k].size(), {MemoryKind::host}}});
  }
  save_checkpoint(path, tensors);
  for (const char* backend : {"posix", "uring", "auto"}) {
    SCOPED_TRACE(backend);
    const LoadedCheckpoint loaded = load_checkpoint(path, {.into = {MemoryKind::device, 0}, .backend = backend, .layout = TensorLayout::per_tensor});
    std::size_t adjacent = 0;
    const std::byte* end = nullptr;
    for (std::size_t k = 0; k < bytes.size(); ++k) {
      const LoadedTensor* t = loaded.find(fmt::format("t{:02}", k));
      ASSERT_NE(t, nullptr);
      adjacent += t->data.data == end;
      end = t->data.data + t->data.size;
      EXPECT_EQ(first_mismatch(to_host(t->data), bytes[k]), -1) << t->name;
    }
    RecordProperty(std::string("adjacent_allocations_") + backend, static_cast<int>(adjacent));
  }
}

TEST(OpenedCheckpoints, ReadsAdjacentInFileAndMemoryAreReadTogetherAndEachToldLanded) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  std::map<std::string, std::size_t> index_of;
  for (std::size_t k = 0; k < sample.tensors.size(); ++k) index_of[sample.tensors[k].name] = k;
  for (const std::uint64_t shard : {std::uint64_t{0}, std::uint64_t{300000}}) {
    const std::string path = dir.file(shard ? "model" : "m.safetensors");
    save_checkpoint(path, sample.tensors, {.max_shard_size = shard});
    const OpenedCheckpoint opened(path);
    for (const char* backend : {"posix", "uring"}) {
      SCOPED_TRACE(fmt::format("{}, {}", shard ? "sharded" : "one file", backend));
      auto inner = make_engine(backend, small_options());
      CountingEngine engine(*inner);
      // Every tensor in file order into one buffer, each where the file has it relative to the
      // first (a gap of 64 bytes after every third read, and the second read only its tail).
      std::vector<TensorRead> reads;
      std::vector<std::pair<std::size_t, std::uint64_t>> wanted;  // per read: sample index, first byte
      std::uint64_t total = 0;
      for (std::size_t i = 0; i < opened.tensors().size(); ++i) {
        const std::size_t k = index_of.at(opened.tensors()[i].info->name);
        const std::uint64_t from = i == 1 ? sample.bytes[k].size() / 2 : 0;
        reads.push_back({.tensor = i, .offset = from, .length = sample.bytes[k].size() - from, .into = {nullptr, 0, {}}, .allocation = 7});
        wanted.emplace_back(k, from);
        total += reads.back().length + (i % 3 == 2 ? 64 : 0);
      }
      Buffer buffer = Buffer::allocate({MemoryKind::host}, total + 1);
      std::uint64_t at = 0;
      for (std::size_t i = 0; i < reads.size(); ++i) {
        reads[i].into = buffer.span().subspan(at, reads[i].length);
        at += reads[i].length + (i % 3 == 2 ? 64 : 0);
      }
      std::vector<std::atomic<int>> told(reads.size());
      std::atomic<int> early{0};
      const auto in_place = [&](std::size_t i) {
        const auto& [k, from] = wanted[i];
        return reads[i].length == 0 || std::memcmp(reads[i].into.data, sample.bytes[k].data() + from, reads[i].length) == 0;
      };
      std::atomic<std::uint64_t> progress{0};
      OpenedCheckpoint::ReadOptions options;
      options.progress = &progress;
      options.landed = [&](std::size_t i) {
        ++told[i];
        if (!in_place(i)) ++early;
      };
      opened.read(reads, engine, options);
      // One request per run of reads adjacent in file and memory: a new one after each gap in
      // memory, at each shard's first tensor, after the tail read and wherever the file pads.
      std::size_t runs = 0;
      std::size_t last_file = SIZE_MAX;
      std::uint64_t file_end = 0;
      const std::byte* memory_end = nullptr;
      for (std::size_t i = 0; i < reads.size(); ++i) {
        if (reads[i].length == 0) continue;
        const auto& t = opened.tensors()[i];
        const std::uint64_t begin = t.file_offset + reads[i].offset;
        runs += !(t.file == last_file && begin == file_end && reads[i].into.data == memory_end);
        last_file = t.file;
        file_end = begin + reads[i].length;
        memory_end = reads[i].into.data + reads[i].length;
      }
      EXPECT_LT(runs, reads.size() / 2) << "the sample should make long runs";
      EXPECT_EQ(engine.requests.load(), runs);
      for (std::size_t i = 0; i < reads.size(); ++i) {
        EXPECT_EQ(told[i].load(), 1) << "read " << i;
        EXPECT_TRUE(in_place(i)) << "read " << i << " (" << sample.tensors[wanted[i].first].name << ")";
      }
      EXPECT_EQ(early.load(), 0) << "reads told landed before their bytes were in place";
      std::uint64_t bytes = 0;
      for (const auto& r : reads) bytes += r.length;
      EXPECT_EQ(progress.load(), bytes);

      // The same reads not named as one allocation: adjacent addresses alone never join two reads
      // (separate cudaMallocs can be adjacent, and no copy may cross their boundary).
      std::size_t nonempty = 0;
      for (auto& r : reads) {
        r.allocation = 0;
        nonempty += r.length > 0;
      }
      std::fill(buffer.span().data, buffer.span().data + buffer.span().size, std::byte{0});
      engine.requests = 0;
      opened.read(reads, engine);
      EXPECT_EQ(engine.requests.load(), nonempty);
      for (std::size_t i = 0; i < reads.size(); ++i) EXPECT_TRUE(in_place(i)) << "read " << i << " read alone";
      // Reads of two different allocations, however adjacent, stay apart too.
      for (std::size_t i = 0; i < reads.size(); ++i) reads[i].allocation = 1 + i;
      engine.requests = 0;
      opened.read(reads, engine);
      EXPECT_EQ(engine.requests.load(), nonempty);
    }
  }
}

// The read-ahead's reader: batches queued while the caller goes on, each read whole and in order,
// each error reaching the wait of its own batch only, and a queue dropped with batches still
// queued stopping without touching them.
// A read that fails inside a round (a file cut short after it was opened) fails only the batch
// whose bytes are gone: the round's other batches are read again alone and get their bytes.
TEST(OpenedCheckpoints, AReadQueueRoundThatFailsFailsOnlyTheBatchThatAskedForTheMissingBytes) {
  for (const char* backend : {"posix", "uring"}) {
    if (std::string(backend) == "uring" && !backend_available("uring")) continue;
    SCOPED_TRACE(backend);
    TempDir dir;
    const std::string path = dir.file("cut.safetensors");
    std::vector<Buffer> data;
    std::vector<TensorToSave> tensors;
    for (int k = 0; k < 12; ++k) {
      data.push_back(Buffer::allocate({MemoryKind::host}, std::size_t{1} << 20));
      for (std::size_t i = 0; i < data.back().size(); i += 512) data.back().data()[i] = static_cast<std::byte>(k * 13 + i / 512);
      tensors.push_back({fmt::format("t{:02}", k), st::Dtype::U8, {data.back().size()}, data.back().span()});
    }
    save_checkpoint(path, tensors, {.checksums = false});
    const auto opened = std::make_shared<const OpenedCheckpoint>(path);
    const st::Header header = st::read_header(path);
    const std::string last = opened->tensors().back().info->name;
    std::filesystem::resize_file(path, header.data_offset + header.find(last)->begin + 4096);  // the last tensor cut short
    ReadQueue queue(opened, backend);
    // The cut tensor's batch first: its read fails before the others have landed.
    std::vector<std::string> names{last};
    for (const auto& t : opened->tensors())
      if (t.info->name != last) names.push_back(t.info->name);
    std::vector<Buffer> into;
    std::vector<std::vector<TensorRead>> batches;
    for (const std::string& name : names) {
      const std::size_t t = *opened->find(name);
      into.push_back(Buffer::allocate({MemoryKind::host}, opened->tensors()[t].info->size()));
      batches.push_back({{.tensor = t, .offset = 0, .length = into.back().size(), .into = into.back().span()}});
    }
    const std::vector<std::uint64_t> ids = queue.push(std::move(batches));
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::string& name = names[i];
      if (name == last) {
        try {
          queue.wait(ids[i]);
          ADD_FAILURE() << "a tensor cut short was read";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("ended"), std::string::npos) << e.what();
        }
        continue;
      }
      EXPECT_NO_THROW(queue.wait(ids[i])) << name;
      const std::size_t k = static_cast<std::size_t>(std::stoi(name.substr(1)));
      EXPECT_EQ(std::memcmp(into[i].data(), data[k].data(), data[k].size()), 0) << name;
    }
  }
}

TEST(OpenedCheckpoints, AReadQueueReadsBatchesInOrderAndGivesEachItsOwnError) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = dir.file("model");
  save_checkpoint(path, sample.tensors, {.max_shard_size = 300000});
  const auto opened = std::make_shared<const OpenedCheckpoint>(path);
  std::atomic<int> reads{0};
  std::uint64_t bytes = 0;
  {
    ReadQueue queue(opened, "uring", [&](const Stats& s) {
      ++reads;
      bytes += s.bytes;  // one reading thread at a time
    });
    EXPECT_EQ(&queue.checkpoint(), opened.get());
    std::vector<Buffer> into;
    std::vector<std::uint64_t> ids;
    std::uint64_t expected = 0;
    for (std::size_t k = 0; k < sample.tensors.size(); ++k) {
      into.push_back(Buffer::allocate({MemoryKind::host}, std::max<std::size_t>(sample.bytes[k].size(), 1)));
      ids.push_back(queue.push({{.tensor = *opened->find(sample.tensors[k].name), .offset = 0, .length = sample.bytes[k].size(),
                                 .into = into.back().span()}}));
      expected += sample.bytes[k].size();
    }
    Buffer one = Buffer::allocate({MemoryKind::host}, 16);
    const std::uint64_t bad = queue.push({{.tensor = *opened->find("norm"), .offset = 300, .length = 16, .into = one.span()}});
    // Waited for out of order: the last first.
    for (std::size_t k = ids.size(); k-- > 0;) {
      queue.wait(ids[k]);
      if (!sample.bytes[k].empty())
        EXPECT_EQ(std::memcmp(into[k].data(), sample.bytes[k].data(), sample.bytes[k].size()), 0) << sample.tensors[k].name;
    }
    try {
      queue.wait(bad);
      ADD_FAILURE() << "a range past the tensor's end was read";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("'norm'"), std::string::npos) << e.what();
    }
    // Stats come per engine batch: the batches queued when the reader comes to them are one.
    EXPECT_GE(reads.load(), 1);
    EXPECT_LE(reads.load(), static_cast<int>(ids.size()));
    EXPECT_EQ(bytes, expected);
    try {
      queue.wait(ids[0]);
      ADD_FAILURE() << "a batch was waited for twice";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), std::errc::invalid_argument);
    }
  }
  // Batches pushed together are read as one engine batch; each still gets its own bytes, and a
  // bad one in their middle alone gets its error.
  {
    int rounds = 0;
    ReadQueue queue(opened, "uring", [&](const Stats&) { ++rounds; });
    std::vector<Buffer> into;
    std::vector<std::vector<TensorRead>> batches;
    for (std::size_t k = 0; k < sample.tensors.size(); ++k) {
      into.push_back(Buffer::allocate({MemoryKind::host}, std::max<std::size_t>(sample.bytes[k].size(), 1)));
      batches.push_back({{.tensor = *opened->find(sample.tensors[k].name), .offset = 0, .length = sample.bytes[k].size(),
                          .into = into.back().span()}});
    }
    Buffer one = Buffer::allocate({MemoryKind::host}, 16);
    const std::size_t bad = batches.size() / 2;
    batches.insert(batches.begin() + static_cast<std::ptrdiff_t>(bad),
                   std::vector<TensorRead>{{.tensor = *opened->find("norm"), .offset = 300, .length = 16, .into = one.span()}});
    const std::vector<std::uint64_t> ids = queue.push(std::move(batches));
    ASSERT_EQ(ids.size(), sample.tensors.size() + 1);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i == bad) {
        try {
          queue.wait(ids[i]);
          ADD_FAILURE() << "a range past the tensor's end was read";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), std::errc::invalid_argument) << e.what();
        }
        continue;
      }
      queue.wait(ids[i]);
      const std::size_t k = i < bad ? i : i - 1;
      if (!sample.bytes[k].empty())
        EXPECT_EQ(std::memcmp(into[k].data(), sample.bytes[k].data(), sample.bytes[k].size()), 0) << sample.tensors[k].name;
    }
    EXPECT_EQ(rounds, 1) << "batches queued together are one engine batch";
  }
  // Dropped with many batches queued: the destructor returns once the batch being read is done.
  std::vector<Buffer> late;
  {
    ReadQueue queue(opened, "posix");
    for (int round = 0; round < 50; ++round)
      for (std::size_t k = 0; k < sample.tensors.size(); ++k) {
        late.push_back(Buffer::allocate({MemoryKind::host}, std::max<std::size_t>(sample.bytes[k].size(), 1)));
        queue.push({{.tensor = *opened->find(sample.tensors[k].name), .offset = 0, .length = sample.bytes[k].size(),
                     .into = late.back().span()}});
      }
  }
  // Poisoned after the queue went: a read still running would write over it (ASan/TSan see it).
  for (auto& b : late) fill_memory(b.span(), std::byte{0x5a});
  EXPECT_EQ(detail::Executor::shared().start([] { return 1; }).get(), 1) << "the pool is fit for more work";
}

// Many loads at once, as a server restoring several models does: 16 threads, each loading 4 of 8
// files (one or sharded, every backend) with verification, through engines of their own and one
// shared engine. Every tensor must be right; under the sanitizer build this also checks for
// memory errors and leaks across threads.
TEST(ConcurrentLoads, SixteenThreadsLoadEightCheckpointsAtOnce) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  std::vector<std::string> paths;
  for (int i = 0; i < 8; ++i) {
    paths.push_back(dir.file(fmt::format("m{}", i)));
    save_checkpoint(paths.back(), sample.tensors, {.max_shard_size = i % 2 ? std::uint64_t{600000} : 0});
  }
  const std::vector<std::string> backends = {"posix", "uring", "auto"};
  const std::unique_ptr<Engine> shared = make_engine("uring", Options{});
  std::atomic<int> loads{0}, wrong{0};
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 16; ++t)
      threads.emplace_back([&, t] {
        try {
          for (int k = 0; k < 4; ++k) {
            const std::string& path = paths[(t + 3 * k) % paths.size()];
            LoadOptions options{.backend = backends[(t + k) % backends.size()], .verify = true};
            if (t % 4 == 0) options.engine = shared.get();  // engines may be shared (requests queue)
            const LoadedCheckpoint loaded = load_checkpoint(path, options);
            for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
              const LoadedTensor* got = loaded.find(sample.tensors[i].name);
              if (got == nullptr || got->data.size != sample.bytes[i].size() ||
                  (got->data.size > 0 && std::memcmp(got->data.data, sample.bytes[i].data(), got->data.size) != 0))
                ++wrong;
            }
            ++loads;
          }
        } catch (const std::exception& e) {
          std::lock_guard lock(errors_mutex);
          errors.push_back(e.what());
        }
      });
  }
  EXPECT_TRUE(errors.empty()) << errors.front();
  EXPECT_EQ(loads.load(), 64);
  EXPECT_EQ(wrong.load(), 0);
}

// ---------------------------------------------------------------------------------------------
// One checkpoint into several locations (load() with LoadRequest::locations)
// ---------------------------------------------------------------------------------------------

namespace multi {

std::uint64_t bytes_of(const Sample& s) {
  std::uint64_t n = 0;
  for (const auto& b : s.bytes) n += b.size();
  return n;
}

// A sharded checkpoint of the sample (several files), saved from host memory.
std::string sharded_sample(const TempDir& dir, const Sample& sample) {
  const std::string target = dir.file("model");
  save_checkpoint(target, sample.tensors, {.max_shard_size = 600000});
  return target;
}

void check_shard(const std::vector<MemoryLocation>& into) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = sharded_sample(dir, sample);
  LoadRequest request{.path = path, .locations = into, .placement = Placement::shard};
  request.options.verify = true;
  const LoadResult r = load(request);
  ASSERT_EQ(r.locations.size(), into.size());
  // Every tensor in exactly one location, byte for byte; every byte read once.
  std::map<std::string, int> seen;
  for (std::size_t k = 0; k < into.size(); ++k) {
    for (const auto& t : r.locations[k].tensors()) {
      ++seen[t.name];
      EXPECT_EQ(t.data.location, into[k]) << t.name;
      const auto i = static_cast<std::size_t>(std::find_if(sample.tensors.begin(), sample.tensors.end(),
                                                           [&](const TensorToSave& s) { return s.name == t.name; }) -
                                              sample.tensors.begin());
      ASSERT_LT(i, sample.tensors.size()) << t.name;
      EXPECT_EQ(first_mismatch(to_host(t.data), sample.bytes[i]), -1) << t.name;
    }
    if (!r.locations[k].tensors().empty()) {
      EXPECT_TRUE(r.locations[k].verified());
      EXPECT_FALSE(r.locations[k].tensors().empty()) << "location " << k << " got nothing";
    }
  }
  EXPECT_EQ(seen.size(), sample.tensors.size());
  for (const auto& [name, count] : seen) EXPECT_EQ(count, 1) << name;
  EXPECT_EQ(r.bytes_from_storage, bytes_of(sample));
  EXPECT_EQ(r.bytes_between, 0u);
}

void check_replicate(const std::vector<MemoryLocation>& into) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = sharded_sample(dir, sample);
  LoadRequest request{.path = path, .locations = into, .placement = Placement::replicate};
  request.options.verify = true;
  const LoadResult r = load(request);
  ASSERT_EQ(r.locations.size(), into.size());
  for (std::size_t k = 0; k < into.size(); ++k) {
    const LoadedCheckpoint& c = r.locations[k];
    EXPECT_TRUE(c.verified());
    ASSERT_EQ(c.tensors().size(), sample.tensors.size());
    for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
      const LoadedTensor* t = c.find(sample.tensors[i].name);
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->data.location, into[k]);
      EXPECT_EQ(t->shape, sample.tensors[i].shape);
      EXPECT_EQ(first_mismatch(to_host(t->data), sample.bytes[i]), -1) << "location " << k << " tensor " << t->name;
    }
  }
  // Each byte read from storage once, over all locations; the rest copied between them.
  EXPECT_EQ(r.bytes_from_storage, bytes_of(sample));
  EXPECT_GE(r.bytes_between, (into.size() - 1) * bytes_of(sample));
}

// `hbmio ckpt checksum` on a sharded checkpoint: every shard gains checksums, the index still
// loads, every tensor is unchanged.
TEST(Checkpoints, ChecksumsCanBeAddedToEveryShard) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string target = dir.file("model");
  save_checkpoint(target, sample.tensors, {.checksums = false, .max_shard_size = 600000});
  const std::vector<CheckpointFile> before = open_checkpoint(target);
  ASSERT_GT(before.size(), 1u);
  EXPECT_FALSE(verify_checkpoint(target).has_checksums);
  EXPECT_FALSE(verify_checkpoint(target).first_bad.has_value()) << "no checksums anywhere is not damage";
  // Checksums in the first shard only: verify names a shard without them.
  add_checksums(before.front().path);
  const VerifyResult mixed = verify_checkpoint(target);
  EXPECT_FALSE(mixed.has_checksums);
  ASSERT_TRUE(mixed.first_bad.has_value());
  EXPECT_NE(mixed.first_bad->find(before[1].path), std::string::npos) << *mixed.first_bad;
  const AddChecksumsResult r = add_checksums(target);
  EXPECT_EQ(r.files_already_valid, 1u);
  EXPECT_EQ(r.files_rewritten, before.size() - 1);
  for (const CheckpointFile& file : open_checkpoint(target)) {
    const VerifyResult r = verify_checkpoint(file.path);
    EXPECT_TRUE(r.has_checksums) << file.path;
    EXPECT_FALSE(r.first_bad.has_value()) << *r.first_bad;
    EXPECT_EQ(r.tensors_checked, file.header.tensors.size()) << file.path;
  }
  const LoadedCheckpoint loaded = load_checkpoint(target, {.verify = true});
  ASSERT_EQ(loaded.tensors().size(), sample.tensors.size());
  for (std::size_t i = 0; i < sample.tensors.size(); ++i) {
    const LoadedTensor* t = loaded.find(sample.tensors[i].name);
    ASSERT_NE(t, nullptr) << sample.tensors[i].name;
    ASSERT_EQ(t->data.size, sample.bytes[i].size());
    if (t->data.size > 0)  // empty tensors may have no pointer at all
      EXPECT_EQ(std::memcmp(t->data.data, sample.bytes[i].data(), t->data.size), 0) << t->name;
  }
}

// The progress counter of a save reaches the tensors' bytes exactly (headers and index not
// counted, nothing twice), for a single file and a sharded checkpoint, on every backend.
TEST(Checkpoints, SaveProgressCountsEveryTensorByteOnce) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  std::uint64_t total = 0;
  for (const auto& t : sample.tensors) total += t.data.size;
  ASSERT_GT(total, 0u);
  for (const std::string backend : {"posix", "uring", "auto"})
    for (const std::uint64_t shard : {std::uint64_t{0}, std::uint64_t{600000}}) {
      SCOPED_TRACE(backend + (shard ? " sharded" : " one file"));
      std::atomic<std::uint64_t> progress{0};
      const std::string target = dir.file(fmt::format("progress-{}-{}", backend, shard));
      save_checkpoint(target, sample.tensors, {.backend = backend, .max_shard_size = shard, .progress = &progress});
      EXPECT_EQ(progress.load(), total);
      if (shard) {
        EXPECT_GT(open_checkpoint(target).size(), 1u);
      }
    }
}

}  // namespace multi

TEST(MultiLoad, ShardPutsEveryTensorInOneLocation) { multi::check_shard({{MemoryKind::host}, {MemoryKind::pinned}, {MemoryKind::host}}); }
TEST(MultiLoad, ReplicateReadsEachByteOnce) { multi::check_replicate({{MemoryKind::host}, {MemoryKind::pinned}, {MemoryKind::host}}); }
TEST(MultiLoad, OneLocationIsAnOrdinaryLoad) {
  multi::check_shard({{MemoryKind::pinned}});
  multi::check_replicate({{MemoryKind::host}});
}

TEST(MultiLoad, ShardMapIsObeyedAndChecked) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = multi::sharded_sample(dir, sample);
  LoadRequest request{.path = path, .locations = {{MemoryKind::host}, {MemoryKind::host}}, .placement = Placement::shard};
  request.shard_map = {{"embed.weight", 1}, {"big", 1}, {"norm", 0}};
  const LoadResult r = load(request);
  EXPECT_NE(r.locations[1].find("embed.weight"), nullptr);
  EXPECT_NE(r.locations[1].find("big"), nullptr);
  EXPECT_NE(r.locations[0].find("norm"), nullptr);
  EXPECT_EQ(r.locations[0].find("big"), nullptr);
  request.shard_map = {{"big", 2}};
  EXPECT_THROW(load(request), Error);
  request.shard_map = {{"no-such-tensor", 0}};
  EXPECT_THROW(load(request), Error);
}

// Engines the caller keeps serve one load after another (each location its own); a list of the
// wrong length or with an engine twice is refused before anything is read.
TEST(MultiLoad, CallerEnginesAreReusedAndChecked) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = multi::sharded_sample(dir, sample);
  auto a = make_engine("uring", Options{}), b = make_engine("uring", Options{});
  for (Placement placement : {Placement::shard, Placement::replicate, Placement::shard}) {
    LoadRequest request{.path = path, .locations = {{MemoryKind::host}, {MemoryKind::pinned}}, .engines = {a.get(), b.get()},
                        .placement = placement};
    request.options.verify = true;
    const LoadResult r = load(request);
    EXPECT_EQ(r.bytes_from_storage, multi::bytes_of(sample));
    for (const auto& location : r.locations)
      for (const auto& t : location.tensors()) {
        const auto it = std::find_if(sample.tensors.begin(), sample.tensors.end(), [&](const TensorToSave& s) { return s.name == t.name; });
        ASSERT_NE(it, sample.tensors.end()) << t.name;
        EXPECT_EQ(first_mismatch(to_host(t.data), sample.bytes[static_cast<std::size_t>(it - sample.tensors.begin())]), -1) << t.name;
      }
  }
  LoadRequest bad{.path = path, .locations = {{MemoryKind::host}, {MemoryKind::host}}};
  bad.engines = {a.get()};
  EXPECT_THROW(load(bad), Error);
  bad.engines = {a.get(), a.get()};
  EXPECT_THROW(load(bad), Error);
  bad.engines = {a.get(), nullptr};
  EXPECT_THROW(load(bad), Error);
}

TEST(Checkpoints, AnIndexWithoutShardsIsRefused) {
  TempDir dir;
  std::ofstream(dir.file("model.safetensors.index.json")) << R"({"metadata": {}, "weight_map": {}})";
  try {
    load_checkpoint(dir.path());
    ADD_FAILURE() << "an index naming no shard was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("names no shard"), std::string::npos) << e.what();
  }
}

// An index that maps a tensor to a shard not holding it is refused, naming the tensor and the
// shard, by every way of opening the checkpoint (not left to fail, or silently skip, later).
TEST(Checkpoints, ATensorMissingFromItsShardIsRefused) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string target = dir.file("model");
  save_checkpoint(target, sample.tensors, {.max_shard_size = 600000});
  const std::string index_path = target + "/model.safetensors.index.json";
  nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
  const std::string shard = index["weight_map"]["norm"];
  index["weight_map"]["ghost.weight"] = shard;
  std::ofstream(index_path) << index.dump(2);
  const auto expect_refused = [&](const char* how, auto&& open) {
    SCOPED_TRACE(how);
    try {
      open();
      ADD_FAILURE() << "an index naming a tensor its shard lacks was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'ghost.weight' is missing from its shard '" + shard + "'"), std::string::npos) << what;
    }
  };
  expect_refused("open_checkpoint", [&] { open_checkpoint(target); });
  expect_refused("load_checkpoint", [&] { load_checkpoint(target); });
  expect_refused("load of a subset", [&] { load_checkpoint(target, {.names = {"norm"}}); });
}

// A shard missing from the directory fails every placement with an error naming it, before any
// location starts (and nothing waits for a location that never finishes).
TEST(MultiLoad, MissingShardIsOneClearError) {
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = multi::sharded_sample(dir, sample);
  fs::remove(path + "/model-00002-of-" + [&] {
    for (const auto& e : fs::directory_iterator(path)) {
      const std::string name = e.path().filename().string();
      if (name.starts_with("model-00001-of-")) return name.substr(15, 5);
    }
    return std::string("?????");
  }() + ".safetensors");
  for (Placement placement : {Placement::shard, Placement::replicate}) {
    try {
      load({.path = path, .locations = {{MemoryKind::host}, {MemoryKind::host}}, .placement = placement});
      ADD_FAILURE() << "a missing shard was not noticed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model-00002-of-"), std::string::npos) << e.what();
    }
  }
}

// GPUs: cuda:0 with host memory (one GPU), and every GPU pair where there are two or more.
TEST(GpuMultiLoad, ShardAndReplicateAcrossDevices) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  std::vector<MemoryLocation> into{{MemoryKind::device, 0}, {MemoryKind::host}};
  multi::check_shard(into);
  multi::check_replicate(into);
  if (cuda_device_count() < 2) GTEST_SKIP() << "one GPU: checked cuda:0 with host memory; cuda:0,1 needs two";
  into = {{MemoryKind::device, 0}, {MemoryKind::device, 1}};
  multi::check_shard(into);
  multi::check_replicate(into);
}

// A request for several locations and an NCCL group at once is refused before the communicator is
// touched (this one is no communicator at all).
TEST(NcclLoad, SeveralLocationsAndAGroupAtOnceAreRefused) {
  int not_a_communicator = 0;
  try {
    load({.path = "model.safetensors", .locations = {{MemoryKind::host}, {MemoryKind::host}}, .nccl_comm = &not_a_communicator});
    ADD_FAILURE() << "a load to several locations and a group was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::invalid_argument) << e.what();
  }
}

// NCCL, one process per rank (tests/nccl_rank.cpp), one rank per GPU: both placements byte for
// byte, each byte read once over all ranks, and one failing rank failing every rank. Each rank
// runs under `timeout`, so a hang fails the test instead of stalling it.
TEST(GpuNcclLoad, ShardAndReplicateOneProcessPerRank) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  const shim::NcclApi* api = nullptr;
  try {
    api = &shim::nccl_api();
  } catch (const Error& e) {
    GTEST_SKIP() << "no NCCL here (HBMIO_NCCL_LIBRARY names one): " << e.what();
  }
  const int n = cuda_device_count();
  TempDir dir;
  const Sample sample = make_sample({MemoryKind::host});
  const std::string path = multi::sharded_sample(dir, sample);
  std::map<std::string, std::string> expected;
  for (std::size_t i = 0; i < sample.tensors.size(); ++i)
    expected[sample.tensors[i].name] = xxh3_hex(sample.bytes[i].data(), sample.bytes[i].size());

  // The rank program: beside the test where it was built, or where HBMIO_NCCL_RANK_BIN says (a
  // copy of the binaries on another machine).
  const char* env_bin = std::getenv("HBMIO_NCCL_RANK_BIN");
  const std::string rank_bin = env_bin && *env_bin ? env_bin : HBMIO_NCCL_RANK_BIN;
  auto run_ranks = [&](const char* placement, auto path_of) {
    shim::ncclUniqueId id{};
    EXPECT_EQ(api->get_unique_id(&id), shim::ncclSuccess);
    std::string hex;
    for (char c : id.internal) hex += fmt::format("{:02x}", static_cast<unsigned char>(c));
    std::vector<FILE*> pipes;
    for (int k = 0; k < n; ++k) {
      const std::string command = fmt::format("timeout 120 '{}' {} {} {} '{}' {}", rank_bin, hex, k, n, path_of(k), placement);
      pipes.push_back(::popen(command.c_str(), "r"));
    }
    std::vector<nlohmann::json> out;
    for (FILE* pipe : pipes) {
      std::string text;
      char buffer[4096];
      while (pipe != nullptr && std::fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
      const int status = pipe != nullptr ? ::pclose(pipe) : -1;
      nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) j = {{"ok", false}, {"error", fmt::format("no result (exit status {}): {}", status, text)}};
      out.push_back(j);
    }
    return out;
  };
  auto same_path = [&](int) { return path; };
  for (const char* placement : {"shard", "replicate"}) {
    const bool shard = std::string(placement) == "shard";
    const auto ranks = run_ranks(placement, same_path);
    std::uint64_t read = 0, received = 0;
    std::map<std::string, int> seen;
    for (int k = 0; k < n; ++k) {
      const auto& r = ranks[static_cast<std::size_t>(k)];
      ASSERT_TRUE(r.value("ok", false)) << placement << ", rank " << k << ": " << r.dump();
      EXPECT_EQ(r["rank_reported"], k);
      EXPECT_EQ(r["world"], n);
      read += r["bytes_from_storage"].get<std::uint64_t>();
      received += r["bytes_received"].get<std::uint64_t>();
      for (const auto& [name, t] : r["tensors"].items()) {
        ++seen[name];
        EXPECT_EQ(t["device"], k) << name;
        ASSERT_TRUE(expected.contains(name)) << name;
        EXPECT_EQ(t["xxh3"], expected[name]) << placement << ", rank " << k << ", tensor " << name;
      }
      if (!shard) EXPECT_TRUE(r["verified"].get<bool>()) << "rank " << k;
    }
    EXPECT_EQ(read, multi::bytes_of(sample)) << placement << ": each byte read once over the ranks";
    EXPECT_EQ(seen.size(), sample.tensors.size()) << placement;
    for (const auto& [name, count] : seen) EXPECT_EQ(count, shard ? 1 : n) << placement << ", " << name;
    if (!shard) EXPECT_GE(received, static_cast<std::uint64_t>(n - 1) * multi::bytes_of(sample));
  }
  // Rank 0 cannot open its checkpoint: every rank fails, the others naming rank 0.
  const auto ranks = run_ranks("replicate", [&](int k) { return k == 0 ? dir.file("missing") : path; });
  for (int k = 0; k < n; ++k) {
    const auto& r = ranks[static_cast<std::size_t>(k)];
    EXPECT_FALSE(r.value("ok", true)) << "rank " << k << " did not fail: " << r.dump();
    const std::string error = r.value("error", "");
    if (k == 0) EXPECT_NE(error.find("missing"), std::string::npos) << error;
    else EXPECT_NE(error.find("rank 0 failed"), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace hbmio::test
