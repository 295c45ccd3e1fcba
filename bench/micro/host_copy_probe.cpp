// Why do the cache server's copies run slower than copies from cudaHostAlloc memory? The server
// (src/cache/server.cpp) holds a file in a sealed memfd, maps it read-only (MAP_SHARED |
// MAP_POPULATE) and pins it with cudaHostRegister(ReadOnly | Portable); on an H100 its copies into
// GPU memory ran at 46 GiB/s where copies from cudaHostAlloc memory run at 51.5. This separates
// the suspects: the source memory's kind and page size (5 sources, one at a time), the destination
// (one allocation; 48, as PyTorch allocates per tensor; one of another process opened through CUDA
// IPC, as the server's destinations are) and the way the copy is issued (whole; 64 MiB pieces on
// one stream; on two streams). Prints a table and one `JSON {...}` line per row for scripts. Build:
//   nvcc -O2 -std=c++20 -o host_copy_probe bench/micro/host_copy_probe.cpp   (static CUDA runtime)
// Run: [PROBE_SOURCES="hostalloc memfd-sealed-ro"] host_copy_probe [GiB=6] [runs=5]
//      (3 x GiB of GPU memory, 1 x GiB of host memory at a time)
#include <cuda_runtime.h>
#include <fcntl.h>
#include <linux/memfd.h>  // MFD_HUGE_2MB; before sys/mman.h, which then leaves the MFD_ flags alone
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
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

// 64-bit word k of every source: k times an odd constant (different at every offset, so a copy to
// the wrong place shows), with the low bit of each byte set (no zero byte: untouched memory shows).
uint64_t word_at(size_t k) { return (k * 0x9E3779B97F4A7C15ull) | 0x0101010101010101ull; }
void fill(void* dst, size_t size) {
  auto* w = static_cast<uint64_t*>(dst);
  for (size_t k = 0; k < size / 8; ++k) w[k] = word_at(k);
}

// The first line of a file, and the named lines of /proc/meminfo, for the record of the run.
std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  return std::getline(in, line) ? line : std::string("(unreadable: ") + path + ")";
}
std::string meminfo(std::initializer_list<const char*> keys) {
  std::ifstream in("/proc/meminfo");
  std::string out;
  for (std::string line; std::getline(in, line);)
    for (const char* key : keys)
      if (line.rfind(std::string(key) + ":", 0) == 0) {
        line.erase(std::unique(line.begin(), line.end(), [](char a, char b) { return a == ' ' && b == ' '; }), line.end());
        out += (out.empty() ? "" : ", ") + line;
      }
  return out;
}

// One source: S bytes of host memory, page-locked; released (unregistered, then freed or unmapped,
// and its memfd closed) when it goes, so only one source holds host memory at a time.
struct Source {
  const char* name = "";
  std::byte* data = nullptr;
  size_t size = 0;
  bool host_alloc = false, registered = false;
  int fd = -1;
  double fill_s = 0, register_s = 0;
  Source(const char* n, size_t s) : name(n), size(s) {}
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  ~Source() {
    if (registered) check(cudaHostUnregister(data), "cudaHostUnregister");
    if (host_alloc && data) check(cudaFreeHost(data), "cudaFreeHost");
    if (!host_alloc && data) munmap(data, size);
    if (fd >= 0) close(fd);
  }
};
using SourcePtr = std::unique_ptr<Source>;

// Page-locks the source; a refusal skips the source instead of ending the run.
bool pin(Source& s, unsigned flags) {
  const double t = now();
  const cudaError_t e = cudaHostRegister(s.data, s.size, flags);
  s.register_s = now() - t;
  if (e != cudaSuccess) {
    std::printf("%s: cudaHostRegister: %s; skipped\n", s.name, cudaGetErrorString(e));
    (void)cudaGetLastError();
    return false;
  }
  s.registered = true;
  return true;
}

