#!/usr/bin/env python3
"""W5, a restart on a node that has loaded the checkpoint once: hbmio.load_file from the node's
resident cache (`hbmio cache serve`, its server DMAs from its pinned copy into the caller's GPU
memory) against the same call served from the page cache, safetensors 0.9's prefetch() (where
--st09 is given) and the pinned host-to-device ceiling, all measured in this run.

Contenders, each in a fresh process per round (rounds interleaved, order rotated); each child loads
four times and reports the median of the last three, the first beside it:
  ceiling: pinned H2D         torch: one pinned host tensor of the file's size copied to the device
  hbmio.load_file warm        the file in the page cache, no cache
  hbmio.load_file cache hit   HBMIO_CACHE set: the file held (and pinned) by the server
  st0.9 prefetch() T=16       safetensors 0.9, safe_open(...).prefetch(device, threads=16)
and with --gpu-memory SIZE, from a second server that also holds each file in the device's memory
(`hbmio cache add --gpu`):
  hbmio.load_file device tier the server's device-to-device copy into the caller's allocation
  hbmio.load_file share=True  the server's copy mapped in place (CUDA IPC), nothing copied
Every hbmio load's tensors are summed (16-bit words) outside the timing and compared with the warm
load's; a cache load must report its file's path as "cache-host" ("cache-device", "cache-shared").

  python3 bench/peers/cache_compare.py FILE... --hbmio PATH/hbmio [--st09 DIR] [--rounds 3]
          [--gpu-memory 16GiB] [--json out.jsonl]
"""
import argparse, json, os, signal, statistics, subprocess, sys, tempfile, time

