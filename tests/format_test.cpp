// The safetensors format layer: conformance with files made by the reference implementation,
// one test per bad-input rule, and serialisation byte-identical to the reference writer.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/safetensors_paths.hpp"
#include "hbmio/error.hpp"
#include "hbmio/safetensors.hpp"
#include "sha256.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
namespace st = hbmio::safetensors;
using hbmio::test::TempDir;

// The manifest lists sha256 per tensor: tests/sha256.hpp, checked here against FIPS 180-4's
// known answers.
std::string sha256(std::string_view data) {
  return hbmio::test::sha256_hex(reinterpret_cast<const std::byte*>(data.data()), data.size());
}

TEST(Sha256, KnownAnswers) {
  EXPECT_EQ(sha256(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  EXPECT_EQ(sha256(std::string(56, 'a')).size(), 64u);  // padding spills into a second block
}

// --- helpers ----------------------------------------------------------------------------------

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string length_prefix(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out;
}

// A file: the length of `header`, `header`, then `data_size` bytes of data.
std::string make_file(std::string_view header, std::size_t data_size) {
  return length_prefix(header.size()) + std::string(header) + std::string(data_size, 'd');
}

fs::path fixtures_dir() {
  const char* env = std::getenv("HBMIO_FIXTURES");
  return fs::path(env && *env ? env : "../shared/fixtures") / "safetensors";
}

#define SKIP_WITHOUT_FIXTURES()                                                                  \
  if (!fs::is_directory(fixtures_dir()))                                                         \
  GTEST_SKIP() << "no fixtures at " << fixtures_dir() << " (set HBMIO_FIXTURES to shared/fixtures)"

// --- conformance with the reference's files ---------------------------------------------------

TEST(SafetensorsFixtures, EveryHeaderMatchesTheManifest) {
  SKIP_WITHOUT_FIXTURES();
  const auto manifest = nlohmann::json::parse(read_file(fixtures_dir() / "MANIFEST.json"));
  ASSERT_FALSE(manifest.empty());
  for (const auto& [file_name, expected] : manifest.items()) {
    SCOPED_TRACE(file_name);
    const std::string path = (fixtures_dir() / file_name).string();
    const st::Header header = st::read_header(path);
    const std::string bytes = read_file(path);
    EXPECT_EQ(header.data_offset + header.data_size, bytes.size());

    std::map<std::string, std::string> expected_metadata;
    std::size_t expected_tensors = 0;
    for (const auto& [name, info] : expected.items()) {
      if (name == "__metadata__") {
        expected_metadata = info.get<std::map<std::string, std::string>>();
        continue;
      }
      ++expected_tensors;
      SCOPED_TRACE(name);
      const st::TensorInfo* tensor = header.find(name);
      ASSERT_NE(tensor, nullptr);
      EXPECT_EQ(st::to_string(tensor->dtype), info["dtype"].get<std::string>());
      EXPECT_EQ(tensor->shape, info["shape"].get<std::vector<std::uint64_t>>());
      EXPECT_EQ(tensor->begin, info["data_offsets"][0].get<std::uint64_t>());
      EXPECT_EQ(tensor->end, info["data_offsets"][1].get<std::uint64_t>());
      const std::string_view data = std::string_view(bytes).substr(header.data_offset + tensor->begin, tensor->size());
      EXPECT_EQ(sha256(data), info["sha256"].get<std::string>());
    }
    EXPECT_EQ(header.tensors.size(), expected_tensors);
    EXPECT_EQ(header.metadata, expected_metadata);
    EXPECT_TRUE(std::is_sorted(header.tensors.begin(), header.tensors.end(),
                               [](const auto& a, const auto& b) { return a.begin < b.begin; }));
  }
}

TEST(SafetensorsFixtures, ShardedIndexPointsAtExistingShards) {
  SKIP_WITHOUT_FIXTURES();
  const fs::path dir = fixtures_dir() / "sharded";
  const st::ShardIndex index = st::read_index((dir / "model.safetensors.index.json").string());
  EXPECT_EQ(index.weight_map.size(), 9u);
  EXPECT_EQ(index.shards.size(), 3u);
  EXPECT_EQ(index.metadata.at("total_size"), "230400");
  std::uint64_t total = 0;
  for (const auto& shard : index.shards) {
    ASSERT_TRUE(fs::is_regular_file(dir / shard)) << shard;
    const auto header = st::read_header((dir / shard).string());
    total += header.data_size;
    for (const auto& tensor : header.tensors) EXPECT_EQ(index.weight_map.at(tensor.name), shard);
  }
  for (const auto& [tensor, shard] : index.weight_map)
    EXPECT_NE(st::read_header((dir / shard).string()).find(tensor), nullptr) << tensor;
  EXPECT_EQ(total, 230400u);
}

// The reference writer's order is visible in its files: the dtypes fixture is in that order.
TEST(SafetensorsFixtures, OrderLikeReferenceReproducesTheWritersOrder) {
  SKIP_WITHOUT_FIXTURES();
  for (const char* file : {"dtypes.safetensors", "layers.safetensors", "scalars_and_empty.safetensors"}) {
    SCOPED_TRACE(file);
    const auto header = st::read_header((fixtures_dir() / file).string());
    // File order is offset order; for "empty" tensors at equal offsets use the header's text order.
    const std::string bytes = read_file(fixtures_dir() / file);
    const std::string_view json = std::string_view(bytes).substr(8, header.header_size);
    auto in_text_order = header.tensors;
    std::sort(in_text_order.begin(), in_text_order.end(), [&](const auto& a, const auto& b) {
      return json.find("\"" + a.name + "\":{") < json.find("\"" + b.name + "\":{");
    });
    auto shuffled = header.tensors;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(7));
    st::order_like_reference(shuffled);
    ASSERT_EQ(shuffled.size(), in_text_order.size());
    for (std::size_t i = 0; i < shuffled.size(); ++i) EXPECT_EQ(shuffled[i].name, in_text_order[i].name) << i;
  }
}

// scalars_and_empty has no metadata (whose order the reference leaves to a hash map), so its whole
// header is reproducible byte for byte.
TEST(SafetensorsFixtures, SerializeReproducesAReferenceHeader) {
  SKIP_WITHOUT_FIXTURES();
  const std::string bytes = read_file(fixtures_dir() / "scalars_and_empty.safetensors");
  const auto n = st::parse_header_length(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), "x");
  const auto header = st::parse_header(std::string_view(bytes).substr(8, n), bytes.size(), "x");
  auto tensors = header.tensors;
  st::order_like_reference(tensors);
  EXPECT_EQ(st::serialize_header(tensors, {}), bytes.substr(0, 8 + header.header_size));
}

