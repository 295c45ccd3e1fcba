#include "io/uring_plan.hpp"

#include <functional>

#include <fmt/format.h>

#include "io/engine_internal.hpp"

namespace hbmio::detail {

UringPlan plan_batch(std::span<const IoRequest> requests, const Options& options, std::string_view backend) {
  UringPlan plan;
  // Writes laid end to end in one file join one part (see Part), in file order; a piece of
  // device memory then takes one copy from the GPU per request it spans, into its slot.
  std::vector<const IoRequest*> order;
  for (const IoRequest& request : requests)
    if (request.memory.size != 0) order.push_back(&request);
  const bool gather = !order.empty() && order.front()->op == IoOp::write;
  if (gather)
    std::stable_sort(order.begin(), order.end(), [](const IoRequest* x, const IoRequest* y) {
      return std::less<const File*>()(x->file, y->file) || (x->file == y->file && x->offset < y->offset);
    });
  for (const IoRequest* r : order) {
    const IoRequest& request = *r;
    plan.bytes += request.memory.size;
    const bool device = request.memory.kind() == MemoryKind::device;
    if (device) {
      if (plan.device >= 0 && plan.device != request.memory.location.device)
        throw Error(errno_code(EINVAL), context_of(request, backend), "a uring batch moves memory of one GPU only");
      plan.device = request.memory.location.device;
    }
    if (gather && !plan.parts.empty()) {
      Part& last = plan.parts.back();
      // A part is all device memory or all host memory: its pieces take one path.
      if (last.first().file == request.file && last.end() == request.offset && last.device == device) {
        last.requests.push_back(&request);
        last.context.length = last.end() - last.offset();  // errors without a piece name the range
        continue;
      }
    }
    Part part{.requests = {&request}, .context = context_of(request, backend), .device = device};
    part.grid_base = round_down(request.offset, kSlotAlignment);
    const DirectIoInfo& dio = request.file->direct_io();
    std::size_t alignment = std::max(dio.memory_alignment, dio.offset_alignment);
    // Direct writes on file-system blocks: a sub-block one drains every direct I/O of the file
    // first (ext4, XFS), so tensors at 512- but not 4 KiB-aligned offsets wrote far slower than
    // one aligned write of the same bytes (bench/RESULTS.md, "Saves").
    if (request.op == IoOp::write)
      alignment = std::max<std::size_t>(alignment, std::min<std::size_t>(dio.block_size, kSlotAlignment));
    if (options.direct_io != DirectIo::off) {
      std::string why;
      if (!dio.supported) why = fmt::format("O_DIRECT unavailable ({}): page cache used", dio.reason);
      else if (alignment > kSlotAlignment) why = fmt::format("O_DIRECT needs {}-byte alignment: page cache used", alignment);
      else part.alignment = alignment;
      if (!why.empty() && plan.note.find(why) == std::string::npos) plan.note += (plan.note.empty() ? "" : "; ") + why;
    }
    plan.parts.push_back(std::move(part));
  }
  // A job of less than two chunks per worker is cut finer, so that every worker takes two shares:
  // with one each, the job lasts as long as its slowest worker's chunk; with two, workers that
  // are done take what is left (a stream's groups of 128 MiB: bench/RESULTS.md, "Batch streams").
  const std::uint64_t workers = std::max(1u, options.resolved_workers());
  const std::uint64_t shares = workers > 1 ? 2 * workers : 1;
  const std::uint64_t share = round_up((plan.bytes + shares - 1) / shares, kMinSharedChunk);
  plan.chunk_size = static_cast<std::size_t>(std::min<std::uint64_t>(options.chunk_size, std::max<std::uint64_t>(share, kMinSharedChunk)));
  for (Part& part : plan.parts) {
    part.first_chunk = plan.chunks;
    part.chunks = (part.end() - part.grid_base + plan.chunk_size - 1) / plan.chunk_size;
    plan.chunks += part.chunks;
  }
  return plan;
}

ChunkRange chunk_range(const std::vector<Part>& parts, std::uint64_t index, std::size_t chunk_size) {
  // The part holding chunk `index`: the last one that starts at or before it.
  const auto next = std::upper_bound(parts.begin(), parts.end(), index, [](std::uint64_t i, const Part& p) { return i < p.first_chunk; });
  const Part& part = *std::prev(next);
  const std::uint64_t k = index - part.first_chunk;
  return {&part, std::max<std::uint64_t>(part.offset(), part.grid_base + k * chunk_size),
          std::min<std::uint64_t>(part.end(), part.grid_base + (k + 1) * chunk_size)};
}

}  // namespace hbmio::detail
