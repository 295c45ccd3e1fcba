// The uring backend: io_uring + O_DIRECT + registered pinned bounce buffers, with storage reads
// overlapped with asynchronous copies to the GPU. The fastest path where GDS is not available.
//
// How a request flows:
//   1. The file range is cut into chunks (Options::chunk_size; finer for a job smaller than a
//      chunk per worker, so a lone tensor is still read by several) on a grid aligned to 4 KiB,
//      so every interior boundary suits O_DIRECT. Worker threads take chunks from a shared counter.
//   2. Each chunk decides O_DIRECT or page cache (Options::direct_io; "auto" asks cachestat(2)
//      or mincore(2) whether the chunk is already cached: a warm chunk is copied from memory, a
//      cold one bypasses the cache).
//   3. A chunk is cut into pieces of Options::bounce_buffer_size (at most 2 MiB through the page
//      cache, see kPageCachePiece). A piece is read either straight into the destination (host
//      memory that satisfies O_DIRECT's alignment, or any host memory through the page cache) or
//      into one of the worker's pinned slots ("bounce buffers"), registered with the ring as
//      fixed buffers so the kernel skips pinning pages per I/O.
//      Unaligned heads and tails read the aligned superset into a slot and copy the wanted bytes.
//   4. When a slot's read completes, the worker starts cudaMemcpyAsync(slot -> GPU) on its stream
//      and records the slot's event; the slot is reused only after that event has fired. So the
//      disk (or page-cache copy) of piece k+1 overlaps the PCIe copy of piece k. (Page-cache
//      reads bound for the GPU are handed to the kernel one at a time for this: see loop().)
//   5. Short transfers resume where they stopped; -EAGAIN/-EINTR resubmit; a read that finds the
//      end of the file before the range is complete is an error (the file shrank).
// Writes mirror this: GPU -> slot (copy), slot -> file (O_DIRECT where aligned; the unaligned
// edges, under a block each, buffered after the direct writes have completed). Writes laid end
// to end in one file (the tensors of a checkpoint) form one range: a piece gathers the bytes of
// several requests into its slot, so only the range's two ends can be unaligned and small
// tensors still make full-size writes.
//
// A batch (Engine::submit_batch) is one job: the chunks of all its requests are numbered in one
// sequence, so the workers stay busy across request boundaries (a checkpoint of 3,000 tensors
// is read at the speed of one large file). How requests become parts and chunks is the pure half,
// in uring_plan.hpp; this file is the pipeline that runs them.
//
// Each worker owns one ring, its slots and its CUDA stream for the engine's life. Worker 0 runs on
// the submitting thread (a one-piece job then costs no hand-off) and restores that thread's CUDA
// device when done; worker i >= 1 runs on the engine's thread i (WorkerThreads), whose ring is set
// up for a single issuer. The engine serves one job at a time.
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/positional_io.hpp"
#include "core/worker_threads.hpp"
#include "io/engine_internal.hpp"
#include "io/page_cache.hpp"
#include "io/uring_plan.hpp"
#include "memory/cuda_runtime.hpp"
#include "memory/staging_ring.hpp"

namespace hbmio::detail {
namespace {

// Pieces read from the page cache are at most this big, while O_DIRECT pieces fill the slot
// (Options::bounce_buffer_size, 8 MiB by default): large direct reads bring cold loads nearer the
// O_DIRECT ceiling, while warm loads are fastest, and use the least CPU, with small page-cache
// copies (a piece copied by the kernel is then read by the DMA engine: small pieces are more often
// still in the CPU's caches); smaller pieces than this were slower again. The runs that chose both
// sizes: bench/RESULTS.md, "Engine tuning".
constexpr std::uint64_t kPageCachePiece = std::uint64_t{2} << 20;
// A job wakes one worker per this many bytes (and per chunk): handing a task to a thread costs
// a few microseconds, about what copying this much from the page cache takes.
constexpr std::uint64_t kBytesPerWorker = std::uint64_t{256} << 10;


// An io_uring instance. Not movable: the kernel maps its rings at this address.
class Ring {
 public:
  // Set up for one issuer, the thread that creates it (each worker creates its own ring on its
  // own thread and is its only user), with completions run when that thread asks for them: the
  // kernel then skips the locking and the interrupts a shared ring needs. Kernels before 6.1
  // refuse the flags (EINVAL): a plain ring works the same way there.
  // `shared`: used from callers' threads (worker 0, see WorkerThreads), so a plain ring.
  Ring(unsigned entries, bool shared, const ErrorContext& context) {
    int r = shared ? -EINVAL : io_uring_queue_init(entries, &ring_, IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN);
    if (r == -EINVAL) r = io_uring_queue_init(entries, &ring_, 0);
    if (r < 0) throw Error(errno_code(-r), context, "io_uring_queue_init");
  }
  ~Ring() { io_uring_queue_exit(&ring_); }  // also unregisters the fixed buffers
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  io_uring* get() noexcept { return &ring_; }

