// The resident cache's server (hbmio/cache.hpp, protocol.hpp).
//
// One thread serves every connection (poll), each request answered at once: a lookup is a map
// search and an fstat. Taking a file in (reading it into a memfd) and a copy into a client's GPU
// memory run on the shared executor, so a slow disk never holds up the answers and the GPUs of a
// node are fed at once, each by its own DMA (copies to one GPU take turns: they share its link). Each cached file is a memfd, filled, then sealed
// against writes, growing and shrinking: a client receives that descriptor and maps it, and no one
// can change the bytes after that, which is what lets a client use them without a copy. Evicting
// an entry closes the server's descriptor; a client that still maps it keeps those pages until it
// unmaps them (the kernel counts them), and a client that dies frees them by dying.
#include "hbmio/cache.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "cache/protocol.hpp"
#include "core/executor.hpp"
#include "memory/cuda_runtime.hpp"
#include "hbmio/error.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"

namespace hbmio {

using cache_detail::OwnedFd;
using detail::Executor;
using detail::Pending;
using Clock = std::chrono::steady_clock;

namespace {

// What makes a cached copy the same file: inode and device, and the size and times that any
// write or replacement changes (st_ctime also moves on chmod or a new link: a spurious miss, never
// a stale hit).
// And the mount it is on (statx's unique mount id, Linux 6.8+; before that, the mount id, which a
// later mount may reuse): a file system unmounted frees its device number, and another mount (a
// FUSE one, which says what inode, size and times it likes) could take it and pose as a file
// cached for someone else.
struct Identity {
  std::uint64_t device = 0, inode = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  std::uint64_t mount = 0;
  bool operator==(const Identity&) const = default;
};

// Why a file must not be read in now: another process has it open for writing, so it may be in
// the middle of a write, whose times were set when it began (a copy read now could mix old and new
// bytes and still match the times after the read). Asked by taking a read lease, which the kernel
// refuses (EAGAIN) while anyone has the file open for writing, and giving it back at once; on a
// description of the server's own (a lease belongs to the open file description, and the client's
// is shared with it). "" when no one does, or when it cannot be asked here (a file the server does
// not own, without CAP_LEASE; a file system without leases): the check after the read is all there
// is then.
std::string open_for_writing(int source) {
  const OwnedFd own(::open(fmt::format("/proc/self/fd/{}", source).c_str(), O_RDONLY | O_CLOEXEC));
  if (own.get() < 0) return "";
  // Were a writer to open the file within the lease's microseconds, the break would signal the
  // server: SIGURG (ignored unless handled), not SIGIO (which ends a process).
  ::fcntl(own.get(), F_SETSIG, SIGURG);
  if (::fcntl(own.get(), F_SETLEASE, F_RDLCK) == 0) {
    ::fcntl(own.get(), F_SETLEASE, F_UNLCK);
    return "";
  }
  return errno == EAGAIN ? "another process has it open for writing (it may be in the middle of a write): not read in" : "";
}

#ifndef STATX_MNT_ID
#define STATX_MNT_ID 0x00001000U
#endif
#ifndef STATX_MNT_ID_UNIQUE
#define STATX_MNT_ID_UNIQUE 0x00004000U
#endif

// The mount `fd`'s file is on (see Identity), tagged by kind (bit 63: the unique id); 0 where the
// kernel says neither.
std::uint64_t mount_of(int fd) {
  struct statx stx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID | STATX_MNT_ID_UNIQUE, &stx) != 0) return 0;
  if (stx.stx_mask & STATX_MNT_ID_UNIQUE) return stx.stx_mnt_id | (1ull << 63);
  if (stx.stx_mask & STATX_MNT_ID) return stx.stx_mnt_id;
  return 0;
}

Identity identity_of(int fd, const struct stat& st) {
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino), static_cast<std::uint64_t>(st.st_size),
          st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec, st.st_ctim.tv_sec * 1'000'000'000LL + st.st_ctim.tv_nsec,
          mount_of(fd)};
}

// The path the kernel knows for a descriptor ("" where /proc is missing).
std::string path_of(int fd) {
  std::error_code ec;
  const auto target = std::filesystem::read_symlink(fmt::format("/proc/self/fd/{}", fd), ec);
  return ec ? std::string() : target.string();
}

// Files are read into the memfd in pieces of this size, on up to kFillThreads threads.
constexpr std::uint64_t kFillPiece = std::uint64_t{16} << 20;
constexpr unsigned kFillThreads = 8;
// A reply the client has not taken whole by then is given up with its connection: a client that
// reads slowly never holds the serving thread (nor a pool thread) longer.
constexpr auto kReplyTime = std::chrono::seconds(2);

// A held file's sealed memfd mapped read-only and page-locked, so that a GPU can DMA from it
// (the "copy" request): where the machine has a GPU, made once when the file is taken in.
class PinnedMapping {
 public:
  PinnedMapping() = default;
  // The mapping, or an empty one with `why` set (no GPU, or the registration failed).
  static PinnedMapping of(int fd, std::uint64_t size, const std::string& path, std::string& why) {
    PinnedMapping out;
    if (size == 0 || !cuda::available()) {
      why = size == 0 ? "an empty file" : "no GPU here";
      return out;
    }
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (map == MAP_FAILED) {
      why = fmt::format("mmap: {}", std::strerror(errno));
      return out;
    }
    try {
      cuda::register_host_read_only(map, size, {.op = "pin the cached copy", .path = path});
    } catch (const std::exception& e) {
      ::munmap(map, size);
      why = e.what();
      return out;
    }
    out.data_ = static_cast<std::byte*>(map);
    out.size_ = size;
    return out;
  }
  ~PinnedMapping() { reset(); }
  PinnedMapping(PinnedMapping&& other) noexcept : data_(std::exchange(other.data_, nullptr)), size_(other.size_) {}
  PinnedMapping& operator=(PinnedMapping&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = other.size_;
    }
    return *this;
  }
  const std::byte* data() const noexcept { return data_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  void reset() noexcept {
    if (!data_) return;
    cuda::unregister_host(data_);
    ::munmap(data_, size_);
    data_ = nullptr;
  }
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};


}  // namespace

