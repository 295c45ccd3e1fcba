#!/usr/bin/env python3
"""Lazy, per-tensor loads into one device: hbmio.open against safetensors.safe_open and the peers.

Files: two checkpoints written by the reference writer, safetensors.torch.save_file (random bf16
bits, seeded), created once in --dir and reused while their header still fits:
  big.safetensors    48 tensors of 128 MiB (8192 x 8192)   at the default --size 6GiB
  small.safetensors  3,072 tensors of 2 MiB (1024 x 1024)  at the default --size 6GiB
--size scales the tensors, never their counts (so the ratio of the counts stays 1:64).

Contenders (--only picks them, by name or group: hbmio, safetensors, instanttensor, fastsafetensors,
pretrained, fresh), each timed from the call into the library until every tensor is on the device
(torch.cuda.synchronize() before the clock stops):
  hbmio.load_file             the whole file at once: the reference point of every table
  hbmio.open walk ORDER       `with hbmio.open(path, framework="pt", device=D) as f:` then
                              f.get_tensor(k) for every key; ORDER: file (f.offset_keys() where it
                              exists, else the header sorted by offset), reverse, random (seeded)
  safe_open walk ORDER        the same with safetensors.safe_open(path, "pt", device=D)
  hbmio.open / safe_open slices   f.get_slice(k)[: rows // 8] for every tensor, in file order
  instanttensor (default), (buffered)   `with instanttensor.safe_open(path, framework="pt",
                              device=N[, backend=BackendPolicy.BUFFERED]) as f: dict(f.tensors())`
  fastsafetensors (O_DIRECT), fastsafetensors (buffered)   SafeTensorsFileLoader(nogds=True),
                              safetensors_peers.py's configuration; by default the O_DIRECT one
                              (the library's default) runs cold and the buffered one
                              (FASTSAFETENSORS_ODIRECT=0, its documented opt-out) warm: each mode
                              gets the configuration its docs recommend for it (--all-peer-modes:
                              both in both)
Modes: warm (the page cache filled by one untimed read before each round; each contender loads
once untimed first) and cold (the page cache dropped before every load: `echo 3 >
/proc/sys/vm/drop_caches` as root, else posix_fadvise(DONTNEED) on the file; each line says which).
Rounds are interleaved across contenders, the order rotated round by round. Every result is
checked: a positional checksum of each tensor's 16-bit words (computed on the device, outside the
timed region) against the same checksum of safetensors.torch.load_file's tensors, computed once
and cached beside the file.

Also: from_pretrained (transformers, if importable, on a CUDA device): a LlamaConfig of about
--size, saved once with save_pretrained (sharded at 2GB), timed stock and inside
hbmio.use_in_transformers() (where it exists), warm, beside the time of from_config on the meta
device + to_empty on the device (what a load costs outside reading); with --cache-hbmio PATH also
inside use_in_transformers() with HBMIO_CACHE pointing at a resident cache (`PATH cache serve`)
that holds the shards. And fresh processes: the wall
time of `python -c` from its start until every tensor is on the device, for hbmio.load_file,
hbmio.open walk and safe_open walk, with the child's own split (interpreter start, import torch,
import the loader, CUDA context, load).

Tables (one per file and mode) go to stdout; one JSON line per measurement to --json; progress to
stderr. --device cpu --size 64MiB is a smoke test without a GPU (peers and from_pretrained skip).
"""
import argparse, contextlib, gc, json, os, random, resource, statistics, struct, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
FULL = 6 * GIB
# name: (tensor count, bytes of one tensor at --size 6GiB, columns)
FILES = {"big": (48, 128 * MIB, 8192), "small": (3072, 2 * MIB, 1024)}
SUMS_VERSION = 1
T_START = time.monotonic()


def log(*a):
    print(f"[{time.monotonic() - T_START:7.1f}s]", *a, file=sys.stderr, flush=True)


