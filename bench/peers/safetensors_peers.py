#!/usr/bin/env python3
"""Peer measurement: safetensors checkpoint loaders reading one .safetensors file into GPU memory.

Each peer is used as its documentation recommends for speed (sources cited per peer below) and timed
end to end: from the call into the library until every tensor sits on the device, materialised and
synchronised. One JSON line per (peer, mode): per-run seconds, median, GiB/s (file bytes / median),
CPU seconds/GiB (getrusage RUSAGE_SELF: all threads of this process, not child processes) and a
bit-exact comparison of the first run's tensors against safetensors.torch.load_file on the CPU.
Peers: safetensors, fastsafetensors, runai, hbmio.load_file; opt-in fastsafetensors_buffered (FASTSAFETENSORS_ODIRECT=0).
"""
import argparse, gc, glob, importlib, json, os, resource, statistics, sys, time, traceback

from measure import cpu_seconds, drop_cache  # shared with kvikio_read.py

GIB = 1 << 30

def live_children():
    # Worker processes a library keeps alive would escape RUSAGE_SELF; count them to say so.
    n = 0
    for p in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:  # a thread may exit between glob and open
            with open(p) as f:
                n += len(f.read().split())
        except OSError:
            pass
    return n

def fill_cache(path):
    # Plain buffered reads, like cat: afterwards the whole file sits in the page cache.
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass

# ---- peers: each returns {name: tensor} on `dev`; imports are done (untimed) by main first ----

def load_safetensors(path, dev, threads):
    # Source: https://huggingface.co/docs/safetensors/api/torch  (safetensors.torch.load_file,
    # device= places the tensors straight on the device). No thread knob exists.
    from safetensors.torch import load_file
    return load_file(path, device=dev)

def load_fastsafetensors(path, dev, threads):
    # Source: foundation-model-stack/fastsafetensors docs/overview.md "Basic API usage" and
    # examples/run_single.py (SafeTensorsFileLoader + SingleGroup, add_filenames,
    # copy_files_to_device, get_tensor, close); knobs from docs/configuration.md "Full reference"
    # (bbuf_size_kb=16384, max_threads=16) and fastsafetensors/loader.py of the 0.5.0 wheel.
    # nogds=True: GDS is not available on the bench machine; the nogds reader overlaps pread with
    # H2D copies over max_threads workers x 2 bounce buffers.
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    loader = SafeTensorsFileLoader(SingleGroup(), dev, nogds=True, max_threads=threads,
                                   bbuf_size_kb=16 * 1024)
    try:
        loader.add_filenames({0: [path]})  # {rank: [files]}
        fb = loader.copy_files_to_device()
        try:
            # Tensors share ownership of the device buffer, so they outlive fb.close() (overview.md).
            return {k: fb.get_tensor(k) for k in loader.get_keys()}
        finally:
            fb.close()
    finally:
        loader.close()

def load_fastsafetensors_buffered(path, dev, threads):
    # Same as above with the documented opt-out of O_DIRECT (docs/overview.md: FASTSAFETENSORS_ODIRECT=0),
    # so warm runs can use the page cache; read by the copier when it opens the file.
    old = os.environ.pop("FASTSAFETENSORS_ODIRECT", None)
    os.environ["FASTSAFETENSORS_ODIRECT"] = "0"
    try:
        return load_fastsafetensors(path, dev, threads)
    finally:
        os.environ.pop("FASTSAFETENSORS_ODIRECT")
        if old is not None:
            os.environ["FASTSAFETENSORS_ODIRECT"] = old

def load_runai(path, dev, threads):
    # Source: run-ai/runai-model-streamer docs/src/usage.md "Streaming from a file system"
    # (SafetensorsStreamer context manager, stream_file, get_tensors) and docs/src/env-vars.md
    # (RUNAI_STREAMER_CONCURRENCY, set in main before import; memory limit left at its default,
    # unlimited). device= is stream_file's parameter in the 0.17.1 wheel (safetensors_streamer.py):
    # file_streamer.py then does tensor.to(device) per tensor from its CPU ring, the same copy the
    # docs' loop does by hand. owned=True (default) lets each yielded tensor outlive the loop.
    from runai_model_streamer import SafetensorsStreamer
    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(path, device=dev)
        for name, tensor in streamer.get_tensors():
            out[name] = tensor
    return out

def load_hbmio(path, dev, threads):
    # hbmio's Python package (python/hbmio): torch tensors in PyTorch's caching allocator; the
    # engine is pooled by the package, as a program that loads repeatedly would have it.
    import hbmio
    return hbmio.load_file(path, device=dev)

PEERS = {  # name: (module imported untimed before the runs, loader, note)
    "safetensors": ("safetensors.torch", load_safetensors, None),
    "fastsafetensors": ("fastsafetensors", load_fastsafetensors,
                        "nogds reader opens with O_DIRECT on local filesystems by default "
                        "(docs/overview.md): warm runs bypass the page cache"),
    "fastsafetensors_buffered": ("fastsafetensors", load_fastsafetensors_buffered,
                                 "FASTSAFETENSORS_ODIRECT=0: buffered reads"),
    "hbmio.load_file": ("hbmio", load_hbmio, "hbmio's Python package, beside its CLI (same run)"),
    "runai": ("runai_model_streamer", load_runai,
              "engine (io_uring/libaio, O_DIRECT or buffered) chosen by the library at run time"),
}