// --- dtypes -----------------------------------------------------------------------------------

TEST(SafetensorsDtype, NamesAndSizes) {
  for (const char* name : {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16",
                           "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64", "F4", "F6_E2M3",
                           "F6_E3M2"}) {
    const auto dtype = st::parse_dtype(name);
    ASSERT_TRUE(dtype) << name;
    EXPECT_EQ(st::to_string(*dtype), name);
  }
  EXPECT_FALSE(st::parse_dtype("bf16"));
  EXPECT_FALSE(st::parse_dtype(""));
  EXPECT_EQ(st::bits_per_element(st::Dtype::F4), 4u);
  EXPECT_EQ(st::bits_per_element(st::Dtype::F6_E3M2), 6u);
  EXPECT_EQ(st::bits_per_element(st::Dtype::BF16), 16u);
  EXPECT_EQ(st::bits_per_element(st::Dtype::C64), 64u);
  const std::vector<std::uint64_t> three{3}, four{4}, huge{1ull << 62, 4};
  EXPECT_EQ(st::tensor_byte_size(st::Dtype::F4, three), std::nullopt);  // 12 bits
  EXPECT_EQ(st::tensor_byte_size(st::Dtype::F4, four), 2u);
  EXPECT_EQ(st::tensor_byte_size(st::Dtype::F6_E2M3, four), 3u);
  EXPECT_EQ(st::tensor_byte_size(st::Dtype::U8, huge), std::nullopt);
  EXPECT_EQ(st::tensor_byte_size(st::Dtype::F32, {}), 4u);  // a scalar
}

// --- bad input: one test per rule ---------------------------------------------------------------

// Writes `bytes` as a file, reads its header, and expects EINVAL whose detail names `rule` (and
// `tensor`, when given) and whose message names the file.
void expect_refused(const std::string& bytes, std::string_view rule, std::string_view tensor = {}) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_file(path, bytes);
  try {
    st::read_header(path);
    ADD_FAILURE() << "accepted; expected the rule \"" << rule << "\"";
  } catch (const hbmio::Error& error) {
    EXPECT_EQ(error.code(), std::errc::invalid_argument) << error.what();
    EXPECT_NE(error.detail().find(rule), std::string::npos) << error.what();
    if (!tensor.empty()) {
      EXPECT_NE(error.detail().find(tensor), std::string::npos) << error.what();
    }
    EXPECT_NE(std::string(error.what()).find(path), std::string::npos) << error.what();
    EXPECT_EQ(error.context().op, "parse safetensors header");
  }
}

std::string tensor(std::string_view name, std::string_view dtype, std::string_view shape, std::string_view offsets) {
  return "\"" + std::string(name) + "\":{\"dtype\":\"" + std::string(dtype) + "\",\"shape\":" + std::string(shape) +
         ",\"data_offsets\":" + std::string(offsets) + "}";
}

TEST(SafetensorsBadInput, FileShorterThanLengthPrefix) {
  expect_refused("", "file too short");
  expect_refused(std::string(7, '\0'), "file too short");
}

TEST(SafetensorsBadInput, HeaderLengthPastEndOfFile) {
  expect_refused(length_prefix(100) + "{}", "header length past end of file");
  expect_refused(length_prefix(~0ull - 3), "header too large");  // 8 + N would overflow
}

TEST(SafetensorsBadInput, HeaderLengthOver100MB) {
  expect_refused(length_prefix(st::kMaxHeaderSize + 1) + "{}", "header too large");
}

