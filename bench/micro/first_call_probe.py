#!/usr/bin/env python3
"""Where the first from_pretrained call of a process spends its time through hbmio.use_in_transformers(),
against stock transformers: each in a fresh process, the first call profiled (cProfile, top entries
by cumulative and by own time), then a second call timed. For issue-level diagnosis, not a benchmark.

  python3 bench/micro/first_call_probe.py MODEL_DIR cuda:0
"""
import subprocess, sys

CHILD = r'''
import cProfile, io, pstats, sys, time, torch, transformers
from transformers import AutoModelForCausalLM
import transformers.modeling_utils, transformers.models.llama.modeling_llama
mdir, device, which = sys.argv[1], sys.argv[2], sys.argv[3]
torch.zeros(1, device=device); torch.cuda.synchronize()
if which == "hbmio":
    t = time.perf_counter(); import hbmio; ctx = hbmio.use_in_transformers(); ctx.__enter__()
    print(f"import hbmio + use_in_transformers: {time.perf_counter() - t:.4f} s")
def load():
    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16, device_map=device)
    torch.cuda.synchronize()
    return time.perf_counter() - t
prof = cProfile.Profile()
prof.enable(); first = load(); prof.disable()
second = load()
third = load()
print(f"{which}: first {first:.4f} s (profiled), second {second:.4f} s, third {third:.4f} s")
for key in ("cumulative", "tottime"):
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28); print(s.getvalue()[-6000:])
'''

for which in ("stock", "hbmio", "stock", "hbmio"):
    r = subprocess.run([sys.executable, "-c", CHILD, sys.argv[1], sys.argv[2], which], capture_output=True, text=True)
    print(f"===== {which} =====")
    print(r.stdout if r.returncode == 0 else r.stdout + r.stderr[-3000:])
