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

Stats OpenedCheckpoint::read(const std::vector<TensorRead>& reads, Engine& engine, std::atomic<std::uint64_t>* progress) const {
  std::vector<detail::RangeRead> ranges;
  ranges.reserve(reads.size());
  for (const TensorRead& r : reads) {
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
    if (r.length > 0) ranges.push_back({t.file, t.file_offset + r.offset, r.into.subspan(0, r.length)});
  }
  // Objects at URLs with the options they were opened with (OpenedCheckpoint's `remote`).
  Stats stats = detail::read_ranges(files_, ranges, {.engine = [&]() -> Engine& { return engine; }, .progress = progress, .resident = resident_.get()});
  stats.note += detail::resident_note(*resident_);
  return stats;
}

}  // namespace hbmio
