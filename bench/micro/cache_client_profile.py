#!/usr/bin/env python3
"""Where a load from the resident cache's GPU tier spends its time on the client, for a file of
many tensors (the device tier's 3,072 x 2 MiB took 17-18 ms against a server copy of 5 ms:
bench/RESULTS.md, "Restarts from the node's resident cache").

Starts `hbmio cache serve` with a device tier, puts FILE in it on cuda:0, then for each way of
loading it (share=True: the cache's copy mapped in place; device: a device-to-device copy into the
load's memory) prints the median of --repeat loads, the client's own steps timed alone (the
header's parse, the plan as tuples) and a cProfile of one load (top functions by own time).
Run on the GPU machine:  python3 bench/micro/cache_client_profile.py FILE --hbmio PATH
"""
import argparse, cProfile, io, json, os, pstats, statistics, subprocess, sys, tempfile, time

import torch

import hbmio
from hbmio import _hbmio


def median_ms(fn, repeat):
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        del out
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--hbmio", required=True, help="the hbmio command")
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    size = os.path.getsize(a.file)
    sockets = tempfile.mkdtemp(prefix="hbmio-prof-", dir="/tmp")
    socket = os.path.join(sockets, "gpu.sock")
    mem = f"{(size >> 30) + 2}GiB"
    server = subprocess.Popen([a.hbmio, "cache", "serve", "--socket", socket, "--host-memory", mem, "--gpu-memory", mem],
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            if subprocess.run([a.hbmio, "cache", "status", "--socket", socket], capture_output=True).returncode == 0:
                break
            time.sleep(0.02)
        subprocess.run([a.hbmio, "cache", "add", "--wait", "--gpu", "0", "--socket", socket, a.file], check=True, capture_output=True)
        os.environ["HBMIO_CACHE"] = socket
        opened = _hbmio.SafeOpen(a.file, cache="off")
        print(f"{a.file}: {size / 2**30:.2f} GiB, {len(list(opened.keys()))} tensors; medians of {a.repeat}, ms")
        print(f"  header parse (SafeOpen)        {median_ms(lambda: _hbmio.SafeOpen(a.file, cache='off'), a.repeat):8.2f}")
        print(f"  plan rows (_plan_rows)         {median_ms(lambda: _hbmio._plan_rows(opened, None), a.repeat):8.2f}")
        ways = {"share=True": lambda: hbmio.load_file(a.file, "cuda:0", share=True),
                "device tier": lambda: hbmio.load_file(a.file, "cuda:0")}
        for label, load in ways.items():
            report = {}
            hbmio.load_file(a.file, "cuda:0", share=label == "share=True", report=report)
            print(f"  {label:30s} {median_ms(load, a.repeat):8.2f}   paths {[p['path'] for p in report['paths']]}")
            print(f"      report: {json.dumps({k: v for k, v in report.items() if k != 'paths'})[:600]}")
        for label, load in ways.items():
            prof = cProfile.Profile()
            prof.enable()
            out = load()
            torch.cuda.synchronize()
            prof.disable()
            del out
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            print(f"\n--- cProfile, {label} (own time) ---")
            print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))
    finally:
        server.terminate()
        server.wait(timeout=30)
        os.environ.pop("HBMIO_CACHE", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
