"""hbmio for NumPy: like safetensors.numpy. NumPy has no bfloat16/float8: such tensors raise
TypeError here; use hbmio.load_file and a framework that has them (torch, jax, ml_dtypes)."""
from __future__ import annotations

import hbmio as _hbmio

Error = _hbmio.Error


def load_file(path, *, backend=None, verify=False, names=None, progress=False, mmap=False):
    """{name: np.ndarray} in file order. See hbmio.load_file for backend (None: $HBMIO_BACKEND,
    else "auto"), verify, names (a str is one name), progress and mmap (True: views of a private
    mapping of a local file, read on first touch; the reference's numpy load_file reads every
    byte, as the default here does)."""
    return _hbmio.load_file(path, "cpu", framework="numpy", backend=backend, verify=verify, names=names,
                            progress=progress, mmap=mmap)


def save_file(tensors, path, metadata=None, *, checksums=False, backend=None, max_shard_size=None):
    """Writes {name: array}, crash-safe. Strided arrays are written in C order (a copy); arrays that
    share memory are refused (RuntimeError naming them). See hbmio.save_file."""
    # No np.ascontiguousarray here: the save copies strided arrays itself, after checking the
    # caller's own arrays for shared memory (a copy made first would hide it).
    _hbmio.save_file(tensors, path, metadata, checksums=checksums, backend=backend, max_shard_size=max_shard_size)