 private:
  io_uring ring_{};
};

// A read's slot while its copy to the GPU runs: the part and how many of its bytes land when the
// copy is done.
struct Landing {
  const Part* part = nullptr;
  std::size_t bytes = 0;
};

// One in-flight storage I/O.
struct Op {
  const Part* part = nullptr;
  std::uint64_t file_pos = 0;   // where the I/O starts in the file
  std::size_t length = 0;       // bytes to transfer from file_pos (block-rounded for O_DIRECT)
  std::size_t needed = 0;       // bytes that must arrive for the piece to be complete
  std::size_t done = 0;
  std::byte* buffer = nullptr;  // slot or user memory
  int slot = -1;                // slot index when bouncing, else -1
  int fd = -1;
  bool direct = false;
  bool resumed = false;           // a short O_DIRECT read whose rest goes through the page cache
  std::size_t wanted_offset = 0;  // read through a slot: wanted bytes start here in the slot
  std::byte* user = nullptr;      // read through a slot: where the wanted bytes go
  std::size_t wanted = 0;         // bytes of the request this piece covers
  std::uint64_t begin = 0;        // where those bytes start in the file
  unsigned retries = 0;
};

void atomic_max(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  for (std::uint64_t seen = a.load(); seen < v && !a.compare_exchange_weak(seen, v);) {
  }
}
void atomic_min(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  for (std::uint64_t seen = a.load(); seen > v && !a.compare_exchange_weak(seen, v);) {
  }
}

// State of one job (a request, or a batch of them), shared by its workers.
struct Job {
  std::vector<Part> parts;
  IoOp op = IoOp::read;
  std::uint64_t chunks = 0;  // over all parts
  std::size_t chunk_size = 0;  // UringPlan::chunk_size
  int device = -1;           // the CUDA device of the parts in device memory, -1 when none is
  std::atomic<std::uint64_t> next_chunk{0};
  std::atomic<bool> failed{false};
  std::atomic<std::uint64_t> bytes_direct{0}, bytes_buffered{0}, bounce_copies{0};
  std::atomic<std::uint64_t> chunks_cached{0}, chunks_cold{0};
  std::atomic<const char*> residency_method{"none"};
  std::atomic<int> fixed_buffer_errno{0};  // why the slots could not be registered, if so
  // First-use set-up inside this job (rings, bounce buffers, streams), summed over workers, ns.
  std::atomic<std::uint64_t> setup_ns{0}, pinning_ns{0}, registering_ns{0};
  std::atomic<unsigned> workers_set_up{0};
  // Stats::wake_seconds, drain_seconds, copy_wait_seconds: ns since `start`, and summed waits.
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::atomic<std::uint64_t> last_start_ns{0}, first_end_ns{UINT64_MAX}, last_end_ns{0}, copy_wait_ns{0};
  std::uint64_t since_start() const {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
  }
  // Per part (same index as `parts`): how its bytes went, for Stats::paths.
  struct PartBytes {
    std::atomic<std::uint64_t> direct{0};
    std::atomic<std::uint64_t> cached{0};   // page cache: the chunk was cached (DirectIo::automatic)
    std::atomic<std::uint64_t> plain{0};    // page cache: the part has no O_DIRECT (Part::alignment 0)
    std::atomic<std::uint64_t> edges{0};    // page cache: unaligned edges of direct writes
    std::atomic<std::uint64_t> resumed{0};  // page cache: the rest of a short O_DIRECT read
  };
  std::vector<PartBytes> part_bytes;
  // Reads whose request names a LandedSink: per part, its bytes not yet in place (empty when no
  // request of the job names one). The worker that lands a part's last bytes tells the sink.
  std::unique_ptr<std::atomic<std::uint64_t>[]> unlanded;
  std::mutex error_mutex;
  std::exception_ptr error;
  // Unaligned edges of direct writes, written after the direct pieces (see start_next_piece).
  struct Edge {
    const Part* part;
    std::uint64_t begin, end;
  };
  std::mutex edges_mutex;
  std::vector<Edge> edges;

  void fail(std::exception_ptr e) {
    std::lock_guard lock(error_mutex);
    if (!error) error = std::move(e);
    failed = true;
  }
};

class Worker {
 public:
  // `on_callers_thread`: worker 0, run by whichever thread submits (see WorkerThreads).
  Worker(const Options& options, FaultHook* faults, bool on_callers_thread)
      : options_(options), faults_(faults), on_callers_thread_(on_callers_thread) {}

  // Runs chunks of `job` until none are left or the job failed. Throws nothing: failures go to
  // job.fail(), after every I/O of this worker has completed and every copy has finished.
  void run(Job& job) noexcept {
    atomic_max(job.last_start_ns, job.since_start());
    job_ = &job;
    // Nothing of an earlier request may carry over (a request that failed elsewhere leaves
    // this worker's chunk half done).
    cursor_ = chunk_end_ = 0;
    chunk_direct_ = submit_now_ = false;
    part_ = &job.parts.front();
    retry_.clear();
    reset_ops();
    try {
      prepare(job);
      loop();
      while (staging_.copying()) wait_for_oldest_copy();  // the data is in GPU memory on return
    } catch (...) {
      job.fail(std::current_exception());
      drain();  // frees every slot (staging_.reset()); a job that ends well has given each back
    }
    const std::uint64_t end = job.since_start();
    atomic_min(job.first_end_ns, end);
    atomic_max(job.last_end_ns, end);
    job_ = nullptr;
    part_ = nullptr;
    device_guard_.reset();
  }

