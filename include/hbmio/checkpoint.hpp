// Checkpoints: safetensors files and Hugging Face sharded checkpoints straight into host, pinned
// or GPU memory, and back out, crash-safe and optionally verified with per-tensor checksums.
//
// Thread-safety: the functions are safe to call from several threads at once on different
// checkpoints. A LoadedCheckpoint owns its memory; the spans it hands out live as long as it does.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "hbmio/cache.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/file_system.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "hbmio/remote.hpp"
#include "hbmio/safetensors.hpp"

namespace hbmio {

enum class TensorLayout {
  single_allocation,  // one buffer; each tensor starts at a multiple of LoadOptions::alignment
  per_tensor,         // one buffer per tensor
};

struct LoadOptions {
  MemoryLocation into{};
  std::string backend;  // posix | uring | cufile | auto; "": configured_backend() (HBMIO_BACKEND, else auto)
  std::vector<std::string> names;  // tensors to load; empty: all
  TensorLayout layout = TensorLayout::single_allocation;
  std::size_t alignment = 256;     // of each tensor in a single allocation (CUDA's own is 256)
  // Recompute the checksums stored in each file and throw Error(Errc::verify_failed) on a
  // mismatch. A file without hbmio checksums (any file another tool wrote) is loaded and listed in
  // LoadedCheckpoint::unverified_files(), unless require_checksums makes it an
  // Error(Errc::no_checksums) before anything is read.
  bool verify = false;
  bool require_checksums = false;
  std::optional<Options> engine_options;  // default: Options::from_env()
  // How a checkpoint at a URL is opened and read (connections, part size, retries, S3 endpoint,
  // region and profile); default: RemoteOptions::from_env() (LoadRequest::files: the options its
  // files were opened with). Ignored for local files.
  std::optional<RemoteOptions> remote;
  std::atomic<std::uint64_t>* progress = nullptr;  // bytes loaded so far, for a progress display
  // An engine to reuse (its rings and pinned buffers stay set up across loads). When null, the
  // load leases one of `backend` from EnginePool::shared(), or makes its own when
  // `engine_options` is set.
  Engine* engine = nullptr;
  // Memory of the caller's to load into, instead of a new allocation per load (single_allocation
  // layout only): repeated loads then reuse it, as PyTorch's caching allocator does for its
  // loaders. It must lie in `into`'s location and hold at least plan_load(request).bytes;
  // the result's spans point into it, so it must outlive their use.
  MemorySpan destination{};
  // The node's resident cache (hbmio/cache.hpp): files it holds unchanged are read from its shared
  // memory instead of the file. `configured`: HBMIO_CACHE and HBMIO_CACHE_ADD decide. A cache
  // that cannot help is a plain load, its reason in the Stats' note and on stderr (once).
  CacheUse cache = CacheUse::configured;
  std::string cache_socket;  // "": HBMIO_CACHE, else the default (default_cache_socket())
  // Into GPU memory: the files the resident cache holds in that GPU's memory (its device tier:
  // `hbmio cache add --gpu`) are not copied: their tensors are the cache's own copy, mapped into
  // this process (CUDA IPC), read in place, kept by the server while this LoadedCheckpoint lives
  // (and never evicted meanwhile). Read-only by agreement: a write would change what every process
  // sharing it sees. The other files are loaded as usual; each file's TransferPath says which it
  // was (cache-shared) or the note why not. Asks the cache even where HBMIO_CACHE is unset (its
  // default socket); not with CacheUse::off, a `destination`, host memory, several locations or
  // an NCCL group (Error EINVAL). Shared tensors lie where their file puts them (at least 8-byte
  // aligned in files hbmio or safetensors wrote), not on `alignment`.
  bool share = false;
  // Once set (by another thread: a Ctrl-C, a job given up), local reads not started yet stop and
  // the load throws Error(ECANCELED), its memory freed (a caller's destination holds part of the
  // checkpoint). The load sets it too when it fails part-way, to stop its other reads: give each
  // load a flag of its own.
  std::atomic<bool>* cancel = nullptr;
};

struct LoadedTensor {
  std::string name;
  safetensors::Dtype dtype = safetensors::Dtype::U8;
  std::vector<std::uint64_t> shape;
  MemorySpan data;            // where the tensor's bytes are now
  std::string file;           // the file it came from
  std::uint64_t file_offset = 0;  // where its bytes start in that file
};

namespace detail {
struct LoadAccess;
struct ResidentCopies;
}

class LoadedCheckpoint {
 public:
  const std::vector<LoadedTensor>& tensors() const noexcept { return tensors_; }
  const LoadedTensor* find(const std::string& name) const noexcept;
  // __metadata__ of the (first) file, and of the index for a sharded checkpoint.
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  const Stats& stats() const noexcept { return stats_; }
  // True when LoadOptions::verify checked every tensor loaded against its file's checksum.
  bool verified() const noexcept { return verified_; }
  // With verify: the files that hold no checksums, whose tensors were loaded unchecked.
  const std::vector<std::string>& unverified_files() const noexcept { return unverified_files_; }
  // The memory every tensor's data lies in, each span one allocation: the load's own and the
  // resident cache's copies it shares (LoadOptions::share). A binding makes the tensors views of
  // these (one object per allocation, not one per tensor).
  std::vector<MemorySpan> memory() const;

