// Loading checkpoints: resolve the path to files, plan where each tensor lands and which reads
// to issue, read through one engine, optionally verify the stored checksums.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/background_saves.hpp"
#include "checkpoint/integrity.hpp"
#include "checkpoint/load_internal.hpp"
#include "source/source.hpp"
#include "core/error_boundary.hpp"
#include "core/executor.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "io/engine_internal.hpp"

namespace hbmio {
namespace fs = std::filesystem;
namespace st = safetensors;

namespace {

Error checkpoint_error(int err, const std::string& path, const std::string& detail) {
  return Error(errno_code(err), {.op = "open checkpoint", .path = path}, detail);
}

// A directory holds an index (sharded) or exactly one .safetensors file: the name of the one to
// open, listed from the directory open as `dir` (through /proc/self/fd where there is a /proc, so
// that it is the directory opened, not whatever has its name now).
std::string resolve_directory(const CheckpointDirectory& dir, const std::string& path) {
  std::error_code ec;
  fs::directory_iterator listing(fmt::format("/proc/self/fd/{}", dir.fd()), ec);
  if (ec) listing = fs::directory_iterator(path);
  std::vector<std::string> indexes, files;
  for (const auto& entry : listing) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".safetensors.index.json")) indexes.push_back(name);
    else if (name.ends_with(".safetensors")) files.push_back(name);
  }
  std::sort(indexes.begin(), indexes.end());
  // model.safetensors beside an index is the checkpoint, as transformers decides (it looks for
  // that name first): a single-file save into a directory that held a sharded checkpoint leaves
  // the old index there, and reading it would load the older model (hbmio's sharded saves remove
  // a model.safetensors, so the reverse does not arise).
  if (!indexes.empty() && std::find(files.begin(), files.end(), "model.safetensors") != files.end()) return "model.safetensors";
  if (indexes.size() == 1) return indexes.front();
  if (indexes.size() > 1)
    throw checkpoint_error(EINVAL, path, fmt::format("holds {} index files; name the one to load", indexes.size()));
  if (files.size() == 1) {
    // "model-00001-of-00004.safetensors" alone names itself one shard of several: the directory
    // is a sharded checkpoint whose other shards and index are missing (another tool is writing
    // it, shards first and the index last, or it was copied in part). Loading the one shard as the
    // whole would give a model with most of its tensors missing, without an error.
    static const std::regex kShardName(R"(.*-([0-9]+)-of-([0-9]+)\.safetensors)");
    const std::string& only = files.front();
    std::smatch m;
    if (std::regex_match(only, m, kShardName) && (m[2].length() > 9 || std::stoul(m[2].str()) > 1))
      throw checkpoint_error(EINVAL, path,
                             fmt::format("holds only {}, shard {} of {}, and no *.safetensors.index.json: an incomplete sharded "
                                         "checkpoint (still being written, or copied in part); name the file to load it alone",
                                         only, m[1].str(), m[2].str()));
    return only;
  }
  throw checkpoint_error(files.empty() ? ENOENT : EINVAL, path,
                         files.empty() ? "holds no .safetensors file and no *.safetensors.index.json"
                                       : fmt::format("holds {} .safetensors files and no index; name the file to load", files.size()));
}

