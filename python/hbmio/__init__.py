"""hbmio: safetensors checkpoints between storage and host/GPU memory.

    import hbmio, numpy as np
    tensors = hbmio.load_file("model.safetensors")            # {name: DLPack array}, host memory
    w = np.from_dlpack(tensors["weight"])                        # no copy; torch.from_dlpack works too
    hbmio.save_file({"weight": w}, "out.safetensors", {"format": "np"})

Every returned array keeps the memory of its load alive; the memory is freed when the last array
of that load (and every NumPy/PyTorch view of it) is gone. There is no close().
"""
from __future__ import annotations

import os as _os

from . import _hbmio
from ._hbmio import (  # noqa: F401
    Error, SafeOpen, backends, cuda_device_count, cuda_unavailable_reason, _inspect, _memory_counters)

__version__ = _hbmio.__version__
__all__ = ["Error", "load_file", "save_file", "open", "backends", "SafeOpen", "cuda_device_count",
           "cuda_unavailable_reason"]


def _device_text(device) -> str:
    # Accepts "cpu", "cuda", "cuda:N", "pinned", an int (CUDA device index) or a torch.device.
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


def load_file(path, device="cpu", *, backend="auto", verify=False, names=None):
    """Loads a .safetensors file, a sharded checkpoint index or a directory holding either.

    Returns {name: array} in file order; each array supports __dlpack__ (NumPy, PyTorch, CuPy and
    JAX import it without a copy). The GIL is released while the data is read."""
    return _hbmio.load_file(_os.fspath(path), _device_text(device), backend=backend, verify=verify,
                            names=None if names is None else list(names))


def open(path):  # noqa: A001 - the safetensors.safe_open counterpart
    """Opens a checkpoint for lazy loads: .keys(), .metadata(), .get_tensor(name, device=...)."""
    return SafeOpen(_os.fspath(path))


def save_file(tensors, path, metadata=None, *, checksums=True, backend="auto"):
    """Writes {name: array} as a safetensors file, crash-safe (temporary file, fsync, rename,
    directory fsync): on any error the previous file at `path` is untouched.

    Arrays: anything supporting DLPack (__dlpack__: torch, cupy, jax, hbmio's own) or the buffer
    protocol (NumPy, memoryview), on the host or a CUDA device; non-contiguous ones are copied.
    With checksums=True the XXH3-64 of each tensor goes into __metadata__ ("hbmio.xxh3.<name>")."""
    _hbmio.save_file(dict(tensors), _os.fspath(path), None if metadata is None else dict(metadata),
                     checksums=checksums, backend=backend)
