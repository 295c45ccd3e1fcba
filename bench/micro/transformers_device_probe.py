"""Where a from_pretrained inside hbmio.use_in_transformers() onto one GPU fails: the model's
shards through hbmio.open(device=cuda:0) walked by one thread and by several (as transformers 5
materialises them), checked against safetensors byte for byte; then from_pretrained itself, three
rounds in one process with the device's cache emptied between them (as lazy_compare.py does).
  usage: transformers_device_probe.py MODEL_DIR [walk|pretrained]..."""
import concurrent.futures as cf
import gc
import glob
import os
import sys
import time
import traceback

import torch

import hbmio

model_dir = sys.argv[1]
what = sys.argv[2:] or ["walk", "pretrained"]
shards = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def walk(threads):
    from safetensors import safe_open
    bad = 0
    for path in shards:
        with safe_open(path, "pt", device="cpu") as ref:
            keys = list(ref.keys())
            with hbmio.open(path, framework="pt", device="cuda:0") as f:
                if threads == 0:
                    got = {k: f.get_tensor(k) for k in keys}
                else:
                    with cf.ThreadPoolExecutor(threads) as pool:
                        got = dict(zip(keys, pool.map(lambda k: f.get_slice(k)[...], keys)))
                torch.cuda.synchronize()
                for k in keys:
                    if not torch.equal(got[k].cpu(), ref.get_tensor(k)):
                        bad += 1
                        print(f"  {os.path.basename(path)} {k}: DIFFERS", flush=True)
                print(f"  {os.path.basename(path)}: {len(keys)} tensors; report {f.report().get('paths')}", flush=True)
    return bad


def interleaved(threads):
    """As transformers 5 loads: every shard opened first, a slice of each tensor taken, then the
    tensors materialised by a pool in the model's order (across the shards), the handles closed last."""
    import re
    from safetensors import safe_open
    handles, slices, where = [], {}, {}
    for path in shards:
        f = hbmio.open(path, framework="pt", device="cuda:0")
        handles.append(f)
        for k in f.keys():
            slices[k], where[k] = f.get_slice(k), path
    order = sorted(slices, key=lambda k: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", k)])
    with cf.ThreadPoolExecutor(threads) as pool:
        got = dict(zip(order, pool.map(lambda k: slices[k][...], order)))
    torch.cuda.synchronize()
    for f in handles:
        f.__exit__(None, None, None)
    bad = 0
    for path in shards:
        with safe_open(path, "pt", device="cpu") as ref:
            for k in ref.keys():
                if not torch.equal(got[k].cpu(), ref.get_tensor(k)):
                    bad += 1
    return bad


def attempt(label, run, threads):
    """Runs one variant, says ok, how many tensors differ, or the failure; frees the device after."""
    t0 = time.perf_counter()
    try:
        bad = run(threads)
        print(f"{label} threads={threads}: {'ok' if not bad else f'{bad} DIFFER'} in {time.perf_counter() - t0:.2f} s", flush=True)
    except Exception:
        print(f"{label} threads={threads}: FAILED", flush=True)
        traceback.print_exc()
    gc.collect()
    torch.cuda.empty_cache()


for w in what:
    if w == "interleaved":
        for threads in (1, 4):
            attempt("interleaved", interleaved, threads)
    elif w == "walk":
        for threads in (0, 1, 4, 8):
            attempt("walk", walk, threads)
    elif w == "pretrained":
        from transformers import AutoModelForCausalLM
        for r in range(3):
            t0 = time.perf_counter()
            try:
                with hbmio.use_in_transformers():
                    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda:0")
                torch.cuda.synchronize()
                print(f"from_pretrained round {r}: ok in {time.perf_counter() - t0:.3f} s", flush=True)
                del m
            except Exception:
                print(f"from_pretrained round {r}: FAILED", flush=True)
                traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