// Is the directory open as `dir` still the one named `path`? (A sharded save swaps a new directory
// in under the name; the old one is then emptied.)
bool still_named(const CheckpointDirectory& dir, const std::string& path) {
  struct stat held {}, named {};
  return ::fstat(dir.fd(), &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
         held.st_ino == named.st_ino;
}

// Thrown by open_checkpoint_once when a file is missing because the directory it opened is no
// longer the one under the checkpoint's name.
struct DirectorySwapped {};

std::vector<CheckpointFile> open_checkpoint_once(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) throw checkpoint_error(errno, path, "");
  if (!S_ISDIR(info.st_mode) && !path.ends_with(".json")) {
    // One file: opened once; the header is read through the descriptor every later read uses.
    auto file = std::make_shared<const File>(File::open(path, OpenMode::read));
    st::Header header = st::read_header(file->fd(), path);
    std::vector<CheckpointFile> files;
    files.push_back({path, std::move(header), file, file->identity(), nullptr});
    return files;
  }
  // A directory, or an index in one: everything is opened relative to the directory as opened now.
  // Paths are shown as given (an index named relative to the working directory has no directory
  // part); the directory itself is then ".".
  const std::string shown_dir = S_ISDIR(info.st_mode) ? path : fs::path(path).parent_path().string();
  const std::string dir_path = shown_dir.empty() ? "." : shown_dir;
  const int dir_fd = ::open(dir_path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) throw checkpoint_error(errno, path, fmt::format("open of its directory {}", dir_path));
  const auto dir = std::make_shared<const CheckpointDirectory>(dir_fd);
  std::string name;
  try {
    name = S_ISDIR(info.st_mode) ? resolve_directory(*dir, path) : fs::path(path).filename().string();
  } catch (const Error&) {
    if (!still_named(*dir, dir_path)) throw DirectorySwapped{};  // listed while being emptied
    throw;
  }
  const std::string target = (fs::path(shown_dir) / name).string();
  const std::size_t bound = detail::open_file_bound();
  auto open_one = [&](const std::string& file_name, const std::string& file_path, std::vector<CheckpointFile>& into) {
    auto file = std::make_shared<const File>(File::open_at(dir->fd(), file_name, file_path, OpenMode::read));
    st::Header header = st::read_header(file->fd(), file_path);
    const FileIdentity identity = file->identity();
    if (into.size() >= bound) file.reset();  // past the bound: opened again, and checked, when read
    into.push_back({file_path, std::move(header), std::move(file), identity, dir});
    return &into.back();
  };

  std::vector<CheckpointFile> files;
  if (!name.ends_with(".json")) {
    // A directory listed while a sharded save emptied it (after swapping a new one in) may show
    // one shard left and no index: that is no checkpoint, and loading it as one would give a
    // shard's tensors for the whole. A directory still under the name after it was listed was
    // not being emptied (a swapped-out directory never comes back).
    if (S_ISDIR(info.st_mode) && !still_named(*dir, dir_path)) throw DirectorySwapped{};
    open_one(name, target, files);
    return files;
  }
  // A sharded checkpoint: each shard's header is read and validated, and must hold the tensors
  // the index assigns to it (and only those are loaded from it).
  const int index_fd = ::openat(dir->fd(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (index_fd < 0) {
    if (errno == ENOENT && !still_named(*dir, dir_path)) throw DirectorySwapped{};
    throw checkpoint_error(errno, target, "open of the index");
  }
  st::ShardIndex index;
  try {
    index = st::read_index(index_fd, target);
  } catch (...) {
    ::close(index_fd);
    throw;
  }
  ::close(index_fd);
  if (index.shards.empty()) throw checkpoint_error(EINVAL, target, "the index names no shard (its weight_map is empty)");
  for (const std::string& shard : index.shards) {
    const std::string shard_path = (fs::path(shown_dir) / shard).string();
    if (::fstatat(dir->fd(), shard.c_str(), &info, 0) != 0) {
      if (errno == ENOENT && !still_named(*dir, dir_path)) throw DirectorySwapped{};
      throw checkpoint_error(errno, target, fmt::format("shard '{}' named by the index cannot be opened", shard));
    }
    try {
      open_one(shard, shard_path, files);
    } catch (const Error& e) {
      if (e.code() == std::errc::no_such_file_or_directory && !still_named(*dir, dir_path)) throw DirectorySwapped{};
      throw;
    }
  }
  detail::keep_indexed_tensors(files, index, {.op = "open checkpoint", .path = target});
  return files;
}

std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return alignment <= 1 ? value : (value + alignment - 1) / alignment * alignment;
}

// The LoadedCheckpoint tensors one planned read fills.
struct ReadTensors {
  std::size_t first = 0, count = 0;
};

}  // namespace

CheckpointDirectory::~CheckpointDirectory() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {
std::vector<CheckpointFile> open_checkpoint_retrying(const std::string& path);
}

std::vector<CheckpointFile> open_checkpoint(const std::string& path, const std::optional<RemoteOptions>& remote) {
  if (is_remote_url(path)) return detail::open_remote_checkpoint(path, remote ? *remote : RemoteOptions::from_env());
  return detail::errors_as_hbmio({.op = "open checkpoint", .path = path}, [&] {
    // This process's own background saves of what it opens are read once published: the path
    // first, then the files it resolved to (a directory's model.safetensors, the index's shards),
    // opened again after a save of one of them (a few times: saves in a loop on another thread).
    detail::wait_for_background_saves_of({path});
    for (int attempt = 1;; ++attempt) {
      std::vector<CheckpointFile> files = open_checkpoint_retrying(path);
      std::vector<std::string> opened;
      for (const CheckpointFile& f : files) opened.push_back(f.path);
      if (attempt == 4 || !detail::wait_for_background_saves_of(opened)) return files;
    }
  });
}

