// The source of objects at URLs (source.hpp): ranged GETs over the remote workers (remote/).
#include "source/source.hpp"

namespace hbmio::detail {

bool RemoteObjects::serves(const CheckpointFile& file, const RangeRead&, const ReadRangesOptions&) const { return file.remote != nullptr; }

Stats RemoteObjects::read(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, std::span<const std::size_t> which,
                          const ReadRangesOptions& options) {
  std::vector<RemoteRead> remote;
  remote.reserve(which.size());
  for (const std::size_t i : which) remote.push_back({files[reads[i].file].remote.get(), reads[i].offset, reads[i].into});
  LandedFunction landed;
  if (options.landed)
    landed = [&](std::size_t k, std::uint64_t at, std::uint64_t length) { options.landed(which[k], at, length); };
  return read_remote(remote, options.remote ? *options.remote : remote.front().object->options(), options.progress, landed);
}

}  // namespace hbmio::detail