 private:
  // Errors name the request of the chunk at hand.
  ErrorContext context(std::uint64_t offset, std::uint64_t length) const { return context(*part_, offset, length); }
  static ErrorContext context(const Part& part, std::uint64_t offset, std::uint64_t length) {
    ErrorContext c = part.context;
    c.offset = offset;
    c.length = length;
    return c;
  }
  const ErrorContext& context() const { return part_->context; }

  void fault_point(FaultSite site, const char* what) {
    if (const int err = inject(faults_, site, what)) throw Error(errno_code(err), context(), fmt::format("{} (injected)", what));
  }

  // Creates the ring, the slots (pinned for device jobs) and the stream, or reuses them. The time
  // it takes goes into the job's note: a program's first transfer pays it, later ones do not.
  void prepare(Job& job) {
    const auto start = std::chrono::steady_clock::now();
    const auto since = [](std::chrono::steady_clock::time_point t) {
      return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count());
    };
    bool set_up = false;
    const ErrorContext ctx = context();
    // A device job's CUDA work (the slots' pinning included, which otherwise takes whatever
    // context is current, or makes device 0's) happens on the job's device. The engine's own
    // threads keep it current; the caller's thread gets its own context back after the job.
    if (job.device >= 0) {
      if (on_callers_thread_) device_guard_.emplace(job.device, ctx);
      else cuda::set_device(job.device, ctx);
    }
    if (!ring_) {
      fault_point(FaultSite::setup, "io_uring_queue_init");
      set_up = true;
      ring_ = std::make_unique<Ring>(options_.queue_depth, on_callers_thread_, ctx);
      ops_.resize(options_.queue_depth);
      reset_ops();
    }
    const bool need_cuda_pinned = job.device >= 0;
    if (!staging_.valid() || (need_cuda_pinned && !staging_.memory().cuda_registered())) {
      if (fixed_buffers_) io_uring_unregister_buffers(ring_->get());
      fixed_buffers_ = false;
      staging_ = StagingRing();
      fault_point(FaultSite::setup, "allocate bounce buffers");
      const std::size_t slot_bytes = options_.bounce_buffer_size + 2 * kSlotAlignment;
      // Host jobs use page-aligned host memory: pinning through CUDA would create a CUDA
      // context (and hold GPU memory) for a transfer that never touches the GPU.
      set_up = true;
      auto t = std::chrono::steady_clock::now();
      staging_ = StagingRing(need_cuda_pinned ? MemoryKind::pinned : MemoryKind::host, options_.bounce_buffers, slot_bytes);
      job.pinning_ns += since(t);
      landing_.assign(options_.bounce_buffers, {});
      std::vector<iovec> iovecs(options_.bounce_buffers);
      for (unsigned i = 0; i < options_.bounce_buffers; ++i) iovecs[i] = {staging_.data(static_cast<int>(i)), slot_bytes};
      int r = -inject(faults_, FaultSite::setup, "io_uring_register_buffers");
      t = std::chrono::steady_clock::now();
      if (r == 0) r = io_uring_register_buffers(ring_->get(), iovecs.data(), static_cast<unsigned>(iovecs.size()));
      job.registering_ns += since(t);
      fixed_buffers_ = r == 0;
      fixed_buffer_errno_ = -r;
      if (r == -EOPNOTSUPP || r == -ENOMEM) {
        // Old kernels refuse some memory as fixed buffers (or count it against RLIMIT_MEMLOCK):
        // the slots then work as plain buffers, at the cost of pinning pages per I/O.
      } else if (r < 0) {
        staging_ = StagingRing();
        throw Error(errno_code(-r), ctx, "io_uring_register_buffers");
      }
    }
    if (!fixed_buffers_) job_->fixed_buffer_errno.store(fixed_buffer_errno_);
    if (job.device >= 0) {
      const cuda::Stream& stream = staging_.stream();
      if (!stream.valid() || stream.device() != job.device) {
        set_up = true;
        fault_point(FaultSite::setup, "cudaStreamCreate");
      }
      staging_.use_device(job.device, ctx);
    }
    if (set_up) {
      job.setup_ns += since(start);
      ++job.workers_set_up;
    }
  }

  void loop() {
    io_uring* ring = ring_->get();
    while (true) {
      while (!retry_.empty()) {
        submit_op(retry_.front());
        retry_.pop_front();
      }
      while (in_flight_ < options_.queue_depth && !job_->failed && start_next_piece()) {
        // A read through the page cache is a copy the kernel makes while it is submitted: handed
        // over alone, its completion (and its slot's copy to the GPU) follows at once, so the
        // copy of piece k runs beside the read of piece k+1. Handed over with the next pieces,
        // a short job (a stream's group: one chunk of four pieces per worker) would read all of
        // them before its first copy started. A direct read stays queued: the disk wants depth.
        if (submit_now_) {
          submit_now_ = false;
          if (const int r = io_uring_submit(ring); r >= 0) pending_sqes_ = 0;
          else if (r != -EINTR && r != -EAGAIN && r != -EBUSY) throw Error(errno_code(-r), context(), "io_uring_submit");
          reap();
        }
      }
      if (in_flight_ == 0) {
        if (retry_.empty()) break;  // no piece left (a slot is always found when none is reading)
        continue;  // a piece completed short above (reap): resubmitted at the top, never waited on
      }
      // While copies to the GPU are running, wake up after 0.1 ms even without a completion: a
      // slot's copy at the host-to-device rate ends well within that, and its slot should carry
      // the next read at once rather than idle until some storage read completes (a disk's
      // latency is far longer).
      int r;
      if (!staging_.copying()) {
        r = io_uring_submit_and_wait(ring, 1);
      } else {
        __kernel_timespec timeout{.tv_sec = 0, .tv_nsec = 100'000};
        io_uring_cqe* first = nullptr;
        r = io_uring_submit_and_wait_timeout(ring, &first, 1, &timeout, nullptr);
        if (r == -ETIME) r = 0;
      }
      // EINTR: a signal; EAGAIN/EBUSY: the kernel is short of resources or the completion queue
      // is full. Reaping completions below and entering again resolves all three.
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY)
        throw Error(errno_code(-r), context(), "io_uring_submit_and_wait");
      if (r >= 0) pending_sqes_ = 0;
      reap();
    }
  }