 private:
  friend struct detail::LoadAccess;
  std::vector<Buffer> buffers_;
  std::vector<std::shared_ptr<const void>> shared_;  // the resident cache's copies mapped here (LoadOptions::share)
  std::vector<MemorySpan> shared_memory_;            // their spans
  std::vector<LoadedTensor> tensors_;
  std::map<std::string, std::string> metadata_;
  Stats stats_;
  bool verified_ = false;
  std::vector<std::string> unverified_files_;
};

// A directory a checkpoint was opened from, held open (a descriptor): its shards are opened
// relative to it, so a sharded save that swaps another directory in under the same name
// (save_checkpoint's renameat2) never mixes the old index with new shards.
class CheckpointDirectory {
 public:
  explicit CheckpointDirectory(int fd) noexcept : fd_(fd) {}
  ~CheckpointDirectory();
  CheckpointDirectory(const CheckpointDirectory&) = delete;
  CheckpointDirectory& operator=(const CheckpointDirectory&) = delete;
  int fd() const noexcept { return fd_; }

 private:
  int fd_;
};

// One file of a checkpoint and the tensors it holds.
struct CheckpointFile {
  std::string path;
  safetensors::Header header;
  // The file whose header this is, as it was opened to read it. A load, verify or checksum reads
  // the data through the same descriptor, so a file replaced meanwhile (rename is atomic) is never
  // read half old, half new: one descriptor sees one file. Null for the files of a checkpoint
  // past open_checkpoint's bound on open files: those are opened again when read (relative to
  // `directory`) and must then still be the same file (`identity`), or the read fails with ESTALE.
  std::shared_ptr<const File> file;
  FileIdentity identity;
  std::shared_ptr<const CheckpointDirectory> directory;  // null for a file named on its own
  // For a checkpoint at a URL: the object (its version fixed when the header was read); `file` is
  // then null, and reads go through read_remote.
  std::shared_ptr<const RemoteObject> remote;

  // `file`, or where open_checkpoint did not keep it, the file opened again from its directory and
  // checked to be the same file (Error ESTALE, naming it, when another file has taken its name:
  // the checkpoint was replaced while being read). Error ENOTSUP for an object at a URL.
  std::shared_ptr<const File> open() const;
};

// Resolves PATH (a .safetensors file, a *.index.json, or a directory holding either) to its files,
// each header read and validated; for an index, checks that every tensor it names is in its shard.
// Every file is opened once: the files returned hold their descriptors (see CheckpointFile::file)
// up to a bound derived from RLIMIT_NOFILE, so a checkpoint of hundreds of shards does not exhaust
// the process's descriptors. A URL's objects are opened with `remote` (default:
// RemoteOptions::from_env()), which their reads then use.
std::vector<CheckpointFile> open_checkpoint(const std::string& path, const std::optional<RemoteOptions>& remote = std::nullopt);

// A checkpoint opened for access a tensor (or part of one) at a time, in any order: what
// frameworks' safe_open-style loaders do (Hugging Face transformers, vLLM). The headers are parsed
// and the files opened once (open_checkpoint); each read goes through the descriptors so held, so
// every read sees the files as they were when opened, even if they are replaced meanwhile, and a
// file truncated meanwhile is an Error (the read ends early), never other bytes. Reads of several
// tensors are one engine batch. Thread-safety: const methods may be called from several threads;
// reads through one engine queue on it (see Engine).
struct TensorRead {
  std::size_t tensor = 0;     // index into OpenedCheckpoint::tensors()
  std::uint64_t offset = 0;   // first byte, within the tensor's bytes
  std::uint64_t length = 0;   // bytes; offset + length must not pass the tensor's end
  MemorySpan into;            // at least `length` bytes, of any memory kind
  // Reads naming the same nonzero id lie in one allocation (a prefetch's batch): where they follow
  // each other in the file and in memory they are read as one range. 0: memory of its own, never
  // joined to another read's, however their addresses fall: two allocations can be adjacent in
  // the address space (torch's separate cudaMallocs often are), and one copy or DMA across their
  // boundary is refused (cudaErrorInvalidValue) or, on the host, reads into memory the caller did
  // not name as one.
  std::uint64_t allocation = 0;
};

class OpenedCheckpoint {
 public:
  struct Tensor {
    std::size_t file = 0;                           // index into files()
    const safetensors::TensorInfo* info = nullptr;  // name, dtype, shape, size
    std::uint64_t file_offset = 0;                  // where its bytes start in its file
  };
  // Throws Error as open_checkpoint(path, remote) does. `cache`: whether reads take the files the
  // node's resident cache holds from it (LoadOptions::cache), asked once, here.
  explicit OpenedCheckpoint(const std::string& path, const std::optional<RemoteOptions>& remote = std::nullopt,
                            CacheUse cache = CacheUse::configured, const std::string& cache_socket = "");
  OpenedCheckpoint(OpenedCheckpoint&&) noexcept = default;
  OpenedCheckpoint& operator=(OpenedCheckpoint&&) noexcept = default;

