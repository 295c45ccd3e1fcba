#include "checkpoint/persist.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "checkpoint/commit.hpp"
#include "checkpoint/integrity.hpp"
#include "checkpoint/save_layout.hpp"
#include "checkpoint/staging.hpp"
#include "core/error_boundary.hpp"
#include "core/executor.hpp"
#include "hbmio/error.hpp"
#include "io/engine_internal.hpp"
#include "io/uring_plan.hpp"

namespace hbmio::detail {
namespace fs = std::filesystem;
namespace st = safetensors;

namespace {

// The bytes a round takes from the staging, at most: half the pool, so that a snapshot larger
// than the pool fills the other half while a round is written. A state that fits the pool is
// then written in a few rounds (the first piece, what the snapshot copied meanwhile, the rest),
// and every round but the file's last ends on the engines' 4 KiB grid (see below).
// On a failure of the writer's round, tells the snapshot (StagedStream::fail) before the round's
// pieces are dropped: their blocks then go back to the pool, and a snapshot waiting for a block
// would otherwise take one and copy more for a save that cannot finish.
class StopSnapshotOnFailure {
 public:
  explicit StopSnapshotOnFailure(StagedStream& stream) : stream_(stream), exceptions_(std::uncaught_exceptions()) {}
  ~StopSnapshotOnFailure() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    try {
      stream_.fail();
    } catch (...) {  // the save's thread says it again once the error reaches it (async_save.cpp)
    }
  }
  StopSnapshotOnFailure(const StopSnapshotOnFailure&) = delete;
  StopSnapshotOnFailure& operator=(const StopSnapshotOnFailure&) = delete;