  // Completes every I/O the ring has finished.
  void reap() {
    io_uring* ring = ring_->get();
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe != nullptr) {
      const auto index = static_cast<std::size_t>(io_uring_cqe_get_data64(cqe));
      const int result = cqe->res;
      io_uring_cqe_seen(ring, cqe);
      --in_flight_;
      complete(index, result);
    }
  }

  // After a failure: let every submitted I/O finish (the kernel writes into our slots and the
  // user's memory until it does), then let pending copies finish. Never throws.
  void drain() noexcept {
    if (ring_) {
      io_uring* ring = ring_->get();
      while (in_flight_ > 0 || pending_sqes_ > 0) {
        const int r = io_uring_submit_and_wait(ring, in_flight_ > 0 ? 1 : 0);
        if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
          // The ring itself is broken. Destroying it waits for (or cancels) its I/O, so no
          // read lands in memory the caller frees after we return; the next request makes a
          // new ring and registers the slots again.
          if (fixed_buffers_) io_uring_unregister_buffers(ring);
          ring_.reset();
          fixed_buffers_ = false;
          staging_ = StagingRing();
          break;
        }
        if (r >= 0) pending_sqes_ = 0;
        io_uring_cqe* cqe = nullptr;
        while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe != nullptr) {
          io_uring_cqe_seen(ring, cqe);
          --in_flight_;
        }
      }
    }
    in_flight_ = 0;
    retry_.clear();
    reset_ops();
    staging_.reset();
    chunk_end_ = cursor_ = 0;
  }

  // Takes the next chunk from the job and decides O_DIRECT or page cache for it.
  bool next_chunk() {
    const std::uint64_t index = job_->next_chunk.fetch_add(1);
    if (index >= job_->chunks) return false;
    const ChunkRange chunk = chunk_range(job_->parts, index, job_->chunk_size);
    part_ = chunk.part;
    const IoRequest& request = part_->first();
    if (request.cancel != nullptr && request.cancel->load(std::memory_order_relaxed))
      throw Error(errno_code(ECANCELED), context_of(request, "uring"), "stopped on request");
    const std::uint64_t begin = chunk.begin, end = chunk.end;
    cursor_ = begin;
    chunk_end_ = end;
    chunk_direct_ = part_->alignment != 0;
    if (chunk_direct_ && options_.direct_io == DirectIo::automatic && request.op == IoOp::read) {
      const Residency residency = page_cache_residency(request.file->fd(), begin, end - begin);
      job_->residency_method.store(residency.method, std::memory_order_relaxed);
      chunk_direct_ = residency.fraction() < 0.5;
      (chunk_direct_ ? job_->chunks_cold : job_->chunks_cached)++;
    }
    return true;
  }

  // Prepares the I/O of the next piece, if a slot (when one is needed) is free. False when there
  // is no piece left or no slot to put it in.
  bool start_next_piece() {
    if (cursor_ >= chunk_end_ && !next_chunk()) return false;
    const IoRequest& request = part_->first();
    const std::uint64_t p = cursor_;
    const std::uint64_t q = piece_end(p);
    // The caller's memory for [p, q) when one request holds it all (always so for reads).
    const IoRequest* whole = part_->holding(p, q);
    std::byte* user = whole != nullptr ? whole->memory.data + (p - whole->offset) : nullptr;
    const std::size_t a = chunk_direct_ ? part_->alignment : 1;
    const bool aligned = user != nullptr && p % a == 0 && (q % a == 0) && reinterpret_cast<std::uintptr_t>(user) % a == 0;
    const bool read = request.op == IoOp::read;

    Op op;
    op.part = part_;
    op.wanted = q - p;
    op.begin = p;
    op.direct = chunk_direct_;
    op.fd = chunk_direct_ ? request.file->direct_fd() : request.file->fd();
    if (!part_->device && aligned) {
      // Straight between the file and the user's host memory.
      op.file_pos = p;
      op.length = op.needed = q - p;
      op.buffer = user;
    } else if (!read && chunk_direct_ && (p % a != 0 || q % a != 0)) {
      // An unaligned edge of a direct write (less than a block: see piece_end) cannot be padded,
      // as that would write bytes outside the range. It is written through the page cache after
      // every direct write of the job has completed (Job::edges): a buffered write running beside
      // direct writes can put a (large) folio over the blocks they write, and the kernel then
      // fails the direct write's page-cache invalidation ("Page cache invalidation failure on
      // direct I/O") and reports EIO at fsync.
      std::lock_guard lock(job_->edges_mutex);
      job_->edges.push_back({part_, p, q});
      cursor_ = q;
      return true;
    } else {
      if (!bounce_into_slot(op, p, q, a, user)) return false;
    }
    cursor_ = q;
    const int index = allocate_op(op);
    submit_op(index);
    submit_now_ = read && !op.direct && op.slot >= 0 && part_->device;  // see loop()
    if (!read) {
      // A write's data may have taken a blocking copy from the GPU to be ready: start the disk
      // on it now instead of after the next pieces' copies.
      io_uring_submit(ring_->get());
      pending_sqes_ = 0;
    }
    return true;
  }

  // Next piece boundary after p: pieces lie on the grid grid_base + k * size, size being the
  // bounce buffer size for O_DIRECT and at most kPageCachePiece through the page cache.
  // A direct write cannot start or end off the O_DIRECT alignment (it would need padding bytes
  // that are not the caller's), so an unaligned head or tail becomes a piece of its own, smaller
  // than a block, written through the page cache; the rest stays direct.
  std::uint64_t piece_end(std::uint64_t p) const {
    const std::uint64_t size = chunk_direct_ ? options_.bounce_buffer_size
                                             : std::min<std::uint64_t>(options_.bounce_buffer_size, kPageCachePiece);
    const std::uint64_t k = (p - part_->grid_base) / size + 1;
    std::uint64_t q = std::min<std::uint64_t>(chunk_end_, part_->grid_base + k * size);
    if (job_->op == IoOp::write && chunk_direct_) {
      const std::uint64_t a = part_->alignment;
      if (p % a != 0) return std::min(q, round_up(p, a));
      if (q % a != 0 && round_down(q, a) > p) return round_down(q, a);
    }
    return q;
  }

  // Sets `op` up to move [p, q) through a slot, reading/writing the `a`-aligned superset.
  bool bounce_into_slot(Op& op, std::uint64_t p, std::uint64_t q, std::size_t a, std::byte* user) {
    const int slot = acquire_slot();
    if (slot < 0) return false;
    const IoRequest& request = part_->first();
    op.slot = slot;
    op.buffer = staging_.data(slot);
    op.user = user;
    if (request.op == IoOp::read) {
      op.file_pos = round_down(p, a);
      op.length = round_up(q, a) - op.file_pos;
      op.wanted_offset = p - op.file_pos;
      op.needed = q - op.file_pos;  // past q (up to the block end) the file may legally end
    } else {
      op.file_pos = p;
      op.length = op.needed = q - p;
      const ErrorContext ctx = context(p, q - p);
      if (part_->device) fault_point(FaultSite::device_copy, "cudaMemcpyAsync (device to host)");
      part_->for_each_request(p, q, [&](const IoRequest& r, std::uint64_t lo, std::uint64_t hi) {
        std::byte* to = op.buffer + (lo - p);
        const std::byte* from = r.memory.data + (lo - r.offset);
        if (part_->device) staging_.stream().copy_to_host_async(to, from, hi - lo, ctx);
        else std::memcpy(to, from, hi - lo);
      });
      if (part_->device) staging_.stream().synchronize(ctx);
      ++job_->bounce_copies;
    }
    return true;
  }

  // A free slot, or -1 when none is free yet. Copies run in order on the worker's stream, so
  // only the oldest can have finished. With storage I/O in flight we do not block on a copy
  // (the loop comes back within 0.1 ms, see loop()); with none, waiting for the copy is all
  // there is to do.
  int acquire_slot() {
    if (const int slot = staging_.acquire(); slot >= 0) return slot;
    if (!staging_.copying()) return -1;
    if (in_flight_ > 0 && !staging_.oldest_done(context())) return -1;
    wait_for_oldest_copy();
    return staging_.acquire();
  }

  // The oldest copy's slot freed and its bytes landed. A small copy is done within microseconds:
  // poll for it a short while before sleeping in the driver (StagingRing::reclaim_oldest).
  void wait_for_oldest_copy() {
    const std::uint64_t from = job_->since_start();
    const Landing landing = landing_[static_cast<std::size_t>(staging_.reclaim_oldest(std::chrono::microseconds(30), context()))];
    job_->copy_wait_ns += job_->since_start() - from;
    land(*landing.part, landing.bytes);
  }

  // At most queue_depth ops exist (in flight or waiting to be resubmitted), so one is free here.
  int allocate_op(const Op& op) {
    const int index = free_ops_.back();
    free_ops_.pop_back();
    ops_[index] = op;
    return index;
  }

  void reset_ops() {
    free_ops_.clear();
    for (std::size_t i = ops_.size(); i > 0; --i) free_ops_.push_back(static_cast<int>(i - 1));
  }

  void submit_op(int index) {
    const Op& op = ops_[index];
    io_uring* ring = ring_->get();
    io_uring_sqe* sqe = io_uring_get_sqe(ring);
    if (sqe == nullptr) {  // submission queue full: hand what is queued to the kernel first
      const int r = io_uring_submit(ring);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) throw Error(errno_code(-r), context(), "io_uring_submit");
      if (r >= 0) pending_sqes_ = 0;
      sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) throw Error(errno_code(EBUSY), context(), "io_uring submission queue stays full");
    }
    std::byte* buf = op.buffer + op.done;
    const auto len = static_cast<unsigned>(op.length - op.done);
    const auto pos = op.file_pos + op.done;
    const bool read = job_->op == IoOp::read;
    if (op.slot >= 0 && fixed_buffers_) {
      if (read) io_uring_prep_read_fixed(sqe, op.fd, buf, len, pos, op.slot);
      else io_uring_prep_write_fixed(sqe, op.fd, buf, len, pos, op.slot);
    } else {
      if (read) io_uring_prep_read(sqe, op.fd, buf, len, pos);
      else io_uring_prep_write(sqe, op.fd, buf, len, pos);
    }
    io_uring_sqe_set_data64(sqe, static_cast<std::uint64_t>(index));
    ++in_flight_;
    ++pending_sqes_;
  }

  void complete(std::size_t index, int kernel_result) {
    Op& op = ops_[index];
    const Part& part = *op.part;
    const bool read = job_->op == IoOp::read;
    const std::uint64_t pos = op.file_pos + op.done;
    const long long result =
        inject_io(faults_, kernel_result, op.length - op.done, read ? "io_uring read" : "io_uring write", pos);
    if (result == -EAGAIN || result == -EINTR) {
      if (++op.retries > kMaxRetries)
        throw Error(errno_code(static_cast<int>(-result)), context(part, pos, op.length - op.done), "retried too often");
      retry_.push_back(static_cast<int>(index));
      return;
    }
    if (result < 0) throw Error(errno_code(static_cast<int>(-result)), context(part, pos, op.length - op.done));
    if (result == 0) {
      if (read)
        throw Error(errno_code(EIO), context(part, pos, op.needed - op.done),
                    fmt::format("file ended at byte {} (did it shrink during the read?)", pos));
      throw Error(errno_code(ENOSPC), context(part, pos, op.length - op.done), "write made no progress");
    }
    op.retries = 0;
    op.done += static_cast<std::size_t>(result);
    if (op.done < op.needed) {
      // Short transfer: go on from where it stopped. O_DIRECT cannot resume at an unaligned
      // position. A read's remainder continues through the page cache; a write's becomes an edge,
      // written after the job's direct writes (never beside them: see start_next_piece).
      if (op.direct && op.done % std::max<std::size_t>(part.alignment, 1) != 0) {
        if (!read) {
          {
            std::lock_guard lock(job_->edges_mutex);
            job_->edges.push_back({&part, op.file_pos + op.done, op.file_pos + op.length});
          }
          op.wanted -= op.length - op.done;  // write_edges counts those bytes
          finish_piece(op);
          free_ops_.push_back(static_cast<int>(index));
          return;
        }
        op.direct = false;
        op.resumed = true;
        op.fd = part.first().file->fd();
      }
      retry_.push_back(static_cast<int>(index));
      return;
    }
    finish_piece(op);
    free_ops_.push_back(static_cast<int>(index));
  }

  void finish_piece(Op& op) {
    const Part& part = *op.part;
    (op.direct ? job_->bytes_direct : job_->bytes_buffered) += op.wanted;
    Job::PartBytes& counts = job_->part_bytes[static_cast<std::size_t>(&part - job_->parts.data())];
    (op.direct ? counts.direct : op.resumed ? counts.resumed : part.alignment == 0 ? counts.plain : counts.cached) += op.wanted;
    if (op.slot >= 0) {
      if (job_->op == IoOp::read) {
        ++job_->bounce_copies;
        if (part.device) {
          const ErrorContext ctx = context(part, op.file_pos + op.wanted_offset, op.wanted);
          fault_point(FaultSite::device_copy, "cudaMemcpyAsync (host to device)");
          staging_.copy_to_device(op.slot, op.wanted_offset, op.user, op.wanted, ctx);
          landing_[static_cast<std::size_t>(op.slot)] = {&part, op.wanted};
        } else {
          std::memcpy(op.user, staging_.data(op.slot) + op.wanted_offset, op.wanted);
          staging_.release(op.slot);
          land(part, op.wanted);
        }
      } else {
        staging_.release(op.slot);
      }
    } else if (job_->op == IoOp::read) {
      land(part, op.wanted);  // read straight into the caller's memory
    }
    part.for_each_request(op.begin, op.begin + op.wanted, [](const IoRequest& r, std::uint64_t lo, std::uint64_t hi) {
      if (r.progress) *r.progress += hi - lo;
    });
  }

  // `bytes` of a read part are in place; the last of them tells its request's sink.
  void land(const Part& part, std::uint64_t bytes) noexcept {
    if (!job_->unlanded) return;
    std::atomic<std::uint64_t>& left = job_->unlanded[static_cast<std::size_t>(&part - job_->parts.data())];
    if (left.fetch_sub(bytes, std::memory_order_acq_rel) == bytes) tell_landed(part.first());
  }

  Options options_;
  FaultHook* faults_;
  bool on_callers_thread_;
  std::optional<cuda::DeviceGuard> device_guard_;  // worker 0, during a device job
  Job* job_ = nullptr;
  const Part* part_ = nullptr;  // the part of the chunk at hand
  std::unique_ptr<Ring> ring_;
  StagingRing staging_;          // the bounce buffers ("slots") and the stream of their copies to the GPU
  std::vector<Landing> landing_;  // per slot
  std::vector<Op> ops_;
  std::vector<int> free_ops_;
  std::deque<int> retry_;
  unsigned in_flight_ = 0;
  unsigned pending_sqes_ = 0;
  std::uint64_t cursor_ = 0, chunk_end_ = 0;
  bool chunk_direct_ = false;
  bool submit_now_ = false;     // the piece just queued is a page-cache read bound for the GPU (loop())
  bool fixed_buffers_ = false;  // slots registered with the ring
  int fixed_buffer_errno_ = 0;
};

