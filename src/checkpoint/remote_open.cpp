// Checkpoints at URLs: a safetensors object, an index (*.json) beside its shards, or a prefix
// ending in '/' (its model.safetensors.index.json, else its model.safetensors). Each header is
// read with one ranged GET of its first MiB (a second one where the header is longer), then
// validated as a local file's is.
#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "checkpoint/load_internal.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/remote.hpp"

namespace hbmio::detail {
namespace {

namespace st = safetensors;

constexpr std::uint64_t kFirstRead = 1ull << 20;

std::string read_text(const RemoteObject& object, std::uint64_t offset, std::uint64_t length) {
  std::string text(length, '\0');
  if (length > 0) object.read(offset, {reinterpret_cast<std::byte*>(text.data()), length, {}});
  return text;
}

CheckpointFile open_remote_file(const std::string& url, const RemoteOptions& options) {
  auto object = RemoteObject::open(url, options);
  const std::uint64_t size = object->size();
  std::string head = read_text(*object, 0, std::min(size, kFirstRead));
  const std::uint64_t n = st::parse_header_length(reinterpret_cast<const std::byte*>(head.data()), size, object->shown());
  if (8 + n > head.size()) head += read_text(*object, head.size(), 8 + n - head.size());
  st::Header header = st::parse_header(std::string_view(head).substr(8, n), size, object->shown());
  CheckpointFile file;
  file.path = object->shown();
  file.header = std::move(header);
  file.remote = std::move(object);
  return file;
}

// An index already opened, and its shards beside it.
std::vector<CheckpointFile> open_remote_index(const std::string& url, const RemoteObject& index_object, const RemoteOptions& options);

}  // namespace

std::vector<CheckpointFile> open_remote_checkpoint(const std::string& url, const RemoteOptions& options) {
  const std::string base = url.substr(0, url.find_first_of("?#"));
  if (base.ends_with("/")) {
    // A prefix: the index where there is one, else a single file.
    const std::string index = remote_sibling(url, "model.safetensors.index.json");
    std::shared_ptr<RemoteObject> index_object;
    try {
      index_object = RemoteObject::open(index, options);
    } catch (const Error& e) {
      if (e.code() != std::errc::no_such_file_or_directory) throw;
      return {open_remote_file(remote_sibling(url, "model.safetensors"), options)};
    }
    return open_remote_index(index, *index_object, options);
  }
  if (!base.ends_with(".json")) return {open_remote_file(url, options)};
  return open_remote_index(url, *RemoteObject::open(url, options), options);
}

namespace {

std::vector<CheckpointFile> open_remote_index(const std::string& url, const RemoteObject& index_file, const RemoteOptions& options) {
  const RemoteObject* const index_object = &index_file;
  if (index_object->size() > st::kMaxIndexSize)
    throw Error(errno_code(EFBIG), {.op = "open", .path = index_object->shown()},
                fmt::format("an index of {} bytes (at most {} are read)", index_object->size(), st::kMaxIndexSize));
  const st::ShardIndex index = st::parse_index(read_text(*index_object, 0, index_object->size()), index_object->shown());
  if (index.shards.empty())
    throw Error(errno_code(EINVAL), {.op = "open", .path = index_object->shown()}, "the index names no shard (its weight_map is empty)");
  std::vector<CheckpointFile> files;
  for (const std::string& shard : index.shards) files.push_back(open_remote_file(remote_sibling(url, shard), options));
  keep_indexed_tensors(files, index, {.op = "open", .path = index_object->shown()});
  return files;
}

}  // namespace
}  // namespace hbmio::detail
