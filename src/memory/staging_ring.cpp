#include "memory/staging_ring.hpp"

#include <cerrno>
#include <utility>

namespace hbmio::detail {

StagingRing::StagingRing(MemoryKind kind, std::size_t count, std::size_t slot_bytes)
    : memory_(Buffer::allocate({kind, 0}, count * slot_bytes)), slot_bytes_(slot_bytes), free_(count, true) {}

StagingRing& StagingRing::operator=(StagingRing&& other) noexcept {
  if (this == &other) return *this;
  stream_.synchronize_noexcept();
  stream_ = std::move(other.stream_);
  copied_ = std::move(other.copied_);
  copying_ = std::move(other.copying_);
  free_ = std::move(other.free_);
  slot_bytes_ = other.slot_bytes_;
  memory_ = std::move(other.memory_);
  return *this;
}

void StagingRing::use_device(int device, const ErrorContext& context) {
  if (stream_.valid() && stream_.device() == device) return;
  if (!memory_.cuda_registered())
    throw Error(errno_code(EINVAL), context, "staging slots for copies to a GPU must be pinned memory");
  reset();  // no copy of the old stream may still be writing
  // Made aside and then taken, so that a failure part way leaves the ring unbound, never bound
  // with fewer events than slots.
  cuda::Stream stream(device, context);
  std::vector<cuda::Event> copied;
  copied.reserve(free_.size());
  for (std::size_t i = 0; i < free_.size(); ++i) copied.emplace_back(context);  // events belong to the device
  copied_ = std::move(copied);
  stream_ = std::move(stream);
}

int StagingRing::acquire() noexcept {
  for (std::size_t i = 0; i < free_.size(); ++i)
    if (free_[i]) {
      free_[i] = false;
      return static_cast<int>(i);
    }
  return -1;
}

void StagingRing::copy_to_device(int slot, std::size_t offset, void* to, std::size_t size, const ErrorContext& context) {
  stream_.copy_to_device_async(to, data(slot) + offset, size, context);
  copied_[static_cast<std::size_t>(slot)].record(stream_, context);
  copying_.push_back(slot);
}

bool StagingRing::oldest_done(const ErrorContext& context) {
  return !copying_.empty() && copied_[static_cast<std::size_t>(copying_.front())].ready(context);
}

int StagingRing::reclaim_oldest(std::chrono::microseconds poll, const ErrorContext& context) {
  const int slot = copying_.front();
  cuda::Event& event = copied_[static_cast<std::size_t>(slot)];
  const auto until = std::chrono::steady_clock::now() + poll;
  while (!event.ready(context) && std::chrono::steady_clock::now() < until) {}
  event.synchronize(context);
  copying_.pop_front();
  free_[static_cast<std::size_t>(slot)] = true;
  return slot;
}

void StagingRing::reset() noexcept {
  stream_.synchronize_noexcept();
  copying_.clear();
  free_.assign(free_.size(), true);
}

}  // namespace hbmio::detail