  const std::string& path() const noexcept { return path_; }
  const std::vector<CheckpointFile>& files() const noexcept { return files_; }
  // Every tensor, in file order (by file, then by offset): the order a walk reads sequentially.
  const std::vector<Tensor>& tensors() const noexcept { return tensors_; }
  // The index of `name` in tensors(), or nullopt.
  std::optional<std::size_t> find(std::string_view name) const noexcept;
  // __metadata__ of the first file (a sharded checkpoint's shards carry the same).
  const std::map<std::string, std::string>& metadata() const noexcept;
  // Whether that file has a "__metadata__" entry (an empty one included: Header::has_metadata).
  bool has_metadata() const noexcept { return !files_.empty() && files_.front().header.has_metadata; }
  // Reads the given byte ranges of tensors, all in one batch through `engine`; reads of one
  // allocation (TensorRead::allocation) that follow each other in one file and in memory (tensors
  // laid out in one allocation as in the file) are one request. Throws Error naming the file,
  // tensor and offset (EINVAL for a range past a tensor's end).
  struct ReadOptions {
    std::atomic<std::uint64_t>* progress = nullptr;  // bytes in place so far
    // Told i once reads[i] is all in place (GPU copies done), while later reads are still being
    // read: a caller hands each tensor out as it lands. It runs on the engine's threads (objects
    // at URLs: the remote workers'), possibly several at once: it must be quick and not throw.
    std::function<void(std::size_t read)> landed;
    // Once set, local reads not started yet stop and the call throws Error(ECANCELED).
    std::atomic<bool>* cancel = nullptr;
  };
  Stats read(const std::vector<TensorRead>& reads, Engine& engine, const ReadOptions& options) const;
  // The Error read() would throw for this read (EINVAL: no such tensor, or a range past its end).
  void check(const TensorRead& read) const;
  Stats read(const std::vector<TensorRead>& reads, Engine& engine, std::atomic<std::uint64_t>* progress = nullptr) const {
    ReadOptions options;
    options.progress = progress;
    return read(reads, engine, options);
  }

 private:
  std::string path_;
  std::vector<CheckpointFile> files_;
  std::shared_ptr<const detail::ResidentCopies> resident_;  // the resident cache's copies of files_
  std::vector<Tensor> tensors_;
  // Keys view the names in files_' headers (which never move: this class moves, never copies).
  std::unordered_map<std::string_view, std::size_t> by_name_;
};

// Batches of reads of an opened checkpoint, read in order by a job of the library's pool while the
// caller goes on: a read-ahead (Python's SafeOpen walks queue the next tensors while the caller
// uses the last) and a prefetch. push() queues a batch and returns its id; wait(id) waits for it
// and rethrows its read's error; each batch is waited for once. The batches queued when the job
// comes to them are read as one engine batch, each finished as soon as its own bytes have landed:
// a prefetch queues every batch at once and reads at the rate of one large load while handing the
// first tensors out early. Destinations must stay valid until their batch is waited for, or until
// the queue is destroyed, which stops the local reads not started, waits for those in flight and
// drops the batches not started. `on_read` gets the Stats of each engine batch (on the reading
// thread). Thread-safe.
class ReadQueue {
 public:
  // `backend`: of the engine leased from EnginePool::shared() for the queue's life ("": the
  // configured one).
  ReadQueue(std::shared_ptr<const OpenedCheckpoint> checkpoint, std::string_view backend,
            std::function<void(const Stats&)> on_read = nullptr);
  ~ReadQueue();
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;

