#include "checkpoint/save_layout.hpp"

#include <map>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/integrity.hpp"

namespace hbmio::detail {
namespace st = safetensors;

namespace {
std::uint64_t expected_size(const TensorToSave& t) {
  std::uint64_t elements = 1;
  for (std::uint64_t d : t.shape)
    if (__builtin_mul_overflow(elements, d, &elements))
      throw Error(errno_code(EOVERFLOW), {.op = "save"}, fmt::format("tensor '{}': shape overflows", t.name));
  std::uint64_t bits = 0;
  if (__builtin_mul_overflow(elements, std::uint64_t{st::bits_per_element(t.dtype)}, &bits))
    throw Error(errno_code(EOVERFLOW), {.op = "save"}, fmt::format("tensor '{}': shape overflows", t.name));
  return (bits + 7) / 8;
}
}  // namespace

void check_tensors(const std::vector<TensorToSave>& tensors, const ErrorContext& context) {
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    if (t.name.empty()) throw Error(errno_code(EINVAL), context, "a tensor has an empty name");
    if (t.name == "__metadata__") throw Error(errno_code(EINVAL), context, "'__metadata__' cannot name a tensor");
    if (!names.insert(t.name).second) throw Error(errno_code(EINVAL), context, fmt::format("tensor '{}' given twice", t.name));
    if (expected_size(t) != t.data.size)
      throw Error(errno_code(EINVAL), context,
                  fmt::format("tensor '{}': {} bytes in memory, but {} {} needs {}", t.name, t.data.size,
                              st::to_string(t.dtype), fmt::join(t.shape, "x"), expected_size(t)));
  }
}

std::map<std::string, std::string> metadata_to_save(const std::vector<TensorToSave>& tensors, const SaveOptions& options) {
  std::map<std::string, std::string> metadata = options.metadata;
  for (auto it = metadata.begin(); it != metadata.end();)  // stale checksums would lie
    it = it->first.starts_with(kChecksumPrefix) || it->first == kChecksumAlgorithmKey || it->first == kHeaderChecksumKey
             ? metadata.erase(it)
             : std::next(it);
  if (options.checksums) {
    metadata[kChecksumAlgorithmKey] = kChecksumAlgorithm;
    metadata[kHeaderChecksumKey] = to_hex(0);  // sealed once the tensors' are in
    for (const auto& t : tensors) metadata[kChecksumPrefix + t.name] = to_hex(0);
  }
  return metadata;
}

std::string sealed_header(std::vector<st::TensorInfo> infos, std::map<std::string, std::string> metadata,
                          const std::vector<TensorToSave>& tensors, const std::vector<std::uint64_t>& checksums,
                          std::uint64_t placeholder_size, const ErrorContext& context) {
  for (std::size_t i = 0; i < tensors.size(); ++i) metadata[kChecksumPrefix + tensors[i].name] = to_hex(checksums[i]);
  std::string header = st::serialize_header(infos, metadata);
  seal_header(header);
  // The placeholders fixed where the data went: the sealed header must keep their size.
  if (header.size() != placeholder_size)
    throw Error(errno_code(EPROTO), context,
                fmt::format("header changed size with its checksums ({} -> {} bytes)", placeholder_size, header.size()));
  return header;
}

ShardPlan plan_shards(const std::vector<TensorToSave>& tensors, std::uint64_t max_shard_size) {
  // Greedy shards in the reference writer's tensor order.
  std::vector<st::TensorInfo> order;
  for (const auto& t : tensors) order.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(order);
  std::map<std::string_view, const TensorToSave*> by_name;
  for (const auto& t : tensors) by_name.emplace(t.name, &t);
  ShardPlan plan;
  plan.shards.resize(1);
  std::uint64_t shard_bytes = 0;
  for (const auto& info : order) {
    if (shard_bytes > 0 && shard_bytes + info.size() > max_shard_size) {
      plan.shards.emplace_back();
      shard_bytes = 0;
    }
    plan.shards.back().push_back(*by_name.at(info.name));
    shard_bytes += info.size();
    plan.total_bytes += info.size();
  }
  // No tensor: one empty model.safetensors and no index, as Hugging Face writes a state of one
  // shard. An index's weight_map would name no file, and such an index is refused by loads.
  if (tensors.empty()) {
    plan.names.push_back("model.safetensors");
    return plan;
  }
  for (std::size_t k = 0; k < plan.shards.size(); ++k)
    plan.names.push_back(fmt::format("model-{:05}-of-{:05}.safetensors", k + 1, plan.shards.size()));
  return plan;
}

std::vector<std::size_t> file_order(const std::vector<TensorToSave>& tensors) {
  std::vector<st::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back({t.name, t.dtype, t.shape, 0, t.data.size});
  st::order_like_reference(infos);
  std::map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  std::vector<std::size_t> order;
  for (const auto& info : infos) order.push_back(index.at(info.name));
  return order;
}

}  // namespace hbmio::detail
