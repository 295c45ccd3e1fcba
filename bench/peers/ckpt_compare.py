#!/usr/bin/env python3
"""Checkpoint loads into GPU memory, interleaved: hbmio beside its ceiling and its peers, same file.

Cold: R rounds; in each round every contender loads the file once, the page cache dropped before
each, the order rotated round by round, so a drift of the disk (a shared virtio disk varies by
+-30% over minutes) falls on every contender alike. Contenders:
  ceiling   `hbmio read FILE --into pinned --backend uring --direct-io on`: the O_DIRECT disk rate
  hbmio     `hbmio ckpt load FILE --into cuda:N --runs 2 --drop-cache`: the second load (a load in a
            running program, like the peers'); the first (fresh process) is reported beside it
  peers     safetensors, fastsafetensors, runai, hbmio.load_file (bench/peers/safetensors_peers.py:
            each as its documentation recommends for speed; every tensor checked against a CPU load
            once; each loads the file once, untimed, before the first round, so that no peer pays
            its first-use set-up in a cold round)
  variants  --variant LABEL=ARGS: `hbmio ckpt load` with extra tuning flags (e.g.
            "bb8=--bounce-buffers 8"), cold and warm, as further contenders
Warm: each contender's median of W loads from the page cache: hbmio with `--runs W` (one engine),
with and without `--reuse-memory`; the peers in this process (torch's caching allocator keeps
their device memory between runs, which `--reuse-memory` gives hbmio).
One JSON line per measurement on stdout and in --json.
"""
import argparse, gc, json, os, statistics, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import drop_cache, json_lines  # noqa: E402
import safetensors_peers as sp  # noqa: E402

GIB = 1 << 30


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def hbmio_load(a, extra=()):
    into = "host" if a.device == "cpu" else a.device  # cpu: a dry run of this script without a GPU
    j = run_json([a.hbmio, "ckpt", "load", a.file, "--into", into, "--json", "-", *extra])
    return j


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--hbmio", required=True, help="the hbmio binary")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm-runs", type=int, default=5)
    p.add_argument("--peers", default="safetensors,fastsafetensors,runai")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--mode", choices=["cold", "warm", "both"], default="both")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                   help="also measure `hbmio ckpt load` with these extra flags, e.g. 'bb8=--bounce-buffers 8'")
    p.add_argument("--json")
    a = p.parse_args()
    variants = {f"hbmio {v.split('=', 1)[0]}": v.split("=", 1)[1].split() for v in a.variant}
    a.runs = 1
    os.environ.setdefault("RUNAI_STREAMER_CONCURRENCY", str(a.threads))
    try:
        import humanize  # noqa: F401
    except ImportError:
        import types
        sys.modules["humanize"] = types.SimpleNamespace(naturalsize=lambda n, **kw: f"{n} B")
    import torch
    from safetensors.torch import load_file

    size = os.path.getsize(a.file)
    ref = {k: v.clone() for k, v in load_file(a.file).items()}
    gc.collect()
    ref_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    torch.zeros(1, device=a.device)
    if a.device != "cpu":
        torch.cuda.synchronize()
    peers = [s.strip() for s in a.peers.split(",") if s.strip()]

    emit = json_lines(a.json, file=a.file, bytes=size, device=a.device)

    def peer_once(name, mode, check):
        a.runs = 1
        rec = sp.measure(torch, name, mode, a, ref if check else {}, ref_bytes, size)
        if not check:
            rec.pop("check", None)
        return rec

    if a.mode in ("cold", "both"):
        for c in peers:  # first-use set-up (imports, engines, allocators) outside the rounds
            try:
                module, fn, _ = sp.PEERS[c]
                __import__(module)
                sp.touch(torch, fn(a.file, a.device, a.threads), a.device)
            except Exception as e:
                emit(dict(contender=c, mode="warm-up", error=f"{type(e).__name__}: {e}"))
            gc.collect()
            torch.cuda.empty_cache()
        contenders = ["ceiling", "hbmio", *variants, *peers]
        results = {c: [] for c in contenders}
        for r in range(a.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                try:
                    if c == "ceiling":
                        drop_cache(a.file)
                        j = run_json([a.hbmio, "read", a.file, "--into", "pinned", "--backend", "uring",
                                      "--direct-io", "on", "--json", "-"])
                        s = j["stats"]["seconds"] if "stats" in j else j["seconds"]
                        rec = dict(contender=c, mode="cold", round=r, seconds=s)
                    elif c == "hbmio" or c in variants:
                        # Two cold loads in one process (page cache dropped before each): the
                        # first pays the process's first touch of 6 GiB of fresh device memory,
                        # the second is a load in a running program, as the peers are measured
                        # (they run in this process, whose CUDA memory is warmed up).
                        j = hbmio_load(a, ("--runs", "2", "--drop-cache", *variants.get(c, ())))
                        emit(dict(contender=f"{c} (first load of a fresh process)", mode="cold", round=r,
                                  seconds=j["run_seconds"][0], gib_per_s=round(size / GIB / j["run_seconds"][0], 3)))
                        rec = dict(contender=c, mode="cold", round=r, seconds=j["run_seconds"][1],
                                   note=j["stats"].get("note", ""), cpu_s=j["stats"].get("cpu_seconds"))
                    else:
                        pr = peer_once(c, "cold", check=(r == 0))
                        rec = dict(contender=c, mode="cold", round=r, seconds=pr["median_s"],
                                   cpu_s_per_gib=pr.get("cpu_s_per_gib"), **({"check": pr["check"]} if "check" in pr else {}))
                except Exception as e:  # one failing contender must not stop the others
                    rec = dict(contender=c, mode="cold", round=r, error=f"{type(e).__name__}: {e}")
                if "seconds" in rec:
                    rec["gib_per_s"] = round(size / GIB / rec["seconds"], 3)
                    results[c].append(rec["seconds"])
                emit(rec)
                gc.collect()
                torch.cuda.empty_cache()
        for c, times in results.items():
            if times:
                med = statistics.median(times)
                emit(dict(contender=c, mode="cold", summary=True, runs=[round(t, 3) for t in times],
                          median_s=round(med, 4), gib_per_s=round(size / GIB / med, 3)))

    if a.mode in ("warm", "both"):
        sp.fill_cache(a.file)
        runs = [((), "hbmio"), (("--reuse-memory",), "hbmio --reuse-memory")]
        runs += [((*flags, "--reuse-memory"), f"{label} --reuse-memory") for label, flags in variants.items()]
        for extra, label in runs:
            j = hbmio_load(a, ("--runs", str(a.warm_runs), *extra))
            emit(dict(contender=label, mode="warm", summary=True, runs=[round(t, 4) for t in j["run_seconds"]],
                      median_s=round(j["median_seconds"], 4), gib_per_s=round(j["median_gib_per_second"], 3),
                      note=j["stats"].get("note", ""), first_run_note=(j.get("run_notes") or [""])[0]))
        for c in peers:
            try:
                a.runs = a.warm_runs
                pr = sp.measure(torch, c, "warm", a, ref, ref_bytes, size)
                emit(dict(contender=c, mode="warm", summary=True, runs=pr["seconds"], median_s=pr["median_s"],
                          gib_per_s=pr["gib_per_s"], cpu_s_per_gib=pr.get("cpu_s_per_gib"), check=pr.get("check")))
            except Exception as e:
                emit(dict(contender=c, mode="warm", error=f"{type(e).__name__}: {e}"))
            gc.collect()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
