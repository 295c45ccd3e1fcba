// Checkpoints saved to s3:// URLs: the file a local save would write, uploaded as one object
// (write_remote: one PUT, or a multipart upload completed only when every part is stored), so a
// reader sees the old object or the whole new one. The bytes go from the tensors' memory (host or
// GPU) into each part's buffer just before the part is sent; checksums are computed beside the
// upload, and the header that holds them is in the first part, which is sent last.
// Sharded: each shard an object under the prefix, then the index, written last: a loader that
// starts from the index never sees a shard of this save missing. Object stores have no directory
// to swap, so each save's shards have names of their own (model-00001-of-00003-<save id>
// .safetensors): a save that fails or is stopped halfway replaces no object the prefix's index
// names (a fixed name would have put new shard 1 beside old shards 2..N, each passing its own
// checksums), removes what it uploaded, and the prefix loads as the checkpoint before it. Once the
// new index is written, the shards the old index named are deleted (a load of the old checkpoint
// still running then fails on a missing shard, never mixes the two).
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/integrity.hpp"
#include "checkpoint/remote_save.hpp"
#include "checkpoint/save_layout.hpp"
#include "core/executor.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"
#include "io/engine_internal.hpp"

namespace hbmio::detail {
namespace {

namespace st = safetensors;

Stats save_remote_file(const std::string& url, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  const ErrorContext context{.op = "save", .path = url};
  check_tensors(tensors, context);
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(infos);
  const std::map<std::string, std::string> metadata = metadata_to_save(tensors, options);
  std::vector<MemorySpan> spans;
  if (options.checksums)
    for (const auto& t : tensors) spans.push_back(t.data);
  const std::string placeholder = st::serialize_header(infos, metadata, options.empty_metadata);
  const std::uint64_t data_start = placeholder.size();
  std::uint64_t size = data_start;
  for (const auto& info : infos) size = std::max(size, data_start + info.end);

  // Each tensor's place in the object, in file order.
  struct Piece {
    std::uint64_t begin, end;  // in the object
    MemorySpan from;
  };
  std::vector<Piece> pieces;
  {
    std::map<std::string_view, MemorySpan> data_of;
    for (const auto& t : tensors) data_of.emplace(t.name, t.data);
    for (const auto& info : infos) pieces.push_back({data_start + info.begin, data_start + info.end, data_of.at(info.name)});
  }

  // Checksums beside the upload; the header is sealed once, by the first fill that needs it.
  Pending<std::vector<std::uint64_t>> sums;
  if (options.checksums)
    sums = Executor::shared().start([&spans] { return xxh3_of_each(spans, std::max(1u, std::thread::hardware_concurrency() / 4)); });
  std::once_flag sealed;
  std::string header = placeholder;
  const auto final_header = [&]() -> const std::string& {
    std::call_once(sealed, [&] {
      if (options.checksums) header = sealed_header(infos, metadata, tensors, sums.get(), placeholder.size(), context);
    });
    return header;
  };

  const auto fill = [&](std::uint64_t offset, std::span<std::byte> into) {
    const std::uint64_t end = offset + into.size();
    if (offset < data_start) {
      const std::string& h = final_header();
      const std::uint64_t n = std::min(end, data_start) - offset;
      std::memcpy(into.data(), h.data() + offset, n);
    }
    // The tensors overlapping [offset, end): pieces are sorted and do not overlap.
    auto it = std::upper_bound(pieces.begin(), pieces.end(), offset, [](std::uint64_t at, const Piece& p) { return at < p.end; });
    for (; it != pieces.end() && it->begin < end; ++it) {
      const std::uint64_t a = std::max(offset, it->begin), b = std::min(end, it->end);
      if (a >= b) continue;
      copy_memory({into.data() + (a - offset), b - a, {}}, it->from.subspan(a - it->begin, b - a));
      // Counted as the part is filled, one part per connection ahead of what is stored.
      if (options.progress != nullptr) *options.progress += b - a;
    }
  };
  bool on_device = false;
  for (const auto& t : tensors) on_device |= t.data.kind() == MemoryKind::device;
  const UploadOptions upload{.pinned = on_device, .progress = nullptr, .cancel = options.cancel};
  Stats stats;
  try {
    stats = write_remote(url, size, fill, upload, options.remote ? *options.remote : RemoteOptions::from_env());
  } catch (...) {
    if (sums.valid()) sums.wait();  // no hashing of the caller's tensors after the save returns
    throw;
  }
  if (sums.valid()) sums.wait();
  stats.note = fmt::format("{} tensors{}, {}", tensors.size(), options.checksums ? " with XXH3-64 checksums" : "", stats.note);
  return stats;
}

// Tells one save's shard objects from another's: 48 random bits, in hex.
std::string save_id() {
  std::random_device random;
  const std::uint64_t bits = (std::uint64_t{random()} << 32 | random()) & 0xFFFF'FFFF'FFFFull;
  return fmt::format("{:012x}", bits);
}

// The shards the index at `index_url` names: none where there is no index (or it cannot be read:
// then nothing is deleted after the save, and old shards stay as garbage, never as data).
std::vector<std::string> shards_named_by(const std::string& index_url, const RemoteOptions& options) {
  try {
    const auto object = RemoteObject::open(index_url, options);
    if (object->size() > st::kMaxIndexSize) return {};
    std::string text(object->size(), '\0');
    if (!text.empty()) object->read(0, {reinterpret_cast<std::byte*>(text.data()), text.size(), {}});
    return st::parse_index(text, object->shown()).shards;
  } catch (const Error&) {
    return {};
  }
}

// Best effort: true when the object is gone.
bool delete_quietly(const std::string& url, const RemoteOptions& options) noexcept {
  try {
    delete_remote(url, options);
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

Stats save_remote(const std::string& url, const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  TransferTimer timer;
  if (!url.starts_with("s3://"))
    throw Error(errno_code(ENOTSUP), {.op = "save", .path = url}, "saves to URLs go to s3:// only (an HTTP server takes no uploads here)");
  if (options.max_shard_size == 0) {
    Stats stats = save_remote_file(url, tensors, options);
    timer.finish(stats);
    return stats;
  }
  // Sharded: URL is a prefix ("s3://bucket/model/", the '/' added where missing). A state without
  // tensors would publish an index naming no object, which loads refuse (a local directory gets
  // one empty model.safetensors instead; an object store's index is what publishes a save).
  if (tensors.empty())
    throw Error(errno_code(EINVAL), {.op = "save", .path = url},
                "a sharded save to a URL needs at least one tensor: save an empty state as one object (no max_shard_size)");
  const std::string prefix = url.ends_with("/") ? url : url + "/";
  const RemoteOptions remote = options.remote ? *options.remote : RemoteOptions::from_env();
  const std::string index_url = prefix + "model.safetensors.index.json";
  auto [shards, names, total_bytes] = plan_shards(tensors, options.max_shard_size);
  const std::string id = save_id();
  for (std::string& name : names) name.insert(name.size() - std::string_view(".safetensors").size(), "-" + id);
  const std::vector<std::string> replaced = shards_named_by(index_url, remote);
  SaveOptions single = options;
  single.max_shard_size = 0;
  Stats total;
  nlohmann::json weight_map = nlohmann::json::object();
  std::size_t uploaded = 0;
  try {
    for (; uploaded < shards.size(); ++uploaded) {
      total.add_part(save_remote_file(prefix + names[uploaded], shards[uploaded], single));
      for (const auto& t : shards[uploaded]) weight_map[t.name] = names[uploaded];
    }
    const std::string index = nlohmann::json({{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}).dump(2) + "\n";
    write_remote(index_url, index.size(), [&](std::uint64_t offset, std::span<std::byte> into) {
      std::memcpy(into.data(), index.data() + offset, into.size());
    }, {.cancel = options.cancel}, remote);
  } catch (...) {
    // A failure of the index's PUT whose answer was lost may still have stored it: an index that
    // names this save's shards means the save published, and they must stay.
    const bool published = uploaded == shards.size() && !names.empty() && [&] {
      const std::vector<std::string> now = shards_named_by(index_url, remote);
      return std::find(now.begin(), now.end(), names.front()) != now.end();
    }();
    if (!published) {
      // The prefix's index still names the shards of the save before: this save's are garbage.
      // (A shard whose own upload failed was aborted by write_remote; one half-stored is not there.)
      for (std::size_t k = 0; k < uploaded; ++k) delete_quietly(prefix + names[k], remote);
      throw;
    }
  }
  unsigned removed = 0;
  for (const std::string& old : replaced)
    if (std::find(names.begin(), names.end(), old) == names.end()) removed += delete_quietly(prefix + old, remote);
  total.backend = "remote";
  total.note = fmt::format("{} tensors in {} shard object(s) (save {}), then the index{}", tensors.size(), shards.size(), id,
                           removed > 0 ? fmt::format("; deleted the {} shard object(s) the index named before", removed) : "");
  timer.finish(total);
  return total;
}

}  // namespace hbmio::detail
