#!/usr/bin/env python3
"""One checkpoint into every GPU of this machine, under torchrun (one rank per GPU, NCCL), warm.

  torchrun --nproc-per-node 2 bench/peers/multi_compare.py CHECKPOINT [--runs 3] [--json FILE]

Rows (each the median of --runs timed runs after one untimed; a run is timed from a barrier to the
last rank's end, so the slowest rank sets it):
  h2d        the ceiling: a 2 GiB pinned -> device copy, rank 0 alone, then every rank at once
             ("summed": world x bytes / the slowest rank's time)
  single     hbmio.load_file(device="cuda:0") on rank 0 alone (the others wait)
  hbmio      hbmio.load_file(..., group=WORLD, placement=shard|replicate)
  fastsafetensors  0.5, its own distribution (examples/run_parallel.py, docs/overview.md): the
             checkpoint's files divided among the ranks (add_filenames({rank: files})),
             copy_files_to_device(), then as_dict with dim -1 (broadcast: replicate) or dim 0
             (scatter of every tensor: each rank 1/world of the bytes, like shard). nogds reader;
             FASTSAFETENSORS_ODIRECT=0 so that it reads the page cache like the others.
Correctness: after the timed runs, rank r's replicate result is compared bit for bit with a
plain single-GPU hbmio load on cuda:r, and its shard result with the same tensors of that load.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set here unless the caller set it).
"""
import argparse, gc, glob, json, os, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import json_lines  # noqa: E402

GIB = 1 << 30
for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)


def files_of(path):
    if os.path.isdir(path):
        return sorted(f for f in glob.glob(os.path.join(path, "*.safetensors")))
    return [path]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="a .safetensors file, an index or a directory of shards")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--peers", default="fastsafetensors")
    p.add_argument("--json")
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    import hbmio

    gpu = torch.cuda.is_available()  # without one (a dry run of this script): gloo, host memory
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    files = files_of(a.path)
    size = sum(os.path.getsize(f) for f in files)
    emit = json_lines(a.json, checkpoint=a.path, bytes=size, world=world) if rank == 0 else (lambda rec: None)
    if rank == 0:
        for f in files:  # the page cache holds the checkpoint for every row
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass
    dist.barrier()

    def timed(fn, ranks=None):
        """Median over --runs of (barrier, fn on `ranks` (all by default), slowest rank's time)."""
        times = []
        for i in range(a.runs + 1):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            out = fn() if ranks is None or rank in ranks else None
            sync()
            t = torch.tensor([time.perf_counter() - t0], device=dev, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i > 0:
                times.append(t.item())
            del out
            gc.collect()
        return statistics.median(times), times

    # Ceiling: pinned host -> device.
    h2d_sum = None
    if gpu:
        n = 2 * GIB
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        copy = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        med, times = timed(copy, ranks={0})
        emit(dict(row="h2d", gpus=1, median_s=round(med, 4), gib_per_s=round(n / GIB / med, 2), runs=times))
        med, times = timed(copy)
        h2d_sum = world * n / GIB / med
        emit(dict(row="h2d", gpus=world, summed=True, median_s=round(med, 4), gib_per_s=round(h2d_sum, 2), runs=times))
        del src, dst
        (torch.cuda.empty_cache() if gpu else None)

    # One GPU: the time replicate is held against.
    med1, times = timed(lambda: hbmio.load_file(a.path, device=str(dev)), ranks={0})
    emit(dict(row="single", contender="hbmio.load_file", gpus=1, median_s=round(med1, 4),
              gib_per_s=round(size / GIB / med1, 2), runs=times))
    (torch.cuda.empty_cache() if gpu else None)

    for placement in ("shard", "replicate"):
        rep = {}
        med, times = timed(lambda: hbmio.load_file(a.path, device=str(dev), group=dist.group.WORLD,
                                                   placement=placement, report=rep))
        delivered = size * (world if placement == "replicate" else 1)
        emit(dict(row=placement, contender="hbmio.load_file(group=...)", gpus=world, median_s=round(med, 4),
                  delivered_gib_per_s=round(delivered / GIB / med, 2),
                  vs_summed_h2d=round(delivered / GIB / med / h2d_sum, 3) if h2d_sum else None,
                  **({"vs_single_gpu_time": round(med / med1, 3)} if placement == "replicate" else {}),
                  runs=times, bytes_from_storage=rep.get("total_bytes_from_storage"),
                  bytes_between_gpus=rep.get("total_bytes_received")))
        (torch.cuda.empty_cache() if gpu else None)

    peers = [s for s in a.peers.split(",") if s] if gpu else []
    if "fastsafetensors" in peers:
        os.environ["FASTSAFETENSORS_ODIRECT"] = "0"
        from fastsafetensors import SafeTensorsFileLoader
        for placement, dim in (("shard", 0), ("replicate", -1)):
            def fst():
                loader = SafeTensorsFileLoader(dist.group.WORLD, str(dev), nogds=True, max_threads=16, bbuf_size_kb=16 * 1024)
                try:
                    loader.add_filenames({r: files[r::world] for r in range(world)})
                    fb = loader.copy_files_to_device()
                    try:
                        return fb.as_dict({k: dim for k in loader.get_keys()})
                    finally:
                        fb.close()
                finally:
                    loader.close()
            try:
                med, times = timed(fst)
                delivered = size * (world if placement == "replicate" else 1)
                emit(dict(row=placement, contender=f"fastsafetensors (as_dict dim {dim})", gpus=world, median_s=round(med, 4),
                          delivered_gib_per_s=round(delivered / GIB / med, 2),
                          vs_summed_h2d=round(delivered / GIB / med / h2d_sum, 3) if h2d_sum else None,
                          **({"vs_single_gpu_time": round(med / med1, 3)} if placement == "replicate" else {}),
                          runs=times))
            except Exception as e:  # a failing peer must not stop the check below
                emit(dict(row=placement, contender="fastsafetensors", error=f"{type(e).__name__}: {e}"))
            (torch.cuda.empty_cache() if gpu else None)

    # Correctness, after timing: every rank's tensors against its own single-GPU load.
    ref = hbmio.load_file(a.path, device=str(dev))
    ok = True
    for placement in ("shard", "replicate"):
        got = hbmio.load_file(a.path, device=str(dev), group=dist.group.WORLD, placement=placement)
        if placement == "replicate" and set(got) != set(ref):
            ok = False
        for k, t in got.items():
            r = ref[k]
            if t.dtype != r.dtype or t.shape != r.shape or not torch.equal(t.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)):
                ok = False
        names = [None] * world
        dist.all_gather_object(names, sorted(got))
        if placement == "shard" and sorted(sum(names, [])) != sorted(ref):
            ok = False  # every tensor on exactly one rank
        del got
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag)
    emit(dict(check="every rank's shard and replicate tensors == its own single-GPU load, bit for bit",
              ok=flag.item() == 0, ranks_failed=flag.item()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