namespace {
std::vector<CheckpointFile> open_checkpoint_retrying(const std::string& path) {
  // A sharded save that swaps a new directory in while the old one is read empties the old one:
  // a file gone by the time it is opened is then not a fault of the checkpoint, which is whole
  // under its name again. That one is opened instead (a few tries).
  for (int attempt = 1;; ++attempt) {
    try {
      return open_checkpoint_once(path);
    } catch (const DirectorySwapped&) {
      if (attempt == 4)
        throw checkpoint_error(ESTALE, path, "the checkpoint was replaced each time it was opened (saves in a loop?)");
    }
  }
}
}  // namespace

const LoadedTensor* LoadedCheckpoint::find(const std::string& name) const noexcept {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// The tensors a load picks, in file order (the order that makes reads sequential), and where each
// lands in a single allocation.
struct Pick {
  std::size_t file;
  const st::TensorInfo* info;
  std::uint64_t memory_offset = 0;
};

std::vector<Pick> pick_tensors(const std::string& path, const std::vector<CheckpointFile>& files, const LoadOptions& options,
                               std::uint64_t& allocation_size) {
  const std::set<std::string> wanted(options.names.begin(), options.names.end());
  std::vector<Pick> picks;
  std::set<std::string> found;
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& t : files[f].header.tensors) {
      if (!wanted.empty() && !wanted.contains(t.name)) continue;
      picks.push_back({f, &t});
      if (!wanted.empty()) found.insert(t.name);  // (only to name what is missing: thousands of names otherwise)
    }
  }
  for (const auto& name : wanted)
    if (!found.contains(name))  // EINVAL: the checkpoint is there, the name asked for is wrong (ENOENT read "No such file")
      throw checkpoint_error(EINVAL, path, fmt::format("no tensor named '{}' in the checkpoint", name));
  // In one allocation a tensor starts at a multiple of `alignment`; one whose predecessor ends
  // aligned follows it directly, so runs of such tensors stay contiguous in memory as they are in
  // the file, and are read with one request.
  std::uint64_t cursor = 0;
  for (auto& pick : picks) {
    pick.memory_offset = align_up(cursor, options.alignment);
    cursor = pick.memory_offset + pick.info->size();
  }
  allocation_size = cursor;
  return picks;
}

}  // namespace

const std::vector<CheckpointFile>& detail::files_of(const LoadRequest& request, std::vector<CheckpointFile>& opened) {
  if (request.files == nullptr) {
    opened = open_checkpoint(request.path, request.options.remote);
    return opened;
  }
  if (request.files->empty()) throw checkpoint_error(EINVAL, request.path, "no file to load (open it with open_checkpoint)");
  return *request.files;
}

std::vector<PlannedTensor> detail::plan_tensors(const std::string& path, const std::vector<CheckpointFile>& files,
                                                const LoadOptions& options) {
  std::uint64_t size = 0;
  std::vector<PlannedTensor> out;
  for (const Pick& p : pick_tensors(path, files, options, size))
    out.push_back({p.info->name, p.info->dtype, p.info->shape, p.info->size(), p.memory_offset});
  return out;
}

LoadPlan plan_load(const LoadRequest& request, int world) {
  return detail::errors_as_hbmio({.op = "plan a load", .path = request.path}, [&] {
    std::vector<CheckpointFile> opened;
    return detail::plan_ranks(request.path, detail::files_of(request, opened), request.options, world, request.placement,
                              request.shard_map);
  });
}

