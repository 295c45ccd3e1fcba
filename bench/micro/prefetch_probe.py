# Where a prefetch of many small tensors loses against load_file on a GPU (one process, warm).
import os, statistics, time, torch, hbmio, hbmio._prefetch as pf, safetensors.torch as st
p = "/var/tmp/pfs2.safetensors"
if not os.path.exists(p):
    st.save_file({f"t{i}": torch.randn(1024, 1024).to(torch.bfloat16) for i in range(1024)}, p)
with open(p, "rb") as fh:
    while fh.read(1 << 26): pass
dev = "cuda:0"
torch.zeros(1, device=dev)
def lf():
    d = hbmio.load_file(p, device=dev); torch.cuda.synchronize(); return d
def pref(batch):
    pf._BATCH = batch
    with hbmio.open(p, framework="pt", device=dev) as f, f.prefetch() as l:
        d = dict(l)
    torch.cuda.synchronize(); return d
def alloc_only():
    d = {f"t{i}": torch.empty(1024, 1024, dtype=torch.bfloat16, device=dev) for i in range(1024)}
    torch.cuda.synchronize(); return d
runs = {"load_file": lf, "prefetch 64MiB": lambda: pref(64 << 20), "prefetch 1 batch": lambda: pref(1 << 40),
        "prefetch 8MiB": lambda: pref(8 << 20), "alloc 1024 tensors": alloc_only}
times = {k: [] for k in runs}
for r in range(6):
    for k, fn in runs.items():
        t = time.perf_counter(); fn(); times[k].append(time.perf_counter() - t)
for k, v in times.items():
    print(f"{k:20s} median {statistics.median(v[1:]):.4f} s  first {v[0]:.4f}  all {[round(x, 4) for x in v]}")