class UringEngine final : public Engine {
 public:
  UringEngine(const Options& options, std::shared_ptr<FaultHook> faults)
      : options_(options), faults_(std::move(faults)), threads_(options.resolved_workers(), "uring worker") {
    workers_.resize(options_.resolved_workers());
  }


  std::string_view name() const noexcept override { return "uring"; }

  Stats submit(const IoRequest& request) override { return submit_batch({&request, 1}); }

  Stats submit_batch(std::span<const IoRequest> requests) override {
    std::lock_guard lock(mutex_);
    validate_batch(requests, name());
    TransferTimer timer;
    Stats stats{.backend = "uring"};

    Job job;
    UringPlan plan = plan_batch(requests, options_, name());  // parts and chunks; no I/O yet
    stats.bytes = plan.bytes;
    std::string note = std::move(plan.note);
    for (const IoRequest& request : requests)
      if (request.memory.size == 0) tell_landed(request);  // no part: nothing to wait for
    if (plan.parts.empty()) {
      timer.finish(stats);
      return stats;
    }
    job.parts = std::move(plan.parts);  // the requests they point to stay where they are
    job.part_bytes = std::vector<Job::PartBytes>(job.parts.size());
    job.chunks = plan.chunks;
    job.chunk_size = plan.chunk_size;
    job.device = plan.device;
    job.op = requests.front().op;
    if (std::any_of(requests.begin(), requests.end(), [](const IoRequest& r) { return r.landed != nullptr; })) {
      job.unlanded = std::make_unique<std::atomic<std::uint64_t>[]>(job.parts.size());
      for (std::size_t i = 0; i < job.parts.size(); ++i) job.unlanded[i] = job.parts[i].end() - job.parts[i].offset();
    }

    // A worker per chunk, up to the engine's, and no more than the bytes are worth: waking a
    // thread costs about what copying kBytesPerWorker from the page cache does.
    const auto count = static_cast<unsigned>(std::min<std::uint64_t>(
        {workers_.size(), job.chunks, std::max<std::uint64_t>(1, (stats.bytes + kBytesPerWorker - 1) / kBytesPerWorker)}));
    for (unsigned i = 0; i < count; ++i)
      if (!workers_[i]) workers_[i] = std::make_unique<Worker>(options_, faults_.get(), i == 0);
    job.start = std::chrono::steady_clock::now();
    threads_.run(count, [&](unsigned i) { workers_[i]->run(job); });
    if (job.error) std::rethrow_exception(job.error);
    write_edges(job);

    stats.bytes_direct = job.bytes_direct;
    stats.bytes_buffered = job.bytes_buffered;
    stats.bounce_copies = job.bounce_copies;
    stats.workers = count;
    stats.wake_seconds = static_cast<double>(job.last_start_ns.load()) * 1e-9;
    stats.drain_seconds = static_cast<double>(job.last_end_ns.load() - std::min(job.first_end_ns.load(), job.last_end_ns.load())) * 1e-9;
    stats.copy_wait_seconds = static_cast<double>(job.copy_wait_ns.load()) * 1e-9;
    if (job.chunks_cached + job.chunks_cold > 0)
      note += fmt::format("{}O_DIRECT auto: {} of {} chunks cold ({})", note.empty() ? "" : "; ", job.chunks_cold.load(),
                          job.chunks_cached + job.chunks_cold, job.residency_method.load());
    if (const unsigned n = job.workers_set_up.load()) {
      const auto ms_each = [n](const std::atomic<std::uint64_t>& ns) { return static_cast<double>(ns.load()) * 1e-6 / n; };
      note += fmt::format("{}first-use set-up of {} worker(s): {:.0f} ms on average (bounce buffers {:.0f} ms, registering them {:.0f} ms)",
                          note.empty() ? "" : "; ", n, ms_each(job.setup_ns), ms_each(job.pinning_ns), ms_each(job.registering_ns));
    }
    if (const int err = job.fixed_buffer_errno.load())
      note += fmt::format("{}bounce buffers not registered with io_uring ({}): plain reads", note.empty() ? "" : "; ",
                          std::strerror(err));
    stats.note = note;
    stats.paths = paths_of(job);
    timer.finish(stats);
    return stats;
  }

