// BatchStream: every record once per epoch on every rank split, reproducible shuffles, each shard
// format against an independent read of the file, bad shards named, early stops that leak nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "format/npy.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/stream.hpp"
#include "test_support.hpp"

using namespace hbmio;
using namespace hbmio::test;
namespace st = hbmio::safetensors;

namespace {

// A raw record: its global id, then three words derived from it, so a record in the wrong place
// or a torn one is caught by looking at it alone.
constexpr std::size_t kWords = 4;
std::uint64_t word(std::uint64_t id, std::size_t k) { return id * 0x9e3779b97f4a7c15ull + k * 0x632be59bd9b4e019ull; }

// Raw shards of 64-bit records with these counts; ids run on across shards. Returns the paths.
std::vector<std::string> raw_shards(const TempDir& dir, const std::vector<std::uint64_t>& counts) {
  std::vector<std::string> paths;
  std::uint64_t id = 0;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    std::vector<std::byte> bytes(counts[s] * kWords * 8);
    for (std::uint64_t r = 0; r < counts[s]; ++r, ++id)
      for (std::size_t k = 0; k < kWords; ++k) {
        const std::uint64_t v = k == 0 ? id : word(id, k);
        std::memcpy(bytes.data() + (r * kWords + k) * 8, &v, 8);
      }
    paths.push_back(dir.file(fmt::format("shard-{}.bin", s)));
    write_file(paths.back(), bytes);
  }
  return paths;
}

StreamOptions raw_options(std::uint64_t batch) {
  return {.raw_dtype = st::Dtype::U64, .raw_record_shape = {kWords}, .batch_records = batch};
}

// The ids of a batch, checking every record's words.
std::vector<std::uint64_t> ids_of(const Batch& batch) {
  std::vector<std::uint64_t> ids;
  const auto bytes = to_host(batch.fields.at(0));
  EXPECT_EQ(bytes.size(), batch.records * kWords * 8);
  for (std::uint64_t r = 0; r < batch.records; ++r) {
    std::uint64_t w[kWords];
    std::memcpy(w, bytes.data() + r * kWords * 8, sizeof w);
    for (std::size_t k = 1; k < kWords; ++k) EXPECT_EQ(w[k], word(w[0], k)) << "record " << r << " of batch " << batch.index;
    ids.push_back(w[0]);
  }
  return ids;
}

// Every batch of every epoch: ids[epoch] in delivery order.
std::vector<std::vector<std::uint64_t>> drain(BatchStream& stream) {
  std::vector<std::vector<std::uint64_t>> ids;
  std::uint64_t expected_index = 0;
  while (auto batch = stream.next()) {
    if (batch->epoch >= ids.size()) {
      ids.resize(batch->epoch + 1);
      expected_index = 0;
    }
    EXPECT_EQ(batch->index, expected_index++);
    const auto these = ids_of(*batch);
    ids[batch->epoch].insert(ids[batch->epoch].end(), these.begin(), these.end());
  }
  return ids;
}

// Threads of this process, those of the library's pool left out: a stream's fill runs there, and
// its thread stays, idle, for the pool's next job.
int thread_count() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(e.path() / "comm");
    std::string name;
    std::getline(comm, name);
    n += name != "hbmio-pool";
  }
  return n;
}

}  // namespace