def touch(torch, tensors, dev):
    """Force materialisation: sum of numel over tensors checked to be on dev, then synchronize."""
    want = torch.device(dev)
    wrong = [k for k, t in tensors.items() if t.device.type != want.type
             or (want.index is not None and t.device.index != want.index)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if want.type == "cuda":
        torch.cuda.synchronize(want)
    return nbytes, wrong

def compare(torch, tensors, ref):
    """Bit-exact: dtype, shape and bytes (a uint8 view, so NaN payloads compare equal too)."""
    def raw(t):
        return t.reshape(-1).view(torch.uint8)
    bad = [k for k in ref if k in tensors and (
        tensors[k].dtype != ref[k].dtype or tensors[k].shape != ref[k].shape
        or not torch.equal(raw(tensors[k].cpu()), raw(ref[k])))]
    return {"ok": not bad and set(ref) == set(tensors), "tensors": len(tensors), "mismatches": len(bad),
            "mismatched": bad[:10], "missing": sorted(set(ref) - set(tensors))[:10],
            "extra": sorted(set(tensors) - set(ref))[:10]}

def measure(torch, name, mode, a, ref, ref_bytes, size):
    module, fn, note = PEERS[name]
    importlib.import_module(module)  # import cost stays out of the timed region
    rec = dict(peer=name, mode=mode, file=a.file, bytes=size, device=a.device, threads=a.threads,
               **({"note": note} if note else {}))
    free_cuda = torch.cuda.empty_cache if torch.device(a.device).type == "cuda" else (lambda: None)
    if mode == "warm":  # page cache filled, then one untimed load (library init, allocator warm-up)
        fill_cache(a.file)
        touch(torch, fn(a.file, a.device, a.threads), a.device)
        gc.collect()
        free_cuda()
    times, cpu_per_gib, children = [], [], 0
    for i in range(a.runs):
        if mode == "cold":
            rec["cache"] = drop_cache(a.file)
        else:
            fill_cache(a.file)  # cheap once cached; guarantees warm even if a run evicted pages
            rec["cache"] = "filled_by_read"
        c0, k0, t0 = cpu_seconds(), cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
        tensors = fn(a.file, a.device, a.threads)
        nbytes, wrong = touch(torch, tensors, a.device)
        t1 = time.perf_counter()
        c1, k1 = cpu_seconds(), cpu_seconds(resource.RUSAGE_CHILDREN)
        children = max(children, live_children() + (k1 > k0))
        times.append(t1 - t0)
        cpu_per_gib.append((c1 - c0) / (size / GIB))
        if wrong or nbytes != ref_bytes:
            raise RuntimeError(f"run {i}: {len(wrong)} tensors not on {a.device} "
                               f"(e.g. {wrong[:3]}), {nbytes} tensor bytes vs {ref_bytes} expected")
        if i == 0:
            rec["check"] = compare(torch, tensors, ref)
        del tensors
        gc.collect()
        free_cuda()
    med = statistics.median(times)
    rec.update(seconds=[round(t, 4) for t in times], median_s=round(med, 4),
               gib_per_s=round(size / GIB / med, 3),
               cpu_s_per_gib=round(statistics.median(cpu_per_gib), 3))
    rec["cpu_scope"] = "RUSAGE_SELF: all threads of this process; child processes not counted"
    if children:
        rec["cpu_scope"] += "; WARNING: child processes seen, their CPU time is missing"
    return rec

def create_file(torch, path, gib):
    """Synthetic checkpoint: 64 MiB tensors of mixed dtypes plus small odd-sized ones (alignment)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    tensors, total, i = {}, 0, 0
    while total < gib * GIB:
        dt = dtypes[i % 3]
        raw = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=g)
        tensors[f"layers.{i}.weight"] = raw.view(dt).reshape(-1, 4096)
        tensors[f"layers.{i}.bias"] = torch.randn(4097 + i, generator=g).to(dt)
        total += (64 << 20) + (4097 + i) * raw.view(dt).element_size()
        i += 1
    save_file(tensors, path)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mode", choices=["cold", "warm", "both"], default="both")
    p.add_argument("--peers", default="safetensors,fastsafetensors,runai")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--json", help="append the JSON lines to this file")
    p.add_argument("--device", default="cuda:0", help="cpu only to debug this script")
    p.add_argument("--create-gib", type=float, help="write a synthetic checkpoint first if FILE is missing")
    a = p.parse_args()
    # Run:ai reads its thread count from the environment when the streamer starts (env-vars.md).
    os.environ.setdefault("RUNAI_STREAMER_CONCURRENCY", str(a.threads))
    try:
        import humanize  # noqa: F401  runai_model_streamer needs it only to format log lines
    except ImportError:
        import types
        sys.modules["humanize"] = types.SimpleNamespace(naturalsize=lambda n, **kw: f"{n} B")
    import torch
    from safetensors.torch import load_file

    if a.create_gib and not os.path.exists(a.file):
        create_file(torch, a.file, a.create_gib)
    size = os.path.getsize(a.file)
    # CPU reference, cloned so no tensor keeps the file mmap'ed (mapped pages survive drop_caches).
    ref = {k: v.clone() for k, v in load_file(a.file).items()}
    gc.collect()
    ref_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    if torch.device(a.device).type == "cuda":
        torch.zeros(1, device=a.device)  # CUDA context created here, not inside the first peer's timing
        torch.cuda.synchronize()
    modes = ["cold", "warm"] if a.mode == "both" else [a.mode]
    failed = 0
    for name in [s.strip() for s in a.peers.split(",") if s.strip()]:
        for mode in modes:
            try:
                if name not in PEERS:
                    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
                rec = measure(torch, name, mode, a, ref, ref_bytes, size)
            except Exception as e:  # one failing peer must not stop the others
                traceback.print_exc()
                rec = dict(peer=name, mode=mode, file=a.file, bytes=size, device=a.device,
                           error=f"{type(e).__name__}: {e}")
                failed += 1
            gc.collect()  # after the except block: the traceback no longer pins a failed run's tensors
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            line = json.dumps(rec)
            print(line, flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(line + "\n")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
