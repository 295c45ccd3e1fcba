#!/usr/bin/env python3
"""Loads into host memory, warm: the time until the call returns and until every tensor has been
used once (summed), for safetensors.torch.load_file (a mapped file, read on first touch),
hbmio.torch.load_file (mapped by default, as the reference), and hbmio.load_file (copied: every byte
read before it returns). Each contender loads --runs times in one process after one untimed load;
medians. Every result is checked equal to the reference's.

  python3 bench/peers/cpu_load_compare.py [--file F] [--size-gib 1] [--tensors 16] [--runs 5]
"""
import argparse, os, statistics, time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default="/tmp/hbmio-cpu-load.safetensors")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    import torch, safetensors.torch as st, hbmio, hbmio.torch as ht
    per = int(a.size_gib * 2**30 / 4 / a.tensors)
    if not os.path.exists(a.file) or os.path.getsize(a.file) < a.size_gib * 2**30:
        g = torch.Generator().manual_seed(0)
        st.save_file({f"t{i}": torch.randn(per, generator=g) for i in range(a.tensors)}, a.file)
    ref = st.load_file(a.file)
    want = {k: float(v.sum()) for k, v in ref.items()}
    del ref
    contenders = {
        "safetensors.torch.load_file (mapped)": lambda: st.load_file(a.file),
        "hbmio.torch.load_file (mapped)": lambda: ht.load_file(a.file),
        "hbmio.load_file (copied)": lambda: hbmio.load_file(a.file),
    }
    print(f"{os.path.getsize(a.file) / 2**30:.2f} GiB, {a.tensors} float32 tensors, warm, into host memory; median of {a.runs}")
    print(f"{'contender':<40} {'returns (s)':>12} {'first use (s)':>14}")
    for name, load in contenders.items():
        load()  # untimed: warm page cache, started engines
        returned, used = [], []
        for _ in range(a.runs):
            t = time.perf_counter()
            d = load()
            t1 = time.perf_counter()
            sums = {k: float(v.sum()) for k, v in d.items()}
            t2 = time.perf_counter()
            assert sums == want, f"{name}: tensors differ from the reference's"
            returned.append(t1 - t)
            used.append(t2 - t)
            del d
        print(f"{name:<40} {statistics.median(returned):>12.4f} {statistics.median(used):>14.4f}")


if __name__ == "__main__":
    main()