// "Refused before any allocation sized from the file": a child process whose address space is
// capped at 64 MiB above what it uses reads files that claim far more than they hold or than is
// allowed (a 99,999,999-byte header in a file of a few bytes; a sparse 3 GiB index, over the
// 100 MB an index may have). Each must be refused with the rule (EINVAL), never fail to
// allocate, which is what reading a claimed size before checking it would do under the cap.
// (A header the file really holds is read whole, as the reference reader does: up to 100 MB.)
// Sanitizer builds reserve terabytes of shadow memory and cannot run under an address-space cap.
TEST(SafetensorsBadInput, RefusedBeforeAllocatingWhatTheFileClaims) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer builds cannot run under RLIMIT_AS";
#else
  TempDir dir;
  const std::string claims = dir.file("claims.safetensors"), index = dir.file("model.safetensors.index.json");
  write_file(claims, length_prefix(99'999'999) + "{}");
  {
    std::ofstream out(index);  // an index that opens an object and never closes it, padded out sparse
    out << "{\"weight_map\": {";
  }
  std::filesystem::resize_file(index, std::uint64_t{3} << 30);  // sparse: no disk used
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    long pages = 0;
    if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
      std::fclose(statm);
    }
    const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + (rlim_t{64} << 20);
    const rlimit limit{cap, cap};
    if (pages == 0 || ::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(3);
    // 1 when `read` is refused with EINVAL; a failed allocation ends the child with `status`.
    const auto refused = [](const auto& read, int status) {
      try {
        read();
      } catch (const hbmio::Error& e) {
        return e.code() == std::errc::invalid_argument ? 1 : 0;
      } catch (const std::bad_alloc&) {
        ::_exit(status);
      }
      return 0;
    };
    const int both = refused([&] { st::read_header(claims); }, 4) + refused([&] { st::read_index(index); }, 5);
    ::_exit(both == 2 ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died (status " << status << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: could not cap the address space; 4/5: an allocation sized from the file "
                                       "(header, index) failed under the cap; 6: not every file refused with EINVAL";
#endif
}

TEST(SafetensorsBadInput, InvalidUtf8) {
  expect_refused(make_file("{\"a\xff\":" + std::string("1}"), 0), "invalid UTF-8");
  expect_refused(make_file("{\"\xed\xa0\x80\":1}", 0), "invalid UTF-8");  // an encoded surrogate
  expect_refused(make_file("{\"\xc0\xaf\":1}", 0), "invalid UTF-8");      // an overlong '/'
}

TEST(SafetensorsBadInput, NotJson) {
  expect_refused(make_file("{\"a\":", 0), "invalid JSON");
  expect_refused(make_file("", 0), "invalid JSON");
  expect_refused(make_file(std::string("{}\0", 3), 0), "invalid JSON");  // trailing garbage (only whitespace may pad)
  expect_refused(make_file("\xEF\xBB\xBF{}", 0), "invalid JSON");  // a BOM: serde_json refuses it
  expect_refused(make_file(std::string(200, '[') + std::string(200, ']'), 0), "nested too deeply");
  // Past double's range: nlohmann throws out_of_range, not parse_error (a fuzzer finding).
  expect_refused(make_file("{" + tensor("w", "U8", "[1e999]", "[0,2]") + "}", 2), "invalid JSON", "w");
}

TEST(SafetensorsBadInput, NotAnObject) {
  expect_refused(make_file("[1,2]", 0), "header not a JSON object");
  expect_refused(make_file("\"x\"    ", 0), "header not a JSON object");
  expect_refused(make_file("{\"w\":[1]}", 0), "tensor entry not an object", "w");
}

TEST(SafetensorsBadInput, MissingField) {
  expect_refused(make_file(R"({"w":{"dtype":"U8","shape":[2]}})", 2), "missing field", "w");
}

TEST(SafetensorsBadInput, UnknownDtype) {
  expect_refused(make_file("{" + tensor("w", "U9", "[2]", "[0,2]") + "}", 2), "unknown dtype", "w");
  expect_refused(make_file("{" + tensor("w", "u8", "[2]", "[0,2]") + "}", 2), "unknown dtype", "w");
  expect_refused(make_file(R"({"w":{"dtype":8,"shape":[2],"data_offsets":[0,2]}})", 2), "unknown dtype", "w");
}

TEST(SafetensorsBadInput, BadShapes) {
  expect_refused(make_file("{" + tensor("neg", "U8", "[-2]", "[0,2]") + "}", 2), "invalid shape", "neg");
  expect_refused(make_file("{" + tensor("flt", "U8", "[2.0]", "[0,2]") + "}", 2), "invalid shape", "flt");
  expect_refused(make_file("{" + tensor("exp", "U8", "[2e0]", "[0,2]") + "}", 2), "invalid shape", "exp");
  expect_refused(make_file("{" + tensor("big", "U8", "[18446744073709551616]", "[0,2]") + "}", 2), "invalid shape", "big");
  expect_refused(make_file("{" + tensor("str", "U8", "[\"2\"]", "[0,2]") + "}", 2), "invalid shape", "str");
  expect_refused(make_file("{" + tensor("obj", "U8", "{}", "[0,2]") + "}", 2), "invalid shape", "obj");
}

TEST(SafetensorsBadInput, BadOffsets) {
  expect_refused(make_file("{" + tensor("w", "U8", "[2]", "[0,2,2]") + "}", 2), "invalid data_offsets", "w");
  expect_refused(make_file("{" + tensor("w", "U8", "[2]", "[-1,1]") + "}", 2), "invalid data_offsets", "w");
  expect_refused(make_file("{" + tensor("w", "U8", "[0]", "[2,0]") + "}", 2), "invalid data_offsets", "w");
}

TEST(SafetensorsBadInput, ShapeProductOverflow) {
  expect_refused(make_file("{" + tensor("w", "U8", "[4294967296,4294967296]", "[0,2]") + "}", 2),
                 "shape product overflows", "w");
  // The product fits in 64 bits, the product times 32 bits does not.
  expect_refused(make_file("{" + tensor("w", "F32", "[1152921504606846976]", "[0,2]") + "}", 2),
                 "shape product overflows", "w");
}

TEST(SafetensorsBadInput, SubByteTensorNotByteAligned) {
  expect_refused(make_file("{" + tensor("w", "F4", "[3]", "[0,2]") + "}", 2), "sub-byte tensor not byte aligned", "w");
}

TEST(SafetensorsBadInput, ShapeSizeMismatch) {
  expect_refused(make_file("{" + tensor("w", "F32", "[2]", "[0,4]") + "}", 4), "shape/size mismatch", "w");
}

TEST(SafetensorsBadInput, GapBetweenTensors) {
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "," + tensor("b", "U8", "[2]", "[3,5]") + "}", 5),
                 "gap in data buffer", "b");
}