def parse_size(text):
    t = str(text).strip()
    for suffix, mult in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB), ("G", GIB), ("M", MIB), ("K", KIB)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def fmt_bytes(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# The file: header, orders, creation, page cache


def read_header(path):
    """{name: (dtype, shape, start, end)} with offsets from the start of the data, plus metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    return {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()}, meta


def file_order(path):
    entries, _ = read_header(path)
    return sorted(entries, key=lambda k: entries[k][2])


def tensor_shape(count_bytes, cols):
    elems = count_bytes // 2  # bf16
    while cols > 16 and elems // cols < 16:
        cols //= 2
    return (elems // cols, cols)


def expected_layout(kind, size):
    count, full_bytes, cols = FILES[kind]
    per_tensor = max(32 * 2 * 16, full_bytes * size // FULL)
    return count, tensor_shape(per_tensor, cols)


def create_checkpoint(torch, path, kind, size, device, seed):
    """48 or 3,072 random bf16 tensors through safetensors.torch.save_file; reused while the header
    still matches. Written to a temporary name and renamed, so a killed run leaves no half file."""
    count, shape = expected_layout(kind, size)
    if os.path.exists(path):
        try:
            entries, _ = read_header(path)
            if len(entries) == count and all(e[0] == "BF16" and e[1] == shape for e in entries.values()):
                log(f"reusing {path}: {count} x {shape} BF16")
                return False
        except (OSError, ValueError, KeyError, struct.error):
            pass
    from safetensors.torch import save_file
    gen_dev = device if torch.device(device).type == "cuda" else "cpu"  # random bits made on the GPU
    g = torch.Generator(device=gen_dev).manual_seed(seed + (0 if kind == "big" else 1))
    log(f"creating {path}: {count} x {shape} BF16 ({fmt_bytes(count * shape[0] * shape[1] * 2)}), seed {seed}")
    tensors = {}
    for i in range(count):
        bits = torch.randint(-32768, 32768, shape, dtype=torch.int16, generator=g, device=gen_dev)
        tensors[f"layers.{i}.weight"] = bits.view(torch.bfloat16).cpu()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    del tensors
    gc.collect()
    return True


def fill_cache(*paths):
    buf = bytearray(16 * MIB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cache(*paths):
    """The whole page cache (root), else these files' pages; returns which."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches=3"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise_dontneed"


# ---------------------------------------------------------------------------------------------
# Checks: a positional checksum of each tensor's 16-bit words, on the tensor's device


def checksum_list(torch, tensors):
    """[(sum of words, sum of word * (i % 65521 + 1))] per tensor, as Python ints (one transfer)."""
    parts = []
    for t in tensors:
        v = t.contiguous().reshape(-1).view(torch.int16).to(torch.int64)
        w = torch.arange(v.numel(), device=v.device, dtype=torch.int64).remainder_(65521).add_(1)
        parts.append(torch.stack([v.sum(), (v * w).sum()]))
        del v, w
    if not parts:
        return []
    return [tuple(x) for x in torch.stack(parts).cpu().tolist()]


def checksum_dict(torch, tensors):
    names = list(tensors)
    return dict(zip(names, checksum_list(torch, [tensors[k] for k in names])))


def reference_sums(torch, path, device, entries):
    """Checksums of safetensors.torch.load_file's tensors (whole and first rows // 8), cached beside
    the file (keyed by its size and mtime)."""
    st = os.stat(path)
    cache = path + ".lazysums.json"
    key = dict(version=SUMS_VERSION, size=st.st_size, mtime_ns=st.st_mtime_ns)
    try:
        with open(cache) as f:
            c = json.load(f)
        if all(c.get(k) == v for k, v in key.items()):
            return ({k: tuple(v) for k, v in c["whole"].items()}, {k: tuple(v) for k, v in c["slice"].items()})
    except (OSError, ValueError, KeyError):
        pass
    from safetensors.torch import load_file
    dev = device if torch.device(device).type == "cuda" else "cpu"
    whole, sliced = {}, {}
    ref = load_file(path)  # the reference reader, on the CPU
    names = list(ref)
    for i in range(0, len(names), 64):  # a batch at a time through the device
        batch = {k: ref[k].to(dev) for k in names[i:i + 64]}
        whole.update(checksum_dict(torch, batch))
        sliced.update(checksum_dict(torch, {k: t[: t.shape[0] // 8] for k, t in batch.items()}))
        del batch
    shapes_ok = all(tuple(ref[k].shape) == entries[k][1] for k in names)
    del ref
    gc.collect()
    if not shapes_ok:
        raise RuntimeError(f"{path}: safetensors' shapes differ from the header")
    with open(cache + ".tmp", "w") as f:
        json.dump(dict(key, whole=whole, slice=sliced), f)
    os.replace(cache + ".tmp", cache)
    return whole, sliced


def check(torch, got, want_sums, want_shapes, device, order=None):
    """Compares a result {name: tensor} with the reference checksums and shapes."""
    want_dev = torch.device(device)
    names = list(got)
    wrong_dev = [k for k in names if got[k].device.type != want_dev.type
                 or (want_dev.index is not None and got[k].device.index != want_dev.index)]
    bad_shape = [k for k in names if k in want_shapes and tuple(got[k].shape) != want_shapes[k]]
    bad_dtype = [k for k in names if got[k].dtype != torch.bfloat16]
    sums = checksum_dict(torch, got)
    bad_sum = [k for k in names if k in want_sums and sums[k] != want_sums[k]]
    missing = sorted(set(want_sums) - set(names))
    extra = sorted(set(names) - set(want_sums))
    rec = dict(ok=not (wrong_dev or bad_shape or bad_dtype or bad_sum or missing or extra), tensors=len(names))
    for label, lst in (("wrong_device", wrong_dev), ("bad_shape", bad_shape), ("bad_dtype", bad_dtype),
                       ("bad_checksum", bad_sum), ("missing", missing), ("extra", extra)):
        if lst:
            rec[label] = lst[:5]
            rec[label + "_count"] = len(lst)
    if order is not None and names != list(order):
        rec["note"] = "tensors arrived in another order than asked"
    return rec


# ---------------------------------------------------------------------------------------------
# Contenders


@contextlib.contextmanager
def opened(obj):
    """`with` for an object that is a context manager, else close() at the end if it has one."""
    if hasattr(obj, "__enter__"):
        with obj as f:
            yield f
    else:
        try:
            yield obj
        finally:
            close = getattr(obj, "close", None)
            if close:
                close()


class Ctx:
    def __init__(self, torch, path, device, seed, threads):
        self.torch, self.path, self.device, self.threads = torch, path, device, threads
        self.entries, _ = read_header(path)
        self.orders = {"file": sorted(self.entries, key=lambda k: self.entries[k][2])}
        self.orders["reverse"] = self.orders["file"][::-1]
        rnd = list(self.orders["file"])
        random.Random(seed).shuffle(rnd)
        self.orders["random"] = rnd
        self.shapes = {k: e[1] for k, e in self.entries.items()}
        self.slice_shapes = {k: (s[0] // 8, *s[1:]) for k, s in self.shapes.items()}
        self.tensor_bytes = sum(e[3] - e[2] for e in self.entries.values())
        # get_slice(k)[: rows // 8]: that many whole rows of each tensor
        self.slice_bytes = sum((s[0] // 8) * ((self.entries[k][3] - self.entries[k][2]) // max(1, s[0]))
                               for k, s in self.shapes.items())
        self.order_source = {}


def hbmio_opener(ctx):
    import hbmio
    return hbmio.open(ctx.path, framework="pt", device=ctx.device)


def st_opener(ctx):
    from safetensors import safe_open
    return safe_open(ctx.path, framework="pt", device=ctx.device)


def make_walk(opener, order):
    def run(ctx, note):
        with opened(opener(ctx)) as f:
            if order == "file" and hasattr(f, "offset_keys"):
                keys = f.offset_keys()
                note["order_source"] = "offset_keys()"
            else:
                keys = ctx.orders[order]
                note["order_source"] = "header" if order == "file" else f"{order} (seed)"
            out = {k: f.get_tensor(k) for k in keys}
        if order == "file" and list(keys) != ctx.orders["file"]:
            note["order_mismatch"] = "offset_keys() differs from the header's offset order"
        return out, ctx.tensor_bytes
    return run


def make_slices(opener):
    def run(ctx, note):
        out = {}
        with opened(opener(ctx)) as f:
            for k in ctx.orders["file"]:
                sl = f.get_slice(k)
                rows = sl.get_shape()[0] if hasattr(sl, "get_shape") else ctx.shapes[k][0]
                out[k] = sl[: rows // 8]
        return out, ctx.slice_bytes
    return run


def run_load_file(ctx, note):
    import hbmio
    return hbmio.load_file(ctx.path, device=ctx.device), ctx.tensor_bytes


def make_instant(buffered):
    def run(ctx, note):
        from instanttensor import safe_open as it_open, BackendPolicy
        torch = ctx.torch
        d = torch.device(ctx.device)
        kw = {"backend": BackendPolicy.BUFFERED} if buffered else {}
        with torch.cuda.device(d), it_open(ctx.path, framework="pt", device=torch.cuda.current_device(), **kw) as f:
            out = dict(f.tensors())  # copy=True (the default): each tensor owns its memory
        return out, ctx.tensor_bytes
    return run


def make_fst(buffered):
    def run(ctx, note):
        sys.path.insert(0, HERE)
        import safetensors_peers as sp
        fn = sp.load_fastsafetensors_buffered if buffered else sp.load_fastsafetensors
        return fn(ctx.path, ctx.device, ctx.threads), ctx.tensor_bytes
    return run


def have(module):
    try:
        __import__(module)
        return None
    except Exception as e:  # ImportError, or a native library that fails to load
        return f"{module} not importable: {type(e).__name__}: {e}"


def need_cuda(device, who):
    return None if device.startswith("cuda") else f"{who} loads into CUDA devices only"


def has_attr_reason(module, obj_fn, attr, what):
    def reason(ctx):
        r = have(module)
        if r:
            return r
        try:
            with opened(obj_fn(ctx)) as f:
                return None if hasattr(f, attr) else f"{what} has no {attr}()"
        except Exception as e:
            return f"{what} failed to open: {type(e).__name__}: {e}"
    return reason


# name: (group, kind, function, availability(ctx) -> reason or None, modes it runs in, safe_open twin)
def contenders(all_peer_modes):
    both = ("warm", "cold")
    c = {
        "hbmio.load_file": ("hbmio", "whole", run_load_file, lambda ctx: have("hbmio"), both, None),
    }
    for order in ("file", "reverse", "random"):
        c[f"hbmio.open walk {order}"] = ("hbmio", "walk", make_walk(hbmio_opener, order),
                                         lambda ctx: have("hbmio"), both, f"safe_open walk {order}")
    c["hbmio.open slices"] = ("hbmio", "slice", make_slices(hbmio_opener),
                              has_attr_reason("hbmio", hbmio_opener, "get_slice", "hbmio.open's object"), both,
                              "safe_open slices")
    for order in ("file", "reverse", "random"):
        c[f"safe_open walk {order}"] = ("safetensors", "walk", make_walk(st_opener, order),
                                        lambda ctx: have("safetensors"), both, None)
    c["safe_open slices"] = ("safetensors", "slice", make_slices(st_opener), lambda ctx: have("safetensors"), both,
                             None)
    c["instanttensor (default)"] = ("instanttensor", "peer", make_instant(False),
                          lambda ctx: need_cuda(ctx.device, "InstantTensor") or have("instanttensor"), both,
                          "safe_open walk file")
    c["instanttensor (buffered)"] = ("instanttensor", "peer", make_instant(True),
                                   lambda ctx: need_cuda(ctx.device, "InstantTensor") or have("instanttensor"), both,
                                   "safe_open walk file")
    c["fastsafetensors (O_DIRECT)"] = ("fastsafetensors", "peer", make_fst(False),
                                       lambda ctx: need_cuda(ctx.device, "this comparison's fastsafetensors")
                                       or have("fastsafetensors"), both if all_peer_modes else ("cold",),
                                       "safe_open walk file")
    c["fastsafetensors (buffered)"] = ("fastsafetensors", "peer", make_fst(True),
                                       lambda ctx: need_cuda(ctx.device, "this comparison's fastsafetensors")
                                       or have("fastsafetensors"), both if all_peer_modes else ("warm",),
                                       "safe_open walk file")
    return c


def selected(name, group, only):
    return not only or name in only or group in only


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def free_device(torch, device):
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


# ---------------------------------------------------------------------------------------------
# Tables


def ratio(ref, t):
    return f"{ref / t:6.2f}" if ref and t else "     -"


def print_table(title, rows, ref_name="hbmio.load_file"):
    """rows: [(name, median_s or None, gib_per_s, bytes delivered, twin name, ok, note)]"""
    med = {r[0]: r[1] for r in rows}
    ref = med.get(ref_name)
    print(f"\n{title}")
    print(f"  {'contender':34} {'median s':>9} {'GiB/s':>7} {'delivered':>10} {'x load_file':>11} "
          f"{'x safe_open':>11}  check")
    for name, m, gibs, nbytes, twin, ok, note in rows:
        if m is None:
            print(f"  {name:34} {'-':>9} {'-':>7} {'-':>10} {'-':>11} {'-':>11}  {note}")
            continue
        tw = med.get(twin) if twin else None
        print(f"  {name:34} {m:9.4f} {gibs:7.2f} {fmt_bytes(nbytes):>10} {ratio(ref, m):>11} {ratio(tw, m):>11}  "
              f"{'ok' if ok else 'FAILED'}{('  ' + note) if note else ''}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Sections


class Runner:
    def __init__(self, a, torch):
        self.a, self.torch = a, torch
        self.initialized = set()

    def emit(self, rec):
        rec.setdefault("device", self.a.device)
        line = json.dumps(rec)
        if self.a.json:
            with open(self.a.json, "a") as f:
                f.write(line + "\n")
        if self.a.verbose:
            print(line, flush=True)

    def over_budget(self):
        return self.a.budget_s and time.monotonic() - T_START > self.a.budget_s

    def measure(self, ctx, name, fn, want, shapes, mode, cache, rnd, order=None):
        torch, dev = self.torch, self.a.device
        note = {}
        c0, t0 = cpu_seconds(), time.perf_counter()
        out, nbytes = fn(ctx, note)
        sync(torch, dev)
        s = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
        chk = check(torch, out, want, shapes, dev, order)
        del out
        free_device(torch, dev)
        rec = dict(section="load", file=os.path.basename(ctx.path), tensors=len(ctx.entries),
                   tensor_bytes=ctx.tensor_bytes, mode=mode, cache=cache, contender=name, round=rnd,
                   seconds=round(s, 5), requested_bytes=nbytes, gib_per_s=round(nbytes / GIB / s, 3),
                   cpu_s=round(cpu, 3), check=chk, **note)
        self.emit(rec)
        log(f"{os.path.basename(ctx.path)} {mode} r{rnd} {name}: {s:.4f} s, {nbytes / GIB / s:.2f} GiB/s, "
            f"check {'ok' if chk['ok'] else 'FAILED ' + json.dumps(chk)[:200]}")
        return s, chk["ok"], nbytes

    def file_section(self, kind, path, ref_whole, ref_slice, mode):
        a, torch = self.a, self.torch
        ctx = Ctx(torch, path, a.device, a.seed, a.threads)
        table, runs, oks, delivered, skipped = contenders(a.all_peer_modes), {}, {}, {}, {}
        names = []
        for name, (group, kind_, fn, avail, modes, twin) in table.items():
            if not selected(name, group, a.only):
                continue
            if mode not in modes:
                continue
            reason = avail(ctx)
            if reason:
                skipped[name] = reason
                self.emit(dict(section="load", file=kind + ".safetensors", mode=mode, contender=name,
                               skipped=reason))
                continue
            names.append(name)

        def want(name):
            k = table[name][1]
            return (ref_slice, ctx.slice_shapes) if k == "slice" else (ref_whole, ctx.shapes)

        def order_of(name):
            for o in ("file", "reverse", "random"):
                if name.endswith(f"walk {o}"):
                    return ctx.orders[o] if o != "file" else None
            return None

        if not names:
            print(f"\n{kind}.safetensors, {mode}: no contender selected and available"
                  + "".join(f"\n  {n:34} skipped: {r[:120]}" for n, r in skipped.items()))
            return
        failed = {}
        if mode == "warm":
            fill_cache(path)
        slow, warmup_s = {}, {}
        stopped = None
        for name in names:  # first use outside the rounds: imports, engines, allocator
            if mode == "cold" and name in self.initialized:
                continue
            if self.over_budget():
                stopped = f"budget of {a.budget_s} s spent during the warm-ups"
                break
            try:
                w, shp = want(name)
                s, _, _ = self.measure(ctx, name, table[name][2], w, shp, mode, "warm-up (untimed)", "warm-up",
                                       order_of(name))
                self.initialized.add(name)
                warmup_s[name] = s
                if a.max_load_s and s > a.max_load_s:
                    slow[name] = f"warm-up took {s:.1f} s > --max-load-s {a.max_load_s:g}: no timed rounds"
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {e}"
                self.emit(dict(section="load", file=kind + ".safetensors", mode=mode, contender=name, round="warm-up",
                               error=failed[name]))
                log(f"{name} warm-up failed: {failed[name]}")
                free_device(torch, a.device)
        names = [n for n in names if n not in failed]
        for r in range(a.rounds):
            if stopped:
                break
            if mode == "warm":
                fill_cache(path)
            live = [n for n in names if n not in slow]
            order = live[r % max(1, len(live)):] + live[:r % max(1, len(live))]
            for name in order:
                if self.over_budget():
                    stopped = f"budget of {a.budget_s} s spent in round {r}"
                    break
                cache = drop_cache(path) if mode == "cold" else "filled_by_read"
                try:
                    w, shp = want(name)
                    s, ok, nb = self.measure(ctx, name, table[name][2], w, shp, mode, cache, r, order_of(name))
                    runs.setdefault(name, []).append(s)
                    oks[name] = oks.get(name, True) and ok
                    delivered[name] = nb
                    if a.max_load_s and s > a.max_load_s:
                        slow[name] = f"a load took {s:.1f} s > --max-load-s {a.max_load_s:g}: no further rounds"
                except Exception as e:
                    failed[name] = f"{type(e).__name__}: {e}"
                    self.emit(dict(section="load", file=kind + ".safetensors", mode=mode, contender=name, round=r,
                                   error=failed[name]))
                    log(f"{name} round {r} failed: {failed[name]}")
                    free_device(torch, a.device)
        if stopped:
            self.emit(dict(section="load", file=kind + ".safetensors", mode=mode, stopped=stopped))
        for name, why in slow.items():
            self.emit(dict(section="load", file=kind + ".safetensors", mode=mode, contender=name, too_slow=why,
                           **({"warm_up_s": round(warmup_s[name], 3)} if name in warmup_s else {})))
        rows = []
        cache_how = "page cache filled by one untimed read before each round" if mode == "warm" else \
            f"page cache dropped before every load ({drop_cache_kind()})"
        for name in table:
            if name in runs:
                med = statistics.median(runs[name])
                nb = delivered[name]
                self.emit(dict(section="load", summary=True, file=kind + ".safetensors", mode=mode, contender=name,
                               runs=[round(t, 4) for t in runs[name]], median_s=round(med, 5),
                               requested_bytes=nb, tensor_bytes=ctx.tensor_bytes,
                               gib_per_s=round(nb / GIB / med, 3), check_ok=oks[name]))
                note = f"{fmt_bytes(nb)} of {fmt_bytes(ctx.tensor_bytes)} asked" if nb != ctx.tensor_bytes else ""
                if len(runs[name]) < a.rounds:
                    note += f" ({len(runs[name])} of {a.rounds} rounds{': ' + slow[name] if name in slow else ''})"
                if name in failed:
                    note += f" (a later round failed: {failed[name][:80]})"
                rows.append((name, med, nb / GIB / med, nb, table[name][5], oks[name], note.strip()))
            elif name in failed:
                rows.append((name, None, 0, 0, None, False, "error: " + failed[name][:120]))
            elif name in slow:
                rows.append((name, None, 0, 0, None, True, slow[name]))
            elif name in names:
                rows.append((name, None, 0, 0, None, True, "not measured: " + (stopped or "?")))
            elif name in skipped:
                rows.append((name, None, 0, 0, None, True, "skipped: " + skipped[name][:120]))
        title = (f"{kind}.safetensors ({len(ctx.entries)} x {ctx.shapes[ctx.orders['file'][0]]} BF16, "
                 f"{fmt_bytes(ctx.tensor_bytes)}), {mode}: {cache_how}; median of {a.rounds} rounds into {a.device}"
                 + (f"; STOPPED: {stopped}" if stopped else ""))
        print_table(title, rows)

    # ---- from_pretrained ----------------------------------------------------------------------

    def pretrained_section(self):
        a, torch = self.a, self.torch
        if a.only and not a.only & {"pretrained", "from_pretrained", "transformers", "hbmio"}:
            return self.skip_section("from_pretrained", "not picked by --only")
        if not a.device.startswith("cuda"):
            return self.skip_section("from_pretrained", "device_map=cuda:N needs a CUDA device")
        r = have("transformers")
        if r:
            return self.skip_section("from_pretrained", r)
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        hidden, inter, vocab = (4096, 11008, 32000) if a.size >= 2 * GIB else (1024, 2752, 32000)
        per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
        fixed = 2 * vocab * hidden + hidden
        layers = max(1, round((a.size / 2 - fixed) / per_layer))
        params = fixed + layers * per_layer
        mdir = os.path.join(a.dir, f"llama-{hidden}x{layers}")
        cfg_kw = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, tie_word_embeddings=False)
        if not os.path.exists(os.path.join(mdir, "config.json")):
            log(f"save_pretrained: LlamaConfig {cfg_kw}, {params / 1e9:.2f} G params, {fmt_bytes(2 * params)} bf16")
            torch.manual_seed(a.seed)
            with torch.device(a.device):
                m = AutoModelForCausalLM.from_config(LlamaConfig(**cfg_kw), **{dtype_kw: torch.bfloat16})
            m.save_pretrained(mdir + ".tmp", max_shard_size="2GB")  # safetensors, the default
            del m
            free_device(torch, a.device)
            os.replace(mdir + ".tmp", mdir)
        shards = sorted(os.path.join(mdir, f) for f in os.listdir(mdir) if f.endswith(".safetensors"))
        nbytes = sum(os.path.getsize(p) for p in shards)
        want = {}
        for p in shards:
            w, _ = reference_sums(torch, p, a.device, read_header(p)[0])
            want.update(w)
        cfg = AutoConfig.from_pretrained(mdir)
        hbmio_reason = have("hbmio")
        if not hbmio_reason:
            import hbmio
            if not hasattr(hbmio, "use_in_transformers"):
                hbmio_reason = "hbmio has no use_in_transformers() yet"

        def stock():
            return AutoModelForCausalLM.from_pretrained(mdir, **{dtype_kw: torch.bfloat16}, device_map=a.device)

        switch = {}

        def with_hbmio():
            import hbmio
            cm = hbmio.use_in_transformers()
            if hasattr(cm, "__enter__"):
                switch["kind"] = "context manager"
                with cm:
                    return stock()
            switch["kind"] = "global switch (no context manager)"
            return stock()

        def outside_loading():
            with torch.device("meta"):
                m = AutoModelForCausalLM.from_config(cfg, **{dtype_kw: torch.bfloat16})
            return m.to_empty(device=a.device)

        HB = "from_pretrained in hbmio.use_in_transformers()"
        HC = "the same, from the resident cache"
        NOREAD = "from_config(meta) + to_empty (no reading)"
        runs_ = {"from_pretrained stock": stock, NOREAD: outside_loading}
        server = None
        if not hbmio_reason:
            runs_[HB] = with_hbmio
            # --cache-hbmio: a resident cache (`hbmio cache serve`) holding the shards, found through
            # HBMIO_CACHE only while this contender runs (a restart on a node that loaded the model).
            if a.cache_hbmio:
                import subprocess, tempfile
                sock = os.path.join(tempfile.mkdtemp(prefix="hbmio-cache-", dir="/tmp"), "cache.sock")
                server = subprocess.Popen([a.cache_hbmio, "cache", "serve", "--socket", sock, "--host-memory",
                                           str(2 * nbytes + (1 << 30))], start_new_session=True)
                for _ in range(500):
                    if subprocess.run([a.cache_hbmio, "cache", "status", "--socket", sock], capture_output=True).returncode == 0:
                        break
                    time.sleep(0.02)
                added = subprocess.run([a.cache_hbmio, "cache", "add", "--wait", "--socket", sock, *shards], capture_output=True, text=True)
                log(f"cache add --wait of {len(shards)} shards: {added.stdout.strip()}")

                def from_cache():
                    os.environ["HBMIO_CACHE"] = sock
                    try:
                        return with_hbmio()
                    finally:
                        os.environ.pop("HBMIO_CACHE", None)
                runs_[HC] = from_cache
        else:
            self.emit(dict(section="from_pretrained", contender=HB, skipped=hbmio_reason))
        times, oks, errors = {k: [] for k in runs_}, {}, {}
        # Phase 1: stock and the no-reading baseline, interleaved; phase 2: hbmio's switch (one that is
        # no context manager would stay on, so it never runs before a stock round).
        phases = [[n for n in runs_ if n not in (HB, HC)]] + ([[n for n in (HB, HC) if n in runs_]] if HB in runs_ else [])
        for phase in phases:
            for r in ["warm-up"] + list(range(a.rounds)):
                if r != "warm-up" and self.over_budget():
                    self.emit(dict(section="from_pretrained", stopped=f"budget spent after {r} rounds"))
                    break
                order = phase if r == "warm-up" else phase[r % len(phase):] + phase[:r % len(phase)]
                for name in order:
                    if name in errors:
                        continue
                    fill_cache(*shards)
                    try:
                        t0 = time.perf_counter()
                        model = runs_[name]()
                        sync(torch, a.device)
                        s = time.perf_counter() - t0
                        if name != NOREAD:
                            sd = model.state_dict()
                            got = {k: v for k, v in sd.items() if k in want}
                            chk = check(torch, got, want, {k: tuple(v.shape) for k, v in got.items()}, a.device)
                            del sd, got
                        else:
                            chk = dict(ok=True, note="not checked: no data read")
                        del model
                        free_device(torch, a.device)
                        if r != "warm-up":
                            times[name].append(s)
                        oks[name] = oks.get(name, True) and chk["ok"]
                        self.emit(dict(section="from_pretrained", model_dir=mdir, bytes=nbytes, params=params,
                                       contender=name, round=r, seconds=round(s, 4),
                                       gib_per_s=round(nbytes / GIB / s, 3), check=chk,
                                       transformers=transformers.__version__,
                                       **({"hbmio_switch": switch["kind"]} if name == HB and switch else {})))
                        log(f"from_pretrained r{r} {name}: {s:.3f} s, check {'ok' if chk['ok'] else 'FAILED'}")
                    except Exception as e:
                        errors[name] = f"{type(e).__name__}: {e}"
                        self.emit(dict(section="from_pretrained", contender=name, round=r, error=errors[name]))
                        log(f"from_pretrained {name} failed: {errors[name]}")
                        free_device(torch, a.device)
        ref = statistics.median(times["from_pretrained stock"]) if times["from_pretrained stock"] else None
        print(f"\nfrom_pretrained: {os.path.basename(mdir)} ({params / 1e9:.2f} G params, {len(shards)} shards, "
              f"{fmt_bytes(nbytes)}), warm (shards read before each load), device_map={a.device}, "
              f"transformers {transformers.__version__}; median of {a.rounds}"
              + (f"; hbmio switch: {switch['kind']}, measured after the stock rounds" if switch else ""))
        print(f"  {'':48} {'median s':>9} {'GiB/s':>7} {'x stock':>8}  check")
        for name in runs_:
            if times[name]:
                m = statistics.median(times[name])
                self.emit(dict(section="from_pretrained", summary=True, contender=name, runs=[round(t, 4) for t in
                               times[name]], median_s=round(m, 4), gib_per_s=round(nbytes / GIB / m, 3),
                               check_ok=oks.get(name)))
                print(f"  {name:48} {m:9.3f} {nbytes / GIB / m:7.2f} {ratio(ref, m):>8}  "
                      f"{'ok' if oks.get(name) else 'FAILED'}")
            else:
                print(f"  {name:48} {'-':>9}  error: {errors.get(name, 'no runs')[:120]}")
        if hbmio_reason:
            print(f"  {'from_pretrained in hbmio.use_in_transformers()':48} {'-':>9}  skipped: {hbmio_reason}")
        if server is not None:
            import signal, subprocess
            print(subprocess.run([a.cache_hbmio, "cache", "status", "--socket", sock], capture_output=True, text=True).stdout)
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
        sys.stdout.flush()

    def skip_section(self, section, reason):
        self.emit(dict(section=section, skipped=reason))
        print(f"\n{section}: skipped: {reason}")

    # ---- fresh processes ------------------------------------------------------------------------

    def fresh_section(self, kind, path, ref_whole):
        a = self.a
        loaders = {
            "hbmio.load_file": ("hbmio", "import hbmio", "out = hbmio.load_file(path, device=dev)"),
            "hbmio.open walk file": ("hbmio", "import hbmio",
                                     "with hbmio.open(path, framework='pt', device=dev) as f:\n"
                                     "    keys = f.offset_keys() if hasattr(f, 'offset_keys') else lc.file_order(path)\n"
                                     "    out = {k: f.get_tensor(k) for k in keys}"),
            "safe_open walk file": ("safetensors", "from safetensors import safe_open",
                                    "with safe_open(path, framework='pt', device=dev) as f:\n"
                                    "    keys = f.offset_keys() if hasattr(f, 'offset_keys') else lc.file_order(path)\n"
                                    "    out = {k: f.get_tensor(k) for k in keys}"),
        }
        names = []
        for name, (group, imp, _) in loaders.items():
            if not (selected(name, group, a.only) or "fresh" in a.only):
                continue
            reason = have(group)
            if reason:
                self.emit(dict(section="fresh", contender=name, skipped=reason))
                continue
            names.append(name)
        if not names:
            return self.skip_section(f"fresh process, {kind}", "no contender selected or importable")
        times, splits, oks, errors = {n: [] for n in names}, {n: [] for n in names}, {}, {}
        for r in range(a.rounds):
            if self.over_budget():
                self.emit(dict(section="fresh", stopped=f"budget spent after {r} rounds"))
                break
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                if name in errors:
                    continue
                _, imp, load = loaders[name]
                code = CHILD.format(imp=imp, load=load.replace("\n", "\n    "))
                fill_cache(path)
                env = dict(os.environ)
                t0 = time.perf_counter()
                env["LAZY_T0"] = repr(time.time())  # the child's clock starts here
                p = subprocess.run([sys.executable, "-c", code, path, a.device, HERE], env=env, capture_output=True,
                                   text=True)
                wall = time.perf_counter() - t0
                if p.returncode != 0:
                    errors[name] = f"exit {p.returncode}: {p.stderr.strip()[-300:]}"
                    self.emit(dict(section="fresh", contender=name, round=r, error=errors[name]))
                    log(f"fresh {name} failed: {errors[name]}")
                    continue
                j = json.loads(p.stdout.strip().splitlines()[-1])
                sums = {k: tuple(v) for k, v in j.pop("sums").items()}
                bad = [k for k in ref_whole if sums.get(k) != ref_whole[k]]
                ok = not bad and set(sums) == set(ref_whole)
                oks[name] = oks.get(name, True) and ok
                times[name].append(wall)
                splits[name].append(j)
                self.emit(dict(section="fresh", file=os.path.basename(path), contender=name, round=r, mode="warm",
                               process_wall_s=round(wall, 4), **{k: round(v, 4) for k, v in j.items()},
                               check=dict(ok=ok, bad_checksum=bad[:5], tensors=len(sums))))
                log(f"fresh {kind} r{r} {name}: wall {wall:.3f} s, to device {j['to_device_s']:.3f} s, "
                    f"check {'ok' if ok else 'FAILED'}")
        print(f"\nfresh process, {kind}.safetensors, warm: `python -c` from spawn to every tensor on {a.device} "
              f"(medians of {a.rounds}; seconds)")
        cols = ("start_s", "import_torch_s", "import_loader_s", "cuda_context_s", "load_s", "to_device_s")
        print(f"  {'contender':24} {'wall':>7} " + " ".join(f"{c[:-2]:>13}" for c in cols) + "  check")
        for name in names:
            if not times[name]:
                print(f"  {name:24} {'-':>7}  error: {errors.get(name, 'no runs')[:150]}")
                continue
            med = {c: statistics.median(s[c] for s in splits[name]) for c in cols}
            wall = statistics.median(times[name])
            self.emit(dict(section="fresh", summary=True, file=os.path.basename(path), contender=name,
                           process_wall_s=round(wall, 4), **{c: round(v, 4) for c, v in med.items()},
                           check_ok=oks.get(name)))
            print(f"  {name:24} {wall:7.3f} " + " ".join(f"{med[c]:13.3f}" for c in cols)
                  + f"  {'ok' if oks.get(name) else 'FAILED'}")
        print("  (start: spawn to the child's first line; wall: spawn to exit, interpreter teardown included)")
        sys.stdout.flush()


# A fresh interpreter: timestamps against LAZY_T0 (the parent's clock just before spawning).
CHILD = r'''
import os, sys, time, json
t_spawn = float(os.environ["LAZY_T0"])
path, dev, here = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
import lazy_compare as lc  # the harness (standard library only): its header reader and checksums
t_first = time.time()
import torch
t_torch = time.time()
{imp}
t_lib = time.time()
if dev.startswith("cuda"):
    torch.empty(1, device=dev)
    torch.cuda.synchronize()
t_ctx = time.time()
if True:
    {load}
if dev.startswith("cuda"):
    torch.cuda.synchronize()
t_done = time.time()
sums = lc.checksum_dict(torch, out)
print(json.dumps(dict(start_s=t_first - t_spawn, import_torch_s=t_torch - t_first, import_loader_s=t_lib - t_torch,
                      cuda_context_s=t_ctx - t_lib, load_s=t_done - t_ctx, to_device_s=t_done - t_spawn,
                      sums=sums)))
sys.stdout.flush()
'''


def drop_cache_kind():
    return "echo 3 > /proc/sys/vm/drop_caches" if os.access("/proc/sys/vm/drop_caches", os.W_OK) \
        else "posix_fadvise(DONTNEED) on the file"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dir", default="/var/tmp/lazy", help="where the checkpoints are made and kept")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="6GiB", help="bytes of each file (tensor counts stay 48 and 3,072)")
    p.add_argument("--files", default="big,small")
    p.add_argument("--modes", default="warm,cold")
    p.add_argument("--cold-files", help="files measured cold (default: --files)")
    p.add_argument("--fresh-files", default="big", help="files of the fresh-process rows ('' for none)")
    p.add_argument("--only", default="", help="contenders or groups: hbmio, safetensors, instanttensor, "
                   "fastsafetensors, pretrained, fresh (comma-separated; default all)")
    p.add_argument("--skip", default="", help="sections to leave out: pretrained, fresh")
    p.add_argument("--all-peer-modes", action="store_true",
                   help="fastsafetensors' O_DIRECT and buffered configurations in both modes")
    p.add_argument("--threads", type=int, default=16, help="fastsafetensors max_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-hbmio", help="the hbmio command: from_pretrained also from a resident cache it serves")
    p.add_argument("--budget-s", type=float, help="start no new load after this many seconds")
    p.add_argument("--max-load-s", type=float, default=60,
                   help="a contender whose load takes longer gets no further rounds (0: no limit)")
    p.add_argument("--json", help="append one JSON line per measurement to this file")
    p.add_argument("--verbose", action="store_true", help="also print the JSON lines on stdout")
    a = p.parse_args()
    a.size = parse_size(a.size)
    a.only = {s.strip() for s in a.only.split(",") if s.strip()}
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    files = [f.strip() for f in a.files.split(",") if f.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    cold_files = files if a.cold_files is None else [f.strip() for f in a.cold_files.split(",") if f.strip()]
    fresh_files = [f.strip() for f in a.fresh_files.split(",") if f.strip()]
    for f in files + cold_files + fresh_files:
        if f not in FILES:
            p.error(f"unknown file {f!r}: big or small")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import safetensors
    if a.device.startswith("cuda"):
        torch.empty(1, device=a.device)  # the CUDA context outside every timing
        sync(torch, a.device)
    run = Runner(a, torch)
    run.emit(dict(section="start", argv=sys.argv[1:], torch=torch.__version__, python=sys.version.split()[0],
                  cache_drop=drop_cache_kind(), size=a.size,
                  gpu=torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else None,
                  safetensors=safetensors.__version__))
    gpu = torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else "no GPU"
    print(f"lazy_compare.py into {a.device} ({gpu}): python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"safetensors {safetensors.__version__}; cold loads: {drop_cache_kind()}")
    for m in ("hbmio", "instanttensor", "fastsafetensors", "transformers", "accelerate"):
        r = have(m)
        v = None
        if not r:
            v = getattr(sys.modules.get(m), "__version__", None)
            try:
                import importlib.metadata
                v = v or importlib.metadata.version(m)
            except Exception:
                pass
        print(f"  {m:16} {v or 'importable' if not r else r}")
        run.emit(dict(section="start", module=m, version=v, importable=not r, reason=r))
    if "hbmio" in sys.modules:
        import hbmio
        print(f"  hbmio.open: {'offset_keys' if hasattr(hbmio.SafeOpen, 'offset_keys') else 'no offset_keys'}, "
              f"{'get_slice' if hasattr(hbmio.SafeOpen, 'get_slice') else 'no get_slice'}; "
              f"use_in_transformers: {'yes' if hasattr(hbmio, 'use_in_transformers') else 'absent'}")
    sys.stdout.flush()
    prep = {}
    for kind in dict.fromkeys(files + cold_files + fresh_files):
        path = os.path.join(a.dir, f"{kind}.safetensors")
        create_checkpoint(torch, path, kind, a.size, a.device, a.seed)
        entries, _ = read_header(path)
        prep[kind] = (path, *reference_sums(torch, path, a.device, entries))
        log(f"{kind}: reference checksums of {len(entries)} tensors ready")
    free_device(torch, a.device)
    # Priority order under a budget: warm, the first file cold, from_pretrained, fresh, the rest cold.
    plan = [("load", k, "warm") for k in files if "warm" in modes]
    cold = [k for k in cold_files if "cold" in modes]
    plan += [("load", k, "cold") for k in cold[:1]]
    if "pretrained" not in skip:
        plan.append(("pretrained", None, "warm"))
    if "fresh" not in skip:
        plan += [("fresh", k, "warm") for k in fresh_files]
    plan += [("load", k, "cold") for k in cold[1:]]
    for section, kind, mode in plan:
        if run.over_budget():
            run.skip_section(f"{section} {kind or ''} {mode}", f"budget of {a.budget_s} s spent")
            continue
        log(f"=== {section} {kind or ''} {mode}")
        try:
            if section == "load":
                path, whole, sliced = prep[kind]
                run.file_section(kind, path, whole, sliced, mode)
            elif section == "pretrained":
                run.pretrained_section()
            else:
                path, whole, _ = prep[kind]
                run.fresh_section(kind, path, whole)
        except Exception as e:  # one broken section must not stop the others
            import traceback
            traceback.print_exc()
            run.skip_section(f"{section} {kind or ''} {mode}", f"error: {type(e).__name__}: {e}")
        free_device(torch, a.device)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
