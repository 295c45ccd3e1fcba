// Which source reads what (source.hpp).
#include "source/source.hpp"

#include <array>

#include <fmt/format.h>

namespace hbmio::detail {

bool add_read(std::vector<RangeRead>& ranges, std::size_t file, std::uint64_t offset, MemorySpan into, bool same_allocation) {
  if (into.size == 0) return false;
  if (same_allocation && !ranges.empty()) {
    RangeRead& last = ranges.back();
    if (last.file == file && last.offset + last.into.size == offset && last.into.location == into.location &&
        last.into.data + last.into.size == into.data) {
      last.into.size += into.size;
      return true;
    }
  }
  ranges.push_back({file, offset, into});
  return false;
}

Stats read_ranges(const std::vector<CheckpointFile>& files, std::span<const RangeRead> reads, const ReadRangesOptions& options) {
  LocalFiles local;
  RemoteObjects remote;
  ResidentDma resident(local);
  // In the order they are asked and run: the cache's DMA first (the fastest, and its fallback
  // reads through `local`), then the local files' engine batch, then the objects at URLs.
  const std::array<ReadSource*, 3> sources{&resident, &local, &remote};
  std::array<std::vector<std::size_t>, 3> served;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const RangeRead& read = reads[i];
    if (read.file >= files.size())
      throw Error(errno_code(EINVAL), {.op = "read"}, fmt::format("file index {} (the checkpoint holds {})", read.file, files.size()));
    if (read.into.size == 0) continue;
    std::size_t s = 0;
    while (s < sources.size() && !sources[s]->serves(files[read.file], read, options)) ++s;
    if (s == sources.size())
      throw Error(errno_code(EINVAL), {.op = "read", .path = files[read.file].path}, "no source reads this file");
    served[s].push_back(i);
  }
  Stats total;
  bool first = true;
  for (std::size_t s = 0; s < sources.size(); ++s) {
    if (served[s].empty()) continue;
    Stats part = sources[s]->read(files, reads, served[s], options);
    if (first) {
      total = std::move(part);
    } else {
      total.add_part(part);
      if (!part.note.empty()) total.note = total.note.empty() ? part.note : total.note + "; " + part.note;
    }
    first = false;
  }
  return total;
}

}  // namespace hbmio::detail
