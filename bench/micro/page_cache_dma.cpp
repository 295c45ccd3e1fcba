// Can a warm load skip the page-cache copy? Maps a file that is in the page cache, registers the
// mapping with CUDA read-only (cudaHostRegisterReadOnly: the kernel pins the page-cache pages)
// and copies from it to the GPU by DMA, so no CPU copies the bytes. Measures the registration
// and the copy, piece by piece on several threads and whole, against a copy from pinned memory
// (bench/RESULTS.md, "Engine tuning"). Build:
//   nvcc -O2 -std=c++20 -o page_cache_dma bench/micro/page_cache_dma.cpp   (static CUDA runtime)
// Run: page_cache_dma FILE [threads] [piece MiB]
//      HYBRID="0 0.3 0.5" COPIERS="8 14" page_cache_dma FILE   (registration beside pread copies)
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

// Hybrid: the file's first `fraction` goes by registration and DMA (one thread, pipelined as
// above: registration serializes in the kernel, so more threads do not help), the rest the
// engine's way at the same time: `copiers` threads pread 2 MiB pieces from the page cache into
// pinned buffers (two per thread, alternating) and copy them to the GPU on their own streams.
// Does registration run beside the copies, so that the two paths add up? Prints when the data is
// in GPU memory and when the registered part is unregistered.
void hybrid(int fd, const std::byte* map, std::byte* dev, size_t size, double fraction, unsigned copiers) {
  constexpr size_t kPiece = 2 * kMiB, kRegPiece = 256 * kMiB;
  const size_t split = static_cast<size_t>(static_cast<double>(size) * fraction) / kRegPiece * kRegPiece;
  std::vector<std::byte*> pinned(2 * copiers);
  for (auto& p : pinned) check(cudaHostAlloc(reinterpret_cast<void**>(&p), kPiece, cudaHostAllocDefault), "cudaHostAlloc");
  std::atomic<size_t> next{split / kPiece};
  const double start = now();
  double registered_done = start, copied_done = start;
  std::vector<void*> registered;
  std::thread registrar([&] {
    if (split == 0) return;
    cudaStream_t s;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    for (size_t off = 0; off < split; off += kRegPiece) {
      void* p = const_cast<std::byte*>(map + off);
      check(cudaHostRegister(p, kRegPiece, cudaHostRegisterReadOnly), "cudaHostRegister(ReadOnly) of the mapping");
      check(cudaMemcpyAsync(dev + off, p, kRegPiece, cudaMemcpyHostToDevice, s), "copy");
      registered.push_back(p);
    }
    check(cudaStreamSynchronize(s), "sync");
    check(cudaStreamDestroy(s), "stream destroy");
    registered_done = now();
  });
  std::vector<std::thread> pool;
  std::vector<double> ends(copiers, start);
  for (unsigned t = 0; t < copiers; ++t)
    pool.emplace_back([&, t] {
      cudaStream_t s;
      cudaEvent_t done[2];
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
      for (auto& e : done) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
      bool used[2] = {false, false};
      for (size_t k = 0, i; (i = next.fetch_add(1)) * kPiece < size; ++k) {
        const size_t off = i * kPiece, n = std::min(kPiece, size - off), b = k % 2;
        if (used[b]) check(cudaEventSynchronize(done[b]), "event wait");  // its last copy is done
        std::byte* buf = pinned[2 * t + b];
        for (size_t got = 0; got < n;) {
          const ssize_t r = pread(fd, buf + got, n - got, static_cast<off_t>(off + got));
          if (r <= 0) {
            std::perror("pread");
            std::exit(1);
          }
          got += static_cast<size_t>(r);
        }
        check(cudaMemcpyAsync(dev + off, buf, n, cudaMemcpyHostToDevice, s), "copy");
        check(cudaEventRecord(done[b], s), "event");
        used[b] = true;
      }
      check(cudaStreamSynchronize(s), "sync");
      for (auto& e : done) check(cudaEventDestroy(e), "event destroy");
      check(cudaStreamDestroy(s), "stream destroy");
      ends[t] = now();
    });
  for (auto& t : pool) t.join();
  registrar.join();
  for (double e : ends) copied_done = std::max(copied_done, e);
  const double data = std::max(registered_done, copied_done) - start;
  for (void* p : registered) check(cudaHostUnregister(p), "cudaHostUnregister");
  const double all = now() - start;
  for (auto* p : pinned) check(cudaFreeHost(p), "free");
  std::printf("hybrid %.2f registered + %u copier(s): data in GPU after %.3f s (%.1f GiB/s; registered part done at %.3f s, "
              "copied part at %.3f s), unregistered after %.3f s\n", static_cast<double>(split) / static_cast<double>(size),
              copiers, data, static_cast<double>(size) / kGiB / data, registered_done - start, copied_done - start, all);
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

  if (const char* fractions = std::getenv("HYBRID")) {  // e.g. HYBRID="0 0.3 0.5" COPIERS="8 14"
    const char* copiers_env = std::getenv("COPIERS");
    for (int round = 0; round < 2; ++round)
      for (const char* f = fractions; *f;) {
        char* end = nullptr;
        const double fraction = std::strtod(f, &end);
        if (end == f) break;
        f = end;
        for (const char* c = copiers_env ? copiers_env : "8"; *c;) {
          char* cend = nullptr;
          const auto copiers = static_cast<unsigned>(std::strtoul(c, &cend, 10));
          if (cend == c) break;
          c = cend;
          auto* map = static_cast<std::byte*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
          hybrid(fd, map, dev, size, fraction, copiers);
          munmap(map, size);
        }
      }
    return 0;
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
