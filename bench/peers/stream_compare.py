#!/usr/bin/env python3
"""Training-batch ingestion into GPU memory: hbmio.stream against PyTorch's DataLoader, beside the
storage and page-cache ceilings of the same run, alone and under a matrix-multiply loop.

Data: .npy shards of float16 records (--record-kib each) in --dir, made once (--gib in all).
Contenders, each reading every shard once per pass into --device in batches of --batch-mib:
  ceiling    hbmio.read_into(SHARD, pinned, backend="uring") over every shard, in this process
             (cold: the O_DIRECT storage rate; warm: the page-cache read rate)
  hbmio      hbmio.stream(shards, device, batch_bytes=..., read_ahead=--read-ahead)
  dataloader torch.utils.data.DataLoader over np.load(mmap_mode="r") shards, a batch per index
             (automatic batching off: one contiguous slice per batch, the fast form for memmaps),
             num_workers=--workers, pin_memory=True, persistent_workers=False, then
             .cuda(non_blocking=True): the documented fast recipe
Each pass is measured (--loads) alone (ingestion rate), and with the GPU busy:
  step    a training-step stand-in per batch: --matmuls bf16 matrix multiplies of --matmul-n, each
          step consuming the batch (a reduction of it added to the matrices) and ending in a host
          sync, as loss.item() does. The loop then cannot run faster than the steps alone: its
          ceiling is the step-bound rate (data bytes / the steps' wall time alone), reported as
          step_bound_gib_per_s and of_step_bound beside the loop's wall time against the steps'.
  beside  the same multiplies on a CUDA stream of their own, kept queued (two steps ahead, never
          waited for) while the batches are consumed as fast as they come: the GPU computes beside
          the ingestion, which is measured against the page-cache and storage ceilings as when
          alone; steps_beside says how many steps ran meanwhile.
Reported: GiB/s, host CPU seconds (this process and its worker children) per GiB, the step's GPU
time (CUDA events around the multiplies only) against the same loop without ingestion.
Cold passes drop the page cache first; rounds rotate the order. Every pass checks the count of
records and the sum of all values against the reference computed when the shards were written.
One JSON line per measurement on stdout and in --json.
"""
import argparse, gc, json, os, statistics, subprocess, sys, time, warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import cpu_seconds, drop_cache, json_lines  # noqa: E402
import resource  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def make_shards(a, np):
    os.makedirs(a.dir, exist_ok=True)
    ref_path = os.path.join(a.dir, "reference.json")
    width = a.record_kib * 1024 // 2
    shard_records = a.shard_mib * MIB // (width * 2)
    count = max(1, a.gib * GIB // (shard_records * width * 2))
    if os.path.exists(ref_path):
        ref = json.load(open(ref_path))
        if ref.get("shards") == count and ref.get("width") == width and ref.get("records_per_shard") == shard_records:
            return ref
    rng = np.random.default_rng(0)
    chunk_records = 64 * MIB // (width * 2)
    base = rng.standard_normal((chunk_records, width)).astype(np.float16)
    total = 0.0
    for s in range(count):
        path = os.path.join(a.dir, f"shard-{s:04d}.npy")
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(shard_records, width))
        for i, lo in enumerate(range(0, shard_records, chunk_records)):
            n = min(chunk_records, shard_records - lo)
            block = base[:n] + np.float16((s * 131 + i) % 64)
            out[lo:lo + n] = block
            total += float(block.sum(dtype=np.float64))
        out.flush()
        del out
    subprocess.run(["sync"], check=True)
    ref = dict(shards=count, width=width, records_per_shard=shard_records, sum=total)
    json.dump(ref, open(ref_path, "w"))
    return ref


class Step:
    """The training-step stand-in: bf16 matrix multiplies that also consume the batch."""

    def __init__(self, torch, a):
        self.torch, self.a = torch, a
        self.x = torch.randn(a.matmul_n, a.matmul_n, device=a.device, dtype=torch.bfloat16)
        self.w = torch.randn(a.matmul_n, a.matmul_n, device=a.device, dtype=torch.bfloat16) / a.matmul_n ** 0.5
        self.cuda = a.device != "cpu"  # cpu: a dry run of this script without a GPU
        self.start = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.end = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.gpu_ms = []

    def __call__(self, batch):
        t = self.torch
        t0 = time.perf_counter()
        if self.cuda:
            self.start.record()
        y = self.x
        for _ in range(self.a.matmuls):
            y = t.tanh(y @ self.w)
        if self.cuda:
            self.end.record()
        s = (y[0, 0].float() + batch[0].float().sum() * 0).item()  # the step's host sync (loss.item())
        self.gpu_ms.append(self.start.elapsed_time(self.end) if self.cuda else (time.perf_counter() - t0) * 1e3)
        return s


