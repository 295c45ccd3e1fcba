#!/usr/bin/env python3
"""Python: hbmio.load_file / save_file against safetensors.torch, in one process, same file.

Load (into cuda:N): cold rounds alternate hbmio and safetensors with the page cache dropped before
each load; warm: the median of W loads each, the file in the page cache. Every tensor of hbmio's
first load is compared bit for bit with safetensors.torch.load_file's.
Save (from cuda:N tensors, durable): hbmio.save_file (checksums on, fsync + rename + directory
fsync inside) against safetensors.torch.save_file followed by os.fsync of the file, each onto a
new name, alternating. One JSON line per measurement on stdout and in --json.
"""
import argparse, gc, os, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_seconds, drop_cache, json_lines  # noqa: E402

GIB = 1 << 30


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm-runs", type=int, default=5)
    p.add_argument("--save-dir", default="/var/tmp")
    p.add_argument("--json")
    a = p.parse_args()
    import torch
    import hbmio
    from safetensors.torch import load_file as st_load, save_file as st_save

    size = os.path.getsize(a.file)
    torch.zeros(1, device=a.device)
    torch.cuda.synchronize()

    emit = json_lines(a.json, file=a.file, bytes=size, device=a.device)

    def as_torch(d):
        return {k: (v if isinstance(v, torch.Tensor) else torch.from_dlpack(v)) for k, v in d.items()}

    loaders = {
        "hbmio.load_file": lambda: as_torch(hbmio.load_file(a.file, device=a.device)),
        "safetensors.torch.load_file": lambda: st_load(a.file, device=a.device),
    }

    def timed(fn):
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0, cpu_seconds() - c0

    # Correctness first: identical to the reference, bit for bit.
    ref = st_load(a.file, device=a.device)
    got = loaders["hbmio.load_file"]()
    bad = [k for k in ref if k not in got or got[k].dtype != ref[k].dtype or got[k].shape != ref[k].shape
           or not torch.equal(got[k].reshape(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8))]
    emit(dict(check="hbmio.load_file == safetensors.torch.load_file", ok=not bad and set(got) == set(ref),
              tensors=len(ref), mismatched=bad[:10], type=type(next(iter(got.values()))).__name__))
    del ref, got
    gc.collect()

    cold = {k: [] for k in loaders}
    for r in range(a.rounds):
        for name in (list(loaders) if r % 2 == 0 else list(reversed(loaders))):
            drop_cache(a.file)
            out, s, c = timed(loaders[name])
            del out
            gc.collect()
            cold[name].append(s)
            emit(dict(contender=name, mode="cold", round=r, seconds=round(s, 4), gib_per_s=round(size / GIB / s, 3),
                      cpu_s=round(c, 3)))
    for name, times in cold.items():
        med = statistics.median(times)
        emit(dict(contender=name, mode="cold", summary=True, runs=[round(t, 3) for t in times], median_s=round(med, 4),
                  gib_per_s=round(size / GIB / med, 3)))

    with open(a.file, "rb", buffering=0) as f:  # into the page cache
        while f.read(16 << 20):
            pass
    for name, fn in loaders.items():
        out, _, _ = timed(fn)  # one untimed load: allocator and library warm-up, for both alike
        del out
        gc.collect()
        times, cpus = [], []
        for _ in range(a.warm_runs):
            out, s, c = timed(fn)
            del out
            gc.collect()
            times.append(s)
            cpus.append(c)
        med = statistics.median(times)
        emit(dict(contender=name, mode="warm", summary=True, runs=[round(t, 4) for t in times], median_s=round(med, 4),
                  gib_per_s=round(size / GIB / med, 3), cpu_s_per_gib=round(statistics.median(cpus) / (size / GIB), 3)))

    # Save from GPU tensors, durable.
    tensors = st_load(a.file, device=a.device)

    def save_hbmio(path):
        hbmio.save_file(tensors, path, {"format": "pt"})

    def save_st(path):
        st_save(tensors, path, {"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    savers = {"hbmio.save_file": save_hbmio, "safetensors.torch.save_file + fsync": save_st}
    saved = {k: [] for k in savers}
    for r in range(a.rounds):
        for name, fn in (list(savers.items()) if r % 2 == 0 else list(reversed(savers.items()))):
            path = os.path.join(a.save_dir, f"py-save-{r}.safetensors")
            os.sync()
            c0, t0 = cpu_seconds(), time.perf_counter()
            fn(path)
            s, c = time.perf_counter() - t0, cpu_seconds() - c0
            saved[name].append(s)
            emit(dict(contender=name, mode="save", round=r, seconds=round(s, 4), gib_per_s=round(size / GIB / s, 3),
                      cpu_s=round(c, 3)))
            os.remove(path)
    for name, times in saved.items():
        med = statistics.median(times)
        emit(dict(contender=name, mode="save", summary=True, runs=[round(t, 3) for t in times], median_s=round(med, 4),
                  gib_per_s=round(size / GIB / med, 3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
