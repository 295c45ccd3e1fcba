#!/usr/bin/env python3
"""Checkpoints that do not stop training: how long the save call blocks (the stall) and how long
until the checkpoint is durable, for a state on the GPU that a loop changes between saves.

Contenders, each in a process of its own (so its peak host memory is its own), on the same state
(--tensors tensors of BF16, --size-gib in all, on --device):
  copy            one device-to-pinned copy of the state into preallocated pinned tensors: the
                  floor of any stall that takes the state off the GPU
  sync            hbmio.save_file, blocking (durable when it returns)
  async-pinned    hbmio.save_file(blocking=False): --saves saves, the state changed between them
                  (each save waited for before the next step, so each is timed alone)
  async-device    the same with staging="device"
  dcp-fs          torch.distributed.checkpoint.async_save with torch's FileSystemWriter (its
                  default stager), then future.result()
  dcp-fs-cached   the same with one FileSystemWriter(cache_staged_state_dict=True) kept across
                  saves (torch's blocking stager into pinned tensors it reuses)
  dcp-fs-pinned   the same with DefaultStager(StagingOptions(pinned, shared memory, async staging,
                  non-blocking copies)) where this torch has it (torch's documented fast path);
                  its stall lasts until its staging_completion future is done (the state may
                  change only then), the return of the call is reported as return_s
  dcp-hbmio       dcp.async_save with hbmio.dcp.StorageWriter: it stages itself (DCP's AsyncStager),
                  one copy into host staging memory it keeps between saves
  dcp-hbmio-device  the same with StorageWriter(staging="device"): a device-to-device copy
  mix             blocking, async-pinned and async-device saves of one state in one process,
                  interleaved and rotated (--saves rounds of the three), each waited for before the
                  next: the time-to-durable ratio of a background save to a blocking one, on a disk
                  whose rate drifts over a run of saves (the contenders above run one after the
                  other, so a later one meets a slower disk); the summary gives each mode's median
                  and its ratio to the blocking saves'
Every contender's last checkpoint is loaded back and compared with the state it was given
(torch.equal on the GPU); a mismatch marks the row ok=false. One JSON line per measurement.
"""
import argparse, json, os, resource, shutil, statistics, subprocess, sys, time

