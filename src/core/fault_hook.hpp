// Where a test may make a backend's calls fail. An engine made with a hook (make_engine's third
// argument) asks it about each of its calls that can fail: setup (ring creation, buffer
// registration, pinned allocation), each storage I/O completion, each copy to or from the GPU.
// Production code passes no hook and asks nothing; the one implementation, the seeded
// FaultInjector, lives in the testing layer (src/testing), which only tests link.
#pragma once

#include <cstdint>

namespace hbmio {

enum class FaultSite {
  setup,       // resource creation: rings, buffer registration, pinned/device allocation
  io,          // one storage read/write (a completion, or a pread/pwrite call)
  device_copy  // one copy between host and GPU memory
};

class FaultHook {
 public:
  static constexpr std::uint64_t kNoOffset = ~std::uint64_t{0};

  virtual ~FaultHook() = default;
  // For setup and device copies: 0 to proceed, or a positive errno to fail with.
  virtual int check(FaultSite site, const char* what) = 0;
  // For an I/O at file `offset` that moved `result` bytes (or -errno) of `requested`: the result
  // to act on (fewer bytes, -EAGAIN, -EINTR or another -errno where a fault is planned).
  virtual long long on_io_result(long long result, std::uint64_t requested, const char* what,
                                 std::uint64_t offset = kNoOffset) = 0;
};

}  // namespace hbmio