CHILD = r'''
import json, os, sys, time
which, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
torch.zeros(1, device=device); torch.cuda.synchronize()
size = os.path.getsize(path)
def sums(tensors):  # by name: a prefetch yields tensors in the order they land
    return {n: int(t.view(torch.int16).to(torch.int64).sum()) for n, t in tensors.items()} if tensors else None
report = {}
if which == "ceiling":
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    def load():
        dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); return None
elif which.startswith("st"):
    from safetensors import safe_open
    def load():
        with safe_open(path, "pt") as f:
            out = dict(f.prefetch(device=device, threads=16))
        torch.cuda.synchronize(); return out
else:
    import hbmio
    def load():
        report.clear()
        out = hbmio.load_file(path, device=device, report=report, share=which.endswith("share=True"))
        torch.cuda.synchronize(); return out
times, out = [], None
for _ in range(4):
    out = None
    torch.cuda.empty_cache()
    t = time.perf_counter(); out = load(); times.append(time.perf_counter() - t)
print(json.dumps({"times": times, "sums": sums(out) if which != "ceiling" else None,
                  "paths": [p["path"] for p in report.get("paths", [])], "note": report.get("note", "")}))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--hbmio", required=True, help="the hbmio command (serves the cache)")
    ap.add_argument("--st09", help="a folder with safetensors 0.9 (pip --target)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-memory", default="16GiB")
    ap.add_argument("--gpu-memory", help="also serve from a device tier of this size (device-to-device and shared loads)")
    ap.add_argument("--json")
    a = ap.parse_args()
    sockets = tempfile.mkdtemp(prefix="hbmio-cache-", dir="/tmp")
    socket = os.path.join(sockets, "cache.sock")
    gpu_socket = os.path.join(sockets, "gpu.sock")
    servers = [subprocess.Popen([a.hbmio, "cache", "serve", "--socket", socket, "--host-memory", a.host_memory], start_new_session=True)]
    if a.gpu_memory:
        servers.append(subprocess.Popen([a.hbmio, "cache", "serve", "--socket", gpu_socket, "--host-memory", a.host_memory,
                                         "--gpu-memory", a.gpu_memory], start_new_session=True))
    gpu_index = a.device.split(":")[1] if ":" in a.device else "0"
    try:
        for s in [socket] + ([gpu_socket] if a.gpu_memory else []):
            for _ in range(500):
                if subprocess.run([a.hbmio, "cache", "status", "--socket", s], capture_output=True).returncode == 0:
                    break
                time.sleep(0.02)
        for f in a.files:
            subprocess.run(["cat", f], stdout=subprocess.DEVNULL, check=True)  # warm
            for s, extra in [(socket, [])] + ([(gpu_socket, ["--gpu", gpu_index])] if a.gpu_memory else []):
                t = time.perf_counter()
                added = subprocess.run([a.hbmio, "cache", "add", "--wait", "--socket", s, *extra, f], capture_output=True, text=True)
                print(f"cache add --wait {' '.join(extra)} {f}: {added.stdout.strip()} in {time.perf_counter() - t:.2f} s", flush=True)
        print(subprocess.run([a.hbmio, "cache", "status", "--socket", socket], capture_output=True, text=True).stdout, flush=True)
        expected_path = {"hbmio.load_file cache hit": "cache-host", "hbmio.load_file device tier": "cache-device",
                         "hbmio.load_file share=True": "cache-shared"}
        contenders = (["ceiling", "hbmio.load_file warm", "hbmio.load_file cache hit"] + (["st0.9 prefetch() T=16"] if a.st09 else [])
                      + (["hbmio.load_file device tier", "hbmio.load_file share=True"] if a.gpu_memory else []))
        rows = []
        for f in a.files:
            size = os.path.getsize(f)
            results = {c: [] for c in contenders}
            firsts = {c: [] for c in contenders}
            ref = None
            for r in range(a.rounds):
                for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
                    env = dict(os.environ)
                    env.pop("HBMIO_CACHE", None)
                    if c in expected_path:
                        env["HBMIO_CACHE"] = socket if c.endswith("cache hit") else gpu_socket
                    if c.startswith("st"):
                        env["PYTHONPATH"] = a.st09 + os.pathsep + env.get("PYTHONPATH", "")
                    subprocess.run(["cat", f], stdout=subprocess.DEVNULL, check=True)
                    out = subprocess.run([sys.executable, "-c", CHILD, c, f, a.device], env=env, capture_output=True, text=True)
                    if out.returncode != 0:
                        raise SystemExit(f"{c} on {f} failed:\n{out.stderr[-3000:]}")
                    res = json.loads(out.stdout.strip().splitlines()[-1])
                    if c.startswith("hbmio") or c.startswith("st"):
                        if ref is None and c == "hbmio.load_file warm":
                            ref = res["sums"]
                        if ref is not None and res["sums"] != ref:
                            raise SystemExit(f"{c} loaded other bytes than the warm load of {f}")
                    if c in expected_path and set(res["paths"]) != {expected_path[c]}:
                        raise SystemExit(f"{c}: the load did not come from the cache that way: {res['paths']} {res['note']}")
                    if c in expected_path:  # the last load's note: the server's share of its time
                        print(f"  {c}, {os.path.basename(f)}: {[round(t, 4) for t in res['times']]} s; {res['note']}")
                    results[c].append(statistics.median(res["times"][1:]))
                    firsts[c].append(res["times"][0])
            ceiling = statistics.median(results["ceiling"])
            print(f"\n{os.path.basename(f)}: {size / 2**30:.2f} GiB into {a.device}, {a.rounds} rounds; median of rounds' medians")
            print(f"{'contender':32s} {'seconds':>8s} {'GiB/s':>7s} {'x ceiling':>9s} {'first call s':>12s}")
            for c in contenders:
                s = statistics.median(results[c])
                row = {"file": f, "bytes": size, "contender": c, "seconds": s, "gib_per_s": size / 2**30 / s,
                       "of_ceiling": ceiling / s, "first": statistics.median(firsts[c]), "rounds": results[c]}
                rows.append(row)
                print(f"{c:32s} {s:8.4f} {row['gib_per_s']:7.2f} {row['of_ceiling']:9.2f} {row['first']:12.4f}")
        if a.json:
            with open(a.json, "a") as out:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
        for s in [socket] + ([gpu_socket] if a.gpu_memory else []):
            print(subprocess.run([a.hbmio, "cache", "status", "--socket", s], capture_output=True, text=True).stdout)
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
