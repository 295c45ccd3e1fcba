# The Python cost of a tensor-parallel walk of many small slices (the bytes are few: what is
# timed is the per-call work), against safetensors' safe_open on the same file, and the same
# rows as a prefetch plan. Usage: python row_walk_overhead.py [tensors] [device]
import os, sys, tempfile, time
import torch, hbmio, safetensors.torch as st
from safetensors import safe_open

n = int(sys.argv[1]) if len(sys.argv) > 1 else 3072
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
path = os.path.join(tempfile.gettempdir(), f"row_walk_{n}.safetensors")
if not os.path.exists(path):
    st.save_file({f"model.layers.{i:05d}.weight": torch.randn(64, 64).to(torch.bfloat16) for i in range(n)}, path)
expected = st.load_file(path)

def hbmio_walk():
    with hbmio.open(path, framework="pt", device=device) as f:
        return {k: f.get_slice(k)[:8] for k in f.keys()}

def hbmio_plan():
    with hbmio.open(path, framework="pt", device=device) as f, f.prefetch({k: slice(0, 8) for k in f.keys()}, device=device) as l:
        return dict(l)

def safe_open_walk():
    with safe_open(path, framework="pt", device=device) as f:
        return {k: f.get_slice(k)[:8] for k in f.keys()}

for fn in (hbmio_walk, hbmio_plan, safe_open_walk):
    times = []
    for _ in range(7):
        start = time.perf_counter()
        got = fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert all(torch.equal(got[k].cpu(), expected[k][:8]) for k in expected), fn.__name__
    best = min(times)
    print(f"{fn.__name__:15s} {best * 1e3:7.2f} ms  {best / n * 1e6:5.2f} us a tensor  (best of 7; results checked)")
