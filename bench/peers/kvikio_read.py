#!/usr/bin/env python3
"""Peer measurement: RAPIDS KvikIO reading a whole file into GPU memory (a CuPy array).

Runs KvikIO the way its users do: FileHandle.pread into a device array, its thread pool sized
like hbmio's workers (KVIKIO_NTHREADS), compat mode as configured (KVIKIO_COMPAT_MODE; ON where
GDS is unavailable). Prints one JSON object: per-run seconds, median GiB/s, CPU seconds/GiB.

usage: kvikio_read.py FILE [--runs 5] [--cold] [--threads 16] [--task-size 16MiB]
"""
import argparse
import json
import os
import statistics
import sys
import time


from measure import cpu_seconds, drop_cache  # shared with safetensors_peers.py


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--task-size", type=int, default=16 << 20)
    a = p.parse_args()
    os.environ.setdefault("KVIKIO_NTHREADS", str(a.threads))
    os.environ.setdefault("KVIKIO_TASK_SIZE", str(a.task_size))
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    import cupy
    import kvikio
    import kvikio.defaults

    size = os.path.getsize(a.file)
    buf = cupy.empty(size, dtype=cupy.uint8)  # allocated once, outside the timed region
    times, cpus = [], []
    with kvikio.CuFile(a.file, "r") as f:
        if not a.cold:
            f.pread(buf).get()  # warm-up read, untimed
        for _ in range(a.runs):
            if a.cold:
                drop_cache(a.file)
            c0, t0 = cpu_seconds(), time.perf_counter()
            n = f.pread(buf).get()
            cupy.cuda.runtime.deviceSynchronize()
            times.append(time.perf_counter() - t0)
            cpus.append(cpu_seconds() - c0)
            assert n == size, (n, size)
    med = statistics.median(times)
    print(json.dumps({
        "peer": "kvikio", "version": kvikio.__version__, "file": a.file, "bytes": size,
        "mode": "cold" if a.cold else "warm", "compat_mode": os.environ["KVIKIO_COMPAT_MODE"],
        "threads": int(os.environ["KVIKIO_NTHREADS"]), "task_size": int(os.environ["KVIKIO_TASK_SIZE"]),
        "seconds": times, "median_seconds": med, "gib_per_second": size / med / 2**30,
        "cpu_seconds_per_gib": statistics.median(cpus) / (size / 2**30),
    }))


if __name__ == "__main__":
    sys.exit(main())
