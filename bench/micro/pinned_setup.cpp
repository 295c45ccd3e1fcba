// What a process's first transfer pays to set up pinned memory, streams and events, measured
// several ways on the GPU machine (bench/RESULTS.md, "first use"). Build:
//   nvcc -O2 -std=c++20 -o pinned_setup bench/micro/pinned_setup.cpp   (static CUDA runtime)
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) { std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e)); std::exit(1); }
}
constexpr size_t kMiB = size_t{1} << 20;

void alloc_free(size_t bytes, unsigned flags) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, flags), "cudaHostAlloc");
  check(cudaFreeHost(p), "cudaFreeHost");
}

// mmap (optionally transparent huge pages), touch, cudaHostRegister.
double register_time(size_t bytes, bool huge, bool touch) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); std::exit(1); }
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  double t = now();
  if (touch) std::memset(p, 0, bytes);
  check(cudaHostRegister(p, bytes, cudaHostRegisterDefault), "cudaHostRegister");
  t = now() - t;
  check(cudaHostUnregister(p), "cudaHostUnregister");
  munmap(p, bytes);
  return t;
}
}  // namespace

int main() {
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaFree(nullptr), "context");
  const size_t total = 512 * kMiB, each = 32 * kMiB + 8192;
  for (int round = 0; round < 2; ++round) {
    double t = now();
    { void* p; check(cudaHostAlloc(&p, total, cudaHostAllocDefault), "a"); t = now() - t; cudaFreeHost(p); }
    std::printf("round %d: one cudaHostAlloc of 512 MiB: %.1f ms\n", round, t * 1e3);
    t = now();
    std::vector<void*> ps(16);
    for (auto& p : ps) check(cudaHostAlloc(&p, each, cudaHostAllocDefault), "b");
    t = now() - t;
    for (auto p : ps) cudaFreeHost(p);
    std::printf("round %d: 16 x 32 MiB cudaHostAlloc, one thread: %.1f ms\n", round, t * 1e3);
    t = now();
    {
      std::vector<std::thread> threads;
      for (int i = 0; i < 16; ++i) threads.emplace_back([&, i] { check(cudaHostAlloc(&ps[i], each, cudaHostAllocDefault), "c"); });
      for (auto& th : threads) th.join();
    }
    t = now() - t;
    for (auto p : ps) cudaFreeHost(p);
    std::printf("round %d: 16 x 32 MiB cudaHostAlloc, 16 threads: %.1f ms (wall)\n", round, t * 1e3);
    std::printf("round %d: mmap+touch+cudaHostRegister 512 MiB, 4 KiB pages: %.1f ms\n", round, register_time(total, false, true) * 1e3);
    std::printf("round %d: mmap+touch+cudaHostRegister 512 MiB, THP: %.1f ms\n", round, register_time(total, true, true) * 1e3);
    std::printf("round %d: mmap+cudaHostRegister 512 MiB (no touch), THP: %.1f ms\n", round, register_time(total, true, false) * 1e3);
    t = now();
    {
      std::vector<std::thread> threads;
      std::vector<cudaStream_t> streams(16);
      std::vector<cudaEvent_t> events(64);
      for (int i = 0; i < 16; ++i)
        threads.emplace_back([&, i] {
          check(cudaSetDevice(0), "set");
          check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "stream");
          for (int k = 0; k < 4; ++k) check(cudaEventCreateWithFlags(&events[i * 4 + k], cudaEventDisableTiming), "event");
        });
      for (auto& th : threads) th.join();
      t = now() - t;
      for (auto s : streams) cudaStreamDestroy(s);
      for (auto e : events) cudaEventDestroy(e);
    }
    std::printf("round %d: 16 streams + 64 events from 16 threads: %.1f ms (wall)\n", round, t * 1e3);
  }
  // The first cudaMemcpyAsync from pinned memory to a fresh 6 GiB device allocation.
  void* d = nullptr;
  double t = now();
  check(cudaMalloc(&d, 6 * 1024 * kMiB), "cudaMalloc");
  std::printf("cudaMalloc 6 GiB: %.1f ms\n", (now() - t) * 1e3);
  void* h = nullptr;
  check(cudaHostAlloc(&h, 64 * kMiB, 0), "h");
  for (int i = 0; i < 3; ++i) {
    t = now();
    for (size_t off = 0; off < 6 * 1024 * kMiB; off += 64 * kMiB) check(cudaMemcpy(static_cast<char*>(d) + off, h, 64 * kMiB, cudaMemcpyHostToDevice), "copy");
    std::printf("pass %d over 6 GiB of device memory (64 MiB copies): %.1f ms\n", i, (now() - t) * 1e3);
  }
  return 0;
}
