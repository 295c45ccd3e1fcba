#include "testing/fault_injection.hpp"

#include <cerrno>
#include <string_view>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace hbmio {

FaultInjector::FaultInjector(FaultPlan plan)
    : plan_(plan), random_(plan.seed), eagain_left_(plan.eagain_count), eintr_left_(plan.eintr_count) {}

int FaultInjector::check(FaultSite site, const char* what) {
  std::lock_guard lock(mutex_);
  ++calls_;
  if (plan_.fail_call != 0 && calls_ == plan_.fail_call) {
    fired_ = true;
    log_.push_back(fmt::format("call {}: {} ({}) fails with errno {}", calls_, what, static_cast<int>(site), plan_.fail_errno));
    return plan_.fail_errno;
  }
  return 0;
}

namespace {
// A number in [0, 1) and a second one from the I/O's identity and the seed (splitmix64 steps over
// an FNV-1a hash of the name): the same I/O gets the same answer whatever ran before it.
std::pair<double, std::uint64_t> draw(std::uint64_t seed, const char* what, std::uint64_t offset, std::uint64_t requested) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char* p = what; *p != '\0'; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  const auto mix = [](std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const std::uint64_t a = mix(seed ^ mix(h ^ mix(offset ^ mix(requested))));
  return {static_cast<double>(a >> 11) * 0x1.0p-53, mix(a)};
}
}  // namespace

long long FaultInjector::on_io_result(long long result, std::uint64_t requested, const char* what, std::uint64_t offset) {
  std::lock_guard lock(mutex_);
  ++calls_;
  ++io_calls_;
  const std::string at = offset == FaultPlan::kNoOffset ? std::string() : fmt::format(" at byte {}", offset);
  if (plan_.fail_call != 0 && calls_ == plan_.fail_call) {
    fired_ = true;
    log_.push_back(fmt::format("call {}: {}{} fails with errno {}", calls_, what, at, plan_.fail_errno));
    return -plan_.fail_errno;
  }
  if (plan_.fail_offset != FaultPlan::kNoOffset && !offset_fired_ && offset != FaultPlan::kNoOffset &&
      offset <= plan_.fail_offset && plan_.fail_offset - offset < requested && std::string_view(what).find(plan_.fail_what) != std::string_view::npos) {
    offset_fired_ = fired_ = true;
    log_.push_back(fmt::format("{}{} fails with errno {}", what, at, plan_.fail_errno));
    return -plan_.fail_errno;
  }
  if (result <= 0) return result;
  if (plan_.end_of_file_io != 0 && io_calls_ == plan_.end_of_file_io) {
    log_.push_back(fmt::format("call {}: {}{} finds the end of the file", calls_, what, at));
    return 0;
  }
  if (eagain_left_ > 0) {
    --eagain_left_;
    log_.push_back(fmt::format("call {}: {}{} reports EAGAIN", calls_, what, at));
    return -EAGAIN;
  }
  if (eintr_left_ > 0) {
    --eintr_left_;
    log_.push_back(fmt::format("call {}: {}{} reports EINTR", calls_, what, at));
    return -EINTR;
  }
  if (plan_.short_probability > 0 && requested > 1 && result > 1) {
    // From the I/O itself where its offset is known; from the seeded stream otherwise.
    double u;
    std::uint64_t pick;
    if (offset != FaultPlan::kNoOffset) {
      std::tie(u, pick) = draw(plan_.seed, what, offset, requested);
    } else {
      u = std::uniform_real_distribution<double>(0, 1)(random_);
      pick = random_();
    }
    if (u < plan_.short_probability) {
      const long long cut = 1 + static_cast<long long>(pick % static_cast<std::uint64_t>(result - 1));
      log_.push_back(fmt::format("{}{} cut short to {} of {} bytes", what, at, cut, result));
      return cut;
    }
  }
  return result;
}

std::uint64_t FaultInjector::calls() const {
  std::lock_guard lock(mutex_);
  return calls_;
}
bool FaultInjector::fired() const {
  std::lock_guard lock(mutex_);
  return fired_;
}
std::vector<std::string> FaultInjector::log() const {
  std::lock_guard lock(mutex_);
  return log_;
}

}  // namespace hbmio
