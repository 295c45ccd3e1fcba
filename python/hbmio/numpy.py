"""hbmio for NumPy: like safetensors.numpy (load_file, save_file, load, save, and the names it
re-exports). NumPy has no bfloat16, float8 or float4: such tensors are refused as the reference
refuses them (TypeError, or a TypeError that is also the reference's AttributeError; see
hbmio/_dtypes.py); use hbmio.torch for them. Files are written as the reference writes them, byte
for byte, unless checksums=True."""
from __future__ import annotations

import hbmio as _hbmio
from hbmio._serialize import TensorSpec, deserialize, serialize, serialize_file  # noqa: F401 (re-exported)

Error = _hbmio.Error

# safetensors.numpy's public names (0.8 and 0.9), each offered here; safe_open is hbmio.open.
__all__ = ["load_file", "save_file", "load", "save", "Error", "safe_open", "serialize", "serialize_file",
           "deserialize", "TensorSpec"]

safe_open = _hbmio.open


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


def save(tensor_dict, metadata=None) -> bytes:
    """Like safetensors.numpy.save: the bytes of a safetensors file holding {name: array}, as the
    reference lays them out (metadata={} writes an empty "__metadata__", None none). Strided
    arrays are written in C order; arrays sharing memory are refused (RuntimeError naming them)."""
    where = "safetensors bytes"
    return _hbmio._hbmio._serialize(_hbmio._prepare_save(tensor_dict, where), _hbmio._check_metadata(metadata))


def load(data) -> dict:
    """Like safetensors.numpy.load: {name: np.ndarray} from the bytes of a safetensors file, in
    file order, each array in memory of its own. A malformed header raises hbmio.HeaderError (a
    SafetensorError where safetensors is installed); a dtype NumPy lacks is refused as load_file
    refuses it."""
    import numpy as np
    from hbmio._dtypes import numpy_refusal
    from hbmio._lazy import _NUMPY_DTYPES
    entries, _ = _hbmio._hbmio._deserialize(data)
    out, dests, offsets = {}, [], []
    for name, dtype, shape, offset, nbytes in entries:
        if dtype not in _NUMPY_DTYPES:
            raise numpy_refusal(name, dtype, "safetensors bytes")
        raw = np.empty(nbytes, dtype=np.uint8)
        out[name] = raw.view(np.dtype(_NUMPY_DTYPES[dtype])).reshape(shape)
        if nbytes:
            dests.append(raw)
            offsets.append(offset)
    _hbmio._hbmio._copy_bytes(data, offsets, dests)
    return out