 private:
  StagedStream& stream_;
  int exceptions_;
};

static_assert(kStagingGrid == kSlotAlignment, "rounds and staging must follow the engines' grid");

std::uint64_t staged_round_limit() {
  return std::max<std::uint64_t>(StagingPool::kBlockBytes, StagingPool::shared().stats().capacity / 2);
}

// The tensors' bytes from a background save's staging. Pieces arrive in file order (the snapshot
// walks the tensors so, laid end to end as in the file), and the writer takes whatever has been
// staged, so the writes start with the first piece and overlap the rest of the snapshot. Each
// round is one batch of the engine, written as a blocking save writes its tensors, and hashed
// beside its writes (a tensor's pieces in order into its XXH3 streaming state, tensors on
// several threads as a blocking save hashes them).
//
// A round ends on the 4 KiB grid unless it holds the file's last bytes: the bytes past the
// round's last grid line (less than 4 KiB) are copied out of their staging block and written
// at the head of the next round. So every direct write of the file starts and ends where a
// blocking save's would, and only the file's own first and last bytes go through the page cache
// as unaligned edges, as in a blocking save: a round ending anywhere would add two such edges
// per round, and a buffered edge written between direct writes of the same file is what the
// engine keeps apart from them (uring_engine.cpp). Copying that tail, instead of holding its
// piece back, returns the staging block at the round's end: a pool of one block would otherwise
// wait forever for the block that the held piece keeps.
//
// A round's pieces, and with them their staging blocks, are dropped once written and hashed.
// Returns each tensor's checksum in the order of `tensors` (none without checksums).
std::vector<std::uint64_t> write_staged_tensors(StagedStream& stream, Engine& engine, File& file, std::uint64_t data_start,
                                        const std::vector<TensorToSave>& tensors, const std::vector<st::TensorInfo>& infos,
                                        const SaveOptions& options, Stats& total, double& hashing, const ErrorContext& context) {
  struct Place {
    std::size_t index = 0;
    std::uint64_t file_offset = 0;
    std::uint64_t left = 0;  // bytes not yet staged
  };
  std::map<std::string_view, Place> place;
  std::uint64_t left = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    place[tensors[i].name] = {.index = i, .left = tensors[i].data.size};
    left += tensors[i].data.size;
  }
  for (const auto& info : infos) place[info.name].file_offset = data_start + info.begin;
  using State = std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)>;
  std::vector<State> states;
  for (std::size_t i = 0; options.checksums && i < tensors.size(); ++i) {
    states.emplace_back(XXH3_createState(), &XXH3_freeState);
    if (!states.back() || XXH3_64bits_reset(states.back().get()) != XXH_OK) throw Error(errno_code(ENOMEM), context, "XXH3_createState");
  }
  const std::uint64_t limit = staged_round_limit();
  // As a blocking save hashes: a quarter of the cores (see persist_file).
  const unsigned hash_threads = std::max(1u, std::thread::hardware_concurrency() / 4);
  // The bytes after the last round's grid line, not written yet: file range [carry_at, carry_at + carry_size).
  Buffer carry;
  std::uint64_t carry_at = 0;
  std::uint64_t carry_size = 0;
  while (left > 0) {
    // At most what this file still needs: the queue holds this file's pieces first, then the next
    // file's (a sharded save), and a prefix of `left` bytes is this file's alone.
    const std::vector<StagedPiece> round = stream.take(std::min(limit, left));
    const StopSnapshotOnFailure stop_snapshot(stream);  // destroyed before `round`
    if (round.empty())
      throw Error(errno_code(ECANCELED), context,
                  stream.abandoned() ? "the snapshot stopped before every tensor was copied; nothing was published"
                                     : "the staging ended before every tensor arrived (an internal error); nothing was published");
    // The round's bytes in file order: the carried tail, then each piece where it goes.
    struct Run {
      std::uint64_t at = 0;
      MemorySpan memory;
    };
    std::vector<Run> runs;
    if (carry_size > 0) runs.push_back({carry_at, carry.span().subspan(0, static_cast<std::size_t>(carry_size))});
    struct Group {  // consecutive pieces of one tensor, hashed in order on one thread
      XXH3_state_t* state = nullptr;
      std::size_t first = 0, end = 0;
    };
    std::vector<Group> groups;
    for (std::size_t k = 0; k < round.size(); ++k) {
      const StagedPiece& piece = round[k];
      const auto it = place.find(piece.tensor);
      if (it == place.end() || piece.memory.size > it->second.left)
        throw Error(errno_code(EPROTO), context, fmt::format("a staged piece of '{}' that this file does not expect (an internal error)", piece.tensor));
      const std::uint64_t at = it->second.file_offset + piece.offset;
      if (!runs.empty() && runs.back().at + runs.back().memory.size != at)
        throw Error(errno_code(EPROTO), context,
                    fmt::format("a staged piece of '{}' at file offset {} does not follow the bytes before it (an internal error)",
                                piece.tensor, at));
      runs.push_back({at, piece.memory});
      if (options.checksums) {
        XXH3_state_t* state = states[it->second.index].get();
        if (groups.empty() || groups.back().state != state) groups.push_back({state, k, k});
        groups.back().end = k + 1;
      }
      it->second.left -= piece.memory.size;
      left -= piece.memory.size;
    }
    const std::uint64_t run_begin = runs.front().at;
    const std::uint64_t run_end = runs.back().at + runs.back().memory.size;
    // Where this round's writes end: the file's end, else the last grid line (none: all carried).
    const std::uint64_t cut = left == 0 ? run_end : std::max(run_begin, round_down(run_end, kStagingGrid));
    std::vector<IoRequest> writes;
    Buffer next_carry;
    if (run_end > cut) next_carry = Buffer::allocate({MemoryKind::host}, static_cast<std::size_t>(run_end - cut));
    for (const Run& run : runs) {
      const std::uint64_t end = run.at + run.memory.size;
      if (run.at < cut && end > run.at) {
        const MemorySpan bytes = run.memory.subspan(0, static_cast<std::size_t>(std::min(end, cut) - run.at));
        // Pieces laid end to end in a block are one request: a direct write of the engine then
        // finds all its bytes in one request, at the file's alignment, and goes straight from
        // the block (the engine bounces a write whose bytes span requests).
        IoRequest* last = writes.empty() ? nullptr : &writes.back();
        if (last != nullptr && last->memory.data + last->memory.size == bytes.data && last->memory.location == bytes.location)
          last->memory.size += bytes.size;
        else
          writes.push_back({.op = IoOp::write, .file = &file, .offset = run.at, .memory = bytes, .progress = options.progress,
                            .cancel = options.cancel});
      }
      if (end > cut) {
        const std::uint64_t from = std::max(run.at, cut);
        std::memcpy(next_carry.data() + (from - cut), run.memory.data + (from - run.at), static_cast<std::size_t>(end - from));
      }
    }
    Pending<void> hashed;  // its destructor waits on every path: no hashing of a dropped block
    if (!groups.empty())
      hashed = Executor::shared().start([&round, &groups, &hashing, hash_threads] {
        const auto start = std::chrono::steady_clock::now();
        Executor::shared().run(groups.size(), hash_threads, [&](std::size_t g) {
          for (std::size_t k = groups[g].first; k < groups[g].end; ++k)
            XXH3_64bits_update(groups[g].state, round[k].memory.data, round[k].memory.size);
        });
        hashing += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
    if (!writes.empty()) total.add_part(engine.submit_batch(writes));
    if (hashed.valid()) hashed.get();
    carry = std::move(next_carry);  // the requests that named the old one are done
    carry_at = cut;
    carry_size = run_end - cut;
  }
  std::vector<std::uint64_t> sums;
  for (const auto& state : states) sums.push_back(XXH3_64bits_digest(state.get()));
  return sums;
}

// One safetensors file at `target` (a regular file's path or nothing, links resolved), named
// `shown` in errors and notes.
Stats persist_file(const fs::path& target, const std::string& shown, const std::vector<TensorToSave>& tensors,
                const SaveOptions& options, bool top_level, StagedStream* staged) {
  // top_level: `target` is the caller's path, not a shard in a sharded save's temporary directory.
  // Only there does the rename wait for a rewrite of the file in place, and only there is it a
  // publication (a failure after it is reported as such).
  TransferTimer timer;
  const ErrorContext context{.op = "save", .path = shown};

  // Check everything before touching the disk.
  check_tensors(tensors, context);
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(infos);

  // Checksums are computed while the tensors are written (both only read the tensors' memory),
  // and the header, which holds them, is written last.
  std::map<std::string, std::string> metadata = metadata_to_save(tensors, options);
  std::vector<MemorySpan> spans;
  if (options.checksums)
    for (const auto& t : tensors) spans.push_back(t.data);
  std::string header = st::serialize_header(infos, metadata, options.empty_metadata);

  check_directory_of(target, context);
  FileSystem& files = files_of(options);
  remove_stale_temporaries(files, target);
  check_cancel(options.cancel, context);
  const EngineInUse chosen(options.engine, options.backend, options.engine_options,
                                   options.engine ? nullptr : files.make_engine(options.backend, options.engine_options));
  Engine* const engine = chosen.get();
  Stats total;
  std::optional<ReplacedFile> previous;  // released (in the background) when the save returns or fails
  // Where the time goes, for the Stats note: a save is its writes plus what makes them durable.
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const Clock::time_point started = Clock::now();
  double hashing = 0, data = 0, wait = 0, header_write = 0, fsync = 0;
  {
    PendingFile pending(files, target, shown);
    File& file = pending.file();
    std::vector<std::uint64_t> computed;  // each tensor's checksum, in the order of `tensors`
    if (staged != nullptr) {
      const Clock::time_point phase = Clock::now();
      computed = write_staged_tensors(*staged, *engine, file, header.size(), tensors, infos, options, total, hashing, context);
      data = seconds_since(phase);
    } else {
      // Hashing runs beside the writes; the future's destructor waits for it on every path, so
      // no hashing thread reads the tensors after a failed save returns.
      Pending<std::vector<std::uint64_t>> sums;
      if (options.checksums)
        sums = Executor::shared().start([&spans, &hashing, &seconds_since] {
          const Clock::time_point start = Clock::now();
          // A quarter of the cores: hashing on all of them starved the writers' threads (saves
          // with checksums ran slower than without, though hashing took a small part of the
          // writes' time; bench/RESULTS.md, "Saves"). A quarter still finishes well within the
          // writes.
          auto result = xxh3_of_each(spans, std::max(1u, std::thread::hardware_concurrency() / 4));
          hashing = seconds_since(start);
          return result;
        });
      // Every tensor in one batch, so the engine's workers write them all at once.
      std::vector<IoRequest> writes;
      std::map<std::string_view, MemorySpan> data_of;
      for (const auto& t : tensors) data_of.emplace(t.name, t.data);
      for (const auto& info : infos)
        writes.push_back({.op = IoOp::write, .file = &file, .offset = header.size() + info.begin, .memory = data_of.at(info.name),
                          .progress = options.progress, .cancel = options.cancel});
      Clock::time_point phase = Clock::now();
      total.add_part(engine->submit_batch(writes));
      data = seconds_since(phase);
      if (options.checksums) {
        phase = Clock::now();
        computed = sums.get();
        wait = seconds_since(phase);
      }
    }
    if (options.checksums) header = sealed_header(infos, metadata, tensors, computed, header.size(), context);
    Buffer header_buffer = Buffer::allocate({MemoryKind::host}, header.size());
    std::memcpy(header_buffer.data(), header.data(), header.size());
    const IoRequest header_request{.op = IoOp::write, .file = &file, .offset = 0, .memory = header_buffer.span()};
    Clock::time_point phase = Clock::now();
    total.add_part(engine->submit_batch({&header_request, 1}));
    header_write = seconds_since(phase);
    if (options.keep_attributes) take_attributes(target, file.fd(), context);
    check_cancel(options.cancel, context);
    phase = Clock::now();
    files.sync(file, context);  // throws on failure: never retried, the old checkpoint stays
    fsync = seconds_since(phase);
    // The last point a stop request is heeded: from the rename on, the new file is the checkpoint.
    check_cancel(options.cancel, context);
    previous.emplace(target);
    pending.publish(context, top_level, options.cancel);
  }
  if (top_level) sync_published(files, target.parent_path(), shown);
  else sync_directory(files, target.parent_path(), shown);
  const double all = seconds_since(started);
  std::string engine_note = total.note;
  total.note = fmt::format("{} tensors, durable (fsync, rename, directory fsync){}; data writes {:.3f} s{}, header {:.3f} s, "
                           "fsync {:.3f} s, the rest (rename, directory fsync, set-up) {:.3f} s{}{}",
                           tensors.size(), options.checksums ? ", with XXH3-64 checksums" : "", data,
                           options.checksums ? fmt::format(" (hashing beside them {:.3f} s, then waited {:.3f} s)", hashing, wait) : "",
                           header_write, fsync, all - data - wait - header_write - fsync, engine_note.empty() ? "" : "; ", engine_note);
  timer.finish(total);
  return total;
}

// A name a checkpoint's file has: model.safetensors, the index, model-00001-of-00004.safetensors.
bool old_checkpoint_name(const std::string& name) {
  static const std::regex shard_name(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == "model.safetensors" || name == "model.safetensors.index.json" || std::regex_match(name, shard_name);
}

// The shards the old index of a directory a sharded save replaces names (whatever their names).
// With old_checkpoint_name, the old checkpoint's own files; nothing else goes: model-ema.safetensors
// or model-best.safetensors are the user's.
std::vector<std::string> shards_of_old_index(const fs::path& dir) {
  try {
    std::error_code ec;
    const fs::path index = dir / "model.safetensors.index.json";
    if (fs::is_regular_file(index, ec)) return st::read_index(index.string()).shards;
  } catch (const std::exception&) {
    // An index that cannot be read names nothing: its shards, if any, stay as the user's files.
  }
  return {};
}

// The directory a sharded save builds takes the mode, owner and group of the one it replaces (a
// private or a group's setgid directory stays so). Best effort for the owner: only root may give
// a file away.
void take_directory_attributes(const fs::path& from, const fs::path& to) {
  struct stat st {};
  if (::stat(from.c_str(), &st) != 0) return;
  if (::chown(to.c_str(), st.st_uid, st.st_gid) != 0) (void)::chown(to.c_str(), static_cast<uid_t>(-1), st.st_gid);
  (void)::chmod(to.c_str(), st.st_mode & 07777);
}

// After the swap, the old directory (at `old`) may hold what was written into it while the new
// one was built: files created or replaced after the listing. They are moved into the new
// directory, replacing the copies taken at the listing (hard links: the same inode means nothing
// changed); the rest (the old checkpoint's files, the copies' originals) is removed. A writer
// still adding files meanwhile is met again by the next pass, up to a few.
void hand_over_late_files(FileSystem& files, const fs::path& old, const fs::path& target, const std::set<std::string>& stale) {
  for (int pass = 0; pass < 4; ++pass) {
    std::error_code ec;
    std::vector<fs::path> entries;
    for (const auto& entry : fs::directory_iterator(old, ec)) entries.push_back(entry.path());
    if (ec) break;
    for (const fs::path& entry : entries) {
      const std::string name = entry.filename().string();
      if (stale.contains(name) || old_checkpoint_name(name)) continue;
      struct stat was {}, now {};
      if (::lstat(entry.c_str(), &was) != 0 || S_ISDIR(was.st_mode)) continue;
      const fs::path there = target / entry.filename();
      if (::lstat(there.c_str(), &now) == 0 && now.st_ino == was.st_ino && now.st_dev == was.st_dev) continue;  // the copy
      (void)::rename(entry.c_str(), there.c_str());  // newer than the copy, or not copied at all
    }
    files.remove_all(old.string());
    if (!fs::exists(old, ec)) return;
  }
}

// Writes small bytes (the index) to a new file and makes them durable; `shown` names it in errors.
void write_index(FileSystem& files, const fs::path& file, const std::string& shown, const std::string& bytes) {
  const ErrorContext context{.op = "save", .path = shown};
  File out = files.open(file.string(), shown, OpenMode::create_new, true);
  files.write(out, std::as_bytes(std::span(bytes)), 0, context);
  files.sync(out, context);
}

Stats persist_sharded(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options,
                   StagedStream* staged) {
  TransferTimer timer;
  const ErrorContext context{.op = "save sharded checkpoint", .path = path};
  const fs::path target = final_target(path, true, context);

  const auto [shards, shard_names, total_bytes] = plan_shards(tensors, options.max_shard_size);

  check_directory_of(target, context);
  FileSystem& files = files_of(options);
  remove_stale_temporaries(files, target);  // directories too
  check_cancel(options.cancel, context);
  std::random_device random;
  const fs::path temp = temp_name(target, random);
  Stats total;
  std::vector<std::string> dropped;  // checkpoint files of the old directory that the new one does not have
  std::set<std::string> stale;       // this save's names and the old index's shards (with old_checkpoint_name: not carried over)
  try {
    // A name already there (even a symlink to a directory) is never built into: the random
    // suffix makes that a sign of interference, not a leftover (those were removed above).
    if (const int err = files.make_directory(temp.string()))
      throw Error(errno_code(err), context,
                  err == EEXIST ? fmt::format("temporary directory {} already exists", temp.string())
                                : fmt::format("mkdir of the temporary directory {}", temp.string()));
    const FileLock lock(::open(temp.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    nlohmann::json weight_map = nlohmann::json::object();
    SaveOptions single = options;
    single.max_shard_size = 0;
    const EngineInUse chosen(options.engine, options.backend, options.engine_options,
                                     options.engine ? nullptr : files.make_engine(options.backend, options.engine_options));
    single.engine = chosen.get();  // one engine writes every shard
    for (std::size_t k = 0; k < shards.size(); ++k) {
      // Errors name the shard where it will be (PATH/model-...), not inside the temporary directory.
      total.add_part(persist_file(temp / shard_names[k], (fs::path(path) / shard_names[k]).string(), shards[k], single, false, staged));
      for (const auto& t : shards[k]) weight_map[t.name] = shard_names[k];
    }
    const bool indexed = !tensors.empty();  // see plan_shards: an empty state is one file
    if (indexed) {
      const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      write_index(files, temp / "model.safetensors.index.json", (fs::path(path) / "model.safetensors.index.json").string(),
                  index.dump(2) + "\n");
    }
    // Whatever else the directory holds (config.json, tokenizer files, symlinks as symlinks)
    // comes along. The old checkpoint's own files do not: a model.safetensors beside the new index
    // would be loaded in its place by loaders that look for it first, and a shard of another count
    // is stale. They are named in the result's note. A file removed while it is listed is gone.
    // The names this save writes are the new checkpoint's, whatever the old directory holds
    // under them by the time it is listed or swapped out (a file written meanwhile, or the shards
    // of a sharded save of the same directory that swapped in first).
    stale.insert(shard_names.begin(), shard_names.end());
    stale.insert("model.safetensors.index.json");
    if (fs::exists(target)) {
      for (std::string& shard : shards_of_old_index(target)) stale.insert(std::move(shard));
      for (const auto& entry : fs::directory_iterator(target)) {
        const std::string name = entry.path().filename().string();
        if (!stale.contains(name) && !old_checkpoint_name(name)) {
          std::error_code ec;
          fs::copy(entry.path(), temp / entry.path().filename(),
                   fs::copy_options::recursive | fs::copy_options::create_hard_links | fs::copy_options::copy_symlinks, ec);
          if (ec && ec != std::errc::no_such_file_or_directory)
            throw Error(ec, {.op = context.op, .path = entry.path().string()}, "carry it into the new checkpoint directory");
        } else if ((!indexed || name != "model.safetensors.index.json") &&
                   std::find(shard_names.begin(), shard_names.end(), name) == shard_names.end()) {
          dropped.push_back(name);
        }
      }
    }
    // The mode last (a read-only directory's mode would keep the save from writing into it).
    take_directory_attributes(target, temp);
    sync_directory(files, temp, path);
    // The last point a stop request is heeded: the swap below publishes the new checkpoint.
    check_cancel(options.cancel, context);
    if (fs::exists(target)) {
      // One atomic step: the new directory takes the name, the old one takes the temporary name.
      if (const int err = files.exchange(temp.string(), target.string()))
        throw Error(errno_code(err), context, "renameat2(RENAME_EXCHANGE) of the new directory");
    } else if (const int err = files.rename(temp.string(), target.string())) {
      throw Error(errno_code(err), context, "rename of the new directory");
    }
  } catch (...) {
    files.remove_all(temp.string());
    throw;
  }
  sync_published(files, target.parent_path(), path, temp);
  hand_over_late_files(files, temp, target, stale);  // then the old checkpoint goes
  std::sort(dropped.begin(), dropped.end());
  total.note = fmt::format("{}, swapped in atomically{}",
                           tensors.empty() ? std::string("no tensors: one empty model.safetensors, no index")
                                           : fmt::format("{} tensors in {} shard(s) + index", tensors.size(), shards.size()),
                           dropped.empty() ? ""
                                           : fmt::format("; the old checkpoint's {} (not part of the new one) went with it",
                                                         fmt::join(dropped, ", ")));
  timer.finish(total);
  return total;
}

}  // namespace

Stats persist(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options, StagedStream* staged) {
  return errors_as_hbmio({.op = "save", .path = path}, [&] {
    if (options.max_shard_size > 0) return persist_sharded(path, tensors, options, staged);
    return persist_file(final_target(path, false, {.op = "save", .path = path}), path, tensors, options, true, staged);
  });
}

std::vector<StagedFile> staged_files(const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  // What persist_file serializes before the data: the header of the file's tensors in the
  // reference writer's order, with the metadata (and checksum placeholders) it saves.
  const auto file_of = [](const std::vector<TensorToSave>& file_tensors, const SaveOptions& file_options) {
    std::vector<st::TensorInfo> infos;
    std::uint64_t bytes = 0;
    for (const auto& t : file_tensors) {
      infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
      bytes += t.data.size;
    }
    st::order_like_reference(infos);
    return StagedFile{.data_start = st::serialize_header(infos, metadata_to_save(file_tensors, file_options),
                                                         file_options.empty_metadata).size(),
                      .bytes = bytes};
  };
  if (options.max_shard_size == 0) return {file_of(tensors, options)};
  SaveOptions single = options;  // as persist_sharded saves each shard
  single.max_shard_size = 0;
  std::vector<StagedFile> files;
  for (const auto& shard : plan_shards(tensors, options.max_shard_size).shards) files.push_back(file_of(shard, single));
  return files;
}

std::string check_save(const std::string& path, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  return errors_as_hbmio({.op = "save", .path = path}, [&] {
    const ErrorContext context{.op = "save", .path = path};
    if (is_remote_url(path))
      throw Error(errno_code(ENOTSUP), context,
                  "background saves write local paths; save to a URL with a blocking save (save_checkpoint, "
                  "save_file(..., blocking=True)), or save locally in the background and upload the result");
    check_tensors(tensors, context);
    const fs::path target = final_target(path, options.max_shard_size > 0, context);
    check_directory_of(target, context);
    return save_key(target);
  });
}

}  // namespace hbmio::detail