struct CacheServer::State {
  struct Entry {
    Identity identity;
    std::string path;
    OwnedFd memory;  // the sealed memfd (while adding: being filled)
    std::uint32_t owner = 0;
    bool ready = false;
    // Evicted or replaced while being added: its fill stops at its next piece and drops it.
    std::atomic<bool> abandoned{false};
    std::uint64_t hits = 0;
    Clock::time_point last_use;
    PinnedMapping pinned;  // for the GPU's DMA, where there is a GPU
    std::string unpinned;  // why not, where it is not
    // The device tier: a copy of the file in a GPU's memory, per device of this process (shared:
    // a copy running from it keeps it while it is evicted). `gpus_wanted`: asked for while the
    // file was still being taken in; `gpus_placing`: being copied there; `gpus_refused`: why not.
    std::map<int, std::shared_ptr<Buffer>> on_gpu;
    std::set<int> gpus_wanted, gpus_placing;
    std::map<int, std::string> gpus_refused;
    // Per device, the clients' shares of its copy there ("share" requests whose connections are
    // still open): a shared copy is never evicted, since a client reads it in place.
    std::map<int, unsigned> shared;
    // Per device, the users who were given its copy there to map: CUDA IPC maps it writable, so
    // after that only the same user gets it (shared or device to device); others get the sealed
    // host copy. Forgotten with the copy.
    std::map<int, std::set<std::uint32_t>> shared_by;
    // Per device, the users whose "copy" requests are reading its copy there right now (device to
    // device). Another user is not given that copy to map until they are done: the mapping is
    // writable, and a write landing during their DMA would hand them bytes that are not the file's.
    std::map<int, std::multiset<std::uint32_t>> reading;
    // Whether `uid` may take its copy on `device`: none but `uid` shared it.
    bool gpu_copy_is_for(int device, std::uint32_t uid) const {
      const auto it = shared_by.find(device);
      return it == shared_by.end() || std::all_of(it->second.begin(), it->second.end(), [uid](std::uint32_t u) { return u == uid; });
    }
    // Whether a user other than `uid` is copying from its copy on `device` now.
    bool read_by_others(int device, std::uint32_t uid) const {
      const auto it = reading.find(device);
      return it != reading.end() && std::any_of(it->second.begin(), it->second.end(), [uid](std::uint32_t u) { return u != uid; });
    }
  };
  // A client's share of a device copy: held (with the client's connection) until it closes.
  struct Share {
    std::weak_ptr<Entry> entry;
    int device = 0;
    std::shared_ptr<Buffer> copy;
  };
  using Key = std::pair<std::uint64_t, std::uint64_t>;  // device, inode

  CacheServerOptions options;
  OwnedFd listener;
  Clock::time_point started = Clock::now();
  mutable std::mutex mutex;
  std::map<Key, std::shared_ptr<Entry>> entries;
  std::list<Pending<void>> fills;
  std::uint64_t bytes = 0, hits = 0, misses = 0, adds = 0, evictions = 0, stale = 0, refused = 0, clients = 0, served_clients = 0;
  std::uint64_t shares = 0;  // held by clients now, of held and retired copies alike
  std::map<int, std::uint64_t> gpu_bytes;  // per device: held, being placed, or retired and still in use
  // Device copies no entry holds any more (evicted, or their file dropped) that a share or a
  // running copy still uses: counted in gpu_bytes until the last user lets go (sweep_retired).
  struct Retired {
    int device = 0;
    std::uint64_t size = 0;
    std::shared_ptr<Buffer> copy;
  };
  std::vector<Retired> retired;

  // Lets go of an entry's device copy (under the mutex): freed now, or retired while in use.
  void release_copy(int device, std::shared_ptr<Buffer> copy, std::uint64_t size) {
    if (copy.use_count() > 1) retired.push_back({device, size, std::move(copy)});
    else gpu_bytes[device] -= size;
  }
  // Frees the retired copies nobody uses any more (under the mutex).
  void sweep_retired() {
    std::erase_if(retired, [this](Retired& r) {
      if (r.copy.use_count() > 1) return false;
      gpu_bytes[r.device] -= r.size;
      return true;
    });
  }
  // Gives back a closed connection's shares (under the mutex).
  void unshare(std::vector<Share>& given_back) {
    for (Share& share : given_back) {
      if (const std::shared_ptr<Entry> entry = share.entry.lock()) {
        const auto it = entry->shared.find(share.device);
        if (it != entry->shared.end() && --it->second == 0) entry->shared.erase(it);
      }
      share.copy.reset();
      --shares;
    }
    given_back.clear();
    sweep_retired();
  }

  // Drops `key`'s entry (under the mutex); an entry still being added is abandoned by its fill.
  void drop(const Key& key) {
    const auto it = entries.find(key);
    if (it == entries.end()) return;
    bytes -= it->second->identity.size;
    for (auto& [device, copy] : it->second->on_gpu) release_copy(device, std::move(copy), it->second->identity.size);
    it->second->on_gpu.clear();
    it->second->abandoned = true;
    entries.erase(it);
  }

  // Starts copying a ready entry to `device`'s memory (under the mutex), unless it is there, on its
  // way, or was refused there.
  void place_on_gpu(const std::shared_ptr<Entry>& entry, int device) {
    if (entry->on_gpu.contains(device) || entry->gpus_placing.contains(device)) return;
    entry->gpus_refused.erase(device);
    const std::uint64_t size = entry->identity.size;
    std::string why;
    if (options.gpu_bytes == 0) why = "the server has no device tier (hbmio cache serve --gpu-memory)";
    else if (!entry->pinned) why = "its host copy is not pinned: " + entry->unpinned;
    else if (size > options.gpu_bytes) why = fmt::format("larger than the device tier ({})", format_size(options.gpu_bytes));
    // Copies still being placed cannot be evicted: where they leave no room, none is evicted for nothing.
    std::uint64_t placing = 0;
    for (const auto& [key, e] : entries) placing += e->gpus_placing.contains(device) ? e->identity.size : 0;
    if (why.empty() && placing + size > options.gpu_bytes) why = "the device tier is taken by copies still being placed";
    // Least recently used copies on that GPU go first; copies in use (shared, or being copied
    // from) stay, and where evicting every other one would not make room, none is evicted.
    std::uint64_t evictable = 0;
    for (const auto& [key, e] : entries)
      if (const auto copy = e->on_gpu.find(device); copy != e->on_gpu.end() && !e->shared.contains(device) && copy->second.use_count() == 1)
        evictable += e->identity.size;
    if (why.empty() && gpu_bytes[device] - std::min(gpu_bytes[device], evictable) + size > options.gpu_bytes)
      why = "the device tier is taken by copies shared with clients or still being placed";
    while (why.empty() && gpu_bytes[device] + size > options.gpu_bytes) {
      std::shared_ptr<Entry> oldest;
      for (const auto& [key, e] : entries)
        if (e->on_gpu.contains(device) && !e->shared.contains(device) && (!oldest || e->last_use < oldest->last_use)) oldest = e;
      if (!oldest) {
        why = "the device tier is taken by copies shared with clients or still being placed";
        break;
      }
      const auto copy = oldest->on_gpu.find(device);
      release_copy(device, std::move(copy->second), oldest->identity.size);
      oldest->on_gpu.erase(copy);
      oldest->shared_by.erase(device);
      ++evictions;
    }
    if (!why.empty()) {
      entry->gpus_refused[device] = why;
      return;
    }
    gpu_bytes[device] += size;
    entry->gpus_placing.insert(device);
    try {
      fills.push_back(Executor::shared().start([this, entry, device] { copy_to_gpu(entry, device); }));
    } catch (const std::exception& e) {
      gpu_bytes[device] -= size;
      entry->gpus_placing.erase(device);
      entry->gpus_refused[device] = e.what();
    }
  }

