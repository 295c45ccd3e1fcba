// A checkpoint opened for access a tensor at a time (OpenedCheckpoint): the headers parsed and the
// files opened once, reads of parts of tensors planned onto those descriptors and sent to an
// engine as one batch.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <iterator>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "source/source.hpp"
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
  // Reads that follow each other both in one file and in memory (a prefetch's tensors laid out in
  // one allocation as they lie in the file) become one range, so the engine reads many small
  // tensors as one large request: no piece, copy and completion per tensor. Each range remembers
  // its reads (`members`) to tell each one landed.
  struct Member {
    std::size_t read;        // index into `reads`
    std::uint64_t begin;     // where its bytes start within the range
    std::uint64_t length;
  };
  std::vector<detail::RangeRead> ranges;
  std::vector<std::size_t> first_member;  // per range, its first member; members are in range order
  std::vector<Member> members;
  ranges.reserve(reads.size());
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const TensorRead& r = reads[i];
    check(r);
    if (r.length == 0) continue;
    const Tensor& t = tensors_[r.tensor];
    // Adjacent addresses alone do not make one allocation (TensorRead::allocation).
    const bool one_allocation = r.allocation != 0 && !members.empty() && reads[members.back().read].allocation == r.allocation;
    const std::uint64_t size_before = ranges.empty() ? 0 : ranges.back().into.size;
    if (detail::add_read(ranges, t.file, t.file_offset + r.offset, r.into.subspan(0, static_cast<std::size_t>(r.length)), one_allocation)) {
      members.push_back({i, size_before, r.length});
      continue;
    }
    first_member.push_back(members.size());
    members.push_back({i, 0, r.length});
  }
  first_member.push_back(members.size());
  // Objects at URLs with the options they were opened with (OpenedCheckpoint's `remote`).
  detail::ReadRangesOptions source{.engine = [&]() -> Engine& { return engine; }, .progress = options.progress,
                                   .cancel = options.cancel, .resident = resident_.get()};
  std::vector<std::atomic<std::uint64_t>> missing;  // per member, bytes not yet told landed
  if (options.landed) {
    for (std::size_t i = 0; i < reads.size(); ++i)
      if (reads[i].length == 0) options.landed(i);  // nothing to wait for
    missing = std::vector<std::atomic<std::uint64_t>>(members.size());
    for (std::size_t m = 0; m < members.size(); ++m) missing[m] = members[m].length;
    source.landed = [&](std::size_t k, std::uint64_t at, std::uint64_t length) {
      // The members of range k that [at, at + length) overlaps: from the last one starting at or
      // before `at`, while they start before its end.
      const auto begin = members.begin() + static_cast<std::ptrdiff_t>(first_member[k]);
      const auto end = members.begin() + static_cast<std::ptrdiff_t>(first_member[k + 1]);
      auto m = std::prev(std::upper_bound(begin, end, at, [](std::uint64_t v, const Member& x) { return v < x.begin; }));
      for (; m != end && m->begin < at + length; ++m) {
        const std::uint64_t n = std::min(at + length, m->begin + m->length) - std::max(at, m->begin);
        if (missing[static_cast<std::size_t>(m - members.begin())].fetch_sub(n) == n) options.landed(m->read);
      }
    };
    source.landed_quick = true;
  }
  Stats stats = detail::read_ranges(files_, ranges, source);
  stats.note += detail::resident_note(*resident_);
  return stats;
}

}  // namespace hbmio
