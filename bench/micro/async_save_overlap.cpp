// Time to durable of a background save (save_checkpoint_async, pinned staging) against a blocking
// save (save_checkpoint) of the same host state, rounds interleaved and rotated so that a disk
// whose rate drifts over a run of saves weighs on both alike. Each mode replaces its own file, as
// a training loop's checkpoints do. Uses only the public API, so the same source measures an older
// build beside a newer one (bench/RESULTS.md, "Background saves").
// Build: the CMake target `async_save_overlap` (built with the tools).
// Run:   async_save_overlap DIR [gib=1.5] [rounds=5] [tensors=48] [memory=host|pinned|cuda:0] [staging=pinned|device]
// Prints one JSON line per save (with the bytes written direct and through the page cache, and
// the copies through the engine's bounce buffers), then each mode's median (rounds after the
// first) and its ratio to the blocking saves'.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "hbmio/async_save.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [gib=1.5] [rounds=5] [tensors=48] [memory=host] [staging=pinned]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const double gib = argc > 2 ? std::atof(argv[2]) : 1.5;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 5;
  const int count = argc > 4 ? std::atoi(argv[4]) : 48;
  const hbmio::MemoryLocation where = hbmio::MemoryLocation::parse(argc > 5 ? argv[5] : "host");
  const std::string staging = argc > 6 ? argv[6] : "pinned";
  const std::size_t per = static_cast<std::size_t>(gib * double(std::uint64_t{1} << 30)) / static_cast<std::size_t>(count) / 2 * 2;

  std::vector<hbmio::Buffer> buffers;
  std::vector<hbmio::TensorToSave> tensors;
  std::vector<std::byte> pattern(per);
  for (std::size_t k = 0; k < per; ++k) pattern[k] = std::byte(static_cast<unsigned char>((k * 2654435761u) >> 7));
  for (int i = 0; i < count; ++i) {
    std::memcpy(pattern.data(), &i, std::min(sizeof i, per));  // no two tensors alike
    buffers.push_back(hbmio::Buffer::allocate(where, per));
    hbmio::copy_memory(buffers.back().span(), {pattern.data(), per, {}});
    tensors.push_back({"layers." + std::to_string(i) + ".weight", hbmio::safetensors::Dtype::BF16, {per / 2}, buffers.back().span()});
  }
  std::filesystem::create_directories(dir);
  const hbmio::AsyncSaveOptions async{.staging = staging == "device" ? hbmio::Staging::device : hbmio::Staging::pinned};
  std::map<std::string, std::vector<double>> durable;
  const std::vector<std::string> modes = {"blocking", "background"};
  for (int r = 0; r < rounds; ++r)
    for (std::size_t m = 0; m < modes.size(); ++m) {
      const std::string& mode = modes[(m + static_cast<std::size_t>(r)) % modes.size()];
      const std::string path = dir + "/" + mode + ".safetensors";
      const auto start = std::chrono::steady_clock::now();
      double stall = 0, seconds = 0, snapshot = 0;
      hbmio::Stats stats;
      if (mode == "blocking") {
        stats = hbmio::save_checkpoint(path, tensors);
        stall = seconds = seconds_since(start);
      } else {
        hbmio::SaveInProgress save = hbmio::save_checkpoint_async(path, tensors, {}, async);
        stall = seconds_since(start);
        stats = save.wait();
        const hbmio::AsyncSaveReport report = save.report();
        seconds = report.persist_seconds;
        snapshot = report.snapshot_seconds;
      }
      if (r > 0 || rounds == 1) durable[mode].push_back(seconds);
      std::printf("{\"round\": %d, \"mode\": \"%s\", \"stall_s\": %.4f, \"durable_s\": %.4f, \"snapshot_s\": %.4f, "
                  "\"bytes_direct\": %llu, \"bytes_buffered\": %llu, \"bounce_copies\": %llu}\n",
                  r, mode.c_str(), stall, seconds, snapshot, static_cast<unsigned long long>(stats.bytes_direct),
                  static_cast<unsigned long long>(stats.bytes_buffered), static_cast<unsigned long long>(stats.bounce_copies));
      std::fflush(stdout);
    }
  const double base = median(durable["blocking"]);
  for (const auto& mode : modes)
    std::printf("# %-10s durable median %.3f s (%.2f GiB/s), x blocking %.2f\n", mode.c_str(), median(durable[mode]),
                gib / median(durable[mode]), median(durable[mode]) / base);
  for (const auto& mode : modes) std::filesystem::remove(dir + "/" + mode + ".safetensors");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "async_save_overlap: %s\n", e.what());
  return 1;
}