  // The pool's half of place_on_gpu: device memory, the pinned copy DMA'd into it.
  void copy_to_gpu(const std::shared_ptr<Entry>& entry, int device) noexcept {
    const std::uint64_t size = entry->identity.size;
    std::shared_ptr<Buffer> copy;
    std::string why;
    try {
      const ErrorContext context{.op = "cache: place on a GPU", .path = entry->path};
      cuda::DeviceGuard guard(device, context);
      // A whole number of 2 MiB: cudaMalloc may carve a smaller block out of a larger one, and a
      // CUDA IPC handle (share=True) then exports the whole block, other files' copies with it
      // (the CUDA programming guide's advice: share only allocations of a 2 MiB-aligned size).
      constexpr std::uint64_t kIpcGranule = 2ull << 20;
      const std::uint64_t allocated = (std::max<std::uint64_t>(size, 1) + kIpcGranule - 1) / kIpcGranule * kIpcGranule;
      copy = std::make_shared<Buffer>(Buffer::allocate({MemoryKind::device, device}, allocated));
      Lane& lane = lane_of(device, context);
      std::lock_guard turn(lane.mutex);
      if (size > 0) lane.stream.copy_async(copy->data(), entry->pinned.data(), size, context);
      lane.stream.synchronize(context);
    } catch (const std::exception& e) {
      copy.reset();
      why = e.what();
    }
    std::lock_guard lock(mutex);
    entry->gpus_placing.erase(device);
    if (entry->abandoned || !copy) {
      gpu_bytes[device] -= size;
      if (!copy) entry->gpus_refused[device] = why;
      return;
    }
    entry->on_gpu[device] = std::move(copy);
    entry->shared_by.erase(device);
  }

  // Makes room for `size` bytes owned by `owner` (under the mutex), evicting the least recently
  // used ready entries: the owner's own first where the quota is what is short. False when even
  // evicting every ready entry would not make room.
  bool make_room(std::uint64_t size, std::uint32_t owner, std::string& why) {
    const std::uint64_t user_limit = options.user_bytes ? options.user_bytes : options.host_bytes;
    const std::uint64_t user_files = options.user_files ? options.user_files : options.max_files;
    if (size > user_limit) {
      why = fmt::format("{} bytes is more than the cache holds for one user ({} bytes)", size, user_limit);
      return false;
    }
    const auto owned = [&] {
      std::uint64_t n = 0;
      for (const auto& [key, e] : entries) n += e->owner == owner ? e->identity.size : 0;
      return n;
    };
    const auto owned_files = [&] {
      return static_cast<std::uint64_t>(std::count_if(entries.begin(), entries.end(), [&](const auto& kv) { return kv.second->owner == owner; }));
    };
    const auto evict_oldest = [&](bool owners_only) {
      std::shared_ptr<Entry> oldest;
      Key oldest_key{};
      for (const auto& [key, e] : entries)
        if (e->ready && e->shared.empty() && (!owners_only || e->owner == owner) && (!oldest || e->last_use < oldest->last_use)) {
          oldest = e;
          oldest_key = key;
        }
      if (!oldest) return false;
      drop(oldest_key);
      ++evictions;
      return true;
    };
    while (owned() + size > user_limit || owned_files() + 1 > user_files)
      if (!evict_oldest(true)) {
        why = "the user's quota is taken by files still being added or shared";
        return false;
      }
    while (bytes + size > options.host_bytes || entries.size() + 1 > options.max_files)
      if (!evict_oldest(false)) {
        why = "the cache is taken by files still being added or shared";
        return false;
      }
    return true;
  }

  // Reads the file open as `source` into `entry`'s memfd, seals it, and marks it ready, unless
  // the file changed meanwhile or the entry was dropped.
  void fill(const std::shared_ptr<Entry>& entry, const Key& key, int source) noexcept {
    try {
      fill_or_throw(entry, key, source);
    } catch (...) {  // a pool job must not throw (reap_fills would rethrow it on the serving thread)
      std::lock_guard lock(mutex);
      if (!entry->abandoned.exchange(true)) {
        drop(key);
        ++refused;
      }
    }
  }
  void fill_or_throw(const std::shared_ptr<Entry>& entry, const Key& key, int source) {
    {
      std::lock_guard lock(mutex);
      if (entry->abandoned) return;
    }
    const std::uint64_t size = entry->identity.size;
    std::string why = open_for_writing(source);
    bool ok = why.empty();
    if (ok && size > 0) {
      void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, entry->memory.get(), 0);
      if (map == MAP_FAILED) {
        ok = false;
        why = fmt::format("mmap: {}", std::strerror(errno));
      } else {
        const std::size_t pieces = static_cast<std::size_t>((size + kFillPiece - 1) / kFillPiece);
        try {
          Executor::shared().run(pieces, kFillThreads, [&](std::size_t k) {
            if (entry->abandoned.load()) throw Error(errno_code(ECANCELED), {.op = "read", .path = entry->path}, "dropped while read in");
            const std::uint64_t at = k * kFillPiece, length = std::min(kFillPiece, size - at);
            std::uint64_t done = 0;
            while (done < length) {
              const ssize_t n = ::pread(source, static_cast<char*>(map) + at + done, length - done, static_cast<off_t>(at + done));
              if (n < 0 && errno == EINTR) continue;
              if (n <= 0) throw Error(errno_code(n < 0 ? errno : ENODATA), {.op = "read", .path = entry->path, .offset = at + done});
              done += static_cast<std::uint64_t>(n);
            }
          });
        } catch (const std::exception& e) {
          ok = false;
          why = e.what();
        }
        ::munmap(map, size);
      }
    }
    // Sealed, the bytes can no longer change, whoever holds the descriptor.
    if (ok && ::fcntl(entry->memory.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
      ok = false;
      why = fmt::format("seal: {}", std::strerror(errno));
    }
    struct stat after {};
    if (ok && (::fstat(source, &after) != 0 || !(identity_of(source, after) == entry->identity))) {
      ok = false;
      why = "the file changed while it was read";
    }
    // Pinned before it is served, so a GPU load's DMA never waits for it. Outside the lock: a
    // registration of gigabytes takes a while.
    PinnedMapping pinned;
    std::string unpinned;
    if (ok) pinned = PinnedMapping::of(entry->memory.get(), size, entry->path, unpinned);
    std::lock_guard lock(mutex);
    if (entry->abandoned) return;
    entry->pinned = std::move(pinned);
    entry->unpinned = std::move(unpinned);
    if (!ok) {
      fmt::print(stderr, "hbmio cache: {} not taken in: {}\n", entry->path, why);
      drop(key);
      ++refused;
      return;
    }
    entry->ready = true;
    entry->last_use = Clock::now();
    for (const int device : entry->gpus_wanted) place_on_gpu(entry, device);
    entry->gpus_wanted.clear();
  }