 private:
  // One TransferPath per file of the job: its parts' bytes summed by the way they went, and why
  // each way, from the file's O_DIRECT facts and the options.
  std::vector<TransferPath> paths_of(const Job& job) const {
    struct Bytes {
      const Part* part;  // the file's first part: its file and O_DIRECT alignment
      std::uint64_t direct = 0, cached = 0, plain = 0, edges = 0, resumed = 0;
    };
    std::vector<Bytes> files;  // in the order first met; few, so a linear search
    for (std::size_t i = 0; i < job.parts.size(); ++i) {
      const Part& part = job.parts[i];
      auto it = std::find_if(files.begin(), files.end(), [&](const Bytes& b) { return b.part->first().file == part.first().file; });
      if (it == files.end()) it = files.insert(files.end(), Bytes{.part = &part});
      const Job::PartBytes& counts = job.part_bytes[i];
      it->direct += counts.direct, it->cached += counts.cached, it->plain += counts.plain;
      it->edges += counts.edges, it->resumed += counts.resumed;
    }
    std::vector<TransferPath> out;
    for (const Bytes& b : files) {
      const File& file = *b.part->first().file;
      std::string why_plain;  // why a part had no O_DIRECT at all (as plan_batch decided)
      if (options_.direct_io == DirectIo::off) why_plain = "O_DIRECT off by option (Options::direct_io, HBMIO_DIRECT_IO)";
      else if (!file.direct_io().supported) why_plain = "O_DIRECT refused: " + file.direct_io().reason;
      else why_plain = "O_DIRECT needs an alignment above 4 KiB here";
      const std::pair<std::uint64_t, std::string> ways[] = {
          {b.direct, job.op == IoOp::read && options_.direct_io == DirectIo::automatic ? "O_DIRECT (not in the page cache)"
                                                                                      : "O_DIRECT"},
          {b.cached, "page cache: already cached, so O_DIRECT auto read it from memory"},
          {b.plain, "page cache: " + why_plain},
          {b.edges, "page cache: unaligned edges, written after the direct writes"},
          {b.resumed, "page cache: short O_DIRECT reads resumed at an unaligned offset"},
      };
      const auto used = std::count_if(std::begin(ways), std::end(ways), [](const auto& w) { return w.first > 0; });
      std::string reason;
      for (const auto& [bytes, how] : ways) {
        if (bytes == 0) continue;
        if (!reason.empty()) reason += "; ";
        reason += used > 1 ? fmt::format("{} {}", format_size(bytes), how) : how;
      }
      const std::uint64_t total = b.direct + b.cached + b.plain + b.edges + b.resumed;
      if (total > 0) out.push_back({.file = file.path(), .path = DataPath::uring, .reason = reason, .bytes = total, .bytes_direct = b.direct});
    }
    return out;
  }

