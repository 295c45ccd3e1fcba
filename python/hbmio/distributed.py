"""Loads across ranks of a torch.distributed process group: each byte read from storage once.

    hbmio.load_file(path, device=f"cuda:{local_rank}", group=dist.group.WORLD, placement="replicate")

placement="replicate": every rank gets every tensor. The tensors, in file order, are split into one
contiguous run per rank of about equal bytes; rank k reads run k from storage into its own copy
of the whole layout, then each run is broadcast from its reader to the others over the group
(NCCL between GPUs, gloo between CPUs). placement="shard": rank k gets only its run (or the tensors
`shard_map` assigns it) and nothing moves between ranks.

Who reads what, the shard_map checks and the digest the ranks compare come from the library
(hbmio::plan_load over the ranks, the plan its own NCCL load uses); this module keeps only the collectives.

Failures: every rank reports to the others whether its read worked before any data moves, so a
rank that cannot read (a missing shard on its node) makes every rank raise hbmio.Error naming
it, instead of leaving the others waiting in a collective. The group's own timeout bounds the
wait for a rank that dies outright.
"""
from __future__ import annotations

import time
from contextlib import nullcontext as _nullcontext

from . import _hbmio

def load(path: str, device, group, placement: str, shard_map, backend: str, verify: bool, names, report):
    import torch
    import torch.distributed as dist

    if placement not in ("replicate", "shard"):
        raise ValueError(f"placement must be 'replicate' or 'shard', not {placement!r}")
    from . import _TORCH_DTYPES, _device_text, _require_gpu  # as the single-process path reads them

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    start = time.perf_counter()
    # Whatever fails on one rank must reach the others through the gather below, never leave
    # them waiting in a collective: everything up to it runs inside this try.
    error, plan, run, ranges, digest, dest, entries, read, dev = None, None, None, None, None, None, {}, 0, None
    mine_report = {}  # this rank's read, as load_file's report (its paths: the way each file's bytes took)
    try:
        device = _device_text(device)  # ValueError for a form hbmio does not load into
        _require_gpu(device, path)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        # 1. Plan (every rank, from its own view of the files) and read this rank's run; the
        # headers are parsed once (SafeOpen) for the plan, the size and the read.
        opened = _hbmio.SafeOpen(path, cache="off")
        planned = _hbmio._plan_distributed(
            opened, names, world, placement, {k: int(v) for k, v in (shard_map or {}).items()}, bool(verify))
        plan, run, ranges, digest = planned.tensors, planned.reader, planned.ranges, planned.digest
        for t in plan:
            if not isinstance(getattr(torch, _TORCH_DTYPES.get(t.dtype, ""), None), torch.dtype):
                raise TypeError(f"tensor {t.name}: dtype {t.dtype} has no torch equivalent here")
        mine = [t.name for t, r in zip(plan, run) if r == rank]
        counter = _hbmio._Progress()
        if placement == "shard":
            if mine:
                own = _hbmio._plan(opened, mine)  # this rank's layout: its tensors only
                size = own[-1].offset + own[-1].size
                dest = torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
                if dev.type == "cuda":
                    torch.cuda.current_stream(dev).synchronize()
                for name, dtype, shape, offset in _hbmio._load_into(opened, dest, backend=backend, verify=verify,
                                                                     names=mine, progress=counter, report=mine_report):
                    entries[name] = (dtype, shape, offset)
        else:
            # The whole layout on every rank (the library's, from _plan); this rank's run read
            # into its place in it.
            end = planned.bytes
            dest = torch.empty(max(end, 1), dtype=torch.uint8, device=dev)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            if mine:
                # Runs are contiguous: the run starts at its first tensor. Its own layout, shifted by
                # that (aligned) offset, is the whole layout's.
                first = plan[run.index(rank)].offset
                # verify: each rank checks the run it read, against the file's checksums.
                got = _hbmio._load_into(opened, dest[first:], backend=backend, verify=verify, names=mine, progress=counter,
                                        report=mine_report)
                for name, dtype, shape, offset in got:
                    entries[name] = (dtype, shape, first + offset)
        read = counter.done
    except Exception as e:  # reported to every rank below, then raised everywhere
        error = f"{type(e).__name__}: {e}"

    # 2. Every rank learns whether every other one succeeded, and that all planned the same.
    # NCCL stages object collectives on the current device: make it this rank's GPU.
    on_device = torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else _nullcontext()
    # What all must agree on (the library's digest): the placement, which decides the collectives
    # below, verify, the layout and who reads what.
    states = [None] * world
    with on_device:
        dist.all_gather_object(states, (error, digest, read), group=group)
    failed = [(r, s[0]) for r, s in enumerate(states) if s[0] is not None]
    if failed:
        raise _hbmio.Error("; ".join(f"rank {r}: {msg}" for r, msg in failed))
    if len({s[1] for s in states}) != 1:
        raise _hbmio.Error(f"the ranks see different checkpoints at {_hbmio.shown_path(str(path))!r} or were given different options "
                           "(tensor names, dtypes, shapes, placement or shard maps differ)")

    moved = 0
    if placement == "replicate":
        # 3. Each run from its reader to everyone: one broadcast per rank that read something.
        for src in range(world):
            lo, hi = ranges[src]
            if lo >= hi:
                continue
            with on_device:
                dist.broadcast(dest[lo:hi], src=dist.get_global_rank(group, src) if group is not None else src,
                               group=group)
            if src != rank:
                moved += hi - lo
        for t in plan:
            entries.setdefault(t.name, (t.dtype, t.shape, t.offset))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start

    out = {}
    for t in plan:
        if t.name in entries:
            dtype, shape, offset = entries[t.name]
            out[t.name] = dest[offset:offset + t.size].view(getattr(torch, _TORCH_DTYPES[dtype])).view(shape)

    # Every rank takes part in this gather, whether or not it asked for a report (a report asked
    # for on one rank only must not leave it waiting for the others).
    paths = mine_report.get("paths", [])
    totals = [None] * world
    with on_device:
        dist.all_gather_object(totals, (read, moved, seconds, paths), group=group)
    if report is not None:
        report.update(
            rank=rank, world=world, placement=placement, bytes_from_storage=read, bytes_received=moved,
            seconds=seconds, gib_per_second=(read + moved) / seconds / (1 << 30) if seconds > 0 else 0.0,
            paths=paths,  # this rank's reads from storage: per file, the way its bytes took and why
            ranks=[{"rank": r, "bytes_from_storage": t[0], "bytes_received": t[1], "seconds": t[2], "paths": t[3]}
                   for r, t in enumerate(totals)],
            total_bytes_from_storage=sum(t[0] for t in totals),
            total_bytes_received=sum(t[1] for t in totals),
            max_seconds=max(t[2] for t in totals))
    return out