LoadResult load(const LoadRequest& request) {
  if (!request.locations.empty() && request.nccl_comm != nullptr)
    throw checkpoint_error(EINVAL, request.path, "a load goes to several locations or to the ranks of an NCCL group, not both");
  if (request.options.share && (request.nccl_comm != nullptr || !request.locations.empty()))
    throw checkpoint_error(EINVAL, request.path, "share maps the resident cache's copies into one load's GPU: not with several "
                                                 "locations or an NCCL group (load each GPU's part with share on its own)");
  if (request.nccl_comm != nullptr) return detail::load_nccl(request);
  if (!request.locations.empty()) return detail::load_locations(request);
  return detail::errors_as_hbmio({.op = "load", .path = request.path}, [&] {
    detail::TransferTimer timer;
    std::vector<CheckpointFile> opened;
    LoadResult result;
    result.locations.push_back(detail::LoadAccess::load(request.path, request.options, detail::files_of(request, opened), nullptr));
    Stats& stats = detail::LoadAccess::stats(result.locations.front());
    timer.finish(stats);
    result.bytes_from_storage = stats.bytes;
    result.seconds = stats.seconds;
    return result;
  });
}

struct LoadInProgress::State {
  detail::Pending<LoadResult> job;
};

LoadInProgress::LoadInProgress(std::unique_ptr<State> state) noexcept : state_(std::move(state)) {}
LoadInProgress::LoadInProgress(LoadInProgress&&) noexcept = default;
LoadInProgress& LoadInProgress::operator=(LoadInProgress&&) noexcept = default;  // State's Pending waits for the old job
LoadInProgress::~LoadInProgress() = default;  // State's Pending waits

LoadResult LoadInProgress::wait() {
  if (!state_ || !state_->job.valid()) throw Error(errno_code(EINVAL), {.op = "load"}, "LoadInProgress::wait() of a load waited for already");
  return state_->job.get();
}

LoadInProgress load_started(LoadRequest request) {
  // The request moves into the job: a temporary request, or one that goes out of scope before
  // the wait, is still the job's to read.
  return LoadInProgress(std::make_unique<LoadInProgress::State>(
      LoadInProgress::State{detail::Executor::shared().start([request = std::move(request)] {
        return load(request);  // what touches CUDA there holds a DeviceGuard of its own
      })}));
}

LoadedCheckpoint load_checkpoint(const std::string& path, const LoadOptions& options) {
  return std::move(load({.path = path, .options = options}).locations.front());
}

std::vector<MemorySpan> LoadedCheckpoint::memory() const {
  std::vector<MemorySpan> out;
  out.reserve(buffers_.size() + shared_memory_.size());
  for (const Buffer& b : buffers_) out.push_back(b.span());
  out.insert(out.end(), shared_memory_.begin(), shared_memory_.end());
  return out;
}