TEST(Stream, EveryRecordOncePerEpochAcrossRanks) {
  TempDir dir;
  const std::vector<std::uint64_t> counts = {37, 0, 101, 5, 64};  // 207 records, an empty shard among them
  const auto files = raw_shards(dir, counts);
  const std::uint64_t total = 207;
  for (const unsigned world : {1u, 2u, 4u})
    for (const bool shuffle : {false, true})
      for (const bool drop_last : {false, true}) {
        SCOPED_TRACE(fmt::format("world {}, shuffle {}, drop_last {}", world, shuffle, drop_last));
        std::vector<std::map<std::uint64_t, int>> seen(2);  // per epoch: id -> times
        std::vector<std::uint64_t> per_rank;
        for (unsigned rank = 0; rank < world; ++rank) {
          StreamOptions o = raw_options(16);
          o.world = world;
          o.rank = rank;
          o.shuffle = shuffle;
          o.seed = 7;
          o.shuffle_window = 50;
          o.drop_last = drop_last;
          o.epochs = 2;
          BatchStream stream(files, o);
          const auto ids = drain(stream);
          ASSERT_EQ(ids.size(), 2u);
          EXPECT_EQ(ids[0].size(), stream.records_per_epoch());
          per_rank.push_back(ids[0].size());
          for (std::size_t e = 0; e < 2; ++e)
            for (std::uint64_t id : ids[e]) ++seen[e][id];
          const StreamStats stats = stream.stats();
          EXPECT_EQ(stats.records, 2 * ids[0].size());
          EXPECT_EQ(stats.epoch, 2u);
          EXPECT_EQ(stream.epoch_stats().size(), 2u);
          // The engine requests behind the batches: at least one group per epoch with records,
          // each part of the time within the groups' time.
          if (!ids[0].empty()) {
            EXPECT_GE(stats.groups, 1u);
            EXPECT_GT(stats.group_seconds, 0.0);
            EXPECT_LE(stats.wake_seconds + stats.drain_seconds, 2 * stats.group_seconds);
          }
        }
        for (std::size_t e = 0; e < 2; ++e) {
          for (const auto& [id, times] : seen[e]) {
            EXPECT_LT(id, total);
            EXPECT_EQ(times, 1) << "record " << id << " in epoch " << e;
          }
          if (drop_last) {
            // Every rank the same number of whole batches; what is left out is less than a batch
            // per rank plus the remainder of the split.
            EXPECT_LE(total - seen[e].size(), world * 16 + world - 1);
          } else {
            EXPECT_EQ(seen[e].size(), total) << "epoch " << e;
          }
        }
        EXPECT_LE(*std::max_element(per_rank.begin(), per_rank.end()) - *std::min_element(per_rank.begin(), per_rank.end()),
                  drop_last ? 0u : 1u);
      }
}

TEST(Stream, ShufflesAreReproducibleAndDifferEveryEpoch) {
  TempDir dir;
  const auto files = raw_shards(dir, {100, 50, 150});
  const auto run = [&](bool shuffle, std::uint64_t seed) {
    StreamOptions o = raw_options(32);
    o.shuffle = shuffle;
    o.seed = seed;
    o.epochs = 2;
    BatchStream stream(files, o);
    return drain(stream);
  };
  const auto plain = run(false, 0);
  std::vector<std::uint64_t> in_order(300);
  for (std::uint64_t i = 0; i < 300; ++i) in_order[i] = i;
  EXPECT_EQ(plain[0], in_order);  // unshuffled: file order, shards in the order given
  EXPECT_EQ(plain[1], in_order);
  const auto a = run(true, 1), b = run(true, 1), c = run(true, 2);
  EXPECT_EQ(a, b) << "the same seed gave another order";
  EXPECT_NE(a[0], a[1]) << "two epochs in the same order";
  EXPECT_NE(a[0], c[0]) << "two seeds gave the same order";
  EXPECT_NE(a[0], in_order);
  auto sorted = a[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, in_order);
}

namespace {

// A .npy file as numpy.lib.format writes it (version 1.0, or 2.0 with a 4-byte length); `pad`
// more spaces lengthen the header as a writer may (the data then starts further on).
std::string write_npy(const std::string& path, const std::string& descr, const std::vector<std::uint64_t>& shape,
                      const std::vector<std::byte>& data, int version = 1, bool fortran = false, std::size_t pad = 0) {
  std::string shape_text = "(";
  for (std::uint64_t d : shape) shape_text += fmt::format("{}, ", d);
  if (shape.size() > 1) shape_text.resize(shape_text.size() - 2);
  else if (shape.size() == 1) shape_text.pop_back();
  shape_text += ")";
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': {}, 'shape': {}, }}", descr, fortran ? "True" : "False", shape_text);
  const std::size_t prefix = version == 1 ? 10 : 12;
  dict += std::string(pad, ' ');
  while ((prefix + dict.size() + 1) % 64 != 0) dict += ' ';
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  const std::uint32_t n = static_cast<std::uint32_t>(dict.size());
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  if (version != 1) {
    out += static_cast<char>((n >> 16) & 0xff);
    out += static_cast<char>((n >> 24) & 0xff);
  }
  out += dict;
  std::vector<std::byte> bytes(out.size() + data.size());
  std::memcpy(bytes.data(), out.data(), out.size());
  if (!data.empty()) std::memcpy(bytes.data() + out.size(), data.data(), data.size());
  write_file(path, bytes);
  return path;
}

}  // namespace

