#!/usr/bin/env python3
"""What a load of many small tensors costs on the client's CPU, outside the data's own transfer:
the header's parse, the load's plan and the views `load_file` hands out (on a GPU they are made
while the data arrives, and a device-to-device copy of the resident cache's takes milliseconds, so
these are most of such a load's time: bench/RESULTS.md, "Restarts from the node's resident cache").

A file of --tensors BF16 tensors of 64 x 16 (written by the reference, safetensors.torch), and the
same header with an unknown key in every entry, which the reference ignores and hbmio parses
through its JSON tree rather than its direct path. Medians of --repeat calls, in ms:
  header        hbmio._hbmio.SafeOpen(path): open, read and parse the header (direct path)
  header-tree   the same for the file whose entries carry an unknown key (the JSON tree)
  json          CPython's json.loads of the same header text (a reference point)
  plan          hbmio._hbmio._plan_rows(opened): the load's layout as tuples
  groups        the layout's views as groups (_plan_summary(opened)[4].groups(): view_groups)
  views-each    one as_strided per tensor of a torch.empty (what _load_torch_into did before groups)
  views         what _load_torch_into runs: an as_strided and an unbind per group (_views_of_groups)
  load          hbmio._load_torch_into(torch, path, cpu): all of it, the reads included
  load-file     hbmio.load_file(path) (torch, CPU): hbmio's memory imported once, views by groups
  load-each     the same load imported per tensor (torch.from_dlpack of each array: the path before)
  reference     safetensors.torch.load_file(path)
Run: build-python/venv/bin/python bench/micro/many_tensor_client.py [--tensors 3072]
"""
import argparse, json, os, statistics, struct, tempfile, time

import torch
from safetensors.torch import load_file as reference_load, save_file

import hbmio
from hbmio import _hbmio


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=3072)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    path = os.path.join(a.dir, f"many-{a.tensors}.safetensors")
    save_file({f"model.layers.{i // 12}.block.{i % 12}.weight": torch.zeros(64, 16, dtype=torch.bfloat16)
               for i in range(a.tensors)}, path)
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    for name, entry in header.items():
        if name != "__metadata__":
            entry["x-unknown"] = 1
    text = json.dumps(header, separators=(",", ":")).encode()
    tree = os.path.join(a.dir, f"many-{a.tensors}-tree.safetensors")
    with open(tree, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob[8 + n:])

    opened = _hbmio.SafeOpen(path, cache="off")
    rows = _hbmio._plan_rows(opened)
    dest = torch.empty(rows[-1][4] + rows[-1][5], dtype=torch.uint8)
    base = {"BF16": (dest.view(torch.bfloat16), 2)}

    layout = _hbmio._plan_summary(opened, None)[4]
    names, groups = layout.groups()

    def views():
        return hbmio._views_of_groups(names, groups, lambda b, dtype, _: base[dtype][0])

    def views_each():
        out = {}
        for name, dtype, shape, strides, offset, _ in rows:
            typed, itemsize = base[dtype]
            out[name] = typed.as_strided(shape, strides, offset // itemsize)
        return out

    raw = blob[8:8 + n]
    result = {
        "tensors": a.tensors, "header_bytes": n,
        "header_ms": median_ms(lambda: _hbmio.SafeOpen(path, cache="off"), a.repeat),
        "header_tree_ms": median_ms(lambda: _hbmio.SafeOpen(tree, cache="off"), a.repeat),
        "json_ms": median_ms(lambda: json.loads(raw), a.repeat),
        "plan_ms": median_ms(lambda: _hbmio._plan_rows(opened), a.repeat),
        "groups_ms": median_ms(layout.groups, a.repeat),
        "groups": len(groups),
        "views_each_ms": median_ms(views_each, a.repeat),
        "views_ms": median_ms(views, a.repeat),
        "load_ms": median_ms(lambda: hbmio._load_torch_into(torch, path, torch.device("cpu"), "auto", False, None, False), a.repeat),
        "load_file_ms": median_ms(lambda: hbmio.load_file(path), a.repeat),
        "load_each_ms": median_ms(lambda: {k: torch.from_dlpack(v) for k, v in _hbmio.load_file(path, "cpu").items()}, a.repeat),
        "reference_ms": median_ms(lambda: reference_load(path), a.repeat),
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