LoadedCheckpoint detail::LoadAccess::load(const std::string& path, const LoadOptions& options,
                                          const std::vector<CheckpointFile>& files, const std::set<std::string>* read_only) {
  std::uint64_t allocation_size = 0;
  const std::vector<Pick> picks = pick_tensors(path, files, options, allocation_size);

  LoadedCheckpoint result;
  result.metadata_ = files.front().header.metadata;

  // One read per run of tensors that lie back to back both in a file and in one allocation (never
  // across the allocations of the per-tensor layout, however close their addresses).
  std::vector<detail::RangeRead> reads;
  std::vector<ReadTensors> read_tensors;  // per read
  const bool one_allocation = options.layout == TensorLayout::single_allocation;
  auto plan_read = [&](const Pick& pick, MemorySpan memory) {
    const std::uint64_t file_offset = files[pick.file].header.data_offset + pick.info->begin;
    const std::size_t ranges = reads.size();
    if (detail::add_read(reads, pick.file, file_offset, memory, one_allocation)) {
      // Through the tensor add_tensor appends next (empty tensors in between included: they
      // take indices but no read).
      read_tensors.back().count = result.tensors_.size() + 1 - read_tensors.back().first;
    } else if (reads.size() > ranges) {
      read_tensors.push_back({result.tensors_.size(), 1});  // add_tensor appends it next: the next index
    }
  };
  auto add_tensor = [&](const Pick& pick, MemorySpan memory) {
    if (read_only == nullptr || read_only->contains(pick.info->name)) plan_read(pick, memory);
    result.tensors_.push_back({pick.info->name, pick.info->dtype, pick.info->shape, memory, files[pick.file].path,
                               files[pick.file].header.data_offset + pick.info->begin});
  };
  // LoadOptions::share: the tensors of files the cache holds in the GPU's memory are views of its
  // copy (nothing read); only the others get memory of their own, laid out without gaps for them.
  detail::SharedFiles shared;
  if (options.share) {
    if (options.into.kind != MemoryKind::device)
      throw checkpoint_error(EINVAL, path, "share maps the resident cache's copies in GPU memory: load into a GPU (cuda:N)");
    if (options.destination.data != nullptr)
      throw checkpoint_error(EINVAL, path, "share hands out the resident cache's memory: it takes no destination");
    std::vector<bool> wanted(files.size(), false);  // only the files this load takes tensors from
    for (const Pick& pick : picks) wanted[pick.file] = true;
    shared = detail::shared_copies(files, wanted, options.cache, options.cache_socket, options.into.device);
    for (const auto& copy : shared.files)
      if (copy) {
        result.shared_.push_back(copy->keep);
        result.shared_memory_.push_back({const_cast<std::byte*>(copy->data), copy->size, options.into});
      }
  }
  const auto is_shared = [&](const Pick& pick) { return shared.held > 0 && shared.files[pick.file].has_value(); };
  const auto add_shared = [&](const Pick& pick) {
    const cache_detail::SharedCopy& copy = *shared.files[pick.file];
    const std::uint64_t file_offset = files[pick.file].header.data_offset + pick.info->begin;
    result.tensors_.push_back({pick.info->name, pick.info->dtype, pick.info->shape,
                               {const_cast<std::byte*>(copy.data) + file_offset, pick.info->size(), options.into}, files[pick.file].path,
                               file_offset});
  };
  if (shared.held > 0) {
    std::uint64_t own = 0;
    bool any_own = false;
    std::vector<std::uint64_t> offset_of(picks.size());
    for (std::size_t k = 0; k < picks.size(); ++k)
      if (!is_shared(picks[k])) {
        offset_of[k] = align_up(own, options.alignment);
        own = offset_of[k] + picks[k].info->size();
        any_own = true;
      }
    if (any_own && options.layout == TensorLayout::single_allocation) result.buffers_.push_back(Buffer::allocate(options.into, own));
    for (std::size_t k = 0; k < picks.size(); ++k) {
      if (is_shared(picks[k])) {
        add_shared(picks[k]);
      } else if (options.layout == TensorLayout::single_allocation) {
        add_tensor(picks[k], result.buffers_.front().span().subspan(offset_of[k], picks[k].info->size()));
      } else {
        result.buffers_.push_back(Buffer::allocate(options.into, picks[k].info->size()));
        add_tensor(picks[k], result.buffers_.back().span());
      }
    }
  } else if (options.destination.data != nullptr) {
    const MemorySpan& to = options.destination;
    if (options.layout != TensorLayout::single_allocation)
      throw checkpoint_error(EINVAL, path, "a caller's destination takes the single_allocation layout only");
    if (to.kind() != options.into.kind || (to.kind() == MemoryKind::device && to.location.device != options.into.device))
      throw checkpoint_error(EINVAL, path, "the destination memory is not in the location the load is into");
    if (to.size < allocation_size)
      throw checkpoint_error(ENOSPC, path,
                             fmt::format("the destination holds {} bytes; the load needs {}", to.size, allocation_size));
    for (const auto& pick : picks) add_tensor(pick, to.subspan(pick.memory_offset, pick.info->size()));
  } else if (options.layout == TensorLayout::single_allocation) {
    result.buffers_.push_back(Buffer::allocate(options.into, allocation_size));
    for (const auto& pick : picks) add_tensor(pick, result.buffers_.front().span().subspan(pick.memory_offset, pick.info->size()));
  } else {
    for (const auto& pick : picks) {
      result.buffers_.push_back(Buffer::allocate(options.into, pick.info->size()));
      add_tensor(pick, result.buffers_.back().span());
    }
  }

  // Every read of every file at once (source.hpp): the engine, or the remote workers, keep their
  // whole queue busy across tensor and file boundaries. With verify, each tensor is checked as soon
  // as it is in place, on the pool, while later bytes are still being read: checking runs beside
  // the reads, not in a second pass over everything once it is loaded.
  const bool check = options.verify && read_only == nullptr;
  if (check && options.require_checksums) require_checksums(files);
  if (check) check_headers(files);  // first: the tensors are checked against the checksums they hold
  std::vector<char> checked(result.tensors_.size(), 0);
  std::vector<std::atomic<std::uint64_t>> missing(result.tensors_.size());  // bytes not yet in place
  for (std::size_t t = 0; t < result.tensors_.size(); ++t) missing[t] = result.tensors_[t].data.size;
  // Pinned staging for hashing GPU tensors, reused from tensor to tensor (at most one per thread).
  std::mutex staging_mutex;
  std::vector<Buffer> stagings;
  const auto landed = [&](std::size_t i, std::uint64_t at, std::uint64_t length) {
    const detail::RangeRead& read = reads[i];
    const CheckpointFile& file = files[read.file];
    if (!has_checksums(file.header.metadata)) return;
    // The read's tensors lie back to back in it, in order.
    for (std::size_t t = read_tensors[i].first; t < read_tensors[i].first + read_tensors[i].count; ++t) {
      const LoadedTensor& tensor = result.tensors_[t];
      if (tensor.data.size == 0) continue;  // in no read (checked by verify below)
      const std::uint64_t begin = static_cast<std::uint64_t>(tensor.data.data - read.into.data), end = begin + tensor.data.size;
      if (end <= at) continue;
      if (begin >= at + length) break;
      const std::uint64_t overlap = std::min(end, at + length) - std::max(begin, at);
      if (missing[t].fetch_sub(overlap) != overlap) continue;  // more of it still to come
      Buffer staging;
      if (tensor.data.kind() == MemoryKind::device) {
        std::lock_guard lock(staging_mutex);
        if (!stagings.empty()) {
          staging = std::move(stagings.back());
          stagings.pop_back();
        }
      }
      const std::uint64_t sum = detail::xxh3_of(tensor.data, staging);
      if (staging.data() != nullptr) {
        std::lock_guard lock(staging_mutex);
        stagings.push_back(std::move(staging));
      }
      if (auto bad = detail::check_tensor(file.header.metadata, tensor.name, tensor.file, tensor.file_offset, sum))
        throw Error(make_error_code(Errc::verify_failed),
                    {.op = "verify", .path = tensor.file, .offset = tensor.file_offset, .length = tensor.data.size}, *bad);
      checked[t] = 1;
    }
  };
  // The engine for local files: the caller's, else one leased for this load (none for a URL).
  std::optional<detail::EngineInUse> chosen;
  // (Every file shared: nothing left to ask the cache for.)
  const detail::ResidentCopies copies =
      detail::resident_copies(files, shared.held == files.size() ? CacheUse::off : options.cache, options.cache_socket);
  const detail::ReadRangesOptions source{
      .engine = [&]() -> Engine& {
        if (!chosen) chosen.emplace(options.engine, options.backend, options.engine_options);
        return **chosen;
      },
      .remote = options.remote ? &*options.remote : nullptr,
      .progress = options.progress,
      // Files without checksums (another tool's) have nothing to check as they land: their load stays one batch.
      .landed = check && std::any_of(files.begin(), files.end(), [](const CheckpointFile& f) { return has_checksums(f.header.metadata); })
                    ? LandedFunction(landed)
                    : nullptr,
      .cancel = options.cancel,
      .resident = &copies};
  result.stats_ = detail::read_ranges(files, reads, source);
  std::string share_note;
  if (options.share) {
    std::map<std::size_t, std::uint64_t> mapped;  // per shared file, its tensors' bytes
    for (const Pick& pick : picks)
      if (is_shared(pick)) mapped[pick.file] += pick.info->size();
    for (const auto& [file, bytes] : mapped) {
      if (options.progress) *options.progress += bytes;
      result.stats_.add_path({.file = files[file].path,
                              .path = DataPath::cache_shared,
                              .reason = "the resident cache held the same file (device, inode, size, times) in this GPU's memory: its "
                                        "copy is mapped here and read in place, nothing copied",
                              .bytes = bytes});
    }
    share_note = fmt::format("; {} of {} file(s) shared from the resident cache's GPU memory at {} (asked in {:.4f} s, mapped in {:.4f} s){}",
                             shared.held, files.size(), shared.socket, shared.ask_seconds, shared.map_seconds,
                             shared.why_not.empty() ? "" : fmt::format(" (not shared: {})", shared.why_not));
  }
  result.stats_.note = fmt::format("{} tensors from {} file(s) in {} read(s){}{}{}{}{}", result.tensors_.size(), files.size(), reads.size(),
                                   check ? ", each checked as it landed" : "", share_note, detail::resident_note(copies),
                                   result.stats_.note.empty() ? "" : "; ", result.stats_.note);
  if (check) verify(result, files, options.require_checksums, &checked);
  return result;
}