  // Whether `fd` is a descriptor a client may ask for; "" when it is, else why not.
  std::string refusal(int fd, const struct stat& st, const std::string& path) const {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0) return fmt::format("fcntl: {}", std::strerror(errno));
    // O_PATH opens need no read permission, and a write-only one none either: the bytes go only
    // to a client that proved it may read them.
    if ((flags & O_PATH) == O_PATH) return "the descriptor was opened with O_PATH, without read access";
    if ((flags & O_ACCMODE) == O_WRONLY) return "the descriptor was opened write-only";
    if (!S_ISREG(st.st_mode)) return "not a regular file";
    if (!options.allow.empty()) {
      const bool inside = std::any_of(options.allow.begin(), options.allow.end(), [&](const std::string& dir) {
        return !path.empty() && path.starts_with(dir) && (path.size() == dir.size() || path[dir.size()] == '/' || dir.ends_with('/'));
      });
      if (!inside) return fmt::format("{} is outside the directories this cache serves", path.empty() ? "the file" : path);
      // The path is the client's view: in a mount namespace of its own (a container, `unshare -m`)
      // a file system mounted over a served directory has paths inside it. Served only where the
      // server, looking up that path itself, finds the same file.
      struct stat here {};
      if (::stat(path.c_str(), &here) != 0 || here.st_dev != st.st_dev || here.st_ino != st.st_ino)
        return fmt::format("{} is another file (or none) where this server looks: the client sees the file system through "
                           "mounts of its own, and only the served directories as the server sees them are cached", path);
    }
    return {};
  }

  // `served` keeps each hit's entry (and so its memfd's descriptor number) alive until the reply is
  // sent: a later file of the same request may evict it, and a descriptor closed meanwhile could
  // take the number of a new, unsealed memfd.
  nlohmann::json get(const nlohmann::json& request, std::vector<OwnedFd>& fds, std::uint32_t uid, std::vector<int>& reply_fds,
                     std::vector<std::shared_ptr<Entry>>& served) {
    const bool add = request.value("add", false);
    // `hbmio cache add --wait` asks again until its files are in: those asks are no load's.
    const bool counted = request.value("count", true);
    const bool place = request.value("place", true);  // false: only say how the GPU copies are doing
    // The device tier: the GPUs (PCI bus ids: processes number GPUs differently) the client wants
    // copies on, with this process's number of each (-1: no such GPU here).
    std::vector<std::pair<std::string, int>> gpus;
    for (const nlohmann::json& id : request.value("gpus", nlohmann::json::array())) {
      int device = -1;
      try {
        device = cuda::device_of_pci_bus_id(id.get<std::string>(), {.op = "cache add"});
      } catch (const std::exception&) {
      }
      gpus.push_back({id.get<std::string>(), device});
    }
    // Per GPU asked for: "held", "adding", or why not; wanted ones not started yet start here.
    const auto on_gpus = [&](const std::shared_ptr<Entry>& entry) {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& [id, device] : gpus) {
        if (device < 0) {
          out[id] = "no GPU with this PCI bus id on the server's machine";
          continue;
        }
        if (place && entry->ready) place_on_gpu(entry, device);
        else if (place) entry->gpus_wanted.insert(device);
        const auto refused_there = entry->gpus_refused.find(device);
        if (entry->on_gpu.contains(device)) out[id] = "held";
        else if (refused_there != entry->gpus_refused.end()) out[id] = refused_there->second;
        else if (entry->gpus_placing.contains(device) || entry->gpus_wanted.contains(device)) out[id] = "adding";
        else out[id] = "not there (evicted, or never asked for)";
      }
      return out;
    };
    nlohmann::json results = nlohmann::json::array();
    std::lock_guard lock(mutex);
    for (OwnedFd& fd : fds) {
      struct stat st {};
      if (::fstat(fd.get(), &st) != 0) {
        results.push_back({{"hit", false}, {"reason", fmt::format("fstat: {}", std::strerror(errno))}});
        ++refused;
        continue;
      }
      const std::string path = path_of(fd.get());
      if (std::string why = refusal(fd.get(), st, path); !why.empty()) {
        results.push_back({{"hit", false}, {"reason", why}});
        ++refused;
        continue;
      }
      const Identity id = identity_of(fd.get(), st);
      const Key key{id.device, id.inode};
      // An entry of the same path and another inode holds a version the name no longer leads to
      // (the file was replaced by rename): its memory goes back now rather than when evicted. Only
      // the same user's: another container's file may have the same path and be another file.
      for (auto it = entries.begin(); it != entries.end();) {
        const auto next = std::next(it);
        if (it->first != key && !path.empty() && it->second->path == path && it->second->owner == uid) {
          drop(it->first);
          ++stale;
        }
        it = next;
      }
      if (const auto it = entries.find(key); it != entries.end()) {
        Entry& e = *it->second;
        if (e.identity == id && e.ready) {
          e.hits += counted ? 1 : 0;
          hits += counted ? 1 : 0;
          e.last_use = Clock::now();
          reply_fds.push_back(e.memory.get());
          served.push_back(it->second);
          results.push_back({{"hit", true}, {"tier", "host"}, {"bytes", id.size}, {"gpus", on_gpus(it->second)}});
          continue;
        }
        if (e.identity == id) {
          misses += counted ? 1 : 0;
          results.push_back({{"hit", false}, {"reason", "being taken in"}, {"gpus", on_gpus(it->second)}});
          continue;
        }
        Identity through_this_mount = e.identity;
        through_this_mount.mount = id.mount;
        if (through_this_mount == id) {
          // The same file unchanged, seen through another mount: another mount namespace (a
          // container, `unshare -m`) sees the file system through mounts of its own. Not served (a
          // mount is part of the identity: see Identity), but not dropped either: the copy is still
          // the file for those who added it.
          misses += counted ? 1 : 0;
          results.push_back({{"hit", false}, {"reason", "held as seen through another mount (another mount namespace?)"}});
          continue;
        }
        drop(key);  // the file changed since: never served again
        ++stale;
      }
      misses += counted ? 1 : 0;
      if (!add) {
        results.push_back({{"hit", false}, {"reason", "not held"}});
        continue;
      }
      std::string why;
      if (!make_room(id.size, uid, why)) {
        ++refused;
        results.push_back({{"hit", false}, {"reason", "not taken in: " + why}});
        continue;
      }
      // (The name is for /proc's eyes only; memfd_create refuses one of more than 249 bytes, and a
      // file's name may have 255.)
      OwnedFd memory(::memfd_create(fmt::format("hbmio-cache:{}", std::filesystem::path(path).filename().string().substr(0, 200)).c_str(),
                                    MFD_CLOEXEC | MFD_ALLOW_SEALING));
      if (!memory || (id.size > 0 && ::ftruncate(memory.get(), static_cast<off_t>(id.size)) != 0)) {
        ++refused;
        results.push_back({{"hit", false}, {"reason", fmt::format("not taken in: memfd: {}", std::strerror(errno))}});
        continue;
      }
      auto entry = std::make_shared<Entry>();
      entry->identity = id;
      entry->path = path;
      entry->memory = std::move(memory);
      entry->owner = uid;
      entry->last_use = Clock::now();
      auto source = std::make_shared<OwnedFd>(std::move(fd));  // std::function (the executor's job) is copyable
      try {
        fills.push_back(Executor::shared().start([this, entry, key, source] { fill(entry, key, source->get()); }));
      } catch (const std::exception& e) {  // no thread for it: not taken in, and nothing held for it
        ++refused;
        results.push_back({{"hit", false}, {"reason", fmt::format("not taken in: {}", e.what())}});
        continue;
      }
      entries[key] = entry;
      bytes += id.size;
      ++adds;
      results.push_back({{"hit", false}, {"reason", "not held; taking it in"}, {"gpus", on_gpus(entry)}});
    }
    return {{"results", std::move(results)}};
  }

  // The "share" request: for each file, its copy in the GPU's memory as a CUDA IPC handle that the
  // client maps, reading the bytes in place (no copy). The copy stays (never evicted, freed only
  // once dropped and unshared) while the connection the request came on is open: the client keeps
  // it open as long as it uses the memory, and a client that dies closes it by dying.
  //   {"op": "share", "device": PCI bus id} + one descriptor per file
  //   -> {"results": [{"shared": true, "handle": hex, "offset": N, "bytes": N} | {"shared": false, "reason": "..."}]}
  nlohmann::json share(const nlohmann::json& request, std::vector<OwnedFd>& fds, std::uint32_t uid, std::vector<Share>& held) {
    const ErrorContext context{.op = "cache share", .path = options.socket};
    const std::string bus_id = request.at("device").get<std::string>();
    int device = -1;
    std::string no_device;
    if (options.gpu_bytes == 0) no_device = "the server has no device tier (hbmio cache serve --gpu-memory)";
    else try {
        device = cuda::device_of_pci_bus_id(bus_id, context);
      } catch (const std::exception& e) {
        no_device = e.what();
      }
    nlohmann::json results = nlohmann::json::array();
    std::lock_guard lock(mutex);
    for (OwnedFd& fd : fds) {
      const auto refuse = [&](std::string why) { results.push_back({{"shared", false}, {"reason", std::move(why)}}); };
      struct stat st {};
      if (::fstat(fd.get(), &st) != 0) {
        refuse(fmt::format("fstat: {}", std::strerror(errno)));
        continue;
      }
      const std::string path = path_of(fd.get());
      if (std::string why = refusal(fd.get(), st, path); !why.empty()) {
        ++refused;
        refuse(why);
        continue;
      }
      const Identity id = identity_of(fd.get(), st);
      const auto it = entries.find({id.device, id.inode});
      if (it == entries.end() || !(it->second->identity == id) || !it->second->ready) {
        ++misses;
        refuse(it == entries.end() ? "not held" : !(it->second->identity == id) ? "the file changed since it was taken in" : "being taken in");
        continue;
      }
      Entry& e = *it->second;
      const auto copy = device < 0 ? e.on_gpu.end() : e.on_gpu.find(device);
      if (copy == e.on_gpu.end()) {
        ++misses;
        refuse(!no_device.empty() ? no_device
                                  : fmt::format("held in host memory, not in the memory of GPU {} (hbmio cache add --gpu)", bus_id));
        continue;
      }
      if (!e.gpu_copy_is_for(device, uid)) {
        ++misses;
        refuse("its copy on that GPU was shared with another user, who may have written to it: only that user gets it");
        continue;
      }
      if (e.read_by_others(device, uid)) {
        ++misses;
        refuse("its copy on that GPU is being copied into another user's memory right now (a load reads the file instead)");
        continue;
      }
      cuda::IpcAllocation allocation;
      try {
        allocation = cuda::ipc_allocation_of(copy->second->data(), context);
      } catch (const std::exception& ex) {
        refuse(ex.what());
        continue;
      }
      // One share per copy and connection, however often it asks.
      if (std::none_of(held.begin(), held.end(), [&](const Share& s) { return s.copy == copy->second; })) {
        held.push_back({it->second, device, copy->second});
        ++e.shared[device];
        ++shares;
      }
      e.shared_by[device].insert(uid);
      ++e.hits;
      ++hits;
      e.last_use = Clock::now();
      results.push_back({{"shared", true},
                         {"handle", cache_detail::to_hex(allocation.handle)},
                         {"offset", reinterpret_cast<std::uintptr_t>(copy->second->data()) - allocation.base},
                         {"bytes", id.size}});
    }
    return {{"results", std::move(results)}};
  }

  // The "copy" request: bytes of held files DMA'd from their pinned copies into a client's GPU
  // memory, opened through CUDA IPC. On a pool thread (run() starts it), while the serving thread
  // answers others: clients on several GPUs are served at once, each GPU's copies on its own lane.
  //   {"op": "copy", "device": PCI bus id, "allocations": [{"handle": hex}],
  //    "copies": [[descriptor index, file offset, length, allocation index, offset in it]]}
  //   + one descriptor per file, as for "get"
  struct Lane {
    std::mutex mutex;  // held for a copy: one at a time per GPU
    cuda::Stream stream;
  };
  std::mutex lanes_mutex;
  std::map<int, std::unique_ptr<Lane>> lanes;  // per device, made at the first copy there
  Lane& lane_of(int device, const ErrorContext& context) {
    std::lock_guard lock(lanes_mutex);
    std::unique_ptr<Lane>& made = lanes[device];
    if (!made) {
      auto lane = std::make_unique<Lane>();
      lane->stream = cuda::Stream(device, context);
      made = std::move(lane);
    }
    return *made;
  }
  nlohmann::json copy(const nlohmann::json& request, std::vector<OwnedFd>& fds, std::uint32_t uid) {
    const ErrorContext context{.op = "cache copy", .path = options.socket};
    std::vector<std::shared_ptr<Entry>> held;
    const int device = cuda::device_of_pci_bus_id(request.at("device").get<std::string>(), context);
    std::vector<std::shared_ptr<Buffer>> on_gpu;  // per held file, its copy in that GPU's memory, if any
    // The device copies read below are marked as being read by `uid` from the moment they are
    // chosen, under the same lock as the choice, until the copies are done (or failed): no other
    // user can be given one of them to map (and write) in between (share).
    struct Reading {
      State& state;
      int device;
      std::uint32_t uid;
      std::vector<std::shared_ptr<Entry>> entries;
      ~Reading() {
        if (entries.empty()) return;
        std::lock_guard lock(state.mutex);
        for (const auto& e : entries) {
          auto& readers = e->reading[device];
          readers.erase(readers.find(uid));
          if (readers.empty()) e->reading.erase(device);
        }
      }
    } reading{*this, device, uid, {}};
    reading.entries.reserve(fds.size());  // (a mark made is always recorded: push_back cannot throw)
    {
      std::lock_guard lock(mutex);
      for (OwnedFd& fd : fds) {
        struct stat st {};
        if (::fstat(fd.get(), &st) != 0) return {{"error", fmt::format("fstat: {}", std::strerror(errno))}};
        const std::string path = path_of(fd.get());
        if (std::string why = refusal(fd.get(), st, path); !why.empty()) {
          ++refused;
          return {{"error", why}};
        }
        const Identity id = identity_of(fd.get(), st);
        const auto it = entries.find({id.device, id.inode});
        if (it == entries.end() || !(it->second->identity == id) || !it->second->ready) return {{"error", path + " is not held (or changed)"}};
        if (!it->second->pinned) return {{"error", fmt::format("{} is held but not pinned: {}", path, it->second->unpinned)}};
        held.push_back(it->second);
        const auto copy = it->second->on_gpu.find(device);
        // A copy another user was given to map is not copied from: the sealed host copy is.
        on_gpu.push_back(copy == it->second->on_gpu.end() || !it->second->gpu_copy_is_for(device, uid) ? nullptr : copy->second);
        if (on_gpu.back()) {
          it->second->reading[device].insert(uid);
          reading.entries.push_back(it->second);
        }
        it->second->last_use = Clock::now();
      }
    }
    // A client that gave up waiting reads its files itself and may reuse its memory: a request
    // that comes too late is refused, never carried out into memory that is no longer the load's.
    // Checked here and again right before the copies start (after the IPC handles are open and
    // the GPU's lane is this request's: other copies and placements may hold it for a while).
    // (CLOCK_MONOTONIC is one clock for every process of the machine.)
    const std::int64_t not_after = request.value("not_after_ns", std::int64_t{0});
    const auto too_late = [not_after] {
      if (not_after <= 0) return false;
      timespec now{};
      ::clock_gettime(CLOCK_MONOTONIC, &now);
      return now.tv_sec * 1'000'000'000LL + now.tv_nsec > not_after;
    };
    if (too_late()) return {{"error", "the request came after its deadline"}};
    std::uint64_t held_bytes = 0;
    for (const auto& e : held) held_bytes += e->identity.size;
    struct Opened {
      void* base = nullptr;
      std::size_t size = 0;
      ~Opened() { cuda::ipc_close(base); }
    };
    std::vector<std::unique_ptr<Opened>> allocations;
    const auto opening = std::chrono::steady_clock::now();
    for (const nlohmann::json& a : request.at("allocations")) {
      auto opened = std::make_unique<Opened>();
      opened->base = cuda::ipc_open(cache_detail::from_hex(a.at("handle").get<std::string>()), device, context);
      opened->size = cuda::device_allocation_size(opened->base, context);
      allocations.push_back(std::move(opened));
    }
    const double open_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - opening).count();
    // A client's numbers are checked, never trusted, all of them before the first copy: a copy
    // past either end refuses the request whole, and so does one that asks for more than twice
    // the bytes of its files (a load reads each byte once).
    struct Copy {
      std::byte* to;
      const std::byte* from;
      std::uint64_t length;
    };
    std::vector<Copy> copies;
    std::uint64_t asked = 0, from_gpu = 0;
    std::set<std::size_t> files_on_gpu;
    for (const nlohmann::json& c : request.at("copies")) {
      const auto file = c.at(0).get<std::size_t>(), allocation = c.at(3).get<std::size_t>();
      const auto offset = c.at(1).get<std::uint64_t>(), length = c.at(2).get<std::uint64_t>(), at = c.at(4).get<std::uint64_t>();
      if (file >= held.size() || allocation >= allocations.size() || offset > held[file]->identity.size ||
          length > held[file]->identity.size - offset || at > allocations[allocation]->size || length > allocations[allocation]->size - at)
        throw Error(errno_code(EINVAL), context, "a copy outside its file or its allocation");
      asked += length;
      if (asked > 2 * held_bytes) throw Error(errno_code(EINVAL), context, "more bytes than twice its files hold");
      // From the copy in that GPU's memory where there is one (device to device), else the pinned one.
      const std::byte* from = on_gpu[file] ? on_gpu[file]->data() + offset : held[file]->pinned.data() + offset;
      if (on_gpu[file]) {
        from_gpu += length;
        files_on_gpu.insert(file);
      }
      copies.push_back({static_cast<std::byte*>(allocations[allocation]->base) + at, from, length});
    }
    cuda::DeviceGuard guard(device, context);
    Lane* lane = &lane_of(device, context);
    std::lock_guard turn(lane->mutex);
    if (too_late()) return {{"error", "the request's deadline passed while it waited for the GPU's lane"}};
    const auto copying = std::chrono::steady_clock::now();
    // One stream: a copy into memory the client has just allocated runs at the pinned rate measured
    // the same way, whatever the number of streams (bench/RESULTS.md, "Restarts from the node's
    // resident cache", host_copy_probe and the fresh-destination ceiling).
    try {
      for (const Copy& c : copies) lane->stream.copy_async(c.to, c.from, c.length, context);
      lane->stream.synchronize(context);
    } catch (...) {
      lane->stream.synchronize_noexcept();  // nothing in flight when the handles close
      throw;
    }
    const double copy_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - copying).count();
    return {{"ok", true},       {"bytes", asked}, {"gpu_bytes", from_gpu}, {"files_on_gpu", files_on_gpu}, {"open_seconds", open_seconds},
            {"copy_seconds", copy_seconds}};
  }

  // Forgets fills that are done (their results are in their entries).
  void reap_fills() {
    for (auto it = fills.begin(); it != fills.end();)
      it = it->wait_for(std::chrono::milliseconds(0)) ? (it->get(), fills.erase(it)) : std::next(it);
  }
};

