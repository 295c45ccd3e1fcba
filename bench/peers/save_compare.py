#!/usr/bin/env python3
"""Durable saves from GPU (or host) memory against the storage write ceiling, rounds interleaved.

A save's target is a ratio to the O_DIRECT write rate of the same disk, and the disks of the lent
machines drift by 10-20% within minutes, so every contender runs once per round, in an order
rotated from round to round, and the summary is the median per contender with its ratio to the
median ceiling. Contenders:
  ceiling          hbmio write --from pinned --direct-io on --sync (O_DIRECT from page-locked memory)
  uring write      hbmio write --from <device> --direct-io on --sync (the engine's own write path)
  ckpt generate big    hbmio ckpt generate --count 48 (checksums on; fsync, rename, directory fsync)
  ckpt generate small  hbmio ckpt generate --count 3072
  hbmio.save_file  from torch tensors on <device>, 48 tensors (needs torch)
  safetensors      safetensors.torch.save_file + os.fsync, same tensors (needs torch and safetensors)
  --variant 'LABEL:K=V ...' adds "ckpt generate big LABEL" and "ckpt generate small LABEL", run with those
  environment variables (engine tunings such as HBMIO_BOUNCE_BUFFERS=8; HBMIO=PATH names another
  hbmio executable, e.g. an earlier build), so a change is measured against its predecessor in the
  same rounds.
Each writes a new file in --dir, removed before the next contender runs (the disk holds one at a
time). One JSON line per measurement on stdout and in --json, then one summary line per contender.
"""
import argparse, json, os, statistics, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_seconds, json_lines  # noqa: E402

GIB = 1 << 30
SIZES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text):
    for suffix, unit in SIZES.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * unit)
    return int(text)


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hbmio", required=True, help="the hbmio executable")
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--device", default="cuda:0", help="cuda:N, or pinned for a machine without a GPU")
    p.add_argument("--size", default="6GiB", help="bytes per save")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", help="comma-separated contenders to run (default: all that can run here)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:K=V ...",
                   help="further ckpt generate contenders under these environment variables (HBMIO=PATH: another executable)")
    p.add_argument("--json")
    a = p.parse_args()
    size = parse_size(a.size)
    emit = json_lines(a.json, device=a.device, bytes=size)
    out = os.path.join(a.dir, "hbmio-save-compare.out")
    big, small = 48, 3072

    def hbmio_write(source):
        return lambda: run_json([a.hbmio, "write-random", out, "--force", "--from", source, "--size", str(size), "--direct-io", "on",
                                 "--backend", "uring", "--sync", "--json", "-"])["stats"]

    def ckpt_save(count, env=None):
        exe = (env or {}).get("HBMIO", a.hbmio)
        cmd = [exe, "ckpt", "generate", out, "--force", "--count", str(count), "--tensor-size", str(size // count), "--from", a.device,
               "--json", "-"]
        return lambda: run_json(cmd, env)["stats"]

    contenders = {"ceiling": hbmio_write("pinned"), "uring write": hbmio_write(a.device),
                  "ckpt generate big": ckpt_save(big), "ckpt generate small": ckpt_save(small)}
    for variant in a.variant:
        label, _, assignments = variant.partition(":")
        env = dict(os.environ, **dict(kv.split("=", 1) for kv in assignments.split()))
        contenders[f"ckpt generate big {label}"] = ckpt_save(big, env)
        contenders[f"ckpt generate small {label}"] = ckpt_save(small, env)
    try:
        import torch
        import hbmio
        from safetensors.torch import save_file as st_save
    except ImportError as e:
        print(f"Python contenders skipped: {e}", file=sys.stderr)
    else:
        device = "cpu" if a.device == "pinned" else a.device
        gen = torch.Generator(device=device).manual_seed(1)
        per = size // big // 2  # bf16 elements per tensor
        tensors = {f"layer.{i:02d}.weight": torch.randn(per, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
                   for i in range(big)}
        if device != "cpu":
            torch.cuda.synchronize()

        def timed(fn):
            def run():
                c, t = cpu_seconds(), time.perf_counter()
                fn()
                t = time.perf_counter() - t
                return {"seconds": t, "gib_per_second": size / GIB / t, "cpu_seconds": cpu_seconds() - c}
            return run

        def st_durable():
            st_save(tensors, out)
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        contenders["hbmio.save_file"] = timed(lambda: hbmio.save_file(tensors, out))
        contenders["safetensors + fsync"] = timed(st_durable)
    if a.only:
        wanted = [name.strip() for name in a.only.split(",")]
        contenders = {name: contenders[name] for name in wanted if name in contenders}

    seconds = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no one always goes first
            if os.path.exists(out):
                os.remove(out)
            subprocess.run(["sync"], check=True)
            stats = contenders[name]()
            seconds[name].append(stats["seconds"])
            rec = {"contender": name, "round": r, "seconds": stats["seconds"], "gib_per_s": round(stats["gib_per_second"], 3),
                   "cpu_s": round(stats.get("cpu_seconds", 0.0), 3)}
            if stats.get("note"):
                rec["note"] = stats["note"]
            emit(rec)
    if os.path.exists(out):
        os.remove(out)
    ceiling = statistics.median(seconds["ceiling"]) if seconds.get("ceiling") else None
    for name, runs in seconds.items():
        median = statistics.median(runs)
        rec = {"contender": name, "summary": True, "runs": [round(s, 3) for s in runs], "median_s": round(median, 4),
               "gib_per_s": round(size / GIB / median, 3)}
        if ceiling:
            rec["of_ceiling"] = round(ceiling / median, 3)
        emit(rec)


if __name__ == "__main__":
    main()
