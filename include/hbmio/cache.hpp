// The node-local resident cache: a long-lived process (`hbmio cache serve`) holds whole checkpoint
// files in shared memory, so that the next process on the node that loads one gets its bytes
// without reading the file again. Loads find the server through one setting (HBMIO_CACHE: the
// path of its Unix socket; off unless set, LoadOptions::cache) and take a file from it only when
// the server holds the same file: the same device and inode, size, modification and change times,
// checked on every load; anything else is read from the file as before. A cache that cannot be
// reached, is out of memory or refuses a file means a plain load and a warning, never an error.
//
// Who may get what: a client names a file by sending a descriptor it opened itself (never a path),
// so it can only receive the bytes of files it could read; descriptors opened without read access
// (O_PATH, write-only) are refused. The socket's file mode (0600 by default) decides which users
// may talk to the server at all. See docs/cache.md.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hbmio {

// Whether a load asks the resident cache. `configured`: HBMIO_CACHE names the socket (use, or add
// with HBMIO_CACHE_ADD=1); unset, off.
enum class CacheUse {
  configured,
  off,
  use,  // take files the cache holds; read the others
  add,  // as use, and ask the server to take in the files it did not hold (read by the server,
        // in the background, after the reply)
};

struct CacheServerOptions {
  std::string socket;              // path of the Unix socket to listen on (made here; an existing one
                                   // that no server answers is replaced)
  std::uint64_t host_bytes = 0;    // shared host memory the cache may hold, in bytes (> 0)
  std::uint64_t user_bytes = 0;    // of which the files one user added may hold; 0: host_bytes
  // Directories whose files may be cached (a file's path at the time it is added, resolved by the
  // kernel from the client's descriptor); empty: any file a client could open.
  std::vector<std::string> allow;
  unsigned socket_mode = 0600;     // who may connect: 0600 the server's user, 0666 everyone
  // The device tier: GPU memory the cache may hold on each GPU of the server's machine, in bytes;
  // 0: none. Files are copied there when a client asks (cache_add's `gpus`), least recently used
  // copies evicted first; a load into that GPU then gets a device-to-device copy. Needs a GPU.
  std::uint64_t gpu_bytes = 0;
  // Files the cache holds at most (each holds a descriptor of the server's: without a bound, many
  // small files would take the descriptors connections need); 0: half the server's descriptor
  // limit (raised to its hard limit at start). `user_files`: of which one user's; 0: all of them.
  std::uint64_t max_files = 0;
  std::uint64_t user_files = 0;
};

// One cached file, as status reports it.
struct CacheEntryStatus {
  std::string path;           // the file's path when it was added
  std::uint64_t bytes = 0;
  std::string tier;           // "host"
  std::string state;          // "ready" or "adding"
  bool pinned = false;        // page-locked, so that GPU loads get it by DMA (only where the server has a GPU)
  std::uint32_t owner = 0;    // the uid of the client that added it
  std::uint64_t hits = 0;
  double idle_seconds = 0;    // since it was last served (or added)
  std::vector<std::string> gpus;  // PCI bus ids of the GPUs holding a copy (the device tier)
  std::uint64_t shares = 0;       // clients' shares of those copies now (LoadOptions::share)
};

struct CacheStatus {
  std::string socket;
  std::uint64_t host_bytes_limit = 0, user_bytes_limit = 0;
  std::uint64_t files_limit = 0, user_files_limit = 0;  // CacheServerOptions::max_files, user_files as in force
  std::uint64_t host_bytes = 0;  // held by the entries now (those being added included)
  std::uint64_t gpu_bytes_limit = 0;  // per GPU (CacheServerOptions::gpu_bytes)
  std::uint64_t gpu_bytes = 0;        // held in GPU memory now, all GPUs together (copies evicted
                                      // while clients still share them included)
  std::uint64_t shares = 0;           // clients' shares of device copies now (LoadOptions::share)
  std::uint64_t hits = 0, misses = 0, adds = 0, evictions = 0, stale = 0, refused = 0;
  std::uint64_t clients = 0;     // connected now
  std::uint64_t served_clients = 0;  // connections since start
  double uptime_seconds = 0;
  std::vector<CacheEntryStatus> entries;  // most recently used first
};

// Listens on options.socket (Error when another server answers there, or the options are invalid).
class CacheServer {
 public:
  explicit CacheServer(CacheServerOptions options);
  ~CacheServer();
  CacheServer(const CacheServer&) = delete;
  CacheServer& operator=(const CacheServer&) = delete;

  // Serves clients until `stop` is set (looked at every 100 ms); files being added are finished
  // or abandoned before it returns. The socket file is removed by the destructor.
  void run(const std::atomic<bool>& stop);
  CacheStatus status() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// The socket `hbmio cache serve` listens on when given none, and loads use when asked to use the
// cache (CacheUse::use or add) without HBMIO_CACHE set: $XDG_RUNTIME_DIR/hbmio-cache.sock, else
// /tmp/hbmio-cache-UID.sock.
std::string default_cache_socket();

// The status of the server at `socket` (Error, op "connect to the resident cache", naming the
// path, when none answers there).
CacheStatus cache_status(const std::string& socket);

// `status` as one JSON object (text): the fields above by their names, `entries` an array of
// objects. The server's status reply and `hbmio cache status --json` are this object.
std::string status_json(const CacheStatus& status);

// Asks the server at `socket` to take in `paths` (opened here; Error naming a file that cannot be
// opened), and to keep a copy of each in the memory of `gpus` (this process's CUDA devices; Error
// ENODEV for one it lacks), where the server has a device tier. With `wait`, returns once each is
// held or refused, and on the GPUs or refused there. Returns, per path, what the server said
// ("held", "adding", or its reason for refusing), and per GPU asked for, "; on 0000:3b:00.0" or
// "; not on 0000:3b:00.0: " and why.
std::vector<std::string> cache_add(const std::string& socket, const std::vector<std::string>& paths, bool wait,
                                   const std::vector<int>& gpus = {});


}  // namespace hbmio