TEST(SafetensorsBadInput, OffsetsNotStartingAtZero) {
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[1,3]") + "}", 3), "gap in data buffer", "a");
}

TEST(SafetensorsBadInput, OverlappingTensors) {
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "," + tensor("b", "U8", "[2]", "[1,3]") + "}", 3),
                 "overlapping tensors", "b");
  // Two tensors sharing bytes exactly (an aliasing trick some writers use) is an overlap too.
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "," + tensor("b", "U8", "[2]", "[0,2]") + "}", 2),
                 "overlapping tensors", "b");
}

TEST(SafetensorsBadInput, TrailingBytesAfterData) {
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "}", 3), "trailing bytes after data buffer", "a");
}

TEST(SafetensorsBadInput, DataPastEndOfFile) {
  expect_refused(make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "}", 1), "data buffer past end of file", "a");
}

TEST(SafetensorsBadInput, DuplicateTensorNames) {
  const std::string a = tensor("a", "U8", "[2]", "[0,2]");
  expect_refused(make_file("{" + a + "," + a + "}", 2), "duplicate key", "a");
  expect_refused(make_file(R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2), "duplicate key", "a");
}

TEST(SafetensorsBadInput, DuplicateMetadataKeys) {
  expect_refused(make_file(R"({"__metadata__":{"k":"1","k":"2"}})", 0), "duplicate key", "__metadata__");
  expect_refused(make_file(R"({"__metadata__":{},"__metadata__":{}})", 0), "duplicate key", "__metadata__");
}

TEST(SafetensorsBadInput, NonStringMetadata) {
  expect_refused(make_file(R"({"__metadata__":{"k":1}})", 0), "__metadata__ not a string -> string map");
  expect_refused(make_file(R"({"__metadata__":{"k":{"x":"y"}}})", 0), "__metadata__ not a string -> string map");
  expect_refused(make_file(R"({"__metadata__":["k"]})", 0), "__metadata__ not a string -> string map");
}

TEST(SafetensorsBadInput, EmptyTensorName) {
  expect_refused(make_file("{" + tensor("", "U8", "[2]", "[0,2]") + "}", 2), "empty tensor name");
}

TEST(SafetensorsBadInput, ErrorCarriesTheFileOffset) {
  const std::string file = make_file("{" + tensor("a", "U8", "[2]", "[0,2]") + "," + tensor("b", "U8", "[2]", "[3,5]") + "}", 5);
  try {
    st::parse_header(std::string_view(file).substr(8, file.size() - 13), file.size(), "f.safetensors");
    FAIL() << "accepted";
  } catch (const hbmio::Error& error) {
    EXPECT_EQ(error.context().offset, file.size() - 5 + 2);  // the gap starts at data byte 2
    EXPECT_EQ(error.context().path, "f.safetensors");
  }
}

// Choices where the reference is lenient or unusual, matched on purpose.
TEST(SafetensorsReferenceLeniency, AcceptedLikeTheReference) {
  const auto parse = [](const std::string& json, std::uint64_t data) {
    return st::parse_header(json, 8 + json.size() + data, "x");
  };
  // Unknown keys in a tensor entry are ignored.
  EXPECT_EQ(parse(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":{"x":[1]}}})", 2).tensors.size(), 1u);
  // "__metadata__": null is no metadata.
  EXPECT_TRUE(parse("{\"__metadata__\":null," + tensor("a", "U8", "[2]", "[0,2]") + "}", 2).metadata.empty());
  // Whitespace around the object (the writer pads with spaces).
  EXPECT_EQ(parse(" \t\n{}\n   ", 0).tensors.size(), 0u);
  // Empty tensors may sit at any offset the tiling reaches, including twice at the same one.
  const auto header = parse("{" + tensor("e1", "F32", "[0,4]", "[0,0]") + "," + tensor("one", "F32", "[1]", "[0,4]") +
                            "," + tensor("e2", "I32", "[2,0]", "[4,4]") + "," + tensor("e0", "I32", "[0]", "[0,0]") + "}", 4);
  ASSERT_EQ(header.tensors.size(), 4u);
  EXPECT_EQ(header.tensors[0].name, "e0");  // ties broken by name
  EXPECT_EQ(header.tensors[1].name, "e1");
  EXPECT_EQ(header.tensors[2].name, "one");
  EXPECT_EQ(header.data_size, 4u);
  // A sub-byte tensor whose bits end on a byte.
  EXPECT_EQ(parse("{" + tensor("f4", "F4", "[4]", "[0,2]") + "," + tensor("f6", "F6_E2M3", "[4]", "[2,5]") + "}", 5)
                .tensors.size(), 2u);
}

