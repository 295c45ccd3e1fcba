"""hbmio for PyTorch: `from hbmio.torch import load_file` as a drop-in for safetensors.torch."""
from __future__ import annotations

import torch as _torch

import hbmio as _hbmio

Error = _hbmio.Error


def load_file(path, device="cpu", *, backend="auto", verify=False, names=None):
    """Like safetensors.torch.load_file: {name: torch.Tensor}, zero-copy from hbmio's memory."""
    arrays = _hbmio.load_file(path, device, backend=backend, verify=verify, names=names)
    return {name: _torch.from_dlpack(array) for name, array in arrays.items()}


def save_file(tensors, path, metadata=None, *, checksums=True):
    """Like safetensors.torch.save_file, crash-safe; CPU or CUDA tensors."""
    _hbmio.save_file({name: t.detach().contiguous() for name, t in tensors.items()}, path, metadata,
                     checksums=checksums)
