// A checkpoint opened for access a tensor at a time (OpenedCheckpoint): the headers parsed and the
// files opened once, reads of parts of tensors planned onto those descriptors and sent to an
// engine as one batch.
#include <algorithm>
#include <cerrno>
#include <tuple>

#include <fmt/format.h>

#include "checkpoint/source.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/error.hpp"

namespace hbmio {

OpenedCheckpoint::OpenedCheckpoint(const std::string& path, const std::optional<RemoteOptions>& remote, CacheUse cache,
                                   const std::string& cache_socket)
    : path_(path), files_(open_checkpoint(path, remote)) {
  resident_ = std::make_shared<const detail::ResidentCopies>(detail::resident_copies(files_, cache, cache_socket));
  for (std::size_t f = 0; f < files_.size(); ++f)
    for (const auto& t : files_[f].header.tensors) tensors_.push_back({f, &t, files_[f].header.data_offset + t.begin});
  // By file, then by (begin, end) as safetensors' offset_keys: an empty tensor comes before the
  // tensor that starts where it does; empty tensors at one offset by name.
  std::sort(tensors_.begin(), tensors_.end(), [](const Tensor& a, const Tensor& b) {
    return std::tie(a.file, a.info->begin, a.info->end, a.info->name) < std::tie(b.file, b.info->begin, b.info->end, b.info->name);
  });
  for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].info->name, i);
}

std::optional<std::size_t> OpenedCheckpoint::find(std::string_view name) const noexcept {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

const std::map<std::string, std::string>& OpenedCheckpoint::metadata() const noexcept {
  static const std::map<std::string, std::string> none;
  return files_.empty() ? none : files_.front().header.metadata;
}

void OpenedCheckpoint::check(const TensorRead& r) const {
  if (r.tensor >= tensors_.size())
    throw Error(errno_code(EINVAL), {.op = "read tensor", .path = path_},
                fmt::format("tensor index {} (the checkpoint holds {})", r.tensor, tensors_.size()));
  const Tensor& t = tensors_[r.tensor];
  const std::uint64_t size = t.info->size();
  if (r.offset > size || r.length > size - r.offset || r.into.size < r.length)
    throw Error(errno_code(EINVAL),
                {.op = "read tensor", .path = files_[t.file].path, .offset = t.file_offset + r.offset, .length = r.length},
                fmt::format("bytes {}..{} of tensor '{}' ({} bytes) into {} bytes of memory", r.offset, r.offset + r.length,
                            t.info->name, size, r.into.size));
}

Stats OpenedCheckpoint::read(const std::vector<TensorRead>& reads, Engine& engine, const ReadOptions& options) const {
  std::vector<detail::RangeRead> ranges;
  std::vector<std::size_t> read_of;  // per range, its index in `reads`
  ranges.reserve(reads.size());
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const TensorRead& r = reads[i];
    check(r);
    const Tensor& t = tensors_[r.tensor];
    if (r.length > 0) {
      ranges.push_back({t.file, t.file_offset + r.offset, r.into.subspan(0, r.length)});
      read_of.push_back(i);
    }
  }
  // Objects at URLs with the options they were opened with (OpenedCheckpoint's `remote`).
  detail::ReadRangesOptions source{.engine = [&]() -> Engine& { return engine; }, .progress = options.progress,
                                   .cancel = options.cancel, .resident = resident_.get()};
  std::vector<std::atomic<std::uint64_t>> missing;  // per range, bytes not yet told landed
  if (options.landed) {
    for (std::size_t i = 0; i < reads.size(); ++i)
      if (reads[i].length == 0) options.landed(i);  // nothing to wait for
    missing = std::vector<std::atomic<std::uint64_t>>(ranges.size());
    for (std::size_t k = 0; k < ranges.size(); ++k) missing[k] = ranges[k].into.size;
    source.landed = [&](std::size_t k, std::uint64_t, std::uint64_t length) {
      if (missing[k].fetch_sub(length) == length) options.landed(read_of[k]);
    };
    source.landed_quick = true;
  }
  Stats stats = detail::read_ranges(files_, ranges, source);
  stats.note += detail::resident_note(*resident_);
  return stats;
}

}  // namespace hbmio
