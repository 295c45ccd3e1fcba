// One rank of the GpuNcclLoad test (tests/checkpoint_test.cpp): joins the communicator named by
// a unique id, loads the checkpoint with load() over the communicator and prints one JSON line: the
// outcome, the byte counts and each tensor's XXH3-64, which the test compares with the sample.
// A process per rank, as programs use NCCL: one process driving several GPUs' collectives from
// threads can deadlock in NCCL when one thread frees memory while another GPU's kernel waits.
//   usage: nccl_rank UNIQUE_ID_HEX RANK WORLD CHECKPOINT shard|replicate
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hbmio/checkpoint.hpp"
#include "memory/cuda_runtime.hpp"
#include "shim/nccl_api.hpp"

int main(int argc, char** argv) {
  using namespace hbmio;
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s UNIQUE_ID_HEX RANK WORLD CHECKPOINT shard|replicate\n", argv[0]);
    return 2;
  }
  const std::string hex = argv[1];
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  const std::string path = argv[4];
  nlohmann::json out{{"rank", rank}, {"ok", false}};
  try {
    const shim::NcclApi& nccl = shim::nccl_api();
    shim::ncclUniqueId id{};
    if (hex.size() != 2 * sizeof(id.internal)) throw std::runtime_error("the unique id must be 256 hex digits");
    for (std::size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    if (cuda_device_count() == 0) throw std::runtime_error(cuda_unavailable_reason());
    const int device = rank % cuda_device_count();
    cuda::set_device(device, {.op = "nccl_rank"});
    shim::ncclComm_t comm = nullptr;
    shim::nccl_check(nullptr, nccl.comm_init_rank(&comm, world, id, rank), "ncclCommInitRank");
    try {
      LoadRequest request{.path = path, .nccl_comm = comm,
                          .placement = std::strcmp(argv[5], "shard") == 0 ? Placement::shard : Placement::replicate};
      request.options.into = {MemoryKind::device, device};
      request.options.verify = true;
      const LoadResult r = load(request);
      if (r.locations.size() != 1) throw std::runtime_error("a rank's load gave " + std::to_string(r.locations.size()) + " results");
      const LoadedCheckpoint& mine = r.locations.front();
      nlohmann::json tensors = nlohmann::json::object();
      for (const auto& t : mine.tensors()) {
        std::vector<std::byte> host(t.data.size);
        copy_memory({host.data(), host.size(), {MemoryKind::host}}, t.data);
        tensors[t.name] = {{"xxh3", xxh3_hex(host.data(), host.size())}, {"device", t.data.location.device}};
      }
      out.update({{"ok", true}, {"rank_reported", r.rank}, {"world", r.world}, {"bytes_from_storage", r.bytes_from_storage},
                  {"bytes_received", r.bytes_between}, {"verified", mine.verified()}, {"tensors", tensors}});
    } catch (const std::exception& e) {
      out["error"] = e.what();
    }
    (void)nccl.comm_destroy(comm);
  } catch (const std::exception& e) {
    out["error"] = std::string("set-up: ") + e.what();
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
