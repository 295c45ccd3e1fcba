// Reads a whole file into GPU memory (or pinned host memory where there is no GPU) with the
// best backend this machine offers, and says what it did.
#include <cstdio>

#include <hbmio/hbmio.hpp>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  try {
    const hbmio::MemoryLocation where =
        hbmio::cuda_device_count() > 0 ? hbmio::MemoryLocation{hbmio::MemoryKind::device, 0}
                                       : hbmio::MemoryLocation{hbmio::MemoryKind::pinned};
    hbmio::File file = hbmio::File::open(argv[1], hbmio::OpenMode::read);
    hbmio::Buffer buffer = hbmio::Buffer::allocate(where, file.size());
    auto engine = hbmio::make_engine("auto");  // HBMIO_* environment variables apply
    const hbmio::Stats stats = engine->read(file, 0, buffer.span());
    std::printf("%s: %llu bytes into %s by %s in %.3f s (%.2f GiB/s)\n%s\n", argv[1],
                static_cast<unsigned long long>(stats.bytes), where.to_string().c_str(), stats.backend.c_str(),
                stats.seconds, stats.gib_per_second(), stats.note.c_str());
  } catch (const hbmio::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
