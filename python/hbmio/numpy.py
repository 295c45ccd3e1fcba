"""hbmio for NumPy: like safetensors.numpy. NumPy has no bfloat16/float8: such tensors raise
TypeError here; use hbmio.load_file and a framework that has them (torch, jax, ml_dtypes)."""
from __future__ import annotations

import numpy as _np

import hbmio as _hbmio

Error = _hbmio.Error


def load_file(path, *, backend="auto", verify=False, names=None):
    arrays = _hbmio.load_file(path, "cpu", backend=backend, verify=verify, names=names)
    out = {}
    for name, array in arrays.items():
        try:
            out[name] = _np.from_dlpack(array)
        except (TypeError, BufferError, ValueError, RuntimeError) as e:
            raise TypeError(f"tensor {name}: {e}") from e
    return out


def save_file(tensors, path, metadata=None, *, checksums=True):
    _hbmio.save_file({name: _np.ascontiguousarray(a) for name, a in tensors.items()}, path, metadata,
                     checksums=checksums)