CacheServer::CacheServer(CacheServerOptions options) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.options = std::move(options);
  const ErrorContext context{.op = "cache serve", .path = s.options.socket};
  if (s.options.host_bytes == 0) throw Error(errno_code(EINVAL), context, "the host tier needs a size (host_bytes > 0)");
  if (s.options.max_files == 0) {
    // Each held file is a memfd of the server's; connections and the descriptors of requests in
    // flight need the rest. A server may raise its own soft limit up to the hard one.
    rlimit files{};
    if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
      if (files.rlim_cur < files.rlim_max) {
        rlimit raised = files;
        raised.rlim_cur = files.rlim_max == RLIM_INFINITY ? std::max<rlim_t>(files.rlim_cur, 1 << 20) : files.rlim_max;
        if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) files = raised;
      }
      s.options.max_files = std::max<std::uint64_t>(16, static_cast<std::uint64_t>(files.rlim_cur) / 2);
    } else {
      s.options.max_files = 512;
    }
  }
  if (s.options.gpu_bytes > 0 && cuda_device_count() == 0)
    throw Error(errno_code(ENODEV), context, fmt::format("a device tier (gpu_bytes) needs a GPU: {}", cuda_unavailable_reason()));
  for (std::string& dir : s.options.allow) {
    std::error_code ec;
    const auto canonical = std::filesystem::canonical(dir, ec);
    if (ec) throw Error(errno_code(ec.value()), {.op = "cache serve", .path = dir}, "a directory to serve");
    dir = canonical.string();
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (s.options.socket.empty() || s.options.socket.size() >= sizeof address.sun_path)
    throw Error(errno_code(ENAMETOOLONG), context, fmt::format("a socket path must have 1 to {} bytes", sizeof address.sun_path - 1));
  std::memcpy(address.sun_path, s.options.socket.data(), s.options.socket.size());
  // A socket file no server answers is a leftover of one that died: replace it. One that answers
  // belongs to a running server: never take its place.
  struct stat existing {};
  if (::lstat(s.options.socket.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) throw Error(errno_code(EEXIST), context, "a file that is not a socket is in the way");
    try {
      cache_detail::connect_to(s.options.socket, 1000);
      throw Error(errno_code(EADDRINUSE), context, "another cache server answers there");
    } catch (const Error& e) {
      if (e.code() == errno_code(EADDRINUSE)) throw;
    }
    ::unlink(s.options.socket.c_str());
  }
  s.listener = OwnedFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s.listener) throw Error(errno_code(errno), context, "socket");
  // Made with the mode asked for from the start (umask), not chmod-ed after: no window in which
  // anyone else could connect.
  const mode_t previous = ::umask(static_cast<mode_t>(~s.options.socket_mode & 0777));
  const int bound = ::bind(s.listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address);
  const int bind_errno = errno;
  ::umask(previous);
  if (bound != 0) throw Error(errno_code(bind_errno), context, "bind");
  if (::listen(s.listener.get(), 64) != 0) throw Error(errno_code(errno), context, "listen");
}

