#!/usr/bin/env python3
"""The per-shard cost of the handles from_pretrained opens, without transformers: every shard of a
small many-shard model (bench/peers/small_shards.py writes one) opened on the CPU and every tensor
taken, through safetensors.safe_open and through hbmio.open(..., mmap=True) (what
use_in_transformers opens there), alternated; prints the mean ms per walk of 20.

  python3 bench/peers/small_shards_handles.py [MODEL_DIR]
"""
import glob
import sys
import time

import hbmio
import safetensors

model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/hbmio-small-shards/llama-256x6-800KB"
files = sorted(glob.glob(f"{model}/*.safetensors"))
assert files, f"no .safetensors files in {model}"


def hbmio_mmap():
    for f in files:
        with hbmio.open(f, framework="pt", device="cpu", mmap=True) as h:
            for k in h.keys():
                h.get_tensor(k)


def safe_open():
    for f in files:
        with safetensors.safe_open(f, framework="pt", device="cpu") as h:
            for k in h.keys():
                h.get_tensor(k)


for walk in (safe_open, hbmio_mmap, safe_open, hbmio_mmap):
    walk()  # warm
    start = time.perf_counter()
    for _ in range(20):
        walk()
    print(f"{walk.__name__:12s} {(time.perf_counter() - start) / 20 * 1000:.3f} ms per walk of {len(files)} shards")