SourcePtr make_hostalloc(size_t size) {
  auto s = std::make_unique<Source>("hostalloc", size);
  s->host_alloc = true;
  const double t = now();
  check(cudaHostAlloc(reinterpret_cast<void**>(&s->data), size, cudaHostAllocDefault), "cudaHostAlloc");
  s->register_s = now() - t;  // the allocation pins: reported as its registration
  const double f = now();
  fill(s->data, size);
  s->fill_s = now() - f;
  return s;
}

// Private anonymous memory, as the engine's own buffers. Under THP "always" it may get huge pages:
// AnonHugePages says.
SourcePtr make_anon(size_t size) {
  auto s = std::make_unique<Source>("anon-registered", size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    std::printf("%s: mmap: %s; skipped\n", s->name, std::strerror(errno));
    return nullptr;
  }
  s->data = static_cast<std::byte*>(p);
  const double t = now();
  fill(p, size);
  s->fill_s = now() - t;
  std::printf("  THP enabled: %s; %s\n", first_line("/sys/kernel/mm/transparent_hugepage/enabled").c_str(),
              meminfo({"AnonHugePages"}).c_str());
  return pin(*s, cudaHostRegisterDefault) ? std::move(s) : nullptr;
}

// The server's way: a memfd of S bytes written through a writable shared mapping, unmapped
// (F_SEAL_WRITE is refused while a writable mapping exists), sealed, mapped read-only and
// populated, and pinned read-only and portable. `thp` asks for transparent huge pages on the
// writable mapping before the first write (a shmem page's size is chosen when it is allocated, at
// the first write); `hugetlb` puts the memfd on hugetlbfs (2 MiB pages, reserved at mmap).
SourcePtr make_memfd(const char* name, size_t size, bool thp, bool hugetlb) {
  auto s = std::make_unique<Source>(name, size);
  const auto pages = [hugetlb] {  // system-wide counts: compare before and after
    return hugetlb ? meminfo({"HugePages_Total", "HugePages_Free"}) : meminfo({"ShmemHugePages", "ShmemPmdMapped"});
  };
  const auto skip = [&](const char* step) {
    const int err = errno;  // before reading /proc/meminfo
    std::printf("%s: %s: %s (%s); skipped\n", name, step, std::strerror(err), pages().c_str());
    return nullptr;
  };
  const std::string before = pages();
  s->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING | (hugetlb ? MFD_HUGETLB | MFD_HUGE_2MB : 0u));
  if (s->fd < 0) return skip("memfd_create");
  if (ftruncate(s->fd, static_cast<off_t>(size)) != 0) return skip("ftruncate");
  void* w = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  if (w == MAP_FAILED) return skip("mmap (writable)");
  if (thp && madvise(w, size, MADV_HUGEPAGE) != 0) std::printf("  madvise(MADV_HUGEPAGE): %s\n", std::strerror(errno));
  const double t = now();
  fill(w, size);
  s->fill_s = now() - t;
  const std::string filled = pages();
  munmap(w, size);
  if (fcntl(s->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    std::printf("  sealing: %s; measured unsealed\n", std::strerror(errno));
  void* r = mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, s->fd, 0);
  if (r == MAP_FAILED) return skip("mmap (read-only)");
  s->data = static_cast<std::byte*>(r);
  if (!hugetlb) std::printf("  shmem_enabled: %s\n", first_line("/sys/kernel/mm/transparent_hugepage/shmem_enabled").c_str());
  std::printf("  before: %s\n  after filling: %s\n  read-only mapped: %s\n", before.c_str(), filled.c_str(), pages().c_str());
  return pin(*s, cudaHostRegisterReadOnly | cudaHostRegisterPortable) ? std::move(s) : nullptr;
}

