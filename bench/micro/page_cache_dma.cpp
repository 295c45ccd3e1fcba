// Can a warm load skip the page-cache copy? Maps a file that is in the page cache, registers the
// mapping with CUDA read-only (cudaHostRegisterReadOnly: the kernel pins the page-cache pages)
// and copies from it to the GPU by DMA, so no CPU copies the bytes. Measures the registration
// and the copy, piece by piece on several threads and whole, against a copy from pinned memory
// (bench/RESULTS.md, warm loads). Build:
//   nvcc -O2 -std=c++20 -o page_cache_dma bench/micro/page_cache_dma.cpp   (static CUDA runtime)
// Run: page_cache_dma FILE [threads] [piece MiB]
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
constexpr size_t kMiB = size_t{1} << 20;
constexpr double kGiB = 1024.0 * 1024 * 1024;

// Threads take pieces from a counter; each registers its piece, copies it on its own stream,
// waits and unregisters. Returns seconds; sums registration and unregistration time.
double pieces(const std::byte* map, std::byte* dev, size_t size, size_t piece, unsigned threads, double& reg, double& unreg) {
  std::atomic<size_t> next{0};
  std::atomic<long long> reg_ns{0}, unreg_ns{0};
  const double start = now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      cudaStream_t s;
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
      for (size_t i; (i = next.fetch_add(1)) * piece < size;) {
        const size_t off = i * piece, n = std::min(piece, size - off);
        void* p = const_cast<std::byte*>(map + off);
        double t0 = now();
        check(cudaHostRegister(p, n, cudaHostRegisterReadOnly), "cudaHostRegister(ReadOnly) of the mapping");
        reg_ns += static_cast<long long>((now() - t0) * 1e9);
        check(cudaMemcpyAsync(dev + off, p, n, cudaMemcpyHostToDevice, s), "copy");
        check(cudaStreamSynchronize(s), "sync");
        t0 = now();
        check(cudaHostUnregister(p), "cudaHostUnregister");
        unreg_ns += static_cast<long long>((now() - t0) * 1e9);
      }
      check(cudaStreamDestroy(s), "stream destroy");
    });
  for (auto& t : pool) t.join();
  reg = static_cast<double>(reg_ns.load()) * 1e-9;
  unreg = static_cast<double>(unreg_ns.load()) * 1e-9;
  return now() - start;
}
// Pipelined: threads take pieces from a counter, register each and queue its copy at once on
// their own stream (so registering piece k+1 overlaps copying piece k); every piece is
// unregistered only after all copies are done. Prints when the data is in GPU memory and when
// the unregistration is done.
void pipelined(const std::byte* map, std::byte* dev, size_t size, size_t piece, unsigned threads) {
  std::atomic<size_t> next{0};
  std::atomic<long long> reg_ns{0};
  const double start = now();
  std::vector<std::vector<void*>> mine(threads);
  std::vector<cudaStream_t> streams(threads);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      check(cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking), "stream");
      for (size_t i; (i = next.fetch_add(1)) * piece < size;) {
        const size_t off = i * piece, n = std::min(piece, size - off);
        void* p = const_cast<std::byte*>(map + off);
        const double t0 = now();
        check(cudaHostRegister(p, n, cudaHostRegisterReadOnly), "cudaHostRegister(ReadOnly) of the mapping");
        reg_ns += static_cast<long long>((now() - t0) * 1e9);
        check(cudaMemcpyAsync(dev + off, p, n, cudaMemcpyHostToDevice, streams[t]), "copy");
        mine[t].push_back(p);
      }
      check(cudaStreamSynchronize(streams[t]), "sync");
    });
  for (auto& t : pool) t.join();
  const double data = now() - start;
  for (unsigned t = 0; t < threads; ++t) {
    for (void* p : mine[t]) check(cudaHostUnregister(p), "cudaHostUnregister");
    check(cudaStreamDestroy(streams[t]), "stream destroy");
  }
  const double all = now() - start;
  std::printf("pipelined %u thread(s), %zu MiB pieces: data in GPU after %.3f s (%.1f GiB/s; registration %.3f s summed), "
              "unregistered after %.3f s\n", threads, piece / kMiB, data, static_cast<double>(size) / kGiB / data,
              static_cast<double>(reg_ns.load()) * 1e-9, all);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE [threads] [piece MiB]\n", argv[0]);
    return 2;
  }
  const unsigned threads = argc > 2 ? static_cast<unsigned>(std::atoi(argv[2])) : 8;
  const size_t piece = (argc > 3 ? static_cast<size_t>(std::atoi(argv[3])) : 64) * kMiB;
  const int fd = open(argv[1], O_RDONLY);
  if (fd < 0) {
    perror(argv[1]);
    return 1;
  }
  struct stat st {};
  fstat(fd, &st);
  const size_t size = static_cast<size_t>(st.st_size) / 4096 * 4096;
  int supported = 0;
  check(cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, 0), "attribute");
  std::printf("file %s, %.2f GiB, %u threads, %zu MiB pieces, read-only registration supported: %d\n", argv[1],
              static_cast<double>(size) / kGiB, threads, piece / kMiB, supported);
  std::byte* dev = nullptr;
  check(cudaMalloc(&dev, size), "cudaMalloc");
  check(cudaFree(nullptr), "context");

  // Reference: the pinned host-to-device rate (one 1 GiB pinned buffer, copied repeatedly).
  {
    void* pinned = nullptr;
    const size_t n = std::min<size_t>(size, 1024 * kMiB);
    check(cudaHostAlloc(&pinned, n, cudaHostAllocDefault), "cudaHostAlloc");
    check(cudaMemcpy(dev, pinned, n, cudaMemcpyHostToDevice), "warm-up");
    const double t = now();
    for (size_t off = 0; off + n <= size; off += n) check(cudaMemcpy(dev + off, pinned, n, cudaMemcpyHostToDevice), "copy");
    const double s = now() - t;
    std::printf("pinned H2D: %.1f GiB/s\n", static_cast<double>(size / n * n) / kGiB / s);
    check(cudaFreeHost(pinned), "free");
  }

  for (int round = 0; round < 2; ++round)
    for (auto [t, mib] : {std::pair{1u, 256}, std::pair{2u, 256}, std::pair{4u, 256}, std::pair{4u, 1024}, std::pair{8u, 128}}) {
      auto* map = static_cast<std::byte*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
      pipelined(map, dev, size, mib * kMiB, t);
      munmap(map, size);
    }
  if (std::getenv("PIPELINED_ONLY")) return 0;
  for (int round = 0; round < 3; ++round) {
    auto* map = static_cast<std::byte*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
    if (map == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    double reg = 0, unreg = 0;
    const double s = pieces(map, dev, size, piece, threads, reg, unreg);
    std::printf("round %d pieces: %.3f s, %.1f GiB/s (registration %.3f s, unregistration %.3f s, summed over threads)\n", round,
                s, static_cast<double>(size) / kGiB / s, reg, unreg);
    munmap(map, size);
  }
  {
    auto* map = static_cast<std::byte*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
    double t = now();
    check(cudaHostRegister(map, size, cudaHostRegisterReadOnly), "cudaHostRegister(ReadOnly) of the whole mapping");
    const double reg = now() - t;
    t = now();
    check(cudaMemcpy(dev, map, size, cudaMemcpyHostToDevice), "copy");
    const double copy = now() - t;
    t = now();
    check(cudaHostUnregister(map), "unregister");
    std::printf("whole: registration %.3f s, copy %.3f s (%.1f GiB/s), unregistration %.3f s\n", reg, copy,
                static_cast<double>(size) / kGiB / copy, now() - t);
    munmap(map, size);
  }
  check(cudaFree(dev), "free");
  close(fd);
  return 0;
}