// The common header is parsed without a JSON tree (FastHeader in safetensors.cpp) and anything
// else through the tree. An unknown key in one entry sends a header the tree's way: each header
// below must come out the same both ways, field by field.
// Two parses of one checkpoint's header gave the same tensors, metadata and data size.
void expect_same_header(const st::Header& a, const st::Header& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype);
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape);
    EXPECT_EQ(a.tensors[i].begin, b.tensors[i].begin);
    EXPECT_EQ(a.tensors[i].end, b.tensors[i].end);
  }
  EXPECT_EQ(a.metadata, b.metadata);
  EXPECT_EQ(a.has_metadata, b.has_metadata);
  EXPECT_EQ(a.data_size, b.data_size);
}

void expect_same_both_ways(const std::string& json, std::uint64_t data_size) {
  SCOPED_TRACE(json.substr(0, 200));
  const std::size_t entry = json.find("\"dtype\"");
  ASSERT_NE(entry, std::string::npos);
  std::string slow = json;
  slow.insert(entry, R"("unknown key":[{"x":null}],)");
  const st::Header a = st::parse_header(json, 8 + json.size() + data_size, "fast");
  const st::Header b = st::parse_header(slow, 8 + slow.size() + data_size, "tree");
  expect_same_header(a, b);
  EXPECT_EQ(a.header_size, json.size());
}

TEST(SafetensorsHeader, ParsedTheSameWithAndWithoutTheJsonTree) {
  // Every header the reference wrote.
  if (fs::is_directory(fixtures_dir())) {
    for (const auto& file : fs::directory_iterator(fixtures_dir())) {
      if (file.path().extension() != ".safetensors") continue;
      const std::string bytes = read_file(file.path());
      const std::uint64_t n = st::parse_header_length(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size(), "x");
      const std::string json = bytes.substr(8, n);
      if (json.find("\"dtype\"") != std::string::npos) expect_same_both_ways(json, bytes.size() - 8 - n);
    }
  }
  // Names with escapes and non-ASCII text, metadata present, empty, null; scalars, empty tensors,
  // sub-byte dtypes; many tensors in random order.
  expect_same_both_ways(R"({"__metadata__":{"format":"pt","k\"\u00e9":"v\n"},"a\u00e9\\b":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
                        R"("s":{"shape":[],"data_offsets":[12,16],"dtype":"F32"},"e":{"data_offsets":[16,16],"dtype":"I64","shape":[4,0]}})", 16);
  expect_same_both_ways(R"({"__metadata__":{},"t":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", 2);
  expect_same_both_ways(R"({"t":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]},"__metadata__":null})", 3);
  std::mt19937_64 random(11);
  std::vector<int> order(500);
  for (int i = 0; i < 500; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), random);
  std::string json = "{";
  for (const int i : order) json += (json.size() > 1 ? "," : "") + tensor("model.layers." + std::to_string(i) + ".w", "BF16", "[2,2]", "[" + std::to_string(8 * i) + "," + std::to_string(8 * i + 8) + "]");
  expect_same_both_ways(json + "}", 8 * 500);
}

// What the direct scan takes, the tree takes the same; what it stops at goes to the tree. So for
// any text, parse_header and the tree alone agree: both refuse it with the same message, or both
// give the same header. Thousands of mutations of common headers (a byte replaced by one of
// JSON's structural characters, a digit, a sign, an escape, a control or non-ASCII byte; a byte
// removed or inserted) probe the edges of the scan's subset.
TEST(SafetensorsHeader, TheDirectScanAndTheTreeAgreeOnMutatedHeaders) {
  const std::vector<std::string> seeds = {
      R"({"__metadata__":{"format":"pt","k":"v"},"a":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("s":{"shape":[],"data_offsets":[12,16],"dtype":"F32"},"e":{"data_offsets":[16,16],"dtype":"I64","shape":[4,0]}})",
      R"({"t":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]},"__metadata__":null})",
      R"( { "w" : { "dtype" : "BF16" , "shape" : [ 1 , 2 ] , "data_offsets" : [ 0 , 4 ] } } )",
      R"({"f4":{"dtype":"F4","shape":[4],"data_offsets":[0,2]},"u":{"dtype":"U8","shape":[10],"data_offsets":[2,12]}})",
  };
  const std::string alphabet = std::string("{}[]:,\"\\ \n\t-+.eE0123456789nulxa") + '\x01' + '\x7f' + "\xc3\xa9" + '\xff';
  std::mt19937_64 random(20261207);
  int taken = 0, refused = 0;
  for (int round = 0; round < 20000; ++round) {
    std::string json = seeds[round % seeds.size()];
    const int edits = 1 + static_cast<int>(random() % 3);
    for (int e = 0; e < edits && !json.empty(); ++e) {
      const std::size_t at = random() % json.size();
      const char c = alphabet[random() % alphabet.size()];
      switch (random() % 3) {
        case 0: json[at] = c; break;
        case 1: json.erase(at, 1); break;
        default: json.insert(json.begin() + static_cast<std::ptrdiff_t>(at), c); break;
      }
    }
    const std::uint64_t file_size = 8 + json.size() + 16;
    std::string fast_error, tree_error;
    st::Header fast, tree;
    try {
      fast = st::parse_header(json, file_size, "x");
    } catch (const hbmio::Error& error) {
      fast_error = error.what();
    }
    try {
      tree = st::detail::parse_header_through_tree(json, file_size, "x");
    } catch (const hbmio::Error& error) {
      tree_error = error.what();
    }
    SCOPED_TRACE(json);
    ASSERT_EQ(fast_error, tree_error);
    if (!fast_error.empty()) {
      ++refused;
      continue;
    }
    ++taken;
    expect_same_header(fast, tree);
  }
  // Both outcomes were probed (a mutation of whitespace or of a name keeps a header valid).
  EXPECT_GT(taken, 100);
  EXPECT_GT(refused, 5000);
}