// The ipc destination's owner: a child forked before this process makes any CUDA call (a CUDA
// context does not survive fork). It allocates, sends the 64-byte IPC handle through one pipe and
// keeps the allocation until the parent writes to, or closes (by exiting), the other pipe.
struct IpcChild {
  pid_t pid = -1;
  int handle_fd = -1, done_fd = -1;
};
IpcChild fork_ipc_child(size_t size) {
  int to_parent[2], to_child[2];
  if (pipe2(to_parent, O_CLOEXEC) != 0) return {};
  if (pipe2(to_child, O_CLOEXEC) != 0) return close(to_parent[0]), close(to_parent[1]), IpcChild{};
  const pid_t pid = fork();
  if (pid == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    void* p = nullptr;
    cudaIpcMemHandle_t handle{};
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle, p);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "ipc child: %s\n", cudaGetErrorString(e));
      _exit(1);  // the parent reads no handle
    }
    if (write(to_parent[1], &handle, sizeof handle) != static_cast<ssize_t>(sizeof handle)) _exit(1);
    char c;
    while (read(to_child[0], &c, 1) < 0 && errno == EINTR) {}
    (void)cudaFree(p);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  if (pid < 0) return close(to_parent[0]), close(to_child[1]), IpcChild{};
  return {pid, to_parent[0], to_child[1]};
}

// A destination: device memory in one or more parts, filled from the source in order.
struct Dest {
  const char* name;
  std::vector<std::pair<std::byte*, size_t>> parts;
};
struct Mode {
  const char* name;
  size_t piece;  // the largest copy; the whole size for "whole" (still one copy per part)
  int streams;
};

// Issues the copies of the source into dest's parts, pieces alternating between the streams;
// returns the seconds from the first issue until every stream is done.
double copy(const Source& src, const Dest& dest, const Mode& mode, cudaStream_t* streams) {
  const double t = now();
  size_t off = 0, k = 0;
  for (auto [ptr, n] : dest.parts)
    for (size_t at = 0; at < n; at += mode.piece, ++k) {
      const size_t len = std::min(mode.piece, n - at);
      check(cudaMemcpyAsync(ptr + at, src.data + off, len, cudaMemcpyHostToDevice, streams[k % mode.streams]), "cudaMemcpyAsync");
      off += len;
    }
  for (int i = 0; i < mode.streams; ++i) check(cudaStreamSynchronize(streams[i]), "cudaStreamSynchronize");
  return now() - t;
}