TEST(Stream, NpyShardsMatchTheirBytes) {
  TempDir dir;
  // Records of 3 x 5 float32; two versions of the header; batches crossing shard boundaries.
  const std::size_t record = 3 * 5 * 4;
  const auto a = random_bytes(7 * record, 1), b = random_bytes(12 * record, 2);
  const std::vector<std::string> files = {write_npy(dir.file("a.npy"), "<f4", {7, 3, 5}, a, 1),
                                          write_npy(dir.file("b.npy"), "<f4", {12, 3, 5}, b, 2)};
  std::vector<std::byte> all(a);
  all.insert(all.end(), b.begin(), b.end());
  for (const unsigned read_ahead : {1u, 3u}) {
    BatchStream stream(files, {.batch_records = 4, .read_ahead = read_ahead});
    ASSERT_EQ(stream.fields().size(), 1u);
    EXPECT_EQ(stream.fields()[0].dtype, st::Dtype::F32);
    EXPECT_EQ(stream.fields()[0].record_shape, (std::vector<std::uint64_t>{3, 5}));
    std::vector<std::byte> got;
    std::uint64_t batches = 0;
    while (auto batch = stream.next()) {
      const auto bytes = to_host(batch->fields[0]);
      got.insert(got.end(), bytes.begin(), bytes.end());
      EXPECT_EQ(batch->last_of_epoch, batch->records == 3);  // 19 = 4 x 4 + 3
      ++batches;
    }
    EXPECT_EQ(batches, 5u);
    EXPECT_EQ(first_mismatch(got, all), -1);
  }
  // Batch size in bytes: whole records only.
  BatchStream by_bytes(files, {.batch_bytes = 5 * record + 10});
  EXPECT_EQ(by_bytes.batch_records(), 5u);
}

TEST(Stream, SafetensorsShardsStreamTheirTensorsSideBySide) {
  TempDir dir;
  std::vector<std::string> files;
  std::vector<std::vector<std::byte>> ids, masks;
  for (int s = 0; s < 3; ++s) {
    const std::uint64_t n = 10 + 7 * s;
    ids.push_back(random_bytes(n * 8 * 8, 10 + s));
    masks.push_back(random_bytes(n * 8, 20 + s));
    files.push_back(dir.file(fmt::format("part-{}.safetensors", s)));
    save_checkpoint(files.back(), {{"input_ids", st::Dtype::I64, {n, 8}, {ids.back().data(), ids.back().size(), {}}},
                                   {"mask", st::Dtype::U8, {n, 8}, {masks.back().data(), masks.back().size(), {}}}});
  }
  std::vector<std::byte> all_ids, all_masks;
  for (int s = 0; s < 3; ++s) {
    all_ids.insert(all_ids.end(), ids[s].begin(), ids[s].end());
    all_masks.insert(all_masks.end(), masks[s].begin(), masks[s].end());
  }
  BatchStream both(files, {.device = {MemoryKind::pinned}, .batch_records = 16});
  ASSERT_EQ(both.fields().size(), 2u);
  EXPECT_EQ(both.fields()[0].name, "input_ids");
  EXPECT_EQ(both.fields()[1].name, "mask");
  std::vector<std::byte> got_ids, got_masks;
  while (auto batch = both.next()) {
    const auto i = to_host(batch->fields[0]), m = to_host(batch->fields[1]);
    got_ids.insert(got_ids.end(), i.begin(), i.end());
    got_masks.insert(got_masks.end(), m.begin(), m.end());
  }
  EXPECT_EQ(first_mismatch(got_ids, all_ids), -1);
  EXPECT_EQ(first_mismatch(got_masks, all_masks), -1);
  // One chosen tensor.
  BatchStream one(files, {.tensors = {"mask"}, .batch_records = 100});
  auto batch = one.next();
  ASSERT_TRUE(batch);
  ASSERT_EQ(batch->fields.size(), 1u);
  EXPECT_EQ(first_mismatch(to_host(batch->fields[0]), all_masks), -1);
  // A name no shard has.
  BatchStream missing(files, {.tensors = {"labels"}, .batch_records = 4});
  try {
    missing.next();
    ADD_FAILURE() << "a missing tensor was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.context().path, files[0]);
    EXPECT_NE(std::string(e.what()).find("'labels'"), std::string::npos) << e.what();
  }
}