// Headers the fast path stops at are parsed through the tree and refused (or taken) as before:
// the refusals below are the tree's, with its rules.
TEST(SafetensorsHeader, WhatTheFastPathStopsAtIsJudgedByTheTree) {
  const auto refused = [](const std::string& json, std::uint64_t data_size, std::string_view rule) {
    try {
      st::parse_header(json, 8 + json.size() + data_size, "x");
      ADD_FAILURE() << "accepted " << json;
    } catch (const hbmio::Error& error) {
      EXPECT_NE(error.detail().find(rule), std::string::npos) << error.what();
    }
  };
  refused(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"dtype":"U8"}})", 2, "duplicate key");
  refused(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2, "duplicate key");
  refused(R"({"__metadata__":{"k":"v"},"__metadata__":null,"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2, "duplicate key");
  refused(R"({"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})", 2, "invalid shape");
  refused(R"({"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}})", 0, "invalid shape");  // -0: not unsigned
  refused(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}})", 0, "invalid data_offsets");
  refused(R"({"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", 2, "invalid shape");
  refused(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}})", 2, "invalid data_offsets");
  refused(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}})", 2, "invalid data_offsets");
  refused(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}})", 2, "shape/size mismatch");
  refused(R"({"a":{"dtype":"X9","shape":[2],"data_offsets":[0,2]}})", 2, "unknown dtype");
  refused(R"({"a":{"shape":[2],"data_offsets":[0,2]}})", 2, "missing field");
  refused(R"({"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2, "__metadata__");
  refused(R"({"":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2, "empty tensor name");
  refused(R"([{"dtype":"U8","shape":[2],"data_offsets":[0,2]}])", 2, "not a JSON object");
  refused(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}} x)", 2, "invalid JSON");
}

// --- index ------------------------------------------------------------------------------------

void expect_index_refused(const std::string& json, std::string_view rule, std::string_view tensor = {}) {
  try {
    st::parse_index(json, "model.safetensors.index.json");
    ADD_FAILURE() << "accepted " << json;
  } catch (const hbmio::Error& error) {
    EXPECT_EQ(error.code(), std::errc::invalid_argument) << error.what();
    EXPECT_NE(error.detail().find(rule), std::string::npos) << error.what();
    if (!tensor.empty()) {
      EXPECT_NE(error.detail().find(tensor), std::string::npos) << error.what();
    }
    EXPECT_NE(std::string(error.what()).find("model.safetensors.index.json"), std::string::npos);
  }
}

std::string index_with_shard(std::string_view shard) {
  return R"({"metadata":{"total_size":4},"weight_map":{"w":)" + nlohmann::json(std::string(shard)).dump() + "}}";
}

TEST(SafetensorsIndex, ShardNamesMustBePlainFileNames) {
  constexpr std::string_view kRule = "shard name not a plain file name";
  expect_index_refused(index_with_shard("../x.safetensors"), kRule, "w");
  expect_index_refused(index_with_shard(".."), kRule, "w");
  expect_index_refused(index_with_shard("."), kRule, "w");
  expect_index_refused(index_with_shard("/abs/x.safetensors"), kRule, "w");
  expect_index_refused(index_with_shard("a/b.safetensors"), kRule, "w");
  expect_index_refused(index_with_shard("a\\b.safetensors"), kRule, "w");
  expect_index_refused(index_with_shard(""), kRule, "w");
  expect_index_refused(index_with_shard(std::string("x\0y", 3)), kRule, "w");
}

TEST(SafetensorsIndex, Structure) {
  expect_index_refused("[]", "index not a JSON object");
  expect_index_refused(R"({"metadata":{}})", "index without weight_map");
  expect_index_refused(R"({"weight_map":[]})", "weight_map not an object");
  expect_index_refused(R"({"weight_map":{"w":1}})", "shard name not a string", "w");
  expect_index_refused(R"({"weight_map":{"":"a.safetensors"}})", "empty tensor name");
  expect_index_refused(R"({"metadata":3,"weight_map":{}})", "index metadata not an object");
  expect_index_refused(R"({"weight_map":{"w":"a","w":"b"}})", "duplicate key", "weight_map");
  expect_index_refused("{\"weight_map\":{\"w\xff\":\"a\"}}", "invalid UTF-8");
  expect_index_refused(R"({"weight_map":{)", "invalid JSON");
  expect_index_refused(R"({"metadata":{"total_size":1e400},"weight_map":{}})", "invalid JSON");
}

