// What a load asks the resident cache (hbmio/cache.hpp): for each of its open files, the cache's
// copy of the same file, if it holds one.
#pragma once

#include <memory>
#include <optional>
#include <set>
#include <span>
#include <utility>
#include <string>
#include <vector>

#include "hbmio/file.hpp"

namespace hbmio::cache_detail {

struct Lookup {
  // Per file asked for: the cache's copy (a sealed memfd, read like the file itself; its path is
  // the file's with " (resident cache)" after it), or null where the cache does not hold it.
  std::vector<std::shared_ptr<const File>> copies;
  // What went wrong with the cache, if anything (unreachable, refused, a broken reply): the load
  // then reads the files, and says this once.
  std::string warning;
};

inline constexpr std::string_view kCopySuffix = " (resident cache)";

// Never throws for the cache's sake: a cache that cannot help is a Lookup without copies.
Lookup lookup(const std::string& socket, std::span<const int> fds, std::span<const std::string> paths, bool add);

// One range of a held file for the server to DMA into this process's GPU memory.
struct DeviceCopy {
  std::size_t file = 0;  // index into the descriptors given with it
  std::uint64_t offset = 0;
  std::byte* into = nullptr;  // device memory (cudaMalloc'ed: CUDA IPC shares nothing else)
  std::uint64_t length = 0;
  int device = 0;  // this process's number of the GPU `into` lies on
};

// What a copy request came to: `failed` empty once every byte is in place; else why not (no GPU
// on the server's side, memory CUDA IPC cannot share, a file no longer held, ...), and the caller
// reads those ranges another way. The server's own time (of the longest request, where several
// GPUs were fed at once): opening the destinations' IPC handles, and the copies.
struct CopyOutcome {
  std::string failed;
  // (GPU, file): the files (indices into the descriptors) whose ranges into that GPU (this
  // process's number) came from the server's copy in its memory (device to device), and their bytes.
  std::set<std::pair<int, std::size_t>> files_on_gpu;
  std::uint64_t gpu_bytes = 0;
  double open_seconds = 0;
  double copy_seconds = 0;
};

// Has the server at `socket` copy each range from its pinned copy of the file open as
// fds[copy.file] into device memory, by DMA, one request per GPU. Never throws.
CopyOutcome copy_to_device(const std::string& socket, std::span<const int> fds, std::span<const DeviceCopy> copies);

// A file the cache holds in a GPU's memory, mapped into this process (CUDA IPC) instead of copied:
// the bytes are read in place. `keep` holds the mapping and the lease: the connection the share
// was asked on, which the server reads as "still in use" (it never evicts or frees a shared copy)
// until it closes, after the mapping is gone. Read-only by agreement: every process sharing the
// copy sees a write to it, and the cache would go on serving the changed bytes as the file's.
struct SharedCopy {
  const std::byte* data = nullptr;  // the file's byte 0, in device memory
  std::uint64_t size = 0;
  int device = 0;  // this process's number of the GPU
  std::shared_ptr<const void> keep;
};

struct Shares {
  std::vector<std::optional<SharedCopy>> copies;  // per descriptor; empty: not shared, see `reasons`
  std::vector<std::string> reasons;               // per descriptor; "" where shared
  std::string warning;                            // the cache could not be asked at all, and why
  double ask_seconds = 0;  // connecting, the request and its reply
  double map_seconds = 0;  // mapping the copies here (CUDA IPC)
};

// Asks the server at `socket` for its copies in the memory of `device` (this process's number) of
// the files open as `fds`, each `sizes[k]` bytes long (what this side's fstat said: a copy of
// another size is not taken). Never throws for the cache's sake.
Shares share_from_device(const std::string& socket, std::span<const int> fds, std::span<const std::uint64_t> sizes, int device);

}  // namespace hbmio::cache_detail
