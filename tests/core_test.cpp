// Options, sizes, memory locations, buffers: the small pieces everything else relies on.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>

#include "memory/staging_ring.hpp"
#include "test_support.hpp"

namespace hbmio::test {
namespace {

TEST(Sizes, ParseAndFormat) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("64K"), 65536u);
  EXPECT_EQ(parse_size("4MiB"), 4u << 20);
  EXPECT_EQ(parse_size("1.5G"), 3u << 29);
  EXPECT_EQ(parse_size("2gib"), std::uint64_t{2} << 30);
  for (const char* bad : {"", "x", "4X", "-1", "1.5", "nan", "1e30T", "0x100", "1e3", "+4", " 4", "1..5G", "4 MiB", ".", "-1MiB"})
    EXPECT_THROW(parse_size(bad), Error) << bad;
  EXPECT_EQ(parse_size("0.5K"), 512u);
  // Decimal units as Hugging Face reads max_shard_size, binary ones as memory sizes are written.
  EXPECT_EQ(parse_size("5GB"), 5'000'000'000u);
  EXPECT_EQ(parse_size("500MB"), 500'000'000u);
  EXPECT_EQ(parse_size("2KB"), 2000u);
  EXPECT_EQ(parse_size("1TB"), 1'000'000'000'000u);
  EXPECT_EQ(parse_size("5gB"), 5'000'000'000u);
  EXPECT_EQ(parse_size("5G"), std::uint64_t{5} << 30);
  EXPECT_EQ(parse_size("5GiB"), std::uint64_t{5} << 30);
  EXPECT_EQ(parse_size("8B"), 8u);
  // "Gb" is gigabits to Hugging Face: refused with the two spellings that mean bytes.
  for (const char* bits : {"5Gb", "5Mb", "1Kb", "2Tb", "5gb"}) {
    try {
      (void)parse_size(bits);
      ADD_FAILURE() << bits << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("bits"), std::string::npos) << e.what();
    }
  }
  for (const char* bad : {"5Gi", "5KiBs", "5PB", "5 GB", "0.3B"}) EXPECT_THROW(parse_size(bad), Error) << bad;
  EXPECT_EQ(format_size(512), "512 B");
  EXPECT_EQ(format_size(3u << 29), "1.50 GiB");
}

// A failed verification is named as what it is, and still compares equal to EIO for code that
// tests errno conditions; a missing checksum to ENODATA.
TEST(Errors, VerificationHasItsOwnWords) {
  const Error bad(make_error_code(Errc::verify_failed), {.op = "verify", .path = "m.safetensors", .offset = 8, .length = 4},
                  "tensor 'w'");
  EXPECT_EQ(std::string(bad.what()), "verify of m.safetensors [offset 8, length 4]: verification failed (tensor 'w')");
  EXPECT_EQ(bad.code(), std::errc::io_error);
  EXPECT_EQ(bad.code().category().name(), std::string("hbmio"));
  const Error none(make_error_code(Errc::no_checksums), {.op = "verify", .path = "m.safetensors"});
  EXPECT_EQ(none.code(), std::errc::no_message_available);
  EXPECT_NE(std::string(none.what()).find("nothing to verify against"), std::string::npos);
}

TEST(MemoryLocations, ParseAndPrint) {
  EXPECT_EQ(MemoryLocation::parse("host"), (MemoryLocation{MemoryKind::host, 0}));
  EXPECT_EQ(MemoryLocation::parse("pinned"), (MemoryLocation{MemoryKind::pinned, 0}));
  EXPECT_EQ(MemoryLocation::parse("cuda:3"), (MemoryLocation{MemoryKind::device, 3}));
  EXPECT_EQ(MemoryLocation::parse("cuda:3").to_string(), "cuda:3");
  EXPECT_EQ(MemoryLocation::parse("cpu"), (MemoryLocation{MemoryKind::host, 0}));
  EXPECT_EQ(MemoryLocation::parse("cuda"), (MemoryLocation{MemoryKind::device, 0}));
  // torch.device's words, no others: "gpu" is refused here as it is in Python, naming the forms.
  for (const char* bad : {"", "gpu", "gpu:0", "gpu0", "cuda:", "cuda:x", "cuda:-1", "cuda:12345", "disk", "CUDA:0"}) {
    try {
      (void)MemoryLocation::parse(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("host (or cpu), pinned, cuda"), std::string::npos) << e.what();
    }
  }
}

TEST(Options, EnvironmentOverridesDefaults) {
  ::setenv("HBMIO_CHUNK_SIZE", "32MiB", 1);
  ::setenv("HBMIO_QUEUE_DEPTH", "16", 1);
  ::setenv("HBMIO_DIRECT_IO", "off", 1);
  const Options o = Options::from_env();
  EXPECT_EQ(o.chunk_size, 32u << 20);
  EXPECT_EQ(o.queue_depth, 16u);
  EXPECT_EQ(o.direct_io, DirectIo::off);
  ::setenv("HBMIO_BOUNCE_BUFFER_SIZE", "lots", 1);
  try {
    Options::from_env();
    ADD_FAILURE() << "malformed variable accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("HBMIO_BOUNCE_BUFFER_SIZE"), std::string::npos) << e.what();
  }
  for (const char* v : {"HBMIO_CHUNK_SIZE", "HBMIO_QUEUE_DEPTH", "HBMIO_DIRECT_IO", "HBMIO_BOUNCE_BUFFER_SIZE"}) ::unsetenv(v);
}

TEST(Options, ValidationNamesTheField) {
  Options o;
  o.bounce_buffer_size = 1000;
  try {
    o.validate();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bounce_buffer_size"), std::string::npos);
  }
  o = Options{};
  o.chunk_size = o.bounce_buffer_size + 4096;
  EXPECT_THROW(o.validate(), Error);
  EXPECT_GE(Options{}.resolved_workers(), 1u);
}

TEST(Buffers, HostAndPinnedAreAlignedAndCounted) {
  const MemoryCounters before = memory_counters();
  {
    Buffer host = Buffer::allocate({MemoryKind::host}, 10000);
    Buffer pinned = Buffer::allocate({MemoryKind::pinned}, 10000);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(host.data()) % 4096, 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pinned.data()) % 4096, 0u);
    EXPECT_EQ(memory_counters().host_buffers, before.host_buffers + 1);
    EXPECT_EQ(memory_counters().pinned_bytes, before.pinned_bytes + 10000);
    Buffer moved = std::move(host);
    EXPECT_EQ(host.data(), nullptr);
    EXPECT_EQ(moved.size(), 10000u);
  }
  EXPECT_EQ(memory_counters().host_buffers, before.host_buffers);
  EXPECT_EQ(memory_counters().pinned_buffers, before.pinned_buffers);
}

