// Clients of the resident cache: the loads' lookup (client.hpp), status and add (hbmio/cache.hpp).
#include "cache/client.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "cache/protocol.hpp"
#include "core/executor.hpp"
#include "memory/cuda_runtime.hpp"
#include "hbmio/cache.hpp"
#include "hbmio/error.hpp"

namespace hbmio {
namespace cache_detail {

namespace {

// How long a load waits for the cache to answer before reading the files itself: a lookup is a
// map search on the server, so anything near this means the server is stuck, not busy.
constexpr int kLookupTimeoutMs = 2000;

// One "get" for up to kMaxDescriptors files over `socket`; appends each result and its copy.
// `gpus`: PCI bus ids of GPUs to keep copies on (the device tier), `place` false to only ask how
// those copies are doing.
void get_some(int socket, const std::string& socket_path, std::span<const int> fds, bool add, std::vector<nlohmann::json>& results,
              std::vector<OwnedFd>& copies, bool counted = true, const nlohmann::json& gpus = nlohmann::json::array(),
              bool place = true) {
  send_message(socket, {{"op", "get"}, {"add", add}, {"count", counted}, {"gpus", gpus}, {"place", place}}, fds, socket_path);
  std::optional<Message> reply = receive_message(socket, socket_path);
  if (!reply) throw Error(errno_code(ECONNRESET), {.op = "cache", .path = socket_path}, "the server closed the connection");
  if (reply->body.contains("error"))
    throw Error(errno_code(EPROTO), {.op = "cache", .path = socket_path}, reply->body["error"].get<std::string>());
  const nlohmann::json& got = reply->body.at("results");
  if (got.size() != fds.size())
    throw Error(errno_code(EPROTO), {.op = "cache", .path = socket_path}, fmt::format("{} answers to {} files", got.size(), fds.size()));
  std::size_t hits = 0;
  for (const nlohmann::json& r : got) hits += r.at("hit").get<bool>() ? 1 : 0;
  if (hits != reply->descriptors.size())
    throw Error(errno_code(EPROTO), {.op = "cache", .path = socket_path}, fmt::format("{} copies for {} hits", reply->descriptors.size(), hits));
  std::size_t next = 0;
  for (const nlohmann::json& r : got) {
    results.push_back(r);
    copies.push_back(r.at("hit").get<bool>() ? std::move(reply->descriptors[next++]) : OwnedFd());
  }
}

// The server must run as this user or as root: anyone else could have put a socket at the path
// first (the default in /tmp, say) and would hand out bytes of its choosing.
void check_server(int socket, const std::string& socket_path) {
  ucred peer{};
  socklen_t length = sizeof peer;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0)
    throw Error(errno_code(errno), {.op = "cache", .path = socket_path}, "SO_PEERCRED");
  if (peer.uid != ::geteuid() && peer.uid != 0)
    throw Error(errno_code(EPERM), {.op = "cache", .path = socket_path},
                fmt::format("the server there runs as uid {}, neither this user ({}) nor root: not trusted", peer.uid, ::geteuid()));
}

// A copy is used only if no one can change its bytes any more: sealed against writes and resizing.
bool sealed(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const int needed = F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK;
  return seals >= 0 && (seals & needed) == needed;
}

}  // namespace

Lookup lookup(const std::string& socket_path, std::span<const int> fds, std::span<const std::string> paths, bool add) {
  Lookup out;
  out.copies.resize(fds.size());
  try {
    const OwnedFd socket = connect_to(socket_path, kLookupTimeoutMs);
    check_server(socket.get(), socket_path);
    std::vector<nlohmann::json> results;
    std::vector<OwnedFd> copies;
    for (std::size_t at = 0; at < fds.size(); at += kMaxDescriptors)
      get_some(socket.get(), socket_path, fds.subspan(at, std::min(kMaxDescriptors, fds.size() - at)), add, results, copies);
    for (std::size_t k = 0; k < fds.size(); ++k) {
      if (!copies[k]) continue;
      if (!sealed(copies[k].get())) {
        out.warning = fmt::format("the server's copy of {} is not sealed: not used", paths[k]);
        continue;
      }
      const std::uint64_t bytes = results[k].value("bytes", std::uint64_t{0});
      File copy = File::adopt(copies[k].release(), paths[k] + std::string(kCopySuffix));
      // The server's copy must be as long as the file: anything else is a broken server, not a hit.
      if (copy.size_at_open() != bytes) continue;
      out.copies[k] = std::make_shared<const File>(std::move(copy));
    }
  } catch (const std::exception& e) {
    out.copies.assign(fds.size(), nullptr);
    out.warning = e.what();
  }
  return out;
}

CopyOutcome copy_to_device(const std::string& socket_path, std::span<const int> fds, std::span<const DeviceCopy> copies) {
  const ErrorContext context{.op = "cache copy", .path = socket_path};
  CopyOutcome out;
  const auto failed = [&out](std::string why) {
    out.failed = std::move(why);
    return out;
  };
  try {
    if (fds.size() > kMaxDescriptors) return failed(fmt::format("{} files in one load (a copy request takes at most {})", fds.size(), kMaxDescriptors));
    // The allocations the destinations lie in, and per GPU (by PCI bus id) one request.
    std::vector<cuda::IpcAllocation> allocations;
    struct Request {
      int device = 0;  // this process's number of the GPU
      std::vector<std::size_t> allocations;  // into `allocations`
      nlohmann::json copies = nlohmann::json::array();
      std::uint64_t bytes = 0;
      // The last copy's end in its file and in its allocation: a copy that continues both extends
      // it (a checkpoint's tensors, back to back in the file and in the load's memory, are one DMA
      // rather than thousands, each a DMA launch on the server and a JSON entry both ways).
      std::size_t last_file = 0, last_allocation = 0;
      std::uint64_t last_end = 0, last_at_end = 0;
    };
    std::map<std::string, Request> by_device;
    for (const DeviceCopy& c : copies) {
      const auto at = reinterpret_cast<std::uintptr_t>(c.into);
      auto found = std::find_if(allocations.begin(), allocations.end(), [&](const cuda::IpcAllocation& a) { return at >= a.base && at < a.base + a.size; });
      if (found == allocations.end()) {
        allocations.push_back(cuda::ipc_allocation_of(c.into, context));
        found = std::prev(allocations.end());
      }
      const std::size_t which = static_cast<std::size_t>(found - allocations.begin());
      Request& r = by_device[found->pci_bus_id];
      r.device = c.device;
      auto local = std::find(r.allocations.begin(), r.allocations.end(), which);
      if (local == r.allocations.end()) local = r.allocations.insert(r.allocations.end(), which);
      const auto local_index = static_cast<std::size_t>(local - r.allocations.begin());
      const std::uint64_t at_in = at - found->base;
      if (!r.copies.empty() && r.last_file == c.file && r.last_allocation == local_index && r.last_end == c.offset &&
          r.last_at_end == at_in) {
        auto& last = r.copies.back();
        last[2] = last[2].get<std::uint64_t>() + c.length;
      } else {
        r.copies.push_back({c.file, c.offset, c.length, local_index, at_in});
      }
      r.last_file = c.file;
      r.last_allocation = local_index;
      r.last_end = c.offset + c.length;
      r.last_at_end = at_in + c.length;
      r.bytes += c.length;
    }
    // One request per GPU, all at once: the server feeds each GPU by its own DMA.
    std::vector<std::pair<const std::string*, const Request*>> requests;
    for (const auto& [device, r] : by_device) requests.push_back({&device, &r});
    std::vector<CopyOutcome> outcomes(requests.size());
    detail::Executor::shared().run(requests.size(), 0, [&](std::size_t k) {
      const auto& [device, r] = requests[k];
      CopyOutcome& mine = outcomes[k];
      try {
        nlohmann::json handles = nlohmann::json::array();
        for (const std::size_t a : r->allocations) {
          handles.push_back({{"handle", to_hex(allocations[a].handle)}});
        }
        // The reply comes when the DMA is done: at least 1 GiB/s, plus time to open the handles.
        const int timeout_ms = static_cast<int>(std::min<std::uint64_t>(5000 + r->bytes / (1 << 20), 600'000));
        const OwnedFd socket = connect_to(socket_path, timeout_ms);
        check_server(socket.get(), socket_path);
        // The server starts the copy by half the time this side waits, or not at all: once this side
        // gives up, its memory may be reused, and a late DMA would land in it.
        timespec now{};
        ::clock_gettime(CLOCK_MONOTONIC, &now);
        const std::int64_t not_after = now.tv_sec * 1'000'000'000LL + now.tv_nsec + std::int64_t{timeout_ms} * 1'000'000 / 2;
        send_message(socket.get(),
                     {{"op", "copy"}, {"device", *device}, {"allocations", handles}, {"copies", r->copies}, {"not_after_ns", not_after}},
                     fds, socket_path);
        std::optional<Message> reply = receive_message(socket.get(), socket_path);
        if (!reply) mine.failed = "the server closed the connection";
        else if (reply->body.contains("error")) mine.failed = reply->body["error"].get<std::string>();
        else if (reply->body.value("bytes", std::uint64_t{0}) != r->bytes) mine.failed = "the server copied another number of bytes";
        else {
          mine.open_seconds = reply->body.value("open_seconds", 0.0);
          mine.copy_seconds = reply->body.value("copy_seconds", 0.0);
          mine.gpu_bytes = reply->body.value("gpu_bytes", std::uint64_t{0});
          for (const nlohmann::json& f : reply->body.value("files_on_gpu", nlohmann::json::array()))
            mine.files_on_gpu.insert({r->device, f.get<std::size_t>()});
        }
      } catch (const std::exception& e) {
        mine.failed = e.what();
      }
    });
    for (const CopyOutcome& o : outcomes) {
      if (!o.failed.empty()) return failed(o.failed);
      out.open_seconds = std::max(out.open_seconds, o.open_seconds);  // the requests ran at once
      out.copy_seconds = std::max(out.copy_seconds, o.copy_seconds);
      out.gpu_bytes += o.gpu_bytes;
      out.files_on_gpu.insert(o.files_on_gpu.begin(), o.files_on_gpu.end());
    }
    return out;
  } catch (const std::exception& e) {
    return failed(e.what());
  }
}

namespace {

// An allocation of the server's mapped here. CUDA maps a handle once per process: every share of
// the same copy in this process gets the same mapping, closed when the last one lets go (under
// the mutex, so that no share opens the handle again while it is being closed).
struct Mapping {
  void* base = nullptr;
  std::size_t size = 0;
  int device = 0;
};
std::mutex& mappings_mutex() {
  static auto* m = new std::mutex;  // outlives static destructors, as the map does: a mapping may go last
  return *m;
}
std::map<std::pair<int, std::string>, std::weak_ptr<Mapping>>& mappings() {
  static auto* m = new std::map<std::pair<int, std::string>, std::weak_ptr<Mapping>>;  // outlives static destructors
  return *m;
}
std::shared_ptr<Mapping> map_shared(const std::string& handle, int device, const ErrorContext& context) {
  std::lock_guard lock(mappings_mutex());
  std::weak_ptr<Mapping>& known = mappings()[{device, handle}];
  if (std::shared_ptr<Mapping> alive = known.lock()) return alive;
  auto mapping = std::make_unique<Mapping>();
  mapping->device = device;
  mapping->base = cuda::ipc_open(handle, device, context);
  try {
    mapping->size = cuda::device_allocation_size(mapping->base, context);
  } catch (...) {
    cuda::ipc_close(mapping->base);
    throw;
  }
  std::shared_ptr<Mapping> out(mapping.release(), [](Mapping* m) {
    std::lock_guard closing(mappings_mutex());
    cuda::ipc_close_when_idle(m->base, m->device);
    delete m;
  });
  known = out;
  std::erase_if(mappings(), [](const auto& kv) { return kv.second.expired(); });
  return out;
}

// What a SharedCopy keeps: the mapping, then (destroyed after it) the lease's connection.
struct Lease {
  OwnedFd socket;
};
struct Kept {
  std::shared_ptr<const Lease> lease;
  std::shared_ptr<Mapping> mapping;
};

}  // namespace

Shares share_from_device(const std::string& socket_path, std::span<const int> fds, std::span<const std::uint64_t> sizes, int device) {
  const ErrorContext context{.op = "cache share", .path = socket_path};
  Shares out;
  out.copies.resize(fds.size());
  out.reasons.assign(fds.size(), "");
  const auto start = std::chrono::steady_clock::now();
  const auto since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  try {
    const std::string bus_id = cuda::pci_bus_id_of(device, context);
    auto lease = std::make_shared<Lease>();
    lease->socket = connect_to(socket_path, kLookupTimeoutMs);
    check_server(lease->socket.get(), socket_path);
    std::vector<nlohmann::json> results;
    for (std::size_t at = 0; at < fds.size(); at += kMaxDescriptors) {
      const std::size_t n = std::min(kMaxDescriptors, fds.size() - at);
      send_message(lease->socket.get(), {{"op", "share"}, {"device", bus_id}}, fds.subspan(at, n), socket_path);
      std::optional<Message> reply = receive_message(lease->socket.get(), socket_path);
      if (!reply) throw Error(errno_code(ECONNRESET), context, "the server closed the connection");
      if (reply->body.contains("error")) throw Error(errno_code(EPROTO), context, reply->body["error"].get<std::string>());
      const nlohmann::json got = reply->body.at("results");
      if (got.size() != n) throw Error(errno_code(EPROTO), context, fmt::format("{} answers to {} files", got.size(), n));
      results.insert(results.end(), got.begin(), got.end());
    }
    const std::shared_ptr<const Lease> held = std::move(lease);
    out.ask_seconds = since(start);
    const auto mapping_start = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < fds.size(); ++k) {
      const nlohmann::json& r = results[k];
      if (!r.at("shared").get<bool>()) {
        out.reasons[k] = r.value("reason", "not shared");
        continue;
      }
      const std::string handle = from_hex(r.at("handle").get<std::string>());
      const auto offset = r.at("offset").get<std::uint64_t>(), bytes = r.at("bytes").get<std::uint64_t>();
      try {
        std::shared_ptr<Mapping> mapping = map_shared(handle, device, context);
        // The server's word is checked against this side's: the copy is as long as the file and lies
        // inside the allocation mapped.
        if (bytes != sizes[k] || offset > mapping->size || bytes > mapping->size - offset) {
          out.reasons[k] = fmt::format("the server's copy ({} bytes at offset {} of a {}-byte allocation) is not the file's {} bytes",
                                       bytes, offset, mapping->size, sizes[k]);
          continue;
        }
        const std::byte* data = static_cast<const std::byte*>(mapping->base) + offset;
        out.copies[k] = SharedCopy{.data = data, .size = bytes, .device = device,
                                   .keep = std::make_shared<const Kept>(Kept{held, std::move(mapping)})};
      } catch (const std::exception& e) {
        out.reasons[k] = e.what();
      }
    }
    out.map_seconds = since(mapping_start);
  } catch (const std::exception& e) {
    out.warning = e.what();
    for (std::size_t k = 0; k < fds.size(); ++k)
      if (!out.copies[k]) out.reasons[k] = e.what();
  }
  return out;
}

nlohmann::json to_json(const CacheStatus& s) {
  nlohmann::json entries = nlohmann::json::array();
  for (const CacheEntryStatus& e : s.entries)
    entries.push_back({{"path", e.path}, {"bytes", e.bytes}, {"tier", e.tier}, {"state", e.state}, {"pinned", e.pinned}, {"owner", e.owner},
                       {"hits", e.hits}, {"idle_seconds", e.idle_seconds}, {"gpus", e.gpus}, {"shares", e.shares}});
  return {{"socket", s.socket},       {"host_bytes_limit", s.host_bytes_limit}, {"user_bytes_limit", s.user_bytes_limit},
          {"files_limit", s.files_limit}, {"user_files_limit", s.user_files_limit},
          {"gpu_bytes_limit", s.gpu_bytes_limit}, {"gpu_bytes", s.gpu_bytes}, {"shares", s.shares},
          {"host_bytes", s.host_bytes}, {"hits", s.hits},                       {"misses", s.misses},
          {"adds", s.adds},           {"evictions", s.evictions},             {"stale", s.stale},
          {"refused", s.refused},     {"clients", s.clients},                 {"served_clients", s.served_clients},
          {"uptime_seconds", s.uptime_seconds}, {"entries", std::move(entries)}};
}

CacheStatus status_from_json(const nlohmann::json& j) {
  CacheStatus s;
  s.socket = j.at("socket").get<std::string>();
  for (auto [field, name] : {std::pair{&s.host_bytes_limit, "host_bytes_limit"}, {&s.user_bytes_limit, "user_bytes_limit"},
                             {&s.host_bytes, "host_bytes"}, {&s.gpu_bytes_limit, "gpu_bytes_limit"}, {&s.gpu_bytes, "gpu_bytes"}, {&s.hits, "hits"}, {&s.misses, "misses"}, {&s.adds, "adds"},
                             {&s.evictions, "evictions"}, {&s.stale, "stale"}, {&s.refused, "refused"}, {&s.clients, "clients"},
                             {&s.served_clients, "served_clients"}})
    *field = j.at(name).get<std::uint64_t>();
  s.shares = j.value("shares", std::uint64_t{0});
  s.files_limit = j.value("files_limit", std::uint64_t{0});  // (an older server does not say)
  s.user_files_limit = j.value("user_files_limit", std::uint64_t{0});
  s.uptime_seconds = j.at("uptime_seconds").get<double>();
  for (const nlohmann::json& e : j.at("entries"))
    s.entries.push_back({.path = e.at("path").get<std::string>(),
                         .bytes = e.at("bytes").get<std::uint64_t>(),
                         .tier = e.at("tier").get<std::string>(),
                         .state = e.at("state").get<std::string>(),
                         .pinned = e.at("pinned").get<bool>(),
                         .owner = e.at("owner").get<std::uint32_t>(),
                         .hits = e.at("hits").get<std::uint64_t>(),
                         .idle_seconds = e.at("idle_seconds").get<double>(),
                         .gpus = e.value("gpus", std::vector<std::string>{}),
                         .shares = e.value("shares", std::uint64_t{0})});
  return s;
}

}  // namespace cache_detail

std::string status_json(const CacheStatus& status) { return cache_detail::to_json(status).dump(); }

CacheStatus cache_status(const std::string& socket_path) {
  const cache_detail::OwnedFd socket = cache_detail::connect_to(socket_path, 5000);
  cache_detail::check_server(socket.get(), socket_path);  // another user's server could say anything
  cache_detail::send_message(socket.get(), {{"op", "status"}}, {}, socket_path);
  std::optional<cache_detail::Message> reply = cache_detail::receive_message(socket.get(), socket_path);
  if (!reply) throw Error(errno_code(ECONNRESET), {.op = "cache", .path = socket_path}, "the server closed the connection");
  try {
    return cache_detail::status_from_json(reply->body);
  } catch (const nlohmann::json::exception& e) {
    throw Error(errno_code(EPROTO), {.op = "cache", .path = socket_path}, fmt::format("a status reply without its fields: {}", e.what()));
  }
}

std::vector<std::string> cache_add(const std::string& socket_path, const std::vector<std::string>& paths, bool wait,
                                   const std::vector<int>& gpus) {
  nlohmann::json bus_ids = nlohmann::json::array();
  for (const int gpu : gpus) bus_ids.push_back(cuda::pci_bus_id_of(gpu, {.op = "cache add", .path = fmt::format("cuda:{}", gpu)}));
  std::vector<cache_detail::OwnedFd> files;
  std::vector<int> fds;
  for (const std::string& path : paths) {
    // O_NONBLOCK: a FIFO's open would wait for a writer; only a regular file is a checkpoint.
    files.emplace_back(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!files.back()) throw Error(errno_code(errno), {.op = "open", .path = path});
    struct stat st {};
    if (::fstat(files.back().get(), &st) != 0) throw Error(errno_code(errno), {.op = "stat", .path = path});
    if (!S_ISREG(st.st_mode)) throw Error(errno_code(EINVAL), {.op = "cache add", .path = path}, "not a regular file");
    fds.push_back(files.back().get());
  }
  const cache_detail::OwnedFd socket = cache_detail::connect_to(socket_path, 5000);
  // Before any descriptor goes: another user's server at the path would get to read the files.
  cache_detail::check_server(socket.get(), socket_path);
  std::vector<std::string> said(paths.size());
  std::vector<std::size_t> open(paths.size());
  for (std::size_t k = 0; k < paths.size(); ++k) open[k] = k;
  for (bool first = true; !open.empty(); first = false) {
    if (!first) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<std::size_t> still;
    for (std::size_t at = 0; at < open.size(); at += cache_detail::kMaxDescriptors) {
      const std::size_t n = std::min(cache_detail::kMaxDescriptors, open.size() - at);
      std::vector<int> some;
      for (std::size_t k = at; k < at + n; ++k) some.push_back(fds[open[k]]);
      std::vector<nlohmann::json> results;
      std::vector<cache_detail::OwnedFd> copies;
      cache_detail::get_some(socket.get(), socket_path, some, first, results, copies, /*counted=*/first, bus_ids, /*place=*/first);
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t which = open[at + k];
        const std::string reason = results[k].value("reason", "");
        said[which] = results[k].at("hit").get<bool>() ? "held"
                      : (!first && reason == "not held") ? "refused while being read in (the server's log says why)"
                                                         : reason;
        bool gpus_pending = false;
        // (Held by name: items() of the temporary value() returns would outlive it in the loop.)
        const nlohmann::json gpu_states = results[k].value("gpus", nlohmann::json::object());
        for (const auto& [id, state] : gpu_states.items()) {
          const std::string text = state.get<std::string>();
          said[which] += text == "held" ? fmt::format("; on {}", id) : text == "adding" ? fmt::format("; adding on {}", id)
                                                                                        : fmt::format("; not on {}: {}", id, text);
          gpus_pending = gpus_pending || text == "adding";
        }
        // Still being read in (or copied to a GPU): asked again (without adding) until it is held or dropped.
        if (wait && ((!results[k].at("hit").get<bool>() && (reason == "being taken in" || reason == "not held; taking it in")) ||
                     (results[k].at("hit").get<bool>() && gpus_pending)))
          still.push_back(which);
      }
    }
    open = std::move(still);
    if (open.empty()) break;
  }
  for (std::string& s : said)
    for (const char* adding : {"not held; taking it in", "being taken in"})
      if (s.starts_with(adding)) s = "adding" + s.substr(std::string_view(adding).size());
  return said;
}

}  // namespace hbmio
