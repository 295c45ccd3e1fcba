#!/usr/bin/env python3
"""safetensors 0.9's loaders against hbmio's on the same file, warm, into one device.

Contenders (each in a fresh process per round, rounds interleaved and their order rotated; the
file read once untimed before each, so the page cache holds it):
  hbmio.load_file                 the whole file
  hbmio prefetch()                hbmio.open(path, "pt").prefetch(device=D): take every tensor
  hbmio prefetch(plan 1/8)        prefetch({name: slice(0, rows // 8)}) of every tensor of >= 8 rows
  hbmio get_slice walk 1/8        f.get_slice(name)[: rows // 8] in file order
  st0.9 load_file                 safetensors.torch.load_file(path, device=D) (0.9, backend "mmap")
  st0.9 load_file pread           the same with backend="pread"
  st0.9 prefetch() T=8|16         safe_open(path, "pt").prefetch(device=D, threads=T): every tensor
  st0.9 prefetch(plan 1/8) T=16   the same plan as hbmio's
Each child loads four times and times each from the call until every tensor is on the device
(torch.cuda.synchronize()); the median of the last three is the figure, the first (which pays each
loader's set-up: engines, pinned pools) is reported beside it. Then, outside the timing, it sums each tensor's 16-bit words; every contender's sums must equal
those of safetensors 0.8's load (the parent checks). The reference 0.9 is taken from --st09 (a
folder with safetensors 0.9 installed by pip --target), put first on the child's sys.path.

  python3 bench/peers/prefetch_compare.py FILE --st09 /tmp/st09 [--device cuda:0] [--rounds 3]
"""
import argparse, json, os, statistics, subprocess, sys, time

CHILD = r'''
import json, os, sys, time
which, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
label = which
import torch
torch.zeros(1, device=device); torch.cuda.synchronize() if device.startswith("cuda") else None
def sync():
    if device.startswith("cuda"):
        torch.cuda.synchronize()
def rows8(shape):
    return shape[0] // 8 if shape and shape[0] >= 8 else None
if which.startswith("st"):
    import safetensors, safetensors.torch as stt
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        names = list(f.offset_keys())
        shapes = {n: f.get_slice(n).get_shape() for n in names}
else:
    import hbmio
    with hbmio.open(path, framework="pt") as f:
        names = list(f.offset_keys())
        shapes = {n: f.shape(n) for n in names}
plan = {n: (slice(0, rows8(shapes[n])) if rows8(shapes[n]) else None) for n in names}
def load():
  if which == "hbmio.load_file":
      return hbmio.load_file(path, device=device)
  elif which == "hbmio prefetch()":
      with hbmio.open(path, framework="pt", device=device) as f, f.prefetch() as loader:
          return dict(loader)
  elif which == "hbmio prefetch(plan 1/8)":
      with hbmio.open(path, framework="pt", device=device) as f, f.prefetch(plan) as loader:
          return dict(loader)
  elif which == "hbmio get_slice walk 1/8":
      with hbmio.open(path, framework="pt", device=device) as f:
          return {n: (f.get_slice(n)[plan[n]] if plan[n] else f.get_tensor(n)) for n in names}
  elif which == "st0.9 load_file":
      return stt.load_file(path, device=device)
  elif which == "st0.9 load_file pread":
      return stt.load_file(path, device=device, backend="pread")
  elif which.startswith("st0.9 prefetch() T="):
      with safe_open(path, "pt") as f, f.prefetch(device=device, threads=int(which.split("=")[1])) as loader:
          return dict(loader)
  elif which.startswith("st0.9 prefetch(plan 1/8) T="):
      with safe_open(path, "pt") as f, f.prefetch(plan, device=device, threads=int(which.split("=")[1])) as loader:
          return dict(loader)
  else:
      raise SystemExit(f"unknown contender {which}")
open(path, "rb").read()  # warm
times = []
for _ in range(4):  # the first load of a process is reported apart: it pays each loader's set-up
    t = time.perf_counter()
    out = load()
    sync()
    times.append(time.perf_counter() - t)
    if len(times) < 4:
        del out
seconds = sorted(times[1:])[1]
planned = "plan" in which or "slice" in which
sums = {n: int(v.reshape(-1).view(torch.int16).to(torch.int64).sum()) for n, v in out.items()}
nbytes = sum(v.numel() * v.element_size() for v in out.values())
print(json.dumps({"contender": label, "seconds": seconds, "first": times[0], "bytes": nbytes, "planned": planned, "sums": sums,
                  "version": getattr(sys.modules.get("safetensors"), "__version__", None)}))
'''

HBMIO = ["hbmio.load_file", "hbmio prefetch()", "hbmio prefetch(plan 1/8)", "hbmio get_slice walk 1/8"]
REFERENCE = ["st0.9 load_file", "st0.9 load_file pread", "st0.9 prefetch() T=8", "st0.9 prefetch() T=16",
             "st0.9 prefetch(plan 1/8) T=16"]


def expected_sums(path):
    """safetensors 0.8's load (the installed reference), on the CPU: whole tensors and 1/8 rows."""
    import torch
    from safetensors.torch import load_file
    whole = load_file(path)
    rows = {n: (t[: t.shape[0] // 8] if t.dim() and t.shape[0] >= 8 else t) for n, t in whole.items()}
    s = lambda d: {n: int(v.contiguous().reshape(-1).view(torch.int16).to(torch.int64).sum()) for n, v in d.items()}
    return s(whole), s(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--st09", help="folder holding safetensors 0.9 (pip install --target)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    whole, rows = expected_sums(a.file)
    contenders = HBMIO + (REFERENCE if a.st09 else [])
    results = {c: [] for c in contenders}
    for r in range(a.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            env = dict(os.environ)
            if c.startswith("st"):
                env["PYTHONPATH"] = a.st09 + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            out = subprocess.run([sys.executable, "-c", CHILD, c, a.file, a.device], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(f"{c}: failed: {out.stderr.strip()[-600:]}", flush=True)
                results.pop(c, None)
                contenders = [x for x in contenders if x != c]
                continue
            j = json.loads(out.stdout.strip().splitlines()[-1])
            want = rows if j["planned"] else whole
            if j["sums"] != want:
                bad = [n for n in want if j["sums"].get(n) != want[n]][:5]
                raise SystemExit(f"{c}: tensors differ from safetensors 0.8's ({bad})")
            if c in results:
                results[c].append(j)
            print(f"round {r + 1} {c:<32} {j['seconds']:.4f} s (first load of the process {j['first']:.4f} s)", flush=True)
    size = os.path.getsize(a.file)
    print(f"\n{os.path.basename(a.file)} ({size / 2**30:.2f} GiB) into {a.device}, warm, median of {a.rounds} fresh processes; "
          f"every result equal to safetensors 0.8's")
    print(f"{'contender':<34} {'seconds':>9} {'GiB/s':>7} {'first':>8}  bytes delivered")
    for c, rs in results.items():
        if not rs:
            continue
        s = statistics.median(x["seconds"] for x in rs)
        b = rs[0]["bytes"]
        first = statistics.median(x["first"] for x in rs)
        print(f"{c:<34} {s:>9.4f} {b / s / 2**30:>7.2f} {first:>8.4f}  {b / 2**20:.0f} MiB  (version {rs[0]['version']})")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"bench": "prefetch", "file": a.file, "contender": c, "median_s": s, "bytes": b,
                                    "runs": [x["seconds"] for x in rs], "first": [x["first"] for x in rs], "version": rs[0]["version"]}) + "\n")


if __name__ == "__main__":
    main()