CacheServer::~CacheServer() {
  if (!state_) return;
  {
    std::lock_guard lock(state_->mutex);
    for (auto& [key, e] : state_->entries) e->abandoned = true;
  }
  for (Pending<void>& fill : state_->fills) fill.wait();
  ::unlink(state_->options.socket.c_str());
}

void CacheServer::run(const std::atomic<bool>& stop) {
  State& s = *state_;
  struct Client {
    OwnedFd socket;
    std::uint32_t uid = 0;
    // A copy being served on the pool: the connection is not read until it has replied. False
    // when the reply could not be sent (the connection is then closed).
    std::optional<detail::Pending<bool>> copying;
    // Device copies this client shares (the "share" request): given back when it disconnects.
    std::vector<State::Share> shares;
  };
  std::list<Client> clients;
  const auto drop = [&](std::list<Client>::iterator c) {
    std::vector<State::Share> shares = std::move(c->shares);
    clients.erase(c);
    std::lock_guard lock(s.mutex);
    --s.clients;
    s.unshare(shares);
  };
  while (!stop.load()) {
    // Copies that have replied give their connections back.
    for (auto c = clients.begin(); c != clients.end();) {
      auto current = c++;
      if (!current->copying || !current->copying->wait_for(std::chrono::milliseconds(0))) continue;
      const bool replied = current->copying->get();
      current->copying.reset();
      if (!replied) drop(current);
    }
    std::vector<pollfd> polled{{s.listener.get(), POLLIN, 0}};
    std::vector<std::list<Client>::iterator> polled_client{clients.end()};
    for (auto c = clients.begin(); c != clients.end(); ++c)
      if (!c->copying) {
        polled.push_back({c->socket.get(), POLLIN, 0});
        polled_client.push_back(c);
      }
    // While copies run, come back soon to give their connections back.
    const bool busy = std::any_of(clients.begin(), clients.end(), [](const Client& c) { return c.copying.has_value(); });
    const int ready = ::poll(polled.data(), polled.size(), busy ? 1 : 100);
    {
      std::lock_guard lock(s.mutex);
      s.reap_fills();
      s.sweep_retired();  // copies a finished copy request was the last user of
    }
    if (ready < 0 && errno != EINTR) throw Error(errno_code(errno), {.op = "cache serve", .path = s.options.socket}, "poll");
    if (ready <= 0) continue;
    if (polled[0].revents & POLLIN) {
      OwnedFd accepted(::accept4(s.listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      // Out of descriptors: the connection waits in the backlog; not a busy loop meanwhile.
      if (!accepted && (errno == EMFILE || errno == ENFILE)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ucred credentials{};
      if (accepted) {
        socklen_t length = sizeof credentials;
        // Without the peer's credentials nothing can be checked (and a zeroed uid would be root's).
        if (::getsockopt(accepted.get(), SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0 || length != sizeof credentials)
          accepted = OwnedFd();
      }
      if (accepted) {
        // A client stalled mid-frame holds the one serving thread at most this long.
        const timeval timeout{.tv_sec = 2, .tv_usec = 0};
        ::setsockopt(accepted.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
        ::setsockopt(accepted.get(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
        clients.push_back({std::move(accepted), credentials.uid});
        std::lock_guard lock(s.mutex);
        ++s.clients;
        ++s.served_clients;
      }
    }
    for (std::size_t k = 1; k < polled.size(); ++k) {
      const auto current = polled_client[k];
      if (!(polled[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      bool keep = true;
      try {
        // A whole request within 2 s (each read waits at most that long, and the frame as a whole
        // too): a client that trickles bytes holds the serving thread no longer than about 4 s.
        std::optional<cache_detail::Message> request =
            cache_detail::receive_message(current->socket.get(), s.options.socket, Clock::now() + std::chrono::seconds(2));
        if (!request) {
          keep = false;
        } else {
          nlohmann::json reply;
          std::vector<int> reply_fds;
          std::vector<std::shared_ptr<State::Entry>> served;
          const std::string op = request->body.is_object() ? request->body.value("op", "") : "";
          if (op == "get") {
            reply = s.get(request->body, request->descriptors, current->uid, reply_fds, served);
          } else if (op == "copy") {
            // Served on the pool; it sends the reply itself.
            current->copying.emplace(detail::Executor::shared().start(
                [&s, socket = current->socket.get(), uid = current->uid, body = std::move(request->body),
                 descriptors = std::make_shared<std::vector<OwnedFd>>(std::move(request->descriptors))]() mutable noexcept {
                  nlohmann::json answer;
                  try {
                    answer = s.copy(body, *descriptors, uid);
                  } catch (const std::exception& e) {  // the client reads the files instead
                    answer = {{"error", e.what()}};
                  }
                  try {
                    cache_detail::send_message(socket, answer, {}, s.options.socket, std::chrono::steady_clock::now() + kReplyTime);
                    return true;
                  } catch (...) {
                    return false;
                  }
                }));
            continue;
          } else if (op == "share") {
            reply = s.share(request->body, request->descriptors, current->uid, current->shares);
          } else if (op == "status") {
            reply = cache_detail::to_json(status());
          } else {
            reply = {{"error", fmt::format("unknown request '{}'", op)}};
          }
          cache_detail::send_message(current->socket.get(), reply, reply_fds, s.options.socket, std::chrono::steady_clock::now() + kReplyTime);
        }
      } catch (const std::exception& e) {
        keep = false;  // a client that breaks the protocol or goes away loses its connection only
      }
      if (!keep) drop(current);
    }
  }
  for (Client& c : clients)
    if (c.copying) c.copying->wait();  // no copy outlives the server's state
  std::lock_guard lock(s.mutex);
  for (Client& c : clients) s.unshare(c.shares);
}

CacheStatus CacheServer::status() const {
  const State& s = *state_;
  std::lock_guard lock(s.mutex);
  CacheStatus out{.socket = s.options.socket,
                  .host_bytes_limit = s.options.host_bytes,
                  .user_bytes_limit = s.options.user_bytes ? s.options.user_bytes : s.options.host_bytes,
                  .files_limit = s.options.max_files,
                  .user_files_limit = s.options.user_files ? s.options.user_files : s.options.max_files,
                  .host_bytes = s.bytes,
                  .gpu_bytes_limit = s.options.gpu_bytes,
                  .hits = s.hits,
                  .misses = s.misses,
                  .adds = s.adds,
                  .evictions = s.evictions,
                  .stale = s.stale,
                  .refused = s.refused,
                  .clients = s.clients,
                  .served_clients = s.served_clients,
                  .uptime_seconds = std::chrono::duration<double>(Clock::now() - s.started).count()};
  out.shares = s.shares;
  for (const auto& [device, bytes] : s.gpu_bytes) out.gpu_bytes += bytes;
  const auto now = Clock::now();
  for (const auto& [key, e] : s.entries) {
    std::vector<std::string> gpus;
    for (const auto& [device, copy] : e->on_gpu) gpus.push_back(cuda::pci_bus_id_of(device, {.op = "cache status"}));
    std::uint64_t shares = 0;
    for (const auto& [device, n] : e->shared) shares += n;
    out.entries.push_back({.path = e->path,
                           .bytes = e->identity.size,
                           .tier = "host",
                           .state = e->ready ? "ready" : "adding",
                           .pinned = static_cast<bool>(e->pinned),
                           .owner = e->owner,
                           .hits = e->hits,
                           .idle_seconds = std::chrono::duration<double>(now - e->last_use).count(),
                           .gpus = std::move(gpus),
                           .shares = shares});
  }
  std::sort(out.entries.begin(), out.entries.end(), [](const auto& a, const auto& b) { return a.idle_seconds < b.idle_seconds; });
  return out;
}

}  // namespace hbmio
