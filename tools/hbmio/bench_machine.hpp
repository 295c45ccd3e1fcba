// `hbmio bench`: the machine a run measured, recorded beside its figures (a figure means little
// without the CPU, kernel, GPU and storage it came from).
#pragma once

#include <cstdint>
#include <string>

#include "hbmio/hbmio.hpp"

namespace hbmio::cli {

struct Machine {
  std::string cpu_model = "unknown";
  unsigned cpus = 1;
  std::uint64_t memory_bytes = 0;
  std::string kernel;
  bool gpu = false;
  std::string gpu_name;    // "NVIDIA H200" when there is one
  std::string gpu_reason;  // why there is none
  std::string file_system, device, device_model;
};

// The machine, the GPU that `into` names (else the first), and the file system and block device
// that hold `file_path`. Facts that cannot be read stay at their defaults: nothing here throws.
Machine describe_machine(const std::string& file_path, const MemoryLocation& into);

}  // namespace hbmio::cli
