"""hbmio for PyTorch, shaped like safetensors.torch: `from hbmio.torch import load_file` (and
save_file, load, save, save_model, load_model) in place of `from safetensors.torch import ...`.

Files are written crash-safe and, as the reference writes them, byte for byte: no metadata that
was not asked for (checksums=True adds hbmio's per-tensor XXH3-64 checksums, as hbmio.save_file
does by default). Loads read through hbmio's engines (backend= names one of hbmio's;
safetensors' own "mmap" and "pread" mean hbmio's default here, as they say how safetensors
reads). Where hbmio still differs from the reference, and why: docs/python.md.
"""
from __future__ import annotations

import torch as _torch  # this module needs torch: fail at import, as safetensors.torch does

import hbmio as _hbmio
from hbmio import _hbmio as _ext

Error = _hbmio.Error

# The reference's low-level names, which safetensors.torch re-exports: see hbmio/_serialize.py.
from hbmio._serialize import TensorSpec, deserialize, serialize, serialize_file  # noqa: E402

# safetensors.torch's public names (0.8 and 0.9), each offered here; safe_open is hbmio.open.
__all__ = ["load_file", "save_file", "load", "save", "load_model", "save_model", "Error", "safe_open",
           "serialize", "serialize_file", "deserialize", "TensorSpec", "storage_ptr", "storage_size"]

safe_open = _hbmio.open


def storage_ptr(tensor) -> int:
    """The address of the storage `tensor` views (0 where it has none: a meta tensor), as
    safetensors.torch.storage_ptr: tensors with the same one share memory."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def storage_size(tensor) -> int:
    """Bytes of the storage `tensor` views (its own bytes where there is none to ask, a meta
    tensor's), as safetensors.torch.storage_size."""
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.nelement() * tensor.element_size()

class _NotATensor(TypeError, ValueError):
    """A value to save that is not a tensor: the reference's ValueError, and the TypeError hbmio
    raised for it before, so that code written for either catches it."""


def _check_tensors(tensors, where) -> dict:
    """tensors as a dict, every value a torch.Tensor with data. What the reference refuses is
    refused with its exception type and the words code matches on: a value that is not a dict
    (ValueError "Expected a dict of [str, torch.Tensor]"), a meta tensor (NotImplementedError
    "Cannot copy out of meta tensor"), a sparse or a non-contiguous one (ValueError "You are
    trying to save a sparse tensors" / "a non contiguous tensor"), a value that is not a tensor
    (ValueError "Key `k` is invalid", also a TypeError); a key that is not a str is a TypeError
    naming it."""
    where = _ext.shown_path(str(where))  # a URL's secrets stay out of messages
    import collections.abc
    if not isinstance(tensors, collections.abc.Mapping):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)} (save to {where})")
    tensors = dict(tensors)
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"save to {where}: tensor names must be str; the key {name!r} ({type(name).__name__}) is not")
        if not isinstance(t, _torch.Tensor):
            raise _NotATensor(f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)} (save to {where})")
    sparse = sorted(name for name, t in tensors.items() if t.layout != _torch.strided)
    if sparse:
        raise ValueError(f"You are trying to save a sparse tensors: `{sparse}` which this library does not support. You can "
                         "make it a dense tensor before saving with `.to_dense()` but be aware this might make a much larger "
                         f"file than needed. (save to {where})")
    _ext._check_shared(tensors, where)  # tensors sharing memory first (RuntimeError), as the reference
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise NotImplementedError(f"Cannot copy out of meta tensor; no data! (tensor {name!r}, save to {where})")
        if not t.is_contiguous():
            raise ValueError(f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. It either means "
                             "you are trying to save tensors which are reference of each other in which case it's recommended "
                             "to save only the full tensors, and reslice at load time, or simply call `.contiguous()` on your "
                             f"tensor to pack it before saving. (save to {where})")
    return tensors