TEST(SafetensorsIndex, ParsesNamesAndMetadata) {
  const auto index = st::parse_index(
      R"({"metadata":{"total_size":12,"format":"pt"},"weight_map":{"b":"s2.safetensors","a":"s1.safetensors","c":"s1.safetensors"}})",
      "i.json");
  EXPECT_EQ(index.shards, (std::vector<std::string>{"s1.safetensors", "s2.safetensors"}));
  EXPECT_EQ(index.weight_map.at("b"), "s2.safetensors");
  EXPECT_EQ(index.metadata.at("total_size"), "12");
  EXPECT_EQ(index.metadata.at("format"), "\"pt\"");  // values are kept as JSON text
  EXPECT_TRUE(st::parse_index(R"({"weight_map":{}})", "i.json").shards.empty());
}

TEST(SafetensorsIndex, ReadIndexRefusesMissingFile) {
  TempDir dir;
  EXPECT_THROW(st::read_index(dir.file("missing.json")), hbmio::Error);
  EXPECT_THROW(st::read_header(dir.file("missing.safetensors")), hbmio::Error);
}

// --- serialisation ----------------------------------------------------------------------------

std::vector<st::TensorInfo> sample_tensors() {
  const auto make = [](std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape) {
    st::TensorInfo t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    return t;
  };
  return {make("b", st::Dtype::U8, {2}),        make("a", st::Dtype::U8, {2}),     make("c", st::Dtype::F32, {3}),
          make("z", st::Dtype::F64, {1}),       make("e", st::Dtype::I16, {1}),    make("bb", st::Dtype::BOOL, {0}),
          make("scalar", st::Dtype::BF16, {}),  make("u", st::Dtype::U64, {2, 2}), make("x\xc3\xa9\"\\/\n\x01", st::Dtype::I8, {1}),
          make("h", st::Dtype::F16, {3, 0, 2}), make("c64", st::Dtype::C64, {1})};
}

TEST(SafetensorsSerialize, RoundTrip) {
  auto tensors = sample_tensors();
  st::order_like_reference(tensors);
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"k", "v \"quoted\""}};
  const std::string bytes = st::serialize_header(tensors, metadata);
  ASSERT_EQ(bytes.size() % 8, 0u);
  const std::uint64_t data_size = tensors.back().end;
  const std::uint64_t file_size = bytes.size() + data_size;
  const auto n = st::parse_header_length(reinterpret_cast<const std::byte*>(bytes.data()), file_size, "x");
  const auto header = st::parse_header(std::string_view(bytes).substr(8, n), file_size, "x");
  EXPECT_EQ(header.metadata, metadata);
  EXPECT_EQ(header.data_size, data_size);
  for (const auto& t : tensors) {
    const auto* parsed = header.find(t.name);
    ASSERT_NE(parsed, nullptr) << t.name;
    EXPECT_EQ(parsed->dtype, t.dtype);
    EXPECT_EQ(parsed->shape, t.shape);
    EXPECT_EQ(parsed->begin, t.begin);
    EXPECT_EQ(parsed->end, t.end);
  }
}

TEST(SafetensorsSerialize, EmptyHeaderIsPaddedLikeTheReference) {
  std::vector<st::TensorInfo> none;
  EXPECT_EQ(st::serialize_header(none, {}), length_prefix(8) + "{}      ");
}

// The reference's bytes for {"a": F32 [3]} (safetensors 0.8.0 and 0.9.0rc1, save(..., metadata=None)
// and save(..., metadata={})): None leaves the entry out, {} writes it empty.
TEST(SafetensorsSerialize, EmptyMetadataIsWrittenOnlyWhenAsked) {
  std::vector<st::TensorInfo> tensors(1);
  tensors[0].name = "a";
  tensors[0].dtype = st::Dtype::F32;
  tensors[0].shape = {3};
  const std::string entry = R"("a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]})";
  EXPECT_EQ(st::serialize_header(tensors, {}), length_prefix(56) + "{" + entry + "} ");
  EXPECT_EQ(st::serialize_header(tensors, {}, st::EmptyMetadata::omit), length_prefix(56) + "{" + entry + "} ");
  EXPECT_EQ(st::serialize_header(tensors, {}, st::EmptyMetadata::write),
            length_prefix(80) + R"({"__metadata__":{},)" + entry + "}       ");
  // Metadata that is there is written either way.
  EXPECT_EQ(st::serialize_header(tensors, {{"k", "v"}}, st::EmptyMetadata::write),
            length_prefix(80) + R"({"__metadata__":{"k":"v"},)" + entry + "}");
  // And what was written parses back: an empty entry that is there, or none.
  const std::string bytes = st::serialize_header(tensors, {}, st::EmptyMetadata::write) + std::string(12, '\0');
  const auto header = st::parse_header(std::string_view(bytes).substr(8, 80), bytes.size(), "x");
  EXPECT_TRUE(header.metadata.empty());
  EXPECT_TRUE(header.has_metadata);
  EXPECT_EQ(header.tensors.size(), 1u);
  const std::string without = st::serialize_header(tensors, {}) + std::string(12, '\0');
  EXPECT_FALSE(st::parse_header(std::string_view(without).substr(8, 56), without.size(), "x").has_metadata);
  const std::string null_entry = R"({"__metadata__":null,)" + entry + "}";
  EXPECT_FALSE(st::parse_header(null_entry, 8 + null_entry.size() + 12, "x").has_metadata);
}