  const OpenedCheckpoint& checkpoint() const noexcept;
  std::uint64_t push(std::vector<TensorRead> reads);
  // Several batches at once (read together, see above); their ids in order.
  std::vector<std::uint64_t> push(std::vector<std::vector<TensorRead>> batches);
  // Throws Error(EINVAL) for an id that is not queued (waited for already).
  void wait(std::uint64_t id);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// How a load to several destinations (LoadRequest::locations, or the ranks of an NCCL group)
// divides the tensors:
//   shard      every tensor goes to one destination: those named in `shard_map` where it says, the
//              others split in file order into runs of about equal bytes (contiguous runs keep the
//              reads large).
//   replicate  every destination gets every tensor, in the same layout. Each byte is read from
//              storage once: destination k reads the k-th run, then every destination gets the
//              runs it did not read from the one that did (several locations: cudaMemcpy between
//              GPUs, hbmio does not enable peer access, see bench/RESULTS.md, "Two GPUs"; an NCCL
//              group: ncclBroadcast from each run's reader, NVLink within a node).
enum class Placement { shard, replicate };

// A load: what to read and where to put it. The destination is one memory location
// (options.into) unless one of these says otherwise:
//   locations  several memory locations of this process (several GPUs; any kinds; a location may
//              repeat), each with its own engine and pipeline, all running in parallel;
//   nccl_comm  every rank of the caller's NCCL communicator (an ncclComm_t; every rank calls
//              load() with the same request), one GPU each: options.into must be this rank's GPU.
//              The ranks divide the reading, so each byte is read from storage once. Before any
//              data moves, the ranks agree that every one read its part and planned the same
//              layout with the same options: a failure on one rank (a missing shard, a bad file,
//              options that differ) makes every rank throw, with the failing rank named, instead
//              of leaving the others waiting in a collective. Only a failure of the CUDA set-up on
//              the communicator's GPU (a stream and 24 bytes of device memory, made first) stays
//              local. NCCL is the caller's: found at run time (src/shim/nccl_api.hpp), never linked.
// Several destinations load in the single_allocation layout (options.destination and
// options.engine are not used: `engines` gives one per location, or an NCCL rank leases its own).
struct LoadRequest {
  std::string path;  // a .safetensors file, a *.index.json, a directory holding either, or a URL
  // The checkpoint's files when the caller opened them already (open_checkpoint(path); must
  // outlive the call): their headers are not read and validated again (a header of thousands of
  // tensors takes milliseconds to parse). Null: opened here.
  const std::vector<CheckpointFile>* files = nullptr;
  LoadOptions options;
  std::vector<MemoryLocation> locations;
  // Optional, with `locations`: one engine per location, in its order, kept by the caller across
  // loads so rings and pinned buffers are set up once; no two may be the same (an engine serves
  // one request at a time). Empty: each location leases or makes its own.
  std::vector<Engine*> engines;
  void* nccl_comm = nullptr;
  Placement placement = Placement::replicate;  // with `locations` or `nccl_comm`
  // shard: tensor name -> index into `locations`, or rank.
  std::map<std::string, int> shard_map;
};

struct LoadResult {
  // One per destination: the one location, each of `locations` in its order (one a shard
  // placement gives no tensor is empty: no tensors, no metadata), or this rank's tensors.
  std::vector<LoadedCheckpoint> locations;
  int rank = 0, world = 1;                   // with nccl_comm: this rank and the group's size
  std::uint64_t bytes_from_storage = 0;      // read by this process
  std::uint64_t bytes_between = 0;           // replicate: copied between locations (padding between tensors included), or received from other ranks
  double seconds = 0;
};

// Loads tensors per `request`. Reads are planned: tensors adjacent in the file and in memory
// become one request, so a file of many small tensors loads like one of few big ones. Throws
// Error naming the file (and tensor) on any failure; nothing is leaked.
LoadResult load(const LoadRequest& request);

// load(request) started on the library's pool, for a caller with other work to do meanwhile
// (Python builds its tensors' views while the bytes are read): wait() returns load's result or
// rethrows what it threw; the destructor waits too, since the load writes the caller's memory
// until it returns. The job keeps its own copy of `request`; what the request points to (its
// files, engines, the destination, a progress counter) must outlive the wait.
class LoadInProgress {
 public:
  LoadInProgress(LoadInProgress&&) noexcept;
  LoadInProgress& operator=(LoadInProgress&&) noexcept;
  ~LoadInProgress();
  LoadResult wait();  // once