// Copies 1 MiB from the middle of `dev` back and compares it with the pattern.
bool verify(const std::byte* dev, size_t size) {
  const size_t at = size / 2 / 8 * 8;
  std::vector<uint64_t> back(kMiB / 8);
  check(cudaMemcpy(back.data(), dev + at, kMiB, cudaMemcpyDeviceToHost), "copy back");
  for (size_t i = 0; i < back.size(); ++i)
    if (back[i] != word_at(at / 8 + i)) {
      std::printf("  first mismatch at byte %zu\n", at + i * 8);
      return false;
    }
  return true;
}
}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::strtod(argv[1], nullptr) : 6;
  const int runs = std::max(1, argc > 2 ? std::atoi(argv[2]) : 5);
  // S: a multiple of 96 MiB, so that the 48 parts are equal and each a whole number of 2 MiB pages.
  const size_t unit = 96 * kMiB, size = std::max<size_t>(1, static_cast<size_t>(gib * kGiB) / unit) * unit;
  IpcChild child = fork_ipc_child(size);  // first: before any CUDA call
  if (child.pid < 0) std::printf("ipc: pipe or fork: %s; destination ipc skipped\n", std::strerror(errno));

  cudaDeviceProp prop{};
  int driver = 0, runtime = 0;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  check(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  check(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
  std::printf("GPU %s, driver %d.%d, runtime %d.%d; S = %.3f GiB, %d timed run(s) per row\n", prop.name, driver / 1000,
              driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10, static_cast<double>(size) / kGiB, runs);

  // The destinations, made once: 3 x S of GPU memory, one third of it the child's.
  std::vector<Dest> dests;
  std::byte* one = nullptr;
  check(cudaMalloc(&one, size), "cudaMalloc (one)");
  dests.push_back({"one", {{one, size}}});
  dests.push_back({"48", {}});
  for (int i = 0; i < 48; ++i) {
    std::byte* p = nullptr;
    check(cudaMalloc(&p, size / 48), "cudaMalloc (48)");
    dests.back().parts.emplace_back(p, size / 48);
  }
  void* ipc = nullptr;
  cudaIpcMemHandle_t handle{};
  if (child.pid > 0) {
    if (read(child.handle_fd, &handle, sizeof handle) != static_cast<ssize_t>(sizeof handle))
      std::printf("ipc: the child sent no handle (its message is above); destination ipc skipped\n");
    else if (const cudaError_t e = cudaIpcOpenMemHandle(&ipc, handle, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
      std::printf("ipc: cudaIpcOpenMemHandle: %s; destination ipc skipped\n", cudaGetErrorString(e));
      (void)cudaGetLastError();
      ipc = nullptr;
    } else {
      dests.push_back({"ipc", {{static_cast<std::byte*>(ipc), size}}});
    }
  }
  cudaStream_t streams[2];
  for (auto& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  const Mode modes[] = {{"whole", size, 1}, {"pieces64", 64 * kMiB, 1}, {"two-streams", 64 * kMiB, 2}};

  const char* names[] = {"hostalloc", "anon-registered", "memfd-sealed-ro", "memfd-thp", "memfd-hugetlb"};
  std::vector<std::string> verdicts;
  const char* only = std::getenv("PROBE_SOURCES");  // e.g. "hostalloc memfd-sealed-ro": these only
  for (int which = 0; which < 5; ++which) {
    if (only && !std::strstr(only, names[which])) continue;
    std::printf("\n== %s\n", names[which]);
    const SourcePtr src = which == 0   ? make_hostalloc(size)
                          : which == 1 ? make_anon(size)
                                       : make_memfd(names[which], size, which == 3, which == 4);
    if (!src) {
      verdicts.push_back(std::string(names[which]) + ": skipped");
      continue;
    }
    std::printf("  fill %.3f s; %s %.3f s\n", src->fill_s, which == 0 ? "cudaHostAlloc" : "cudaHostRegister", src->register_s);
    // Cleared first, so that the check below sees this source's bytes, not the previous one's.
    check(cudaMemset(one, 0, size), "cudaMemset");
    std::printf("  %-16s %-5s %-12s %10s %8s\n", "source", "dest", "mode", "seconds", "GiB/s");
    for (const Dest& dest : dests)
      for (const Mode& mode : modes) {
        copy(*src, dest, mode, streams);  // warm-up
        std::vector<double> times(static_cast<size_t>(runs));
        for (double& t : times) t = copy(*src, dest, mode, streams);
        std::sort(times.begin(), times.end());
        const size_t mid = times.size() / 2;
        const double median = times.size() % 2 ? times[mid] : (times[mid - 1] + times[mid]) / 2;
        const double rate = static_cast<double>(size) / kGiB / median;
        std::printf("  %-16s %-5s %-12s %10.4f %8.2f\n", src->name, dest.name, mode.name, median, rate);
        std::printf("JSON {\"source\": \"%s\", \"dest\": \"%s\", \"mode\": \"%s\", \"seconds\": %.6f, \"gib_per_s\": %.3f}\n",
                    src->name, dest.name, mode.name, median, rate);
      }
    // What a cache hit meets that the rows above do not: a destination never copied into before.
    // The client's allocation is new at each load (`fresh`: cudaMalloc, the copy, cudaFree), and the
    // server opens the client's IPC handle at each request (`reopened`: the same allocation of the
    // child's, closed and opened again before each copy; the open timed apart). Read with care:
    // the `whole` reopened copy follows the fresh allocation's cudaFree, the `two-streams` one
    // follows a copy; a copy right after a large free is the slow one, however it is issued
    // (bench/RESULTS.md, "Restarts from the node's resident cache", 2026-12-06).
    {
      std::vector<double> fresh, reopened, opening, reopened_two;
      for (int r = 0; r < runs; ++r) {
        std::byte* p = nullptr;
        check(cudaMalloc(&p, size), "cudaMalloc (fresh)");
        fresh.push_back(copy(*src, Dest{"fresh", {{p, size}}}, modes[0], streams));
        check(cudaFree(p), "cudaFree (fresh)");
        if (ipc) {
          for (const Mode& mode : {modes[0], modes[2]}) {
            check(cudaIpcCloseMemHandle(ipc), "cudaIpcCloseMemHandle");
            const double t = now();
            check(cudaIpcOpenMemHandle(&ipc, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (again)");
            if (mode.streams == 1) opening.push_back(now() - t);
            dests.back().parts[0].first = static_cast<std::byte*>(ipc);
            (mode.streams == 1 ? reopened : reopened_two).push_back(copy(*src, dests.back(), mode, streams));
          }
        }
      }
      const auto median_of = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
      };
      const double f = median_of(fresh);
      std::printf("  %-16s %-5s %-12s %10.4f %8.2f\n", src->name, "fresh", "whole", f, static_cast<double>(size) / kGiB / f);
      std::printf("JSON {\"source\": \"%s\", \"dest\": \"fresh\", \"mode\": \"whole\", \"seconds\": %.6f, \"gib_per_s\": %.3f}\n",
                  src->name, f, static_cast<double>(size) / kGiB / f);
      if (!reopened.empty()) {
        const double r = median_of(reopened);
        std::printf("  %-16s %-5s %-12s %10.4f %8.2f   (opening the handle: %.4f s)\n", src->name, "ipc-reopened", "whole", r,
                    static_cast<double>(size) / kGiB / r, median_of(opening));
        std::printf("JSON {\"source\": \"%s\", \"dest\": \"ipc-reopened\", \"mode\": \"whole\", \"seconds\": %.6f, \"gib_per_s\": %.3f, "
                    "\"open_seconds\": %.6f}\n", src->name, r, static_cast<double>(size) / kGiB / r, median_of(opening));
        const double two = median_of(reopened_two);
        std::printf("  %-16s %-5s %-12s %10.4f %8.2f\n", src->name, "ipc-reopened", "two-streams", two, static_cast<double>(size) / kGiB / two);
        std::printf("JSON {\"source\": \"%s\", \"dest\": \"ipc-reopened\", \"mode\": \"two-streams\", \"seconds\": %.6f, \"gib_per_s\": %.3f}\n",
                    src->name, two, static_cast<double>(size) / kGiB / two);
      }
    }
    const bool ok = verify(one, size);
    std::printf("  verify (1 MiB from the middle of 'one'): %s\n", ok ? "ok" : "MISMATCH");
    verdicts.push_back(std::string(names[which]) + ": " + (ok ? "ok" : "MISMATCH"));
  }
  std::printf("\nverification:\n");
  for (const auto& v : verdicts) std::printf("  %s\n", v.c_str());

  for (auto& s : streams) check(cudaStreamDestroy(s), "cudaStreamDestroy");
  if (ipc) check(cudaIpcCloseMemHandle(ipc), "cudaIpcCloseMemHandle");
  for (const Dest& dest : dests)
    if (std::string(dest.name) != "ipc")
      for (auto [p, n] : dest.parts) check(cudaFree(p), "cudaFree");
  if (child.pid > 0) {  // the child frees its allocation once told
    if (write(child.done_fd, "x", 1) != 1) std::printf("ipc: telling the child: %s\n", std::strerror(errno));
    close(child.done_fd);
    close(child.handle_fd);
    int status = 0;
    waitpid(child.pid, &status, 0);
  }
  return 0;
}
