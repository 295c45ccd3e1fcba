"""hbmio for PyTorch: `from hbmio.torch import load_file` as a drop-in for safetensors.torch."""
from __future__ import annotations

import torch as _torch  # this module needs torch: fail at import, as safetensors.torch does

import hbmio as _hbmio

Error = _hbmio.Error


def load_file(path, device="cpu", *, backend="auto", verify=False, names=None, progress=False):
    """Like safetensors.torch.load_file: {name: torch.Tensor}. On CUDA the tensors are views of one
    allocation from PyTorch's caching allocator; on the host they share hbmio's memory (no copy)."""
    return _hbmio.load_file(path, device, framework="torch", backend=backend, verify=verify, names=names,
                            progress=progress)


def save_file(tensors, path, metadata=None, *, checksums=True, max_shard_size=None):
    """Like safetensors.torch.save_file, crash-safe; CPU or CUDA tensors."""
    for name, t in tensors.items():
        if not isinstance(t, _torch.Tensor):
            raise TypeError(f"tensor {name}: expected a torch.Tensor, got {type(t).__name__}")
    _hbmio.save_file({name: t.detach().contiguous() for name, t in tensors.items()}, path, metadata,
                     checksums=checksums, max_shard_size=max_shard_size)
