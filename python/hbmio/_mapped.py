"""Memory-mapped loads into host memory: load_file(..., mmap=True).

The reference's own load_file maps the file and hands out tensors whose pages are read on first
touch: it returns in a millisecond whatever the size, and a caller that uses a few tensors reads
only those. A copied load (hbmio's default) reads every byte before it returns, and its tensors
are immune to what happens to the file afterwards. The trade-off, as the reference makes it:
a mapped tensor is a private (copy-on-write) view of the file's pages, so
  - a file truncated while its tensors live makes touching them fail with SIGBUS;
  - a file rewritten in place may show the new bytes in pages not yet touched;
  - a file replaced by rename (how every safetensors writer and hbmio's saves publish) is safe:
    the mapping keeps the old inode.
Checksums (verify=) need every byte read, so a verified load is always a copied one.
"""
from __future__ import annotations

import mmap as _mmap
import os as _os

from . import _hbmio as _ext


def _map(fd: int):
    try:
        size = _os.fstat(fd).st_size
        # ACCESS_COPY: private pages, writable as torch.frombuffer wants, never written back.
        return _mmap.mmap(fd, size, access=_mmap.ACCESS_COPY) if size else None
    finally:
        _os.close(fd)  # the mapping holds the file


def load(path: str, framework: str, names) -> dict:
    """{name: tensor} of `path` in file order, each a view of a private mapping of its file."""
    # The checkpoint as every load resolves it: its files, and which file gives each tensor (a
    # sharded index names one file per tensor; a shard may also hold tensors the index gives to
    # another shard, or none, and those are not the checkpoint's).
    opened = _ext.SafeOpen(path, cache="off")
    files = list(opened.files())
    of_file = [set() for _ in files]
    for (name, *_), (index, _) in zip(opened._entries(), opened._placements()):
        of_file[index].add(name)
    wanted = None if names is None else set(names)
    out = {}
    for index, file in enumerate(files):
        keep = of_file[index] if wanted is None else of_file[index] & wanted
        if not keep:
            continue
        # The file as it was opened and parsed above (never one that took its name since).
        mapping = _map(opened._map_fd(index))
        # The same validating parser as every load.
        entries, _ = _ext._deserialize(mapping if mapping is not None else b"")
        if framework == "torch":
            out.update(_torch_views(mapping, entries, keep, file))
        else:
            out.update(_numpy_views(mapping, entries, keep, file))
    if wanted is not None:
        missing = sorted(wanted - out.keys())
        if missing:
            raise KeyError(f"no tensor named {missing[0]!r} in {_ext.shown_path(str(path))}")
    return out


def _torch_views(mapping, entries, wanted, file):
    import torch
    from . import _TORCH_DTYPES
    from ._dtypes import packed_refusal, torch_shape
    out = {}
    for name, dtype, shape, offset, nbytes in entries:
        if name not in wanted:
            continue
        # F4 as the reference gives it: float4_e2m1fn_x2, two values a byte (see _dtypes.torch_shape).
        torch_dtype = getattr(torch, "float4_e2m1fn_x2" if dtype == "F4" else _TORCH_DTYPES.get(dtype, ""), None)
        if not isinstance(torch_dtype, torch.dtype):
            if dtype in ("F6_E2M3", "F6_E3M2"):
                raise packed_refusal(name, dtype, file)
            raise TypeError(f"tensor {name} of {file}: dtype {dtype} has no torch equivalent in torch {torch.__version__}")
        raw = _mapped_bytes(torch, mapping, offset, nbytes)
        if offset % torch_dtype.itemsize:
            raw = raw.clone()  # a view needs an offset that is a multiple of the element size
        out[name] = raw.view(torch_dtype).reshape(torch_shape(name, dtype, shape, file))
    return out


def _mapped_bytes(torch, mapping, offset: int, nbytes: int):
    """Bytes [offset, offset + nbytes) of `mapping` as a uint8 tensor with a storage of its own
    (which keeps the mapping alive), as the reference's tensors each have: torch.save of one of
    them writes its bytes, not the file's, and safetensors' save_model takes a model assigned from
    them. (Slices of one tensor over the whole mapping share its storage.)"""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)


def _numpy_views(mapping, entries, wanted, file):
    import numpy as np
    from ._lazy import _NUMPY_DTYPES
    base = np.frombuffer(mapping, dtype=np.uint8)
    out = {}
    for name, dtype, shape, offset, nbytes in entries:
        if name not in wanted:
            continue
        if dtype not in _NUMPY_DTYPES:
            from ._dtypes import numpy_refusal
            raise numpy_refusal(name, dtype, file)
        out[name] = base[offset:offset + nbytes].view(np.dtype(_NUMPY_DTYPES[dtype])).reshape(shape)
    return out