void detail::require_checksums(const std::vector<CheckpointFile>& files) {
  for (const auto& file : files)
    if (!has_checksums(file.header.metadata))
      throw Error(make_error_code(Errc::no_checksums), {.op = "verify", .path = file.path},
                  "the file holds no hbmio checksums; add them with `hbmio ckpt checksum`");
}

void detail::check_headers(const std::vector<CheckpointFile>& files) {
  // Each header against its own checksum (a few KiB to MiB read again): the tensors' checksums
  // cannot see a damaged name, dtype or metadata value.
  for (const auto& file : files)
    if (has_checksums(file.header.metadata))
      if (auto bad = detail::check_header(file))
        throw Error(make_error_code(Errc::verify_failed),
                    {.op = "verify", .path = file.path, .offset = 0, .length = file.header.data_offset}, *bad);
}

void detail::LoadAccess::verify(LoadedCheckpoint& result, const std::vector<CheckpointFile>& files, bool strict,
                                const std::vector<char>* already) {
  if (strict) require_checksums(files);
  // Files without checksums (every file another tool wrote) load unchecked and are named, so
  // that --verify works on any checkpoint and says what it could not check.
  std::set<std::string> unchecked;
  for (const auto& file : files)
    if (!has_checksums(file.header.metadata)) {
      unchecked.insert(file.path);
      result.unverified_files_.push_back(file.path);
    }
  if (already == nullptr) check_headers(files);  // else the caller checked them before the load
  std::vector<MemorySpan> spans;
  std::vector<std::size_t> checked;  // indices of the tensors whose file has checksums
  for (std::size_t i = 0; i < result.tensors_.size(); ++i)
    if (unchecked.count(result.tensors_[i].file) == 0 && (already == nullptr || !(*already)[i])) {
      spans.push_back(result.tensors_[i].data);
      checked.push_back(i);
    }
  const std::vector<std::uint64_t> sums = detail::xxh3_of_each(spans);
  for (std::size_t k = 0; k < checked.size(); ++k) {
    const LoadedTensor& tensor = result.tensors_[checked[k]];
    const auto file = std::find_if(files.begin(), files.end(), [&](const CheckpointFile& f) { return f.path == tensor.file; });
    if (auto bad = detail::check_tensor(file->header.metadata, tensor.name, tensor.file, tensor.file_offset, sums[k]))
      throw Error(make_error_code(Errc::verify_failed),
                  {.op = "verify", .path = tensor.file, .offset = tensor.file_offset, .length = tensor.data.size}, *bad);
  }
  result.verified_ = result.unverified_files_.empty();
}