TEST(Buffers, SubspanChecksBounds) {
  Buffer b = Buffer::allocate({MemoryKind::host}, 100);
  EXPECT_EQ(b.span().subspan(10, 90).size, 90u);
  EXPECT_THROW(b.span().subspan(10, 91), Error);
}

// The staging ring every path into GPU memory without GDS lands through: each slot is handed out
// once until given back, and a slot whose copy is queued comes back only through reclaim_oldest,
// oldest first, once its copy is done; the copies land every byte where they were sent.
TEST(StagingRings, SlotsAreHandedOutOnceUntilGivenBack) {
  detail::StagingRing ring(MemoryKind::host, 3, 8192);
  std::set<int> taken;
  for (int i = 0; i < 3; ++i) {
    const int slot = ring.acquire();
    ASSERT_GE(slot, 0);
    EXPECT_TRUE(taken.insert(slot).second) << "slot " << slot << " handed out twice";
    EXPECT_EQ(ring.data(slot), ring.memory().data() + static_cast<std::size_t>(slot) * 8192);
  }
  EXPECT_EQ(ring.acquire(), -1);
  ring.release(1);
  EXPECT_EQ(ring.acquire(), 1);
  EXPECT_FALSE(ring.copying());
  // Copies to a GPU need pinned slots: refused before any CUDA call, so this runs everywhere.
  try {
    ring.use_device(0, {.op = "test"});
    ADD_FAILURE() << "a ring of pageable memory was bound to a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), std::errc::invalid_argument);
  }
}

TEST(GpuStagingRing, CopiesLandInOrderAndSlotsComeBackOnlyOnceCopied) {
  if (cuda_device_count() == 0) GTEST_SKIP() << cuda_unavailable_reason();
  constexpr std::size_t kSlot = std::size_t{1} << 20, kParts = 9;
  const ErrorContext context{.op = "staging ring test"};
  detail::StagingRing ring(MemoryKind::pinned, 2, kSlot);
  ring.use_device(0, context);
  Buffer device = Buffer::allocate({MemoryKind::device, 0}, kParts * kSlot);
  std::deque<int> queued;
  for (std::size_t k = 0; k < kParts; ++k) {
    int slot = ring.acquire();
    if (slot < 0) {
      ASSERT_TRUE(ring.copying());
      EXPECT_EQ(ring.reclaim_oldest(std::chrono::microseconds(30), context), queued.front());  // oldest first
      queued.pop_front();
      slot = ring.acquire();
    }
    ASSERT_GE(slot, 0);
    std::memset(ring.data(slot), static_cast<int>(k + 1), kSlot);
    ring.copy_to_device(slot, 4096, device.data() + k * kSlot, kSlot - 4096, context);  // from an offset in the slot
    queued.push_back(slot);
  }
  while (ring.copying()) {
    EXPECT_EQ(ring.reclaim_oldest(std::chrono::microseconds(0), context), queued.front());
    queued.pop_front();
  }
  const std::vector<std::byte> back = to_host(device.span());
  for (std::size_t k = 0; k < kParts; ++k)
    for (std::size_t i = 0; i < kSlot - 4096; i += 4093)
      ASSERT_EQ(back[k * kSlot + i], static_cast<std::byte>(k + 1)) << "part " << k << ", byte " << i;
}

TEST(Files, DirectIoAlignmentIsReported) {
  TempDir dir;
  write_file(dir.file("f"), random_bytes(10, 1));
  File f = File::open(dir.file("f"), OpenMode::read);
  EXPECT_EQ(f.size(), 10u);
  if (f.direct_io().supported) {
    EXPECT_GT(f.direct_io().offset_alignment, 0u);
    EXPECT_LE(f.direct_io().offset_alignment, 4096u);
    EXPECT_GT(f.direct_io().block_size, 0u);
  } else {
    EXPECT_FALSE(f.direct_io().reason.empty());
  }
}

TEST(Backends, ProbeNamesEveryBackendWithAReason) {
  const auto statuses = probe_backends();
  ASSERT_EQ(statuses.size(), 4u);
  for (const auto& s : statuses) EXPECT_FALSE(s.detail.empty()) << s.name;
  EXPECT_TRUE(statuses[0].available);  // posix always works
}

}  // namespace
}  // namespace hbmio::test