def load_file(path, device="cpu", *, backend=None, verify=False, names=None, progress=False, mmap=None):
    """Like safetensors.torch.load_file: {name: torch.Tensor}, in file order. On CUDA the tensors
    are views of one allocation from PyTorch's caching allocator. On the host, as the reference
    does, they are views of a private mapping of the file, read on first touch (mmap=None: mapped
    for a local file into "cpu" without verify or progress; mmap=False: every byte read before
    the call returns, immune to a later truncation of the file). See hbmio.load_file."""
    if mmap is None:
        where = _hbmio._os.fspath(path)
        mmap = (not verify and not progress and str(device) == "cpu" and not _hbmio._is_url(where))
    return _hbmio.load_file(path, device, framework="torch", backend=backend, verify=verify, names=names,
                            progress=progress, mmap=mmap)


def save_file(tensors, path, metadata=None, *, checksums=False, backend=None, max_shard_size=None, progress=False,
              blocking=True, staging="pinned", pool_bytes=None, wait_if_busy=True):
    """Like safetensors.torch.save_file, crash-safe; CPU or CUDA tensors. Refuses what safetensors
    refuses: tensors that share memory (RuntimeError naming them: use save_model), strided
    tensors (ValueError: save .contiguous()), sparse ones (ValueError). blocking=False returns an
    hbmio.SaveHandle once the tensors are copied out. See hbmio.save_file."""
    where = _hbmio._os.fspath(path)
    return _hbmio.save_file(_check_tensors(tensors, where), path, metadata, checksums=checksums, backend=backend,
                            max_shard_size=max_shard_size, progress=progress, blocking=blocking, staging=staging,
                            pool_bytes=pool_bytes, wait_if_busy=wait_if_busy)


# --- bytes ----------------------------------------------------------------------------------
# save() and load() go through the C++ format code (the header writer and the validating parser
# that files use) on memory, not through a temporary file: the bytes are exactly those of a file
# hbmio would write with checksums=False, a file-backed path would cost a write, an fsync and a
# read for nothing, and load() applies the same checks to bytes as to files.

def save(tensors, metadata=None) -> bytes:
    """Like safetensors.torch.save: the bytes of a safetensors file holding `tensors` (CPU or CUDA;
    CUDA tensors are copied to the host first), without checksums, laid out as safetensors lays
    it out. Refuses what save_file refuses."""
    where = "safetensors bytes"
    tensors = _hbmio._prepare_save(_check_tensors(tensors, where), where)
    metadata = _hbmio._check_metadata(metadata)
    if any(t.device.type != "cpu" for t in tensors.values()):
        _ext._check_shared(tensors, where)  # before the copies to the host, which share nothing
        tensors = {name: t.cpu() for name, t in tensors.items()}
    return _ext._serialize(tensors, metadata)


def load(data) -> dict:
    """Like safetensors.torch.load: {name: torch.Tensor} on the CPU from the bytes of a safetensors
    file (bytes, bytearray or memoryview), in file order, each tensor in memory of its own.
    A malformed header raises hbmio.Error naming the rule it breaks."""
    from hbmio._dtypes import packed_refusal, torch_shape
    entries, _ = _ext._deserialize(data)
    out, dests, offsets = {}, [], []
    for name, dtype, shape, offset, nbytes in entries:
        # F4 as the reference's load_file gives it: float4_e2m1fn_x2, two values a byte (its
        # load() of bytes has no F4 in its table and raises KeyError; hbmio reads it as a file).
        torch_dtype = getattr(_torch, "float4_e2m1fn_x2" if dtype == "F4" else _hbmio._TORCH_DTYPES.get(dtype, ""), None)
        if not isinstance(torch_dtype, _torch.dtype):
            if dtype in ("F6_E2M3", "F6_E3M2"):
                raise packed_refusal(name, dtype, "safetensors bytes")
            raise TypeError(f"tensor {name}: dtype {dtype} has no torch equivalent in torch {_torch.__version__}")
        raw = _torch.empty(nbytes, dtype=_torch.uint8)
        out[name] = raw.view(torch_dtype).reshape(torch_shape(name, dtype, shape, "safetensors bytes"))
        if nbytes:
            dests.append(raw)
            offsets.append(offset)
    _ext._copy_bytes(data, offsets, dests)
    return out


# --- models ---------------------------------------------------------------------------------
# A model's state_dict names tied weights (an embedding and the output layer) more than once, each
# name a view of one storage. A file cannot say that two names are one tensor, so save_model writes
# one name per shared memory and records each dropped name in the metadata ({dropped: kept}), and
# load_model fills the model through the kept names, which ties the dropped ones again.

