// What a save writes, wherever it writes it (a local file, shards, an object at a URL): the checks
// of the tensors, their order in the file, the shards of a sharded checkpoint, and the header with
// its checksums. Pure: nothing here touches a file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"
#include "hbmio/safetensors.hpp"

namespace hbmio::detail {

// Names (none empty, none "__metadata__", none twice) and sizes (each span the size its dtype and
// shape call for): what every save checks before it writes anything.
void check_tensors(const std::vector<TensorToSave>& tensors, const ErrorContext& context);
// The indices of `tensors` in the order the save writes them (the reference writer's order; a
// sharded save's shards are consecutive runs of it).
std::vector<std::size_t> file_order(const std::vector<TensorToSave>& tensors);
// A sharded save's shards: greedy runs of the reference writer's order, each at most
// max_shard_size tensor bytes (a larger tensor alone), named model-0000K-of-0000N.safetensors.
struct ShardPlan {
  std::vector<std::vector<TensorToSave>> shards;
  std::vector<std::string> names;
  std::uint64_t total_bytes = 0;
};
// Shards of at most max_shard_size bytes (a larger tensor alone), named model-0000K-of-0000N; a
// state without tensors is one file, model.safetensors, saved without an index.
ShardPlan plan_shards(const std::vector<TensorToSave>& tensors, std::uint64_t max_shard_size);
// The caller's metadata without stale checksum entries and, with options.checksums, with
// fixed-width placeholders for the new ones: a header serialized with them has the final
// header's size, and so fixes where the data goes before the checksums are known.
std::map<std::string, std::string> metadata_to_save(const std::vector<TensorToSave>& tensors, const SaveOptions& options);
// The final header: `metadata` (from metadata_to_save) with each tensor's checksum (in the order
// of `tensors`), sealed; throws EPROTO if its size differs from the placeholder header's.
std::string sealed_header(std::vector<safetensors::TensorInfo> infos, std::map<std::string, std::string> metadata,
                          const std::vector<TensorToSave>& tensors, const std::vector<std::uint64_t>& checksums,
                          std::uint64_t placeholder_size, const ErrorContext& context);

}  // namespace hbmio::detail
