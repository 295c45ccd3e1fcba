"""hbmio for NumPy: like safetensors.numpy. NumPy has no bfloat16/float8: such tensors raise
TypeError here; use hbmio.load_file and a framework that has them (torch, jax, ml_dtypes)."""
from __future__ import annotations

import numpy as _np

import hbmio as _hbmio

Error = _hbmio.Error


def load_file(path, *, backend="auto", verify=False, names=None, progress=False):
    return _hbmio.load_file(path, "cpu", framework="numpy", backend=backend, verify=verify, names=names,
                            progress=progress)


def save_file(tensors, path, metadata=None, *, checksums=True, max_shard_size=None):
    _hbmio.save_file({name: _np.ascontiguousarray(a) for name, a in tensors.items()}, path, metadata,
                     checksums=checksums, max_shard_size=max_shard_size)
