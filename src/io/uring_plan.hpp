// The pure half of the uring backend: how a batch of requests becomes parts and chunks, before
// any I/O (see the top of uring_engine.cpp for the pipeline that runs them). Unit-tested on its
// own (tests/uring_plan_test.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/options.hpp"

namespace hbmio::detail {

inline constexpr std::size_t kSlotAlignment = 4096;  // slots and grid; O_DIRECT needs at most this
// The smallest chunk a small job is cut into so that several workers share it (see
// UringPlan::chunk_size): below this, waking a worker costs more than the copy it takes over.
inline constexpr std::size_t kMinSharedChunk = std::size_t{256} << 10;

inline std::uint64_t round_down(std::uint64_t v, std::uint64_t a) { return v / a * a; }
inline std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// A file range of a job, with what its chunks need to know: one request, or several writes laid
// end to end in one file (the tensors of a checkpoint), whose pieces then gather the bytes of
// several requests into one slot, so that only the two ends of the run can be unaligned.
struct Part {
  std::vector<const IoRequest*> requests;  // in file order, end to end; the first gives file and op
  ErrorContext context;         // built once: hot paths pass it by reference
  std::uint64_t grid_base = 0;  // round_down(offset, 4 KiB): chunk and piece boundaries lie on it
  std::uint64_t first_chunk = 0;  // this part's chunks are job chunks [first_chunk, first_chunk + chunks)
  std::uint64_t chunks = 0;
  std::size_t alignment = 0;    // O_DIRECT alignment of this file; 0 when O_DIRECT is off
  bool device = false;

  const IoRequest& first() const { return *requests.front(); }
  std::uint64_t offset() const { return requests.front()->offset; }
  std::uint64_t end() const { return requests.back()->offset + requests.back()->memory.size; }

  // Calls f(request, lo, hi) for each request overlapping [p, q) (within the part), where
  // [lo, hi) is the overlap, in file order.
  template <class F>
  void for_each_request(std::uint64_t p, std::uint64_t q, F&& f) const {
    auto it = std::prev(std::upper_bound(requests.begin(), requests.end(), p,
                                         [](std::uint64_t v, const IoRequest* r) { return v < r->offset; }));
    for (; it != requests.end() && (*it)->offset < q; ++it) {
      const IoRequest& r = **it;
      f(r, std::max(p, r.offset), std::min(q, r.offset + r.memory.size));
    }
  }

  // The request holding all of [p, q), or nullptr when the range spans several.
  const IoRequest* holding(std::uint64_t p, std::uint64_t q) const {
    const IoRequest* found = nullptr;
    int count = 0;
    for_each_request(p, q, [&](const IoRequest& r, std::uint64_t, std::uint64_t) { found = &r, ++count; });
    return count == 1 ? found : nullptr;
  }
};

struct UringPlan {
  std::vector<Part> parts;   // reads: one per request, in request order; writes: sorted by file and offset
  std::uint64_t chunks = 0;  // over all parts (a part's chunks follow the previous part's)
  // The job's chunk size: Options::chunk_size, or less for a job smaller than two chunks per
  // worker (at least kMinSharedChunk, on the 4 KiB grid). A lone 2 MiB tensor in one chunk is one
  // worker's page-cache copy; in 256 KiB chunks it is eight workers' (random and sliced access).
  std::size_t chunk_size = 0;
  std::uint64_t bytes = 0;   // of all requests
  int device = -1;           // the CUDA device of the parts in device memory, -1 when none is
  std::string note;          // why O_DIRECT is not used where it is not ("" when it is everywhere)
};

// Parts of a batch (empty requests dropped): each read its own part; writes laid end to end in
// one file, all of device or all of host memory, joined into one part (its pieces gather several
// requests into one slot, so only the run's two ends can be unaligned). The chunk size: see
// UringPlan::chunk_size (the workers are Options::resolved_workers()). Each part's O_DIRECT
// alignment: the file's (statx), for writes at least its file-system block up to 4 KiB; 0 when
// Options::direct_io is off or the file refuses O_DIRECT (the note says why). Chunks of
// Options::chunk_size on a 4 KiB grid from each part's start. Throws Error(EINVAL) for a batch
// whose device memory lies on two GPUs (one stream per worker, on one device).
UringPlan plan_batch(std::span<const IoRequest> requests, const Options& options, std::string_view backend);

// Where chunk `index` (< the plan's chunks) lies: its part and its file range [begin, end).
struct ChunkRange {
  const Part* part = nullptr;
  std::uint64_t begin = 0, end = 0;
};
ChunkRange chunk_range(const std::vector<Part>& parts, std::uint64_t index, std::size_t chunk_size);

}  // namespace hbmio::detail