namespace {

// The error the first next() throws, with a check that it names `path`.
Error first_error(const std::vector<std::string>& files, const StreamOptions& options, const std::string& path) {
  BatchStream stream(files, options);
  try {
    while (stream.next()) {
    }
  } catch (const Error& e) {
    EXPECT_EQ(e.context().path, path) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(std::error_code(), {});
}

}  // namespace

TEST(Stream, BadShardsAreNamedWithTheirByte) {
  TempDir dir;
  auto files = raw_shards(dir, {10, 10});
  // A raw shard that is not a whole number of records: the partial record's first byte.
  {
    auto bytes = pread_range(files[1], 0, 10 * 32);
    bytes.resize(bytes.size() - 5);
    write_file(files[1], bytes);
    const Error e = first_error(files, raw_options(4), files[1]);
    EXPECT_EQ(e.context().offset, 9u * 32);
    EXPECT_NE(std::string(e.what()).find("partial record"), std::string::npos) << e.what();
  }
  // A missing file.
  {
    const std::string gone = dir.file("gone.bin");
    const Error e = first_error({files[0], gone}, raw_options(4), gone);
    EXPECT_EQ(e.code(), std::errc::no_such_file_or_directory);
  }
  // .npy shards of another dtype, another record shape, truncated, or longer than their shape.
  const auto data = random_bytes(6 * 8, 3);
  const std::string good = write_npy(dir.file("good.npy"), "<f4", {6, 2}, data);
  {
    const std::string f2 = write_npy(dir.file("f2.npy"), "<f2", {12, 2}, data);
    const Error e = first_error({good, f2}, {.batch_records = 4}, f2);
    EXPECT_NE(std::string(e.what()).find("F16"), std::string::npos) << e.what();
  }
  {
    const std::string wide = write_npy(dir.file("wide.npy"), "<f4", {4, 3}, data);
    first_error({good, wide}, {.batch_records = 4}, wide);
  }
  {
    const std::string shortened = write_npy(dir.file("short.npy"), "<f4", {7, 2}, data);
    const Error e = first_error({good, shortened}, {.batch_records = 4}, shortened);
    EXPECT_NE(std::string(e.what()).find("partial record"), std::string::npos) << e.what();
  }
  {
    const std::string longer = write_npy(dir.file("long.npy"), "<f4", {5, 2}, data);
    const Error e = first_error({good, longer}, {.batch_records = 4}, longer);
    EXPECT_NE(std::string(e.what()).find("follow the array"), std::string::npos) << e.what();
  }
  for (const auto& [descr, fortran, why] : std::vector<std::tuple<std::string, bool, std::string>>{
           {">f4", false, "big-endian"}, {"<f4", true, "Fortran"}, {"<c16", false, "no safetensors counterpart"}}) {
    const std::string odd = write_npy(dir.file("odd.npy"), descr, {3, 2}, random_bytes(descr == "<c16" ? 96 : 24, 4), 1, fortran);
    const Error e = first_error({odd}, {.batch_records = 4}, odd);
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
  {
    const std::string not_npy = dir.file("plain.npy");
    write_file(not_npy, random_bytes(100, 5));
    first_error({not_npy}, {.batch_records = 4}, not_npy);
  }
}

namespace {

// What a shard is renamed over with: a valid .npy that a reader at the old header's offsets and
// dtype would misread without noticing.
struct Replacement {
  std::string name, descr;
  std::uint64_t records = 0;
  std::size_t pad = 0;
};

const std::vector<Replacement> kReplacements = {
    {"another header length", "<f4", 2, 64},  // the same records 64 bytes further on
    {"another dtype", "<i4", 2, 0},
    {"another record count", "<f4", 3, 0},
    {"the same size, other bytes", "<f4", 2, 0},  // a new inode, nothing else changed
};

// Writes `r` beside `path` and renames it over `path` (a new inode, as a data pipeline's atomic
// publish would give).
void rename_over(const std::string& path, const Replacement& r, std::uint64_t seed) {
  const std::string next = path + ".next";
  write_npy(next, r.descr, {r.records, 4}, random_bytes(r.records * 16, seed), 1, false, r.pad);
  ASSERT_EQ(::rename(next.c_str(), path.c_str()), 0) << path;
}

// `count` .npy shards of 2 records of 4 float32 each, and all their data bytes in order.
std::vector<std::string> small_npy_shards(const TempDir& dir, std::size_t count, std::vector<std::byte>& all) {
  std::vector<std::string> files;
  for (std::size_t s = 0; s < count; ++s) {
    const auto data = random_bytes(2 * 16, 100 + s);
    files.push_back(write_npy(dir.file(fmt::format("s-{:03}.npy", s)), "<f4", {2, 4}, data));
    all.insert(all.end(), data.begin(), data.end());
  }
  return files;
}

}  // namespace

// A shard renamed over after the headers were read, while the stream runs: with few shards every
// one keeps the descriptor its header was read through, so the stream delivers the original
// bytes, byte for byte; the old code opened the path again and read the new file at the old
// offsets, as the old dtype.
TEST(Stream, AShardRenamedOverIsReadAsTheFileItsHeaderCameFrom) {
  for (const Replacement& r : kReplacements) {
    SCOPED_TRACE(r.name);
    TempDir dir;
    std::vector<std::byte> all;
    const auto files = small_npy_shards(dir, 3, all);
    // One shard a batch, two buffers: shards 0 and 1 may be read ahead, shard 2 only after the
    // caller gives batch 0 back (its second next()).
    BatchStream stream(files, {.batch_records = 2, .read_ahead = 1});
    ASSERT_EQ(stream.fields().size(), 1u);  // the headers are read
    rename_over(files[2], r, 7);
    std::vector<std::byte> got;
    while (auto batch = stream.next()) {
      const auto bytes = to_host(batch->fields[0]);
      got.insert(got.end(), bytes.begin(), bytes.end());
    }
    EXPECT_EQ(first_mismatch(got, all), -1);
    EXPECT_EQ(got.size(), all.size());
  }
}

// With more shards than kOpenShards (64) descriptors, a shard is opened again by path: one that
// was never kept open, and one closed to make room and needed again in the next epoch. Either
// must be the file its header came from, or next() throws naming it.
TEST(Stream, AShardRenamedOverIsRefusedWhenOpenedAgain) {
  for (const Replacement& r : kReplacements) {
    SCOPED_TRACE(r.name);
    TempDir dir;
    std::vector<std::byte> all;
    const auto files = small_npy_shards(dir, 80, all);
    const auto expect_refused = [&](BatchStream& stream, const std::string& path, std::uint64_t delivered) {
      try {
        while (auto batch = stream.next()) {
          // Every batch delivered is its shard's original bytes.
          const std::uint64_t at = (batch->epoch * 80 + batch->index) % 80 * 32;
          EXPECT_EQ(first_mismatch(to_host(batch->fields[0]), {all.begin() + at, all.begin() + at + 32}), -1) << batch->index;
          ++delivered;
        }
        ADD_FAILURE() << "the replaced shard was read";
      } catch (const Error& e) {
        EXPECT_EQ(e.context().path, path) << e.what();
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("replaced"), std::string::npos) << e.what();
      }
      return delivered;
    };
    {
      // Shard 70: past the 64 kept open from the header scan.
      BatchStream stream(files, {.batch_records = 2, .read_ahead = 1});
      ASSERT_EQ(stream.fields().size(), 1u);
      rename_over(files[70], r, 8);
      EXPECT_EQ(expect_refused(stream, files[70], 0), 70u);
    }
    {
      // Shard 0, closed once shards 64.. were opened, needed again by epoch 1.
      all.clear();
      const auto again = small_npy_shards(dir, 80, all);
      BatchStream stream(again, {.batch_records = 2, .read_ahead = 1, .epochs = 2});
      for (std::uint64_t i = 0; i <= 70; ++i) ASSERT_TRUE(stream.next());  // at most batch 71 read by now
      rename_over(again[0], r, 9);
      EXPECT_EQ(expect_refused(stream, again[0], 71), 80u);
    }
  }
}

// Headers that claim more than any file holds, and batch sizes beyond the records: named, or
// served, never a wrapped product.
TEST(Stream, HugeClaimsAreNamedAndHugeBatchesServed) {
  TempDir dir;
  {
    // 2^60 + 10 records of 20 bytes: the product, 2^64 * 1.25 + 200, wraps to 2^62 + 200.
    const std::string liar = write_npy(dir.file("liar.npy"), "<f4", {(1ull << 60) + 10, 5}, random_bytes(200, 1));
    const Error e = first_error({liar}, {.batch_records = 4}, liar);
    EXPECT_NE(std::string(e.what()).find("header lies"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fmt::format("{}", (1ull << 60) + 10)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(fmt::format("the file is {} bytes", std::filesystem::file_size(liar))), std::string::npos)
        << e.what();
  }
  {
    // A record of 2^80 elements.
    const std::string wide = write_npy(dir.file("wide.npy"), "<f4", {2, 1ull << 40, 1ull << 40}, random_bytes(8, 2));
    const Error e = first_error({wide}, {.batch_records = 4}, wide);
    EXPECT_NE(std::string(e.what()).find("more than 2^64 bytes"), std::string::npos) << e.what();
  }
  {
    // More records than the file has, without wrapping: the claim and the size.
    const std::string more = write_npy(dir.file("more.npy"), "<f4", {1000, 5}, random_bytes(200, 3));
    const Error e = first_error({more}, {.batch_records = 4}, more);
    EXPECT_NE(std::string(e.what()).find("of the 1000 its header claims"), std::string::npos) << e.what();
  }
  // Batches of 2^62 and 2^64 - 1 records: one batch of everything (the ring sized by the records,
  // not by a wrapped product; the batch count not wrapped to 0), shuffled too.
  const auto files = raw_shards(dir, {37, 5});
  for (const std::uint64_t batch : std::vector<std::uint64_t>{1ull << 62, UINT64_MAX}) {
    for (const bool shuffle : {false, true}) {
      StreamOptions o = raw_options(batch);
      o.shuffle = shuffle;
      BatchStream stream(files, o);
      const auto ids = drain(stream);
      ASSERT_EQ(ids.size(), 1u);
      std::vector<std::uint64_t> sorted = ids[0];
      std::sort(sorted.begin(), sorted.end());
      std::vector<std::uint64_t> expected(42);
      for (std::uint64_t i = 0; i < 42; ++i) expected[i] = i;
      EXPECT_EQ(sorted, expected);
      if (shuffle) EXPECT_NE(ids[0], expected);  // the window is 16 batches, saturated, not 0
    }
  }
}

// A shard that shrinks while the stream runs: the batches before the failing one are delivered,
// then next() throws the read's error naming the file.
TEST(Stream, AReadErrorComesAfterTheBatchesBeforeIt) {
  TempDir dir;
  const auto files = raw_shards(dir, {64, 64, 64});
  BatchStream stream(files, {.raw_dtype = st::Dtype::U64, .raw_record_shape = {kWords}, .batch_records = 8, .read_ahead = 1});
  auto first = stream.next();
  ASSERT_TRUE(first);
  ::truncate(files[2].c_str(), 10 * 32);
  std::uint64_t delivered = 1;
  try {
    while (auto batch = stream.next()) {
      ids_of(*batch);
      ++delivered;
    }
    ADD_FAILURE() << "the shrunk shard was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.context().path, files[2]) << e.what();
  }
  EXPECT_GE(delivered, 16u);  // the first two shards' batches at least
  EXPECT_THROW(stream.next(), Error);  // and again: the stream does not pretend to have ended
}

TEST(Stream, ClosingEarlyLeaksNoThreadOrBuffer) {
  TempDir dir;
  const auto files = raw_shards(dir, {1000, 1000});
  {
    // The engine a stream leases stays in the process's pool with its threads afterwards: lease
    // it once before counting.
    BatchStream warm(files, raw_options(16));
    drain(warm);
  }
  const int threads = thread_count();
  const MemoryCounters before = memory_counters();
  const int fds = open_fd_count();
  for (const int taken : {0, 1, 5}) {
    SCOPED_TRACE(taken);
    {
      StreamOptions o = raw_options(16);
      o.epochs = 0;  // endless
      o.shuffle = true;
      BatchStream stream(files, o);
      for (int i = 0; i < taken; ++i) ASSERT_TRUE(stream.next());
      if (taken == 5) {
        stream.close();
        EXPECT_FALSE(stream.next());
      }
    }
    EXPECT_EQ(thread_count(), threads);
    EXPECT_EQ(memory_counters().host_buffers, before.host_buffers);
    EXPECT_EQ(open_fd_count(), fds);
  }
  // Every fill left the pool: shutting it down (as Python's exit handler does) joins all its
  // threads, where a fill still running would hang here.
  detail::Executor::shared().shutdown();
  EXPECT_EQ(detail::Executor::shared().threads(), 0u);
}

TEST(Stream, OptionsThatCannotWorkAreRefusedAtOnce) {
  TempDir dir;
  const auto files = raw_shards(dir, {4});
  const auto refused = [&](const std::vector<std::string>& f, StreamOptions o, const char* why) {
    try {
      BatchStream stream(f, o);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refused({}, raw_options(4), "no shard files");
  StreamOptions o = raw_options(4);
  o.batch_bytes = 100;
  refused(files, o, "one of them");
  o = raw_options(4);
  o.rank = 2;
  o.world = 2;
  refused(files, o, "rank 2 is not in a world of 2");
  o = raw_options(4);
  o.read_ahead = 0;
  refused(files, o, "read_ahead must be 1 to 4096 batches, not 0");
  o.read_ahead = UINT_MAX;  // the ring of read_ahead + 1 buffers would wrap to none
  refused(files, o, "read_ahead must be 1 to 4096 batches, not 4294967295");
  o = raw_options(4);
  o.world = 0;
  refused(files, o, "rank 0 is not in a world of 0");
  // Raw shards without a dtype: found when the first file is looked at, thrown by next().
  BatchStream untyped(files, {.batch_records = 4});
  EXPECT_THROW(untyped.next(), Error);
}

TEST(Npy, HeadersAsNumpyWritesThem) {
  const auto parse = [](const std::string& text) {
    std::vector<std::byte> bytes(text.size());
    std::memcpy(bytes.data(), text.data(), text.size());
    return format::parse_npy_header(bytes, "x.npy");
  };
  const auto header = [](const std::string& dict) {
    std::string s = "\x93NUMPY\x01";
    s += '\0';
    s += static_cast<char>(dict.size());
    s += '\0';
    return s + dict;
  };
  auto h = parse(header("{'descr': '<i8', 'fortran_order': False, 'shape': (10,), }  \n"));
  EXPECT_EQ(h.dtype, st::Dtype::I64);
  EXPECT_EQ(h.shape, std::vector<std::uint64_t>{10});
  h = parse(header("{'descr': '|b1', 'fortran_order': True, 'shape': (4, 1, 1), }\n"));  // Fortran order of a column: same bytes
  EXPECT_EQ(h.dtype, st::Dtype::BOOL);
  h = parse(header("{'descr': '<f2', 'fortran_order': False, 'shape': (), }\n"));
  EXPECT_TRUE(h.shape.empty());
  for (const char* bad : {"{'descr': '<f4', 'shape': (1,), }", "{'descr': '<f4', 'fortran_order': False, 'shape': [1], }",
                          "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}",
                          "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }",
                          "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", "{'descr': '<f4'"})
    EXPECT_THROW(parse(header(bad)), Error) << bad;
}

// Into GPU memory, the caller's stream given back with each batch: the same records as on the
// host, shuffled over two epochs, and the ring's device memory freed with the stream.
TEST(GpuStream, BatchesLandOnTheDeviceIntact) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  TempDir dir;
  const auto files = raw_shards(dir, {300, 200, 77});
  const MemoryCounters before = memory_counters();
  for (const std::string backend : {"posix", "uring", "auto"}) {
    SCOPED_TRACE(backend);
    StreamOptions o = raw_options(64);
    o.device = {MemoryKind::device, 0};
    o.shuffle = true;
    o.epochs = 2;
    o.backend = backend;
    BatchStream stream(files, o);
    const auto ids = drain(stream);
    ASSERT_EQ(ids.size(), 2u);
    for (const auto& epoch : ids) {
      std::set<std::uint64_t> unique(epoch.begin(), epoch.end());
      EXPECT_EQ(unique.size(), 577u);
      EXPECT_EQ(epoch.size(), 577u);
    }
  }
  EXPECT_EQ(memory_counters().device_buffers, before.device_buffers);
}

namespace {

// Batches (ids each) of a stream until its end.
std::vector<std::vector<std::uint64_t>> batches_of(BatchStream& stream) {
  std::vector<std::vector<std::uint64_t>> out;
  while (auto batch = stream.next()) out.push_back(ids_of(*batch));
  return out;
}

}  // namespace

TEST(Stream, ResumesExactlyOnTheSameOrAnotherNumberOfRanks) {
  TempDir dir;
  const auto files = raw_shards(dir, {37, 0, 101, 5, 64});  // 207 records
  const auto options = [](unsigned rank, unsigned world, bool drop_last) {
    StreamOptions o = raw_options(16);
    o.rank = rank, o.world = world, o.shuffle = true, o.seed = 3, o.shuffle_window = 50, o.drop_last = drop_last;
    return o;
  };
  for (const bool drop_last : {false, true})
    for (const unsigned before : {1u, 3u})
      for (const std::uint64_t k : {0u, 2u, 4u}) {
        SCOPED_TRACE(fmt::format("drop_last {}, {} ranks, resumed after {} batches", drop_last, before, k));
        std::vector<std::vector<std::vector<std::uint64_t>>> full;
        std::optional<StreamPosition> saved;
        std::set<std::uint64_t> given, all;
        for (unsigned r = 0; r < before; ++r) {
          BatchStream stream(files, options(r, before, drop_last));
          full.push_back(batches_of(stream));
          for (std::size_t b = 0; b < full.back().size(); ++b)
            for (std::uint64_t id : full.back()[b]) {
              all.insert(id);
              if (b < k) given.insert(id);
            }
          BatchStream again(files, options(r, before, drop_last));
          for (std::uint64_t b = 0; b < k; ++b) ASSERT_TRUE(again.next());
          const StreamPosition p = again.position();
          EXPECT_EQ(p.batches, std::vector<std::uint64_t>{k});
          if (saved) EXPECT_EQ(p.fingerprint, saved->fingerprint);
          saved = p;  // every rank's is the same: the last one stands for all
        }
        // The same ranks: each goes on with exactly its own batches, their indices continuing.
        for (unsigned r = 0; r < before; ++r) {
          StreamOptions o = options(r, before, drop_last);
          o.resume = saved;
          BatchStream stream(files, o);
          if (auto first = stream.next()) EXPECT_EQ(first->index, k);
          BatchStream again(files, o);
          const auto rest = batches_of(again);
          EXPECT_EQ(rest, std::vector<std::vector<std::uint64_t>>(full[r].begin() + static_cast<std::ptrdiff_t>(k), full[r].end()));
        }
        // Two ranks: what no rank delivered, each record once.
        std::set<std::uint64_t> got = given;
        std::size_t count = given.size();
        for (unsigned r = 0; r < 2; ++r) {
          StreamOptions o = options(r, 2, drop_last);
          o.resume = saved;
          BatchStream stream(files, o);
          for (const auto& batch : batches_of(stream)) {
            got.insert(batch.begin(), batch.end());
            count += batch.size();
          }
        }
        EXPECT_EQ(count, got.size()) << "a record delivered twice";
        if (!drop_last) EXPECT_EQ(got.size(), 207u);
        else EXPECT_TRUE(std::includes(all.begin(), all.end(), got.begin(), got.end()));
      }
}

TEST(Stream, AResumeFromOtherShardsOrOptionsIsRefused) {
  TempDir dir;
  const auto files = raw_shards(dir, {37, 101});
  StreamOptions o = raw_options(16);
  o.seed = 1;
  BatchStream stream(files, o);
  ASSERT_TRUE(stream.next());
  const StreamPosition p = stream.position();
  StreamOptions other = o;
  other.seed = 2;
  other.resume = p;
  EXPECT_THROW(
      {
        try {
          BatchStream s(files, other);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("seed 1; this stream's is 2"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  StreamOptions same = o;
  same.resume = p;
  BatchStream s({files.front()}, same);
  try {
    s.next();
    ADD_FAILURE() << "resumed over other shards";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("other shards"), std::string::npos) << e.what();
  }
}
