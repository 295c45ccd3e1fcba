#!/usr/bin/env python3
"""Small and many-shard models through from_pretrained: stock transformers against the same call
inside hbmio.use_in_transformers(). No model size or shard count may load slower through hbmio.

The model: a LlamaConfig of about --size (default 11 MiB) in bf16, saved once with
save_pretrained(max_shard_size=--shard-size), so it has many shards (15 at the defaults).
Each contender runs in a fresh process (--runs of them, interleaved), where it times, around
AutoModelForCausalLM.from_pretrained(dir, device_map=--device), the first call and then --calls
more in the same process; CUDA is synchronized before each clock stops. Every load is checked
against the stock load's tensors (byte equality, outside the timed region).

  python3 bench/peers/small_shards.py --device cuda:0 [--dir D] [--json out.jsonl]

Prints a table of medians; one JSON line per contender to --json.
"""
import argparse, json, os, statistics, subprocess, sys, time

CHILD = r'''
import json, sys, time, torch, transformers
from transformers import AutoModelForCausalLM
import transformers.modeling_utils, transformers.models.llama.modeling_llama  # imports are nobody's load time
mdir, device, calls, which = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ctx = None
if which.startswith("hbmio"):
    import hbmio
    if which == "hbmio-direct":  # every file read straight into the device, however small
        from hbmio import integrations
        integrations._DIRECT_MIN_BYTES = 0
    ctx = hbmio.use_in_transformers()
    ctx.__enter__()
def load():
    t = time.perf_counter()
    kw = {"device_map": device} if device != "cpu" else {}  # device_map needs accelerate
    m = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16, **kw)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t, m
if device.startswith("cuda"):
    torch.zeros(1, device=device); torch.cuda.synchronize()  # the CUDA context is not the loader's cost
first, m = load()
later = []
for _ in range(calls):
    s, m2 = load(); later.append(s); del m2
sums = {k: int(v.detach().view(torch.int16).to(torch.int64).sum()) if v.dtype == torch.bfloat16 else float(v.float().sum())
        for k, v in m.state_dict().items()}
print(json.dumps({"first": first, "later": later, "sums": sums}))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default="/tmp/hbmio-small-shards")
    ap.add_argument("--size", type=float, default=11, help="model size in MiB (bf16)")
    ap.add_argument("--shard-size", default="800KB")
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per contender")
    ap.add_argument("--calls", type=int, default=5, help="loads after the first, per process")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    hidden, inter, vocab = 256, 688, 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((a.size * 2**20 / 2 - 2 * vocab * hidden) / per_layer))
    mdir = os.path.join(a.dir, f"llama-{hidden}x{layers}-{a.shard_size}")
    if not os.path.exists(os.path.join(mdir, "config.json")):
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                          num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m.save_pretrained(mdir, max_shard_size=a.shard_size)
    shards = [f for f in os.listdir(mdir) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(mdir, f)) for f in shards)
    print(f"model: {mdir}, {len(shards)} shards, {size / 2**20:.1f} MiB; device {a.device}; "
          f"{a.runs} fresh processes x (first call + {a.calls})", flush=True)
    contenders = ["stock", "hbmio"] + (["hbmio-direct"] if a.device.startswith("cuda") else [])
    results = {which: [] for which in contenders}
    for run in range(a.runs):
        for which in contenders[run % len(contenders):] + contenders[:run % len(contenders)]:  # rotated
            out = subprocess.run([sys.executable, "-c", CHILD, mdir, a.device, str(a.calls), which],
                                 capture_output=True, text=True, check=True)
            results[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    want = results["stock"][0]["sums"]
    for which, rs in results.items():
        for r in rs:
            assert r["sums"] == want, f"{which}: tensors differ from the stock load"
    rows = []
    for which, rs in results.items():
        first = statistics.median(r["first"] for r in rs)
        later = statistics.median(s for r in rs for s in r["later"])
        rows.append((which, first, later))
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"bench": "small_shards", "contender": which, "device": a.device, "shards": len(shards),
                                    "bytes": size, "first_s": first, "later_s": later,
                                    "first_all": [r["first"] for r in rs]}) + "\n")
    print(f"{'contender':<34} {'first call (s)':>15} {'later calls (s)':>16}")
    for which, first, later in rows:
        name = {"stock": "from_pretrained, stock", "hbmio": "inside hbmio.use_in_transformers()",
                "hbmio-direct": "  the same, every file into the GPU"}[which]
        print(f"{name:<34} {first:>15.4f} {later:>16.4f}")
    print("every load checked equal to the stock load")


if __name__ == "__main__":
    main()