GIB = 1 << 30


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_state(torch, args):
    n = args.tensors
    per = int(args.size_gib * GIB) // n // 2  # BF16 elements per tensor
    g = torch.Generator(device=args.device).manual_seed(1)
    return {f"layers.{i}.weight": torch.randn(per, device=args.device, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for i in range(n)}


def sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step(torch, state):
    # What a training step does to the state: every tensor changes.
    for t in state.values():
        t.add_(1)
    sync(torch)


def check(torch, got, expected):
    return sorted(got) == sorted(expected) and all(torch.equal(got[k].to(expected[k].device), expected[k]) for k in expected)


def one(args):
    import torch
    out = {"contender": args.one, "device": args.device}
    state = make_state(torch, args)
    sync(torch)
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    out["rss_start"] = rss()
    path = os.path.join(args.dir, args.one)
    rows = []
    if args.one == "copy":
        pin = torch.cuda.is_available()
        pinned = {k: torch.empty_like(v, device="cpu").pin_memory() if pin else torch.empty_like(v, device="cpu")
                  for k, v in state.items()}
        for _ in range(args.rounds):
            sync(torch)
            t0 = time.perf_counter()
            for k, v in state.items():
                pinned[k].copy_(v, non_blocking=pin)
            sync(torch)
            rows.append({"stall_s": time.perf_counter() - t0})
        out["ok"] = check(torch, pinned, state)
    elif args.one == "sync":
        import hbmio
        for _ in range(args.rounds):
            step(torch, state)
            t0 = time.perf_counter()
            hbmio.save_file(state, path + ".safetensors")
            s = time.perf_counter() - t0
            rows.append({"stall_s": s, "durable_s": s})
        out["ok"] = check(torch, hbmio.load_file(path + ".safetensors", device=args.device, framework="torch"), state)
    elif args.one.startswith("async-"):
        import hbmio
        staging = args.one.split("-", 1)[1]
        expected = None
        for i in range(args.saves):
            step(torch, state)
            t0 = time.perf_counter()
            h = hbmio.save_file(state, path + ".safetensors", blocking=False, staging=staging)
            stall = time.perf_counter() - t0
            resident = rss()  # before the check's copy below
            if i == args.saves - 1:
                expected = {k: v.clone() for k, v in state.items()}
            step(torch, state)  # the next step runs while the save persists
            h.result()
            r = h.report
            cap, allocated, in_use = hbmio._hbmio._staging_pool()
            rows.append({"save": i, "stall_s": stall, "durable_s": r["persist_seconds"], "snapshot_s": r["snapshot_seconds"],
                         "stalled_s": r["stalled_seconds"], "staging": r["staging"], "pool_allocated": allocated,
                         "rss": resident})
        out["ok"] = check(torch, hbmio.load_file(path + ".safetensors", device=args.device, framework="torch"), expected)
    elif args.one == "mix":
        import hbmio
        modes = ["sync", "async-pinned", "async-device"]
        expected = {}
        for i in range(args.saves):
            for mode in modes[i % 3:] + modes[:i % 3]:
                step(torch, state)
                target = f"{path}-{mode}.safetensors"  # each mode replaces its own previous file
                t0 = time.perf_counter()
                if mode == "sync":
                    hbmio.save_file(state, target)
                    stall = durable = time.perf_counter() - t0
                    row = {}
                else:
                    h = hbmio.save_file(state, target, blocking=False, staging=mode.split("-", 1)[1])
                    stall = time.perf_counter() - t0
                    snapshot = {k: v.clone() for k, v in state.items()} if i == args.saves - 1 else None
                    step(torch, state)  # the next step runs while the save persists
                    h.result()
                    durable = h.report["persist_seconds"]
                    row = {"staging": h.report["staging"], "snapshot_s": h.report["snapshot_seconds"]}
                    if snapshot is not None:
                        expected[mode] = snapshot
                if i == args.saves - 1 and mode == "sync":
                    expected[mode] = {k: v.clone() for k, v in state.items()}
                rows.append({"save": i, "mode": mode, "stall_s": stall, "durable_s": durable, **row})
        out["ok"] = all(check(torch, hbmio.load_file(f"{path}-{m}.safetensors", device=args.device, framework="torch"), e)
                        for m, e in expected.items())
        for m in modes:
            if os.path.exists(f"{path}-{m}.safetensors"):
                os.unlink(f"{path}-{m}.safetensors")
    elif args.one.startswith("dcp-"):
        import torch.distributed.checkpoint as dcp
        kwargs = {}
        if args.one.startswith("dcp-hbmio"):
            import hbmio.dcp
            staging = "device" if args.one == "dcp-hbmio-device" else "pinned"
            make_writer = lambda: hbmio.dcp.StorageWriter(path, staging=staging)  # noqa: E731
        elif args.one == "dcp-fs-cached":
            kept = dcp.FileSystemWriter(path, cache_staged_state_dict=True)
            make_writer = lambda: kept  # noqa: E731
        else:
            make_writer = lambda: dcp.FileSystemWriter(path)  # noqa: E731
            if args.one == "dcp-fs-pinned":
                try:
                    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                except ImportError:
                    print(json.dumps({**out, "skipped": "this torch has no DefaultStager"}), flush=True)
                    return
                stager = DefaultStager(StagingOptions(True, True, True, True))
                kwargs["async_stager"] = stager
        expected = None
        for i in range(args.rounds):
            step(torch, state)
            shutil.rmtree(path, ignore_errors=True)
            writer = make_writer()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=writer, **kwargs)
            returned = time.perf_counter() - t0
            # async_save's future: an AsyncSaveResponse (staging and upload futures) where the
            # stager stages in the background; the state may change only once staging completed.
            staging_done = getattr(fut, "staging_completion", None)
            if staging_done is not None:
                staging_done.result()
            stall = time.perf_counter() - t0
            if i == args.rounds - 1:
                expected = {k: v.clone() for k, v in state.items()}
            step(torch, state)
            upload = getattr(fut, "upload_completion", fut)
            upload.result()
            row = {"round": i, "stall_s": stall, "return_s": returned, "durable_s": time.perf_counter() - t0, "rss": rss()}
            staged = getattr(writer, "last_staging", None)
            if staged:  # hbmio's writer: what its stage() did
                row.update({"stage_s": staged["stage_seconds"], "staging": staged["staging"],
                            "staged_bytes": staged["staged_bytes"], "unpooled_bytes": staged["unpooled_bytes"],
                            "staging_pool": hbmio.dcp._arena.stats()["allocated"]})
            rows.append(row)
        got = {k: torch.empty_like(v) for k, v in expected.items()}
        reader = hbmio.dcp.StorageReader(path) if args.one.startswith("dcp-hbmio") else dcp.FileSystemReader(path)
        dcp.load(got, storage_reader=reader)
        out["ok"] = check(torch, got, expected)
    out["peak_rss"] = peak_rss()
    for r in rows:
        print(json.dumps({**out, **r}), flush=True)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path + ".safetensors"):
        os.unlink(path + ".safetensors")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/asave")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size-gib", type=float, default=6)
    p.add_argument("--tensors", type=int, default=48)
    p.add_argument("--saves", type=int, default=20, help="background saves in a row (async-*); rounds of the three modes (mix)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the other contenders")
    p.add_argument("--only", default="copy,sync,async-pinned,async-device,dcp-fs,dcp-fs-cached,dcp-fs-pinned,dcp-hbmio,"
                                     "dcp-hbmio-device")
    p.add_argument("--json", help="also append the JSON lines here")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.one:
        return one(args)
    lines = []
    for contender in args.only.split(","):
        # The caller's arguments less --only and --json (and their values, given as "--json=F"
        # or as "--json F").
        passed, skip = [], False
        for a in sys.argv[1:]:
            if skip:
                skip = False
            elif a in ("--only", "--json"):
                skip = True
            elif not a.startswith(("--only=", "--json=")):
                passed.append(a)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", contender] + passed
        started = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
        if run.returncode != 0:
            got.append({"contender": contender, "error": run.stderr[-2000:]})
        for g in got:
            print(json.dumps(g), flush=True)
        lines += got
        print(f"# {contender}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for l in lines:
                f.write(json.dumps(l) + "\n")
    # Summary: medians (async: saves after the first, which also fills the pool).
    print()
    print(f"{'contender':<16} {'stall s':>9} {'durable s':>10} {'peak RSS GiB':>13} ok")
    for contender in args.only.split(","):
        rows = [l for l in lines if l.get("contender") == contender and "stall_s" in l]
        if contender == "mix" and rows:
            # Medians over the rounds after the first (which also fills the pool), per mode.
            later = [r for r in rows if r["save"] > 0] or rows
            median = {m: statistics.median(r["durable_s"] for r in later if r["mode"] == m)
                      for m in ("sync", "async-pinned", "async-device")}
            for m, d in median.items():
                stall = statistics.median(r["stall_s"] for r in later if r["mode"] == m)
                print(f"mix {m:<10} {stall:9.3f} {d:10.3f} {rows[0]['peak_rss'] / GIB:13.2f} {all(r.get('ok', True) for r in rows)}"
                      f"  durable x blocking: {d / median['sync']:.2f}")
            continue
        if not rows:
            err = next((l.get("error") or l.get("skipped") for l in lines if l.get("contender") == contender), "no rows")
            print(f"{contender:<16} {str(err).splitlines()[-1] if err else ''}")
            continue
        # Saves after the first, which also allocates (and page-locks) the memory later ones reuse.
        later = rows[1:] if contender.startswith(("async-", "dcp-")) and len(rows) > 1 else rows
        stall = statistics.median(r["stall_s"] for r in later)
        durable = [r["durable_s"] for r in later if "durable_s" in r]
        print(f"{contender:<16} {stall:9.3f} {statistics.median(durable) if durable else float('nan'):10.3f} "
              f"{rows[0]['peak_rss'] / GIB:13.2f} {all(r.get('ok', True) for r in rows)}")
        if contender.startswith("dcp-"):
            print(f"{'':<16} first save: stall {rows[0]['stall_s']:.3f} s, durable {rows[0]['durable_s']:.3f} s"
                  + (f"; staging {rows[-1]['staging']}, copy {statistics.median(r['stage_s'] for r in later):.3f} s, "
                     f"pool {rows[-1]['staging_pool'] / GIB:.2f} GiB" if "stage_s" in rows[-1] else ""))
        if contender.startswith("async-"):
            print(f"{'':<16} first save: stall {rows[0]['stall_s']:.3f} s, durable {rows[0]['durable_s']:.3f} s; "
                  f"RSS after save 2 / last: {later[0]['rss'] / GIB:.2f} / {rows[-1]['rss'] / GIB:.2f} GiB; "
                  f"pool {rows[-1]['pool_allocated'] / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
