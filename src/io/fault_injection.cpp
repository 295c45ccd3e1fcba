#include "hbmio/testing/fault_injection.hpp"

#include <cerrno>

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

long long FaultInjector::on_io_result(long long result, std::uint64_t requested, const char* what) {
  std::lock_guard lock(mutex_);
  ++calls_;
  ++io_calls_;
  if (plan_.fail_call != 0 && calls_ == plan_.fail_call) {
    fired_ = true;
    log_.push_back(fmt::format("call {}: {} fails with errno {}", calls_, what, plan_.fail_errno));
    return -plan_.fail_errno;
  }
  if (result <= 0) return result;
  if (plan_.end_of_file_io != 0 && io_calls_ == plan_.end_of_file_io) {
    log_.push_back(fmt::format("call {}: {} finds the end of the file", calls_, what));
    return 0;
  }
  if (eagain_left_ > 0) {
    --eagain_left_;
    log_.push_back(fmt::format("call {}: {} reports EAGAIN", calls_, what));
    return -EAGAIN;
  }
  if (eintr_left_ > 0) {
    --eintr_left_;
    log_.push_back(fmt::format("call {}: {} reports EINTR", calls_, what));
    return -EINTR;
  }
  if (plan_.short_probability > 0 && requested > 1 &&
      std::uniform_real_distribution<double>(0, 1)(random_) < plan_.short_probability) {
    const auto cut = std::uniform_int_distribution<long long>(1, result > 1 ? result - 1 : 1)(random_);
    log_.push_back(fmt::format("call {}: {} cut short to {} of {} bytes", calls_, what, cut, result));
    return cut;
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