class Beside:
    """The step's multiplies on a stream of their own, kept two steps ahead and never waited for:
    called once per batch, it tops the queue up."""

    def __init__(self, torch, step):
        self.torch, self.step = torch, step
        self.stream = torch.cuda.Stream(device=step.a.device)
        self.queued = []
        self.steps = 0

    def __call__(self, batch):
        t = self.torch
        self.queued = [e for e in self.queued if not e.query()]
        while len(self.queued) < 2:
            with t.cuda.stream(self.stream):
                y = self.step.x
                for _ in range(self.step.a.matmuls):
                    y = t.tanh(y @ self.step.w)
                done = t.cuda.Event()
                done.record(self.stream)
            self.queued.append(done)
            self.steps += 1

    def finish(self):
        self.stream.synchronize()


def consume(torch, batches, step, device, records_out):
    """Iterates the batches; returns (records, sum of all values) and runs the step when given."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    records = 0
    for b in batches:
        records += b.shape[0]
        total += b.sum(dtype=torch.float64)
        if step is not None:
            step(b)
    if isinstance(step, Beside):
        step.finish()
    records_out.append(records)
    return total.item()


def hbmio_pass(torch, a, files, step):
    import hbmio
    s = hbmio.stream(files, device=a.device, batch_bytes=a.batch_mib * MIB, read_ahead=a.read_ahead)
    out = []
    value = consume(torch, s, step, a.device, out)
    stats = s.stats()
    s.close()
    g = stats.get("groups", {})
    return out[0], value, dict(wait_s=round(stats["wait_seconds"], 3), read_s=round(stats["read_seconds"], 3),
                               groups=g.get("count"), group_s=round(g.get("seconds", 0), 4), wake_s=round(g.get("wake_seconds", 0), 4),
                               drain_s=round(g.get("drain_seconds", 0), 4), copy_wait_s=round(g.get("copy_wait_seconds", 0), 4))


def dataloader_pass(torch, a, files, step, np):
    from torch.utils.data import DataLoader, Dataset

    class Shards(Dataset):
        def __init__(self):
            self.arrays = None
            self.rows = np.load(files[0], mmap_mode="r").shape[1]
            self.per_batch = a.batch_mib * MIB // (self.rows * 2)
            self.index = []
            for f, path in enumerate(files):
                n = np.load(path, mmap_mode="r").shape[0]
                self.index += [(f, lo, min(lo + self.per_batch, n)) for lo in range(0, n, self.per_batch)]

        def __len__(self):
            return len(self.index)

        def __getitem__(self, i):
            if self.arrays is None:  # opened in each worker
                self.arrays = [np.load(p, mmap_mode="r") for p in files]
            f, lo, hi = self.index[i]
            return torch.from_numpy(np.ascontiguousarray(self.arrays[f][lo:hi]))

    loader = DataLoader(Shards(), batch_size=None, shuffle=False, num_workers=a.workers, pin_memory=a.device != "cpu",
                        persistent_workers=False, prefetch_factor=2)
    out = []
    value = consume(torch, (b.to(a.device, non_blocking=True) for b in loader), step, a.device, out)
    return out[0], value, {}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=int, default=16)
    p.add_argument("--shard-mib", type=int, default=1024)
    p.add_argument("--record-kib", type=int, default=8)
    p.add_argument("--batch-mib", type=int, default=64)
    p.add_argument("--read-ahead", type=int, default=4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--matmuls", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mode", choices=["cold", "warm", "both"], default="both")
    p.add_argument("--only", default="ceiling,hbmio,dataloader")
    p.add_argument("--loads", default="alone,step,beside", help="what runs beside each pass (see above)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--json")
    a = p.parse_args()
    # A read-only memmap's slice handed to torch.from_numpy: the DataLoader copies it into shared memory.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    import numpy as np
    import torch

    ref = make_shards(a, np)
    files = sorted(os.path.join(a.dir, f) for f in os.listdir(a.dir) if f.endswith(".npy"))[: ref["shards"]]
    size = sum(os.path.getsize(f) for f in files)
    data_bytes = ref["shards"] * ref["records_per_shard"] * ref["width"] * 2
    emit = json_lines(a.json, bytes=size, shards=len(files), batch_mib=a.batch_mib, device=a.device)
    torch.zeros(1, device=a.device)
    step = Step(torch, a)
    for _ in range(3):
        step(torch.zeros(1, device=a.device))
    step.gpu_ms.clear()
    # The step alone, as many as a pass has batches: the compute the ingestion must not slow.
    batches = -(-ref["records_per_shard"] // (a.batch_mib * MIB // (ref["width"] * 2))) * len(files)
    t0 = time.perf_counter()
    for _ in range(batches):
        step(torch.zeros(1, device=a.device))
    alone_wall = time.perf_counter() - t0
    alone_ms = statistics.median(step.gpu_ms)
    emit(dict(contender="step alone", batches=batches, step_gpu_ms=round(alone_ms, 3), wall_s=round(alone_wall, 3)))

    # The ceiling reads each whole shard into pinned memory through hbmio's uring engine in this
    # process (O_DIRECT where the file is not cached, the page cache where it is): a process per
    # shard would add its start-up to every shard.
    import hbmio
    pinned = torch.empty(max(os.path.getsize(f) for f in files), dtype=torch.uint8, pin_memory=a.device != "cpu")
    contenders = [c for c in ("ceiling", "hbmio", "dataloader") if c in a.only.split(",")]
    modes = ["cold", "warm"] if a.mode == "both" else [a.mode]
    if "hbmio" in contenders:
        # Untimed: one stream over the first shard sets up the pooled engines the timed streams then
        # lease (pinned bounce buffers of 2 x 16 workers take a few hundred ms), as they are in a
        # training job past its first batches; otherwise the first timed pass carries them.
        hbmio_pass(torch, a, files[:1], None)
    for mode in modes:
        if mode == "warm":
            for f in files:  # into the page cache
                with open(f, "rb") as fh:
                    while fh.read(64 * MIB):
                        pass
        for r in range(a.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                loads = [x for x in ("alone", "step", "beside") if x in a.loads.split(",")]
                for load in (["alone"] if c == "ceiling" else loads):
                    if load == "beside" and a.device == "cpu":
                        continue
                    with_step = load == "step"
                    if mode == "cold":
                        drop_cache(files[0])
                    gc.collect()
                    rec = dict(contender=c, mode=mode, round=r, step=with_step, beside=load == "beside")
                    try:
                        cpu0 = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN)
                        t0 = time.perf_counter()
                        if c == "ceiling":
                            for f in files:
                                n = os.path.getsize(f)
                                hbmio.read_into(f, pinned[:n], backend="uring")
                            extra = {}
                        else:
                            st = step if with_step else Beside(torch, step) if load == "beside" else None
                            step.gpu_ms.clear()
                            if c == "hbmio":
                                records, value, extra = hbmio_pass(torch, a, files, st)
                            else:
                                records, value, extra = dataloader_pass(torch, a, files, st, np)
                            ok = records == ref["shards"] * ref["records_per_shard"] and abs(value - ref["sum"]) <= 1e-6 * max(1.0, abs(ref["sum"]))
                            extra["check"] = "ok" if ok else f"MISMATCH records {records} sum {value} vs {ref['sum']}"
                            if with_step:
                                extra["step_gpu_ms"] = round(statistics.median(step.gpu_ms), 3)
                                extra["step_slowdown"] = round(extra["step_gpu_ms"] / alone_ms, 3)
                                extra["wall_vs_alone"] = round((time.perf_counter() - t0) / alone_wall, 3)
                                extra["step_bound_gib_per_s"] = round(data_bytes / GIB / alone_wall, 3)
                            if load == "beside":
                                extra["steps_beside"] = st.steps
                        seconds = time.perf_counter() - t0
                        cpu = cpu_seconds() + cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
                        rec.update(seconds=round(seconds, 3), gib_per_s=round(data_bytes / GIB / seconds, 3),
                                   cpu_s_per_gib=round(cpu / (data_bytes / GIB), 3), **extra)
                        if "step_bound_gib_per_s" in rec:
                            rec["of_step_bound"] = round(rec["gib_per_s"] / rec["step_bound_gib_per_s"], 3)
                    except Exception as e:  # one failing contender must not stop the others
                        rec["error"] = f"{type(e).__name__}: {e}"
                    emit(rec)
                    if a.device != "cpu":
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
