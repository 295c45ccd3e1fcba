#!/usr/bin/env python3
"""Where the time of an hbmio.open walk goes, warm, into one device: allocation (PyTorch's caching
allocator, empty and primed), one engine request per tensor, the walk in file and random order,
slices, and a cProfile of the walk. A diagnostic for bench/peers/lazy_compare.py's figures, on the
same files (its --dir, made there by safetensors.torch.save_file when missing).

    python3 bench/micro/lazy_walk_profile.py [--dir /var/tmp/lazy] [--device cuda:0] [--files big,small]

Prints one line per measurement (median of --rounds) and the profile's top functions. Nothing is
checked here beyond shapes: lazy_compare.py checks every tensor of the same code paths.
"""
import argparse, cProfile, gc, io, os, pstats, random, statistics, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))
import lazy_compare as lc  # noqa: E402  (the files and their layout)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/var/tmp/lazy")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--files", default="big,small")
    p.add_argument("--size", default="6GiB")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import torch
    import hbmio
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.empty(1, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def empty():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def timed(fn, rounds=a.rounds, fresh=True):
        times = []
        for _ in range(rounds):
            if fresh:
                empty()
            t0 = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t0)
            del out
        return statistics.median(times)

    for kind in [k.strip() for k in a.files.split(",") if k.strip()]:
        path = os.path.join(a.dir, f"{kind}.safetensors")
        lc.create_checkpoint(torch, path, kind, lc.parse_size(a.size), a.device, 0)
        lc.fill_cache(path)
        with hbmio.open(path, framework="pt", device=a.device) as f:
            entries = f._entries_list
        n = len(entries)
        sizes = [e[3] for e in entries]
        total = sum(sizes)
        print(f"\n== {kind}: {n} tensors, {total / lc.GIB:.2f} GiB, warm, into {a.device}", flush=True)

        def report(what, s, nbytes=total):
            print(f"  {what:58} {s * 1e3:9.2f} ms  {nbytes / lc.GIB / s:7.2f} GiB/s  {s / n * 1e6:8.1f} us/tensor", flush=True)

        def alloc():
            return [torch.empty(b, dtype=torch.uint8, device=dev) for b in sizes]
        report("allocate every tensor, allocator emptied", timed(alloc))
        report("allocate every tensor, allocator holding their memory", timed(alloc, fresh=False))

        def alloc_primed():
            out, batch, acc = [], [], 0
            for b in sizes:  # one allocation of each 512 MiB batch, freed, then the tensors in it
                if acc + b > 512 << 20 and batch:
                    x = torch.empty(sum(batch), dtype=torch.uint8, device=dev)
                    del x
                    out += [torch.empty(s, dtype=torch.uint8, device=dev) for s in batch]
                    batch, acc = [], 0
                batch.append(b)
                acc += b
            if batch:
                x = torch.empty(sum(batch), dtype=torch.uint8, device=dev)
                del x
                out += [torch.empty(s, dtype=torch.uint8, device=dev) for s in batch]
            return out
        report("allocate, each 512 MiB batch primed by one allocation", timed(alloc_primed))
        report("hbmio.load_file", timed(lambda: hbmio.load_file(path, device=a.device)))

        def walk(order, fresh_alloc=True):
            def run():
                with hbmio.open(path, framework="pt", device=a.device) as f:
                    keys = f.offset_keys()
                    if order == "random":
                        random.Random(0).shuffle(keys)
                    elif order == "reverse":
                        keys = keys[::-1]
                    return {k: f.get_tensor(k) for k in keys}
            return run
        report("walk, file order", timed(walk("file")))
        report("walk, file order, allocator holding the memory", timed(walk("file"), fresh=False))
        report("walk, random order", timed(walk("random"), rounds=1))
        report("walk, random order, allocator holding the memory", timed(walk("random"), rounds=1, fresh=False))

        # One engine request per tensor into memory allocated beforehand: the engine's share.
        loc = f"cuda:{dev.index or 0}" if cuda else "cpu"
        with hbmio.open(path, framework="pt", device=a.device) as f:
            raws = [torch.empty(b, dtype=torch.uint8, device=dev) for b in sizes]
            order = list(range(n))
            random.Random(1).shuffle(order)
            pick = order[: min(n, 200)]
            t0 = time.perf_counter()
            for i in pick:
                f._read([i], [raws[i].data_ptr()], backend=f._backend, location=loc)
            sync()
            s = time.perf_counter() - t0
            report(f"engine request per tensor, {len(pick)} random, memory ready", s / len(pick) * n)
            t0 = time.perf_counter()
            f._read(list(range(n)), [r.data_ptr() for r in raws], backend=f._backend, location=loc)
            sync()
            report("engine, every tensor in one batch, memory ready", time.perf_counter() - t0)
            del raws

        # One request of part of a tensor, by size and backend: the floor under get_slice and random access.
        with hbmio.open(path, framework="pt", device=a.device) as f:
            loc = f"cuda:{dev.index or 0}" if cuda else "cpu"
            buf = torch.empty(2 << 20, dtype=torch.uint8, device=dev)
            for backend in ("auto", "uring", "posix"):
                for size in [s for s in (64 << 10, 256 << 10, 2 << 20) if s <= min(sizes)]:
                    picks = [random.Random(size).randrange(n) for _ in range(100)]
                    f._read([picks[0]], [buf.data_ptr()], lengths=[size], backend=backend, location=loc)
                    t0 = time.perf_counter()
                    for i in picks:
                        f._read([i], [buf.data_ptr()], lengths=[size], backend=backend, location=loc)
                    s = (time.perf_counter() - t0) / len(picks)
                    print(f"  one request of {size >> 10:5d} KiB, {backend:5}, memory ready: {s * 1e6:8.1f} us "
                          f"({size / lc.GIB / s:6.2f} GiB/s)", flush=True)
            del buf

        def slices():
            out = {}
            with hbmio.open(path, framework="pt", device=a.device) as f:
                for k in f.offset_keys():
                    sl = f.get_slice(k)
                    out[k] = sl[: sl.get_shape()[0] // 8]
            return out
        report("get_slice [: rows // 8] of every tensor", timed(slices), total // 8)

        empty()
        prof = cProfile.Profile()
        prof.enable()
        out = walk("file")()
        sync()
        prof.disable()
        del out
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        print("  cProfile of one walk in file order (by own time):")
        print("\n".join("    " + line for line in text.getvalue().splitlines() if line.strip())[:4000], flush=True)
        empty()


if __name__ == "__main__":
    main()
