// What one request costs beyond its bytes: many small warm reads through one engine, and batches
// of them (how lazy loads and read-ahead use an engine). Uses only the public API, so the same
// source measures an older build beside a newer one (bench/RESULTS.md, "per-request overhead").
// Build: the CMake target `request_overhead` (built with the tools), or against an installed hbmio.
// Run:   request_overhead FILE [requests=20000] [size=64K] [memory=pinned|host|cuda:0] [backends=uring,posix]
// FILE should be warm (read it once) and at least requests * size / 16 bytes long: offsets cycle.
// Prints one JSON line per backend and shape.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::string::size_type start = 0;
  while (start <= text.size()) {
    const auto comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: request_overhead FILE [requests] [size] [memory] [backends]\n");
    return 2;
  }
  const std::string path = argv[1];
  const std::size_t requests = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20000;
  const std::size_t size = argc > 3 ? hbmio::parse_size(argv[3]) : 64 * 1024;
  const hbmio::MemoryLocation where = hbmio::MemoryLocation::parse(argc > 4 ? argv[4] : "pinned");
  const std::vector<std::string> backends = split(argc > 5 ? argv[5] : "uring,posix");

  const hbmio::File file = hbmio::File::open(path, hbmio::OpenMode::read);
  const std::uint64_t file_size = file.size();
  if (file_size < size) throw std::runtime_error("file smaller than one request");
  const std::size_t slots = 16;  // destinations, so a batch of 16 reads lands in distinct memory
  hbmio::Buffer memory = hbmio::Buffer::allocate(where, slots * size);
  const std::uint64_t positions = file_size / size;

  for (const std::string& backend : backends) {
    auto engine = hbmio::make_engine(backend);
    // Offsets walk the file in steps of `size`, wrapping: warm data, no two reads alike in a row.
    auto request = [&](std::size_t i) {
      return hbmio::IoRequest{.op = hbmio::IoOp::read, .file = &file, .offset = (i % positions) * size,
                              .memory = memory.span().subspan((i % slots) * size, size)};
    };
    for (std::size_t i = 0; i < 200; ++i) engine->submit(request(i));  // set-up, caches

    // One request at a time (a lazy get_tensor of a small tensor).
    double cpu0 = hbmio::process_cpu_seconds(), t0 = now();
    for (std::size_t i = 0; i < requests; ++i) engine->submit(request(i));
    double wall = now() - t0, cpu = hbmio::process_cpu_seconds() - cpu0;
    std::printf("{\"backend\": \"%s\", \"shape\": \"single\", \"memory\": \"%s\", \"requests\": %zu, \"size\": %zu, "
                "\"seconds\": %.4f, \"us_per_request\": %.2f, \"cpu_us_per_request\": %.2f}\n",
                backend.c_str(), where.to_string().c_str(), requests, size, wall, wall / requests * 1e6, cpu / requests * 1e6);

    // Batches of 16 (read-ahead of a run of small tensors).
    std::vector<hbmio::IoRequest> batch(slots);
    cpu0 = hbmio::process_cpu_seconds(), t0 = now();
    for (std::size_t i = 0; i < requests; i += slots) {
      for (std::size_t k = 0; k < slots; ++k) batch[k] = request(i + k);
      engine->submit_batch(batch);
    }
    wall = now() - t0, cpu = hbmio::process_cpu_seconds() - cpu0;
    std::printf("{\"backend\": \"%s\", \"shape\": \"batch16\", \"memory\": \"%s\", \"requests\": %zu, \"size\": %zu, "
                "\"seconds\": %.4f, \"us_per_request\": %.2f, \"cpu_us_per_request\": %.2f}\n",
                backend.c_str(), where.to_string().c_str(), requests, size, wall, wall / requests * 1e6, cpu / requests * 1e6);
    std::fflush(stdout);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "request_overhead: %s\n", e.what());
  return 1;
}