def _byte_end(t) -> int:
    """One past the last byte of t's elements (torch strides are never negative)."""
    if t.numel() == 0:
        return t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr() + (reach + 1) * t.element_size()


def _storage(t):
    """(storage address, storage bytes) of a tensor; (0, 0) where there is no storage to share
    (meta tensors, tensor subclasses without one)."""
    if t.device.type == "meta":
        return 0, 0
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


def _shared_groups(state) -> list:
    """Names whose bytes overlap within one storage, as sorted lists (groups of one left out)."""
    by_storage = {}
    for name, t in state.items():
        address, size = _storage(t)
        if address and size:
            by_storage.setdefault((t.device, address, size), []).append(name)
    groups = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        # Views of one storage that do not overlap (two halves of a fused weight) are separate
        # tensors: only overlapping byte ranges form a group.
        spans = sorted((state[n].data_ptr(), _byte_end(state[n]), n) for n in names)
        group, end = [spans[0][2]], spans[0][1]
        for start, stop, name in spans[1:]:
            if start < end:
                group.append(name)
            else:
                if len(group) > 1:
                    groups.append(sorted(group))
                group = [name]
            end = max(end, stop)
        if len(group) > 1:
            groups.append(sorted(group))
    return sorted(groups)


def _covers_storage(t) -> bool:
    address, size = _storage(t)
    return t.data_ptr() == address and t.numel() * t.element_size() == size


def _names_to_drop(state, keep_first=()) -> dict:
    """{kept name: [names dropped for it]} for every group of names sharing memory. The kept name
    covers the whole storage (so it alone holds every byte any of them sees): the first in sorted
    order, or the first of those in `keep_first` (the names a file holds, when loading)."""
    keep_first = set(keep_first)
    drops = {}
    for group in _shared_groups(state):
        whole = [name for name in group if _covers_storage(state[name])]
        if not whole:
            raise RuntimeError(
                f"tensors {group} share memory, but none of them covers all of it, so no one of them can be "
                "saved for the others without losing bytes; save copies of them (.clone()) instead. See "
                "https://huggingface.co/docs/safetensors/torch_shared_tensors")
        preferred = [name for name in whole if name in keep_first]
        kept = (preferred or whole)[0]
        drops[kept] = [name for name in group if name != kept]
    return drops


def save_model(model, filename, metadata=None, force_contiguous=True, *, checksums=False, backend=None):
    """Like safetensors.torch.save_model: saves model.state_dict() with one name per shared memory
    (tied weights), each dropped name recorded in the metadata as {dropped: kept} unless the
    caller's metadata has that key already. force_contiguous (the default, as in safetensors
    0.5 and later) saves strided tensors as contiguous copies; False refuses them (ValueError)."""
    state = model.state_dict()
    metadata = None if metadata is None else dict(metadata)  # the caller's dict stays as it was
    for kept, dropped in _names_to_drop(state).items():
        for name in dropped:
            metadata = {} if metadata is None else metadata
            metadata.setdefault(name, kept)
            del state[name]
    if force_contiguous:
        state = {name: t.contiguous() for name, t in state.items()}
    try:
        save_file(state, filename, metadata, checksums=checksums, backend=backend)
    except ValueError as e:
        if force_contiguous:
            raise
        raise ValueError(f"{e}; or save_model(..., force_contiguous=True)") from e


def load_model(model, filename, strict=True, device="cpu", *, backend=None):
    """Like safetensors.torch.load_model: loads a file (save_model's, or any) into `model` and
    returns (missing, unexpected): the model's names the file did not fill and the file's names
    the model did not take, as lists. A tied name the file left out (save_model keeps one of each
    group) is filled through the name it holds, so it is not missing; a tied name the file holds
    as well is reported unexpected, as safetensors reports it. strict=True raises RuntimeError
    naming them instead of returning any."""
    state = load_file(filename, device=device, backend=backend)
    drops = _names_to_drop(model.state_dict(), keep_first=state.keys())
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A set and a list, as the reference returns them (whatever its annotation says).
    missing, unexpected = set(missing), list(unexpected)
    for dropped in drops.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        text = f"Error(s) in loading state_dict for {type(model).__name__} from {_ext.shown_path(str(filename))}:"
        if missing:
            text += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            text += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(text)
    return missing, unexpected