LoadResult detail::load_locations(const LoadRequest& request) {
  detail::TransferTimer timer;
  const std::string& path = request.path;
  const std::size_t n = request.locations.size();
  if (n == 0) throw checkpoint_error(EINVAL, path, "no memory location to load into");
  if (!request.engines.empty()) {
    if (request.engines.size() != n)
      throw checkpoint_error(EINVAL, path, fmt::format("{} engines given for {} locations", request.engines.size(), n));
    std::set<Engine*> distinct(request.engines.begin(), request.engines.end());
    if (distinct.size() != n || distinct.contains(nullptr))
      throw checkpoint_error(EINVAL, path, "each location needs an engine of its own (an engine serves one request at a time)");
  }
  auto engine_of = [&](std::size_t k) { return request.engines.empty() ? nullptr : request.engines[k]; };
  std::vector<CheckpointFile> opened;
  const std::vector<CheckpointFile>& files = detail::files_of(request, opened);
  LoadOptions base = request.options;
  base.layout = TensorLayout::single_allocation;
  base.destination = {};
  const std::vector<PlannedTensor> plan = detail::plan_tensors(path, files, base);
  const std::uint64_t allocation_size = plan.empty() ? 0 : plan.back().memory_offset + plan.back().size;
  const std::map<std::string, int> no_map;
  const detail::RunSplit split = detail::split_runs(plan, n, request.placement == Placement::shard ? request.shard_map : no_map,
                                                    {.op = "load", .path = path}, "location");
  std::vector<std::set<std::string>> names(n);
  for (std::size_t i = 0; i < plan.size(); ++i) names[split.reader[i]].insert(plan[i].name);

  LoadResult result;
  result.locations.resize(n);
  if (request.placement == Placement::shard) {
    // One ordinary load per location, with its own engine, all at once.
    detail::Executor::shared().run(n, 0, [&](std::size_t k) {
      LoadOptions mine = base;
      mine.into = request.locations[k];
      mine.names.assign(names[k].begin(), names[k].end());
      mine.engine = engine_of(k);  // an engine serves one request at a time: each pipeline has its own
      if (!mine.names.empty()) result.locations[k] = detail::LoadAccess::load(path, mine, files, nullptr);
    });
  } else {
    // Every location gets the whole layout; location k reads run k, then copies the others'.
    std::vector<std::byte*> base_of(n, nullptr);  // each location's copy of the layout
    detail::Executor::shared().run(n, 0, [&](std::size_t k) {
      LoadOptions mine = base;
      mine.into = request.locations[k];
      mine.engine = engine_of(k);
      Buffer buffer = Buffer::allocate(request.locations[k], allocation_size);
      mine.destination = buffer.span();
      base_of[k] = buffer.data();
      result.locations[k] = detail::LoadAccess::load(path, mine, files, &names[k]);
      detail::LoadAccess::adopt(result.locations[k], std::move(buffer));
    });
    // Run j occupies one byte range of the layout (runs are contiguous in file order, and so in
    // the layout): one copy per (reader, other location).
    const auto& range = split.range;
    std::atomic<std::uint64_t> copied{0};
    detail::Executor::shared().run(n, 0, [&](std::size_t k) {
      for (std::size_t j = 0; j < n; ++j) {
        const auto [begin, end] = range[j];
        if (j == k || begin >= end) continue;
        const MemorySpan to{base_of[k] + begin, end - begin, request.locations[k]};
        const MemorySpan from{base_of[j] + begin, end - begin, request.locations[j]};
        copy_memory(to, from);
        copied += end - begin;
      }
    });
    result.bytes_between = copied;
    if (base.verify)
      detail::Executor::shared().run(n, 0, [&](std::size_t k) { detail::LoadAccess::verify(result.locations[k], files, base.require_checksums); });
  }
  for (auto& location : result.locations) result.bytes_from_storage += location.stats().bytes;
  Stats total;
  timer.finish(total);
  result.seconds = total.seconds;
  return result;
}