  // The unaligned edges of direct writes (each under one block), with pwrite through the page
  // cache, now that no direct write of the job is in flight; fsync makes them durable with the rest.
  void write_edges(Job& job) {
    std::vector<std::byte> staging;
    for (const Job::Edge& edge : job.edges) {
      const Part& part = *edge.part;
      const std::size_t n = edge.end - edge.begin;
      ErrorContext context = part.context;
      context.offset = edge.begin;
      context.length = n;
      staging.resize(n);
      std::optional<cuda::DeviceGuard> guard;  // this runs on the caller's thread
      if (part.device) guard.emplace(part.first().memory.location.device, context);
      part.for_each_request(edge.begin, edge.end, [&](const IoRequest& r, std::uint64_t lo, std::uint64_t hi) {
        const std::byte* from = r.memory.data + (lo - r.offset);
        if (part.device) cuda::memcpy_sync(staging.data() + (lo - edge.begin), from, hi - lo, context);
        else std::memcpy(staging.data() + (lo - edge.begin), from, hi - lo);
      });
      write_fully(part.first().file->fd(), staging, edge.begin, context,
                  {.faults = faults_.get(), .what = "pwrite (unaligned edge)"});
      job.bytes_buffered += n;
      job.part_bytes[static_cast<std::size_t>(&part - job.parts.data())].edges += n;
      part.for_each_request(edge.begin, edge.end, [](const IoRequest& r, std::uint64_t lo, std::uint64_t hi) {
        if (r.progress) *r.progress += hi - lo;
      });
    }
  }

  Options options_;
  std::shared_ptr<FaultHook> faults_;
  std::vector<std::unique_ptr<Worker>> workers_;  // workers_[i] is used by thread i only
  WorkerThreads threads_;  // declared after workers_: the threads stop before the workers go
  std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(const Options& options, std::shared_ptr<FaultHook> faults) {
  const BackendStatus status = probe_uring();
  if (!status.available)
    throw Error(errno_code(ENOTSUP), {.op = "open backend", .backend = "uring"}, status.detail);
  return std::make_unique<UringEngine>(options, std::move(faults));
}

BackendStatus probe_uring() {
  // Containers often forbid io_uring (seccomp, or kernel.io_uring_disabled): try it, don't assume.
  io_uring ring{};
  const int r = io_uring_queue_init(2, &ring, 0);
  if (r < 0)
    return {"uring", false, fmt::format("io_uring_queue_init failed: {} (seccomp or kernel.io_uring_disabled?)", std::strerror(-r))};
  io_uring_queue_exit(&ring);
  return {"uring", true, "io_uring with O_DIRECT and registered bounce buffers"};
}

}  // namespace hbmio::detail