TEST(SafetensorsSerialize, RefusesWhatNoReaderWouldAccept) {
  const auto refused = [](std::vector<st::TensorInfo> tensors, std::string_view rule) {
    try {
      st::serialize_header(tensors, {});
      ADD_FAILURE() << "accepted; expected " << rule;
    } catch (const hbmio::Error& error) {
      EXPECT_NE(error.detail().find(rule), std::string::npos) << error.what();
    }
  };
  auto tensors = sample_tensors();
  tensors[0].name = tensors[1].name;
  refused(tensors, "duplicate key");
  tensors = sample_tensors();
  tensors[0].name = "";
  refused(tensors, "empty tensor name");
  tensors[0].name = "__metadata__";
  refused(tensors, "reserved tensor name");
  tensors[0].name = "\xff";
  refused(tensors, "invalid UTF-8");
  tensors = sample_tensors();
  tensors[0].shape = {1ull << 40, 1ull << 40};
  refused(tensors, "shape product overflows");
  tensors[0].dtype = st::Dtype::F4;
  tensors[0].shape = {3};
  refused(tensors, "shape product overflows");
}

// Runs `command` with /bin/sh; returns its exit status.
int run_shell(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The same tensors written by the reference (pip safetensors, via numpy) must give the same bytes.
TEST(SafetensorsSerialize, ByteIdenticalToTheReferenceWriter) {
  if (run_shell("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with safetensors and numpy not available (pip install safetensors numpy)";
  TempDir dir;
  const std::string path = dir.file("reference.safetensors");
  // bfloat16/float8 are not numpy dtypes; the others cover every element size and the ordering.
  // The metadata has one key: the reference writes metadata in hash-map order.
  const std::string script =
      "import numpy as np, sys\n"
      "from safetensors.numpy import save_file\n"
      "t = {'b': np.zeros((2,), np.uint8), 'a': np.zeros((2,), np.uint8), 'c': np.zeros((3,), np.float32),\n"
      "     'z': np.zeros((1,), np.float64), 'e': np.zeros((1,), np.int16), 'bb': np.zeros((0,), np.bool_),\n"
      "     'scalar': np.zeros((), np.float16), 'u': np.zeros((2, 2), np.uint64),\n"
      "     'x\\u00e9\"\\\\/\\n\\x01': np.zeros((1,), np.int8), 'h': np.zeros((3, 0, 2), np.float16),\n"
      "     'c64': np.zeros((1,), np.complex64), 'i32': np.zeros((5,), np.int32), 'u16': np.zeros((2,), np.uint16)}\n"
      "save_file(t, sys.argv[1], metadata={'format': 'np'})\n";
  write_file(dir.file("make.py"), script);
  ASSERT_EQ(run_shell("python3 " + dir.file("make.py") + " " + path), 0);

  const auto make = [](std::string name, st::Dtype dtype, std::vector<std::uint64_t> shape) {
    st::TensorInfo t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    return t;
  };
  std::vector<st::TensorInfo> tensors{
      make("b", st::Dtype::U8, {2}),         make("a", st::Dtype::U8, {2}),      make("c", st::Dtype::F32, {3}),
      make("z", st::Dtype::F64, {1}),        make("e", st::Dtype::I16, {1}),     make("bb", st::Dtype::BOOL, {0}),
      make("scalar", st::Dtype::F16, {}),    make("u", st::Dtype::U64, {2, 2}),  make("x\xc3\xa9\"\\/\n\x01", st::Dtype::I8, {1}),
      make("h", st::Dtype::F16, {3, 0, 2}),  make("c64", st::Dtype::C64, {1}),   make("i32", st::Dtype::I32, {5}),
      make("u16", st::Dtype::U16, {2})};
  st::order_like_reference(tensors);
  const std::string ours = st::serialize_header(tensors, {{"format", "np"}});
  const std::string reference = read_file(path);
  ASSERT_GE(reference.size(), ours.size());
  EXPECT_EQ(ours, reference.substr(0, ours.size()));
  // And the reference's file passes our reader.
  const auto header = st::read_header(path);
  EXPECT_EQ(header.data_size, tensors.back().end);
}

// Files hbmio's serializer lays out are read by the reference reader.
TEST(SafetensorsSerialize, ReadByTheReferenceReader) {
  if (run_shell("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with safetensors and numpy not available (pip install safetensors numpy)";
  TempDir dir;
  auto tensors = sample_tensors();
  st::order_like_reference(tensors);
  const std::string path = dir.file("ours.safetensors");
  const std::string header = st::serialize_header(tensors, {{"k", "v"}});  // sets the offsets
  write_file(path, header + std::string(tensors.back().end, '\0'));
  const std::string script =
      "import sys\n"
      "from safetensors import safe_open\n"
      "with safe_open(sys.argv[1], 'np') as f:\n"
      "    assert f.metadata() == {'k': 'v'}, f.metadata()\n"
      "    names = set(f.keys())\n"
      "assert len(names) == " + std::to_string(tensors.size()) + ", names\n";
  write_file(dir.file("check.py"), script);
  EXPECT_EQ(run_shell("python3 " + dir.file("check.py") + " " + path), 0);
}

}  // namespace
