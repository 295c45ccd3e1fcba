// The resident cache as a source (source.hpp), and the lookups that find its copies of a
// checkpoint's files: in its pinned host memory (resident_copies) or, mapped here, in a GPU's
// memory (shared_copies).
#include "source/source.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "core/executor.hpp"
#include "hbmio/config.hpp"

namespace hbmio::detail {

bool ResidentDma::serves(const CheckpointFile&, const RangeRead& read, const ReadRangesOptions& options) const {
  return options.resident != nullptr && options.resident->files[read.file] != nullptr &&
         read.into.location.kind == MemoryKind::device;
}

Stats ResidentDma::read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
                        const ReadRangesOptions& options) {
  const ResidentCopies& resident = *options.resident;
  std::vector<cache_detail::DeviceCopy> copies;
  std::vector<int> fds;
  std::map<std::size_t, std::size_t> fd_of;  // file -> index into fds
  for (const std::size_t i : which) {
    const RangeRead& read = reads[i];
    auto [it, added] = fd_of.emplace(read.file, fds.size());
    if (added) fds.push_back(files[read.file].file->fd());
    copies.push_back({it->second, read.offset, read.into.data, read.into.size, read.into.location.device});
  }
  const auto start = std::chrono::steady_clock::now();
  const cache_detail::CopyOutcome outcome = cache_detail::copy_to_device(resident.socket, fds, copies);
  if (!outcome.failed.empty()) {
    Stats stats = fallback_.read(files, reads, which, options);
    const std::string why =
        fmt::format("the resident cache's server could not DMA into GPU memory ({}): read from its copy instead", outcome.failed);
    stats.note = stats.note.empty() ? why : why + "; " + stats.note;
    return stats;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Stats stats;
  stats.backend = "cache";
  for (const std::size_t i : which) {
    const RangeRead& read = reads[i];
    stats.bytes += read.into.size;
    const bool on_gpu = outcome.files_on_gpu.contains({read.into.location.device, fd_of.at(read.file)});
    stats.add_path({.file = files[read.file].path,
                    .path = on_gpu ? DataPath::cache_device : DataPath::cache_host,
                    .reason = on_gpu ? "the resident cache held the same file (device, inode, size, times) and a copy of it in this "
                                       "GPU's memory: its server copied it device to device"
                                     : "the resident cache held the same file (device, inode, size, times): its server DMA'd it from its "
                                       "pinned copy straight into GPU memory",
                    .bytes = read.into.size,
                    .bytes_direct = read.into.size});
  }
  stats.bytes_direct = stats.bytes;
  if (options.progress) *options.progress += stats.bytes;
  // The server's share of the time, so that a slow hit says where it went.
  stats.note = fmt::format("{} of GPU memory DMA'd by the resident cache's server in {:.3f} s ({} of it from its copy in the GPU's "
                     "memory; the server: {:.3f} s opening the destination's IPC handles, {:.3f} s copying)",
                     format_size(stats.bytes), seconds, format_size(outcome.gpu_bytes), outcome.open_seconds, outcome.copy_seconds);
  if (options.landed)
    Executor::shared().run(which.size(), landed_width(which.size()), [&](std::size_t k) {
      options.landed(which[k], 0, reads[which[k]].into.size);
    });
  return stats;
}

ResidentCopies resident_copies(const std::vector<CheckpointFile>& files, CacheUse use, const std::string& socket) {
  ResidentCopies out;
  out.files.resize(files.size());
  if (use == CacheUse::off) return out;
  bool add = use == CacheUse::add;
  out.socket = socket;
  if (use == CacheUse::configured) {
    if (out.socket.empty()) out.socket = configured_cache_socket();
    if (out.socket.empty()) return out;  // no cache configured
    add = configured_cache_add();
  }
  if (out.socket.empty()) out.socket = configured_cache_socket();
  if (out.socket.empty()) out.socket = default_cache_socket();
  std::vector<int> fds;
  std::vector<std::string> paths;
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < files.size(); ++i)
    if (files[i].file && !files[i].remote) {
      fds.push_back(files[i].file->fd());
      paths.push_back(files[i].path);
      which.push_back(i);
    }
  if (fds.empty()) return out;
  cache_detail::Lookup found = cache_detail::lookup(out.socket, fds, paths, add);
  for (std::size_t k = 0; k < which.size(); ++k)
    if (found.copies[k]) {
      out.files[which[k]] = std::move(found.copies[k]);
      ++out.held;
    }
  if (!found.warning.empty()) {
    out.warning = fmt::format("the resident cache could not help, files read instead: {}", found.warning);
    // Once per process and reason: a loop of loads against a stopped server says it once.
    static std::mutex said_mutex;
    static std::set<std::string> said;
    std::lock_guard lock(said_mutex);
    if (said.insert(found.warning).second) fmt::print(stderr, "hbmio: warning: {}\n", out.warning);
  }
  return out;
}

SharedFiles shared_copies(const std::vector<CheckpointFile>& files, const std::vector<bool>& wanted, CacheUse use, const std::string& socket,
                          int device) {
  SharedFiles out;
  out.files.resize(files.size());
  if (use == CacheUse::off) throw Error(errno_code(EINVAL), {.op = "load", .path = files.front().path}, "share asks the resident cache, which the load turns off");
  // Asked for explicitly: the configured socket where there is one, else the default (as CacheUse::use).
  out.socket = socket;
  if (out.socket.empty()) out.socket = configured_cache_socket();
  if (out.socket.empty()) out.socket = default_cache_socket();
  std::vector<int> fds;
  std::vector<std::uint64_t> sizes;
  std::vector<std::size_t> which;
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (!wanted[i]) continue;
    if (files[i].file && !files[i].remote) {
      fds.push_back(files[i].file->fd());
      sizes.push_back(files[i].file->size_at_open());
      which.push_back(i);
    } else if (out.why_not.empty()) {
      out.why_not = fmt::format("{}: {}", files[i].path, files[i].remote ? "an object at a URL" : "not held open by this load");
    }
  }
  if (fds.empty()) return out;
  cache_detail::Shares shares = cache_detail::share_from_device(out.socket, fds, sizes, device);
  out.ask_seconds = shares.ask_seconds;
  out.map_seconds = shares.map_seconds;
  for (std::size_t k = 0; k < which.size(); ++k) {
    if (shares.copies[k]) {
      out.files[which[k]] = std::move(shares.copies[k]);
      ++out.held;
    } else if (out.why_not.empty()) {
      out.why_not = fmt::format("{}: {}", files[which[k]].path, shares.reasons[k]);
    }
  }
  return out;
}

std::string resident_note(const ResidentCopies& copies) {
  if (!copies.warning.empty()) return "; " + copies.warning;
  if (copies.socket.empty()) return {};
  return fmt::format("; {} of {} file(s) from the resident cache at {}", copies.held, copies.files.size(), copies.socket);
}

}  // namespace hbmio::detail
