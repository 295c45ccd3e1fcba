// The one interface over every data path.
//
//   posix   pread/pwrite, one thread, pageable staging + cudaMemcpy: the article's baseline.
//   uring   io_uring, O_DIRECT where possible, registered pinned bounce buffers, reads
//           overlapped with cudaMemcpyAsync on several streams, several worker rings.
//   cufile  NVIDIA GPUDirect Storage through libcufile (loaded at run time).
//   auto    picks per request: cufile where it runs true GDS/P2PDMA, else uring, else posix,
//           and says why in Stats::note.
//
// A request names a file range and a memory span of the same length. Reads fill the span with
// bytes [offset, offset + size) of the file; writes store the span there. A zero-length request
// is a no-op. A read must lie within the file (a read past the end is an error, not a short read).
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"

namespace hbmio {

enum class IoOp { read, write };

// Told as each read of a batch lands (IoRequest::landed), while the batch's later reads are still
// being transferred: a caller hands out each tensor as soon as its bytes are in place instead of
// when the whole batch is.
class LandedSink {
 public:
  // The request tagged `tag` has all its bytes in place (device memory: its copies have finished).
  // Called once per request, on one of the engine's threads, before submit_batch returns; never
  // for a request of a batch that fails before it lands. It runs inside the transfer: it must
  // be quick (hand heavy work such as hashing to another thread) and must not throw.
  virtual void landed(std::uint64_t tag) noexcept = 0;

 protected:
  ~LandedSink() = default;
};

struct IoRequest {
  IoOp op = IoOp::read;
  const File* file = nullptr;
  std::uint64_t offset = 0;  // file offset
  MemorySpan memory{};       // destination (read) or source (write); its size is the length
  // Optional: engines add the bytes they complete, as they complete them, so another thread
  // can show progress. Must outlive the transfer.
  std::atomic<std::uint64_t>* progress = nullptr;
  // Optional: once it reads true the transfer stops at its next chunk (what is in flight
  // completes first) and throws Error(ECANCELED). A save stopped by Ctrl-C uses it.
  const std::atomic<bool>* cancel = nullptr;
  // Optional, reads only: told `landed_tag` once this request's bytes are in place (see
  // LandedSink). Must outlive the transfer. A write that names one is refused (EINVAL).
  LandedSink* landed = nullptr;
  std::uint64_t landed_tag = 0;
};

// Thread-safety: an Engine may be shared by threads; each engine serves one request at a time
// (concurrent submits queue on an internal mutex) and uses its own worker threads inside it.
// Run several engines to run several transfers truly at once.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual std::string_view name() const noexcept = 0;

  // Blocking transfer. Throws Error with op, path, offset, length and backend on failure; the
  // span's contents are then unspecified, and nothing is leaked or left in flight.
  virtual Stats submit(const IoRequest& request) = 0;

  // Several transfers as one: all reads or all writes, in any order, possibly overlapped (uring
  // spreads the chunks of every request over all its workers, so a checkpoint of many tensors or
  // files keeps the whole queue busy). Every request is checked before any I/O starts. Returns
  // the summed Stats. The default runs the requests one after another.
  virtual Stats submit_batch(std::span<const IoRequest> requests);

  Stats read(const File& file, std::uint64_t offset, MemorySpan destination);
  Stats write(const File& file, std::uint64_t offset, MemorySpan source);

  // Runs submit() on another thread (std::async: the future's destructor waits for it). The file
  // and memory must stay alive until get() returns.
  std::future<Stats> submit_async(IoRequest request);
};

// Creates a backend by name: "posix", "uring", "cufile" or "auto"; "" is the configured one
// (configured_backend(): HBMIO_BACKEND, else "auto"). Throws Error(EINVAL) for an unknown name
// (naming HBMIO_BACKEND where the name came from it) and Error(ENOTSUP) with the reason when the
// backend cannot run here.
std::unique_ptr<Engine> make_engine(std::string_view backend, const Options& options = Options::from_env());

// What each backend can do on this machine, and why not where it cannot.
struct BackendStatus {
  std::string name;
  bool available = false;
  std::string detail;  // mode or version when available ("compatibility mode"), reason otherwise
};
std::vector<BackendStatus> probe_backends(const Options& options = Options::from_env());

std::vector<std::string> backend_names();  // {"posix", "uring", "cufile", "auto"}

// Idle engines by backend name, for reuse: an engine's first transfer pays for its rings, pinned
// bounce buffers and threads; later ones do not. A call leases an idle engine (or a new one) and
// the lease gives it back when it ends, so concurrent calls each hold their own engine and run
// truly at once (an Engine serves one request at a time). Loads and saves that are given no
// engine lease one from EnginePool::shared(). Engines are made with Options::from_env(): HBMIO_*
// changes apply to engines made after release_all(). Thread-safe.
class EnginePool {
 public:
  // Idle engines kept per backend; one more given back frees the oldest idle one (each holds up to
  // workers x bounce_buffers x bounce_buffer_size bytes of pinned memory).
  explicit EnginePool(std::size_t max_idle_per_backend = 4) : max_idle_(max_idle_per_backend) {}
  ~EnginePool();
  EnginePool(const EnginePool&) = delete;
  EnginePool& operator=(const EnginePool&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();  // gives the engine back (an engine that threw has nothing in flight: fit for reuse)
    Engine& operator*() const noexcept { return *engine_; }
    Engine* operator->() const noexcept { return engine_.get(); }
    Engine* get() const noexcept { return engine_.get(); }

   private:
    friend class EnginePool;
    Lease(EnginePool* pool, std::string backend, unsigned workers, std::unique_ptr<Engine> engine)
        : pool_(pool), backend_(std::move(backend)), workers_(workers), engine_(std::move(engine)) {}
    void give_back() noexcept;
    EnginePool* pool_ = nullptr;
    std::string backend_;
    unsigned workers_ = 0;
    std::unique_ptr<Engine> engine_;
  };

  // An idle engine of `backend` ("": the configured one, as for make_engine), or a new one
  // (make_engine's errors). `workers` other than 0 replaces Options::from_env()'s worker count:
  // callers that run several engines at once (a stream's two) share the cores between them.
  Lease acquire(std::string_view backend, unsigned workers = 0);
  // Frees the idle engines (leased ones come back later as usual); returns how many.
  std::size_t release_all();
  std::map<std::string, std::size_t> idle_counts() const;  // {backend: idle engines}

  // The process's pool. Never destroyed: a static destructor would free CUDA memory after the
  // CUDA runtime's own teardown at exit; call release_all() to free its engines before then. A
  // child of fork() gets an empty one (the parent's engines' worker threads are not in it).
  static EnginePool& shared();

 private:
  void give_back(const std::string& backend, unsigned workers, std::unique_ptr<Engine> engine) noexcept;
  struct Idle {
    unsigned workers;  // as asked of acquire(): 0 is Options::from_env()'s
    std::unique_ptr<Engine> engine;
  };
  const std::size_t max_idle_;
  mutable std::mutex mutex_;
  std::map<std::string, std::vector<Idle>, std::less<>> idle_;  // oldest first
};

}  // namespace hbmio