void detail::keep_indexed_tensors(std::vector<CheckpointFile>& files, const st::ShardIndex& index, const ErrorContext& context) {
  if (files.size() != index.shards.size())
    throw Error(errno_code(EPROTO), context,
                fmt::format("{} shards opened for the {} the index names (an internal error)", files.size(), index.shards.size()));
  for (std::size_t k = 0; k < files.size(); ++k)
    std::erase_if(files[k].header.tensors, [&](const st::TensorInfo& t) {
      const auto it = index.weight_map.find(t.name);
      return it == index.weight_map.end() || it->second != index.shards[k];
    });
  for (const auto& [tensor, shard] : index.weight_map) {
    const auto k = static_cast<std::size_t>(std::find(index.shards.begin(), index.shards.end(), shard) - index.shards.begin());
    if (k >= files.size() || files[k].header.find(tensor) == nullptr)
      throw Error(errno_code(EINVAL), context, fmt::format("tensor '{}' is missing from its shard '{}'", tensor, shard));
  }
}

std::vector<std::size_t> detail::contiguous_runs(const std::vector<std::uint64_t>& sizes, std::size_t n) {
  std::uint64_t total = 0;
  for (const auto size : sizes) total += size;
  std::vector<std::size_t> run(sizes.size());
  std::uint64_t before = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    // A tensor goes to the run its middle byte falls in.
    const std::uint64_t middle = before + sizes[i] / 2;
    run[i] = total == 0 ? i * n / std::max<std::size_t>(sizes.size(), 1)
                        : std::min<std::size_t>(n - 1, static_cast<std::size_t>(static_cast<long double>(middle) * n / total));
    before += sizes[i];
  }
  return run;
}

}  // namespace hbmio