 private:
  struct State;
  explicit LoadInProgress(std::unique_ptr<State> state) noexcept;
  friend LoadInProgress load_started(LoadRequest request);
  std::unique_ptr<State> state_;
};
LoadInProgress load_started(LoadRequest request);

// load({.path = path, .options = options}) into its one location: the common case.
LoadedCheckpoint load_checkpoint(const std::string& path, const LoadOptions& options = {});

// Where a load puts each chosen tensor in its single allocation, in the order it reads them (file
// order), and, planned for `world` ranks, who reads what: for callers that allocate first
// (LoadOptions::destination) or divide a load among processes and must agree on the layout (the
// Python package's torch.distributed loads, which keep only the collectives).
struct PlannedTensor {
  std::string name;
  safetensors::Dtype dtype = safetensors::Dtype::U8;
  std::vector<std::uint64_t> shape;
  std::uint64_t size = 0;           // bytes
  std::uint64_t memory_offset = 0;  // in the allocation
};
struct LoadPlan {
  std::vector<PlannedTensor> tensors;
  std::uint64_t bytes = 0;  // the single allocation's size (what LoadOptions::destination must hold)
  // The rank that reads each tensor (contiguous runs of about equal bytes in layout order; with
  // Placement::shard, the tensors `shard_map` names go to the rank it gives), each rank's byte
  // range of the layout ([first, second); none when first >= second), and a digest of all of it
  // with the placement and options.verify, which the ranks compare before any data moves.
  std::vector<int> reader;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> range;
  std::uint64_t digest = 0;
};
// The plan of load(request) over `world` ranks (1: one process). Uses path, files, options
// (names, alignment, verify), placement and shard_map. Throws Error: EINVAL for a rank out of
// range in `shard_map` or a name the checkpoint lacks.
LoadPlan plan_load(const LoadRequest& request, int world = 1);

struct TensorToSave {
  std::string name;
  safetensors::Dtype dtype = safetensors::Dtype::U8;
  std::vector<std::uint64_t> shape;
  MemorySpan data;  // host, pinned or device; its size must match dtype and shape
};

struct SaveOptions {
  std::map<std::string, std::string> metadata;
  // With no metadata to write (an empty `metadata` and no checksums): write: the header holds
  // "__metadata__":{}, as safetensors writes for metadata={} (hbmio.torch.save_file(..., metadata={}));
  // omit: no such entry, as it writes for metadata=None.
  safetensors::EmptyMetadata empty_metadata = safetensors::EmptyMetadata::omit;
  bool checksums = true;  // XXH3-64 of each tensor in __metadata__ ("hbmio.xxh3.<name>")
  std::string backend;  // posix | uring | cufile | auto; "": configured_backend() (HBMIO_BACKEND, else auto)
  std::optional<Options> engine_options;  // default: Options::from_env()
  // How a save to an s3:// URL uploads (connections, part size, retries, S3 endpoint, region and
  // profile); default: RemoteOptions::from_env(). Ignored for local files.
  std::optional<RemoteOptions> remote;
  // The engine that writes every file of the save (all shards of a sharded one). When null, the
  // save takes the one `file_system` gives, else makes its own when `engine_options` is set, else
  // leases one of `backend` from EnginePool::shared().
  Engine* engine = nullptr;
  // Every file operation of the save but the engine's data writes (file_system.hpp); null:
  // FileSystem::posix().
  std::shared_ptr<FileSystem> file_system;
  // 0: one file at `path`. Otherwise `path` is a directory that receives a Hugging Face sharded
  // checkpoint: model-0000K-of-0000N.safetensors of at most this many tensor bytes each (a larger
  // tensor gets a shard of its own) and model.safetensors.index.json.
  std::uint64_t max_shard_size = 0;
  // Tensor bytes written so far (every shard's, headers and index not counted), for a progress
  // display; it reaches the sum of the tensors' sizes when the save returns.
  std::atomic<std::uint64_t>* progress = nullptr;
  // The new file takes the mode, and where permitted the owner and group, of the file it replaces
  // (a rewrite of the same checkpoint, as add_checksums does, should not change who may read it).
  // Off: mode 0666 less the umask, owned by the caller, as any new file.
  bool keep_attributes = false;
  // Optional: a stop request (Ctrl-C in `hbmio ckpt generate`). Once it reads true, the save stops
  // at its next safe point (between pieces of its writes, before its fsync, before it publishes)
  // and throws Error(ECANCELED) with nothing of it left behind and the path as it was. A save past
  // its rename (or a sharded save past its directory swap) has published and finishes instead:
  // whether save_checkpoint returned or threw ECANCELED says which the path holds.
  const std::atomic<bool>* cancel = nullptr;
};

// Writes a safetensors file that the reference reader accepts, crash-safe: a new file in the same
// directory, unnamed (O_TMPFILE, mode 0666 so the umask applies) where the file system allows it,
// else a hidden temporary name (O_CREAT|O_EXCL|O_NOFOLLOW); fsync; a rename over `path`; fsync of
// the directory. On any error before the rename the previous file at `path` is untouched, nothing
// of the new one is left, and the error (never retried: an fsync failure is final) is thrown. An
// error after it (the fsync of the directory) is thrown with op "make the save durable": the new
// file is in place, and whether its name survives a power loss is unknown. A save killed outright
// leaves nothing either where the file was unnamed. Temporary files left by a crashed earlier save
// of the same name are removed first (those of a save still running are not: each holds a lock).
// A symbolic link at `path` is followed: the file it names is replaced, and the link stays. Only a
// regular file is replaced: a device node, FIFO, socket or directory at `path` is refused (EINVAL,
// EISDIR). The rename waits while add_checksums rewrites the file there (its older data would
// otherwise replace this save's). Errors name `path` (and a shard's final name), never a temporary.
// Sharded (options.max_shard_size > 0): the whole directory is built beside the target and
// swapped in with one renameat2(RENAME_EXCHANGE), so readers see all old or all new shards, never
// a mix; other files in the directory (config.json, tokenizer files) are carried over as hard
// links, while the old checkpoint's own files that the new one lacks (a model.safetensors, shards
// of another count) go with the old checkpoint, as the returned note says.
Stats save_checkpoint(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options = {});

// The outcome of checking the stored checksums of a checkpoint against its bytes on disk.
struct VerifyResult {
  bool has_checksums = false;
  std::uint64_t tensors_checked = 0;
  std::uint64_t headers_checked = 0;     // files whose header carries its own checksum (hbmio writes one)
  std::optional<std::string> first_bad;  // "tensor T in FILE starting at byte OFFSET: stored X, computed Y",
                                         // or "header of FILE ...": the first problem found
};
VerifyResult verify_checkpoint(const std::string& path);

// Rewrites every file of a checkpoint (a file, a sharded index, or a directory holding either)
// with checksums added, one file at a time, each crash-safe as save_checkpoint and keeping the
// file's mode, owner and group. The data is copied in pieces through the descriptor its header was
// read from (no mapping: a file truncated meanwhile is an Error EIO "the file changed while being
// read", not a SIGBUS), so memory use does not grow with the file's size. A rewrite holds the
// file's lock (flock): two rewrites of the same file, in any processes, take turns, and a save of
// that name waits to publish. A file whose stored checksums all match its
// bytes is left as it is. A file whose stored checksums do not match is refused (Error EBADMSG
// naming the tensor), since new checksums would certify damaged data, unless `force`. A file with
// more than one hard link is refused (the rewrite would give only this name the new file).
// `cancel`: as SaveOptions::cancel; files already rewritten keep their checksums.
struct AddChecksumsResult {
  std::uint64_t files_rewritten = 0;
  std::uint64_t files_already_valid = 0;  // checksums present and matching: not rewritten
};
AddChecksumsResult add_checksums(const std::string& path, bool force = false, const std::atomic<bool>* cancel = nullptr);

// XXH3-64 of host memory, as hex (16 digits): the checksum format stored in files.
std::string xxh3_hex(const std::byte* data, std::size_t size);
inline constexpr const char* kChecksumPrefix = "hbmio.xxh3.";

}  // namespace hbmio
