"""hbmio: safetensors checkpoints between storage and host/GPU memory.

A drop-in for safetensors' loaders:

    from hbmio import load_file                          # was: from safetensors.torch import load_file
    state = load_file("model.safetensors", device="cuda:0")   # {name: torch.Tensor}
    model.load_state_dict(state)

framework="auto" (the default) returns torch tensors when torch is installed, else
framework-neutral DLPack arrays (NumPy, PyTorch, CuPy and JAX import them with from_dlpack, no
copy); "numpy" and "dlpack" choose explicitly.

Lifetime: every returned tensor or array keeps the memory of its load alive; the memory is freed
when the last tensor of that load (and every view of it) is gone. There is no close(). Torch
tensors on a CUDA device live in memory from PyTorch's caching allocator, like safetensors'.

Engines: loads and raw reads/writes reuse I/O engines (io_uring rings, worker threads, pinned
bounce buffers) kept in a small pool, since setting one up costs tens of milliseconds. Idle
engines keep their pinned buffers until hbmio._release_engines() or interpreter exit.
"""
from __future__ import annotations

import atexit as _atexit
import errno as _errno
import math as _math
import numbers as _numbers
import os as _os
import re as _re
import sys as _sys
from collections.abc import Mapping as _Mapping

from . import _hbmio
from ._hbmio import Error, NotVerifiedWarning, VerifyError, backends, cuda_device_count, cuda_unavailable_reason, _release_engines
# hbmio.Error subclasses that are also Python's own OSError subclass for the errno value
# (`except FileNotFoundError` catches a missing checkpoint). They shadow the builtins in this
# module's namespace: code here that means Python's own names them through `builtins`.
from ._hbmio import FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError  # noqa: A004
from ._lazy import SafeOpen

# Test and diagnostic support, not public API.
_inspect = _hbmio._inspect
_memory_counters = _hbmio._memory_counters
_idle_engines = _hbmio._idle_engines

__version__ = _hbmio.__version__
__all__ = ["Error", "VerifyError", "NotVerifiedWarning", "DeviceError", "FrameworkError", "BackendError", "StateError", "load_file", "save_file", "SaveHandle", "open", "read_into", "write_from", "backends", "SafeOpen", "use_in_transformers", "stream", "Stream",
           "cuda_device_count", "cuda_unavailable_reason"]

# Join the library's threads and free the pooled engines while the CUDA runtime is still alive (a
# static destructor would run after its teardown); the saves and streams are finished before.
_atexit.register(_hbmio._shutdown)

_FRAMEWORKS = {"auto": "auto", "torch": "torch", "pt": "torch", "numpy": "numpy", "np": "numpy",
               "dlpack": "dlpack"}
_torch_module = None  # torch once imported; False when it cannot be
# From this many tensors on, their views are made while the data is read (see _load_torch_into).
_VIEWS_BESIDE_LOAD = 64


def _torch():
    global _torch_module
    if _torch_module is None:
        try:
            import torch
            _torch_module = torch
        except (ImportError, OSError):  # not installed, or its native libraries fail to load
            _torch_module = False
    return _torch_module or None


def _framework(framework: str) -> str:
    try:
        resolved = _FRAMEWORKS[framework]
    except (KeyError, TypeError):
        raise _as_reference_error(FrameworkError)(
            _errno.EINVAL, f"framework must be one of {sorted(_FRAMEWORKS)}, not {framework!r}") from None
    if resolved == "auto":
        return "torch" if _torch() is not None else "dlpack"
    if resolved == "torch" and _torch() is None:
        raise ImportError("framework='torch' needs PyTorch, which is not installed")
    return resolved


_DEVICE_FORMS = ("'cpu', 'cuda', 'cuda:N', an int N (meaning cuda:N), a torch.device of type cpu or cuda, "
                 "or 'pinned' (page-locked host memory)")
_CUDA_INDEX = _re.compile(r"cuda:(\d+)")


class DeviceError(Error, ValueError):
    """A device form hbmio does not load into ("gpu", "mps", "cuda:x"): a ValueError, as a bad
    argument is, and an hbmio.Error (EINVAL), as the library's parser of memory locations raised
    before Python checked the forms itself, so code catching either keeps working. What is raised
    is also a safetensors.SafetensorError where safetensors is installed, as the reference raises
    for a bad device (_device_error)."""


_reference_subclasses = {}


def _as_reference_error(cls):
    """`cls`, or where safetensors is installed a subclass of it that is also a SafetensorError
    (what the reference raises for the same mistake), made at first use: importing safetensors at
    every import of hbmio would cost every user."""
    made = _reference_subclasses.get(cls)
    if made is None:
        try:
            from safetensors import SafetensorError
        except ImportError:
            made = cls
        else:
            made = type(cls.__name__, (cls, SafetensorError), {"__module__": "hbmio", "__doc__": cls.__doc__})
        _reference_subclasses[cls] = made
    return made


class FrameworkError(Error, ValueError):
    """An unknown framework= ("PT", "jax"): a ValueError (what hbmio raised before) and an
    hbmio.Error (EINVAL); also a safetensors.SafetensorError where safetensors is installed, as
    the reference raises."""


def _device_error(message):
    return _as_reference_error(DeviceError)(_errno.EINVAL, message)


def _device_text(device) -> str:
    """hbmio's text for a device: "cpu", "cuda", "cuda:N" or "pinned". Accepts those (any case;
    "host", the hbmio command's word, is "cpu"), an int N (CUDA device N) or a torch.device;
    DeviceError (a ValueError and an hbmio.Error) listing the accepted forms for anything else
    ("gpu", "mps", "cuda:x")."""
    if device is None:
        return "cpu"  # as safetensors reads device=None (safe_open, load_file, load_model)
    if isinstance(device, bool):
        raise TypeError("device must be a string, an int or a torch.device, not a bool")
    if isinstance(device, int):
        if device < 0:
            raise _device_error(f"device {device}: a CUDA device index is 0 or more; accepted are {_DEVICE_FORMS}")
        return f"cuda:{device}"
    if isinstance(device, str):
        text = device.strip().lower()
    elif type(device).__name__ == "device" and type(device).__module__ == "torch":  # torch need not be imported
        text = str(device)
    else:
        raise TypeError(f"device must be a string, an int or a torch.device, not {type(device).__name__}")
    if text == "host":
        text = "cpu"
    if text in ("cpu", "cuda", "pinned") or _CUDA_INDEX.fullmatch(text):
        return text
    raise _device_error(f"unknown device {device!r}: accepted are {_DEVICE_FORMS}")


def _require_gpu(device: str, path=None) -> None:
    """hbmio.Error (ENODEV) when `device` (from _device_text) is a CUDA device this machine does
    not have, said as such before torch or the library fail deeper down (a driver message from
    torch.cuda, an allocation error)."""
    if not device.startswith("cuda"):
        return
    what = f"load of {_hbmio.shown_path(str(path))} into {device}" if path is not None else f"device {device}"
    count = cuda_device_count()
    if count == 0:
        raise Error(_errno.ENODEV, f"{what}: this machine has no GPU ({cuda_unavailable_reason()})")
    match = _CUDA_INDEX.fullmatch(device)
    if match and int(match.group(1)) >= count:
        raise Error(_errno.ENODEV, f"{what}: there is no such GPU; this machine has {count} "
                                   f"(cuda:0 to cuda:{count - 1})")


_BACKENDS = ("auto", "posix", "uring", "cufile")
# safetensors' own backend= names (0.9: how it reads a file). They do not carry over to hbmio's
# engines, so they mean hbmio's default (as backend=None).
_REFERENCE_BACKENDS = ("mmap", "pread")
class BackendError(Error, ValueError):
    """An unknown backend name, refused when the call is made (not at its first read). An
    hbmio.Error and a ValueError; what is raised is also a safetensors.SafetensorError where
    safetensors is installed, which is what safe_open and load_file raise for one."""


def _backend_error(message):
    return _as_reference_error(BackendError)(_errno.EINVAL, message)


def _backend(backend) -> str:
    """The backend of a call: the caller's, else (backend=None, or one of safetensors' own names
    "mmap" and "pread") $HBMIO_BACKEND where it is set, as for the hbmio command, else "auto".
    Any other name is a BackendError naming the accepted ones."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, not {type(backend).__name__}")
    if backend is None or backend in _REFERENCE_BACKENDS:
        try:
            return _hbmio._configured_backend()  # HBMIO_BACKEND, else "auto"; checked by the library
        except Error as e:
            raise _backend_error(e.strerror or str(e)) from None
    if backend not in _BACKENDS:
        accepted = ", ".join(f'"{b}"' for b in _BACKENDS + _REFERENCE_BACKENDS)
        raise _backend_error(f'backend "{backend}" is invalid (expected one of: {accepted})')
    return backend


def _names(names):
    """names= as a list: None stays None (every tensor), a str is one name (not its letters)."""
    if names is None:
        return None
    out = [names] if isinstance(names, str) else list(names)
    for name in out:
        if not isinstance(name, str):
            raise TypeError(f"names holds tensor names (str), not {name!r} ({type(name).__name__})")
    return out


# safetensors dtype -> name of the torch dtype. Where the installed torch lacks one (uint16/32/64
# before torch 2.3, some float8 kinds), such tensors take the DLPack path, which raises if torch
# cannot represent them either.
_TORCH_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


class _ProgressBar:
    """'\\r{done} / {total}  (P%)  {rate} GiB/s' on stderr every 0.2 s while the call (GIL
    released) fills the counter, and a last line and a newline at the end: drawn by the library's
    pool (hbmio::ProgressLine), so Python starts no thread of its own."""

    def __init__(self, total: int, enabled: bool):
        self.counter = _hbmio._Progress() if enabled else None
        self._total = total

    def __enter__(self):
        if self.counter is not None:
            self.counter._show(self._total)
        return self

    def __exit__(self, *exc):
        if self.counter is not None:
            self.counter._hide()
        return False


def _torch_target(torch, device: str):
    """The torch.device a torch load goes to; "cuda" means the current device, as in torch.
    None for text torch does not parse ("pinned", typos): hbmio's own parser then takes it, and
    raises hbmio.Error for what it cannot parse either."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        return None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _cache_text(cache):
    """load_file's and open's cache= as the extension takes it: "" (None: HBMIO_CACHE decides),
    "off" (False), "use" (True) or "add"."""
    if cache is None:
        return ""
    if cache is False or cache == "off":
        return "off"
    if cache is True or cache == "use":
        return "use"
    if cache == "add":
        return "add"
    raise ValueError(f"cache must be None, True, False, 'use', 'add' or 'off', not {cache!r}")


def _load_torch_into(torch, path: str, dev, backend, verify, names, progress, report=None, cache=""):
    """Loads into one torch.empty(n, dtype=uint8, device=dev) and returns views of it: on CUDA
    the memory comes from PyTorch's caching allocator, so repeated loads reuse it. None when a
    dtype of the file has no torch equivalent here (the caller then takes the DLPack path)."""
    # One look at the headers gives everything: each tensor's dtype (every one must have a torch
    # equivalent, checked before reading), its bytes, and where it lands. The load below reuses
    # the parsed headers (a 3,072-tensor header takes milliseconds to parse).
    opened = _hbmio.SafeOpen(path, cache="off")  # for its headers: the load below asks the cache
    # The allocation's size and the dtypes now; the views' rows while the load reads (below): a
    # load from the resident cache's GPU copy takes about as long as making them.
    size, dtypes, count, tensor_bytes, layout = _hbmio._plan_summary(opened, names)
    torch_dtypes = {d: getattr(torch, _TORCH_DTYPES.get(d, ""), None) for d in dtypes}
    if not all(isinstance(d, torch.dtype) for d in torch_dtypes.values()):
        return None
    # max(.., 1): an all-empty checkpoint still needs a real pointer to load "into".
    dest = torch.empty(max(size, 1), dtype=torch.uint8, device=dev)
    if dev.type == "cuda":
        # The caching allocator may hand out a block freed by work still queued on the current
        # stream; hbmio's copies run on streams of its own, so let that work finish first.
        torch.cuda.current_stream(dev).synchronize()
    def make_views():
        # Views of `dest`, which every tensor keeps alive, made by groups (_views_of_groups).
        # Offsets are multiples of 256, so whole elements. Views need no data, only the plan.
        base = {}
        for text, dtype in torch_dtypes.items():
            whole = dest.numel() // dtype.itemsize * dtype.itemsize  # a whole number of elements
            base[(0, text)] = dest[:whole].view(dtype)
        names, groups = layout.groups()
        return _views_of_groups(names, groups, lambda b, dtype, _: base[(b, dtype)])

    with _ProgressBar(tensor_bytes if progress else 0, progress) as bar:
        # The load lays the tensors out as _plan said (same parsed headers, same options).
        def load():
            _hbmio._load_into(opened, dest, backend=backend, verify=verify, names=names, progress=bar.counter, entries=False,
                              report=report, cache=cache)

        if count < _VIEWS_BESIDE_LOAD:
            load()
            return make_views()
        # Many tensors: their views are made while the data is read (the load runs on the
        # library's pool), so the Python side costs nothing a C++ caller would not pay: making
        # thousands of views takes a small fraction of a warm load of the same tensors
        # (bench/RESULTS.md, "Python against the command").
        job = _hbmio._load_into(opened, dest, backend=backend, verify=verify, names=names, progress=bar.counter, entries=False,
                                report=report, cache=cache, background=True)
        try:
            out = make_views()
        except BaseException:
            # No views, no load: stop its reads and wait for those in flight (`dest` is written
            # until the load returns), then raise what stopped the views, not the load's ECANCELED.
            job.cancel()
            try:
                job.wait()
            except Exception:
                pass
            raise
        job.wait()  # raises what the load raised; a Ctrl-C meanwhile stops it and is raised
        return out


def _views_of_groups(names, groups, typed_base) -> dict:
    """{name: tensor} in the order of `names`, from view_groups' groups (python/src/load.cpp):
    typed_base(base, dtype, name) is the allocation as a 1-D tensor of that dtype. A group of tensors of
    one shape a constant step apart (one weight of every layer) is one as_strided and one unbind:
    a call per tensor was most of a 3,072-tensor load from the resident cache's GPU copy."""
    out = dict.fromkeys(names)
    for members, dtype, shape, strides, base, offset, step in groups:
        typed = typed_base(base, dtype, members[0])
        if step == 0:
            out[members[0]] = typed.as_strided(shape, strides, offset)
        else:
            out.update(zip(members, typed.as_strided((len(members),) + shape, (step,) + strides, offset).unbind(0)))
    return out


def _torch_views(torch, bases, names, groups, arrays, path) -> dict:
    """{name: tensor} from _load_views: one torch tensor per allocation (the DLPack import that
    keeps the load's memory alive), reinterpreted once per dtype, and the views made by groups, as
    _load_torch_into makes them; a tensor that is no such view comes as its own array."""
    whole = [torch.from_dlpack(b) for b in bases]
    typed = {}

    def typed_base(base, dtype, name):
        view = typed.get((base, dtype))
        if view is None:
            torch_dtype = getattr(torch, _TORCH_DTYPES.get(dtype, ""), None)
            if not isinstance(torch_dtype, torch.dtype):
                raise TypeError(f"tensor {name} of {_hbmio.shown_path(str(path))}: dtype {dtype} has no torch equivalent "
                                f"in torch {torch.__version__}")
            b = whole[base]
            size = b.numel() // torch_dtype.itemsize * torch_dtype.itemsize  # a whole number of elements
            view = typed[(base, dtype)] = b[:size].view(torch_dtype)
        return view

    out = _views_of_groups(names, groups, typed_base)
    for name, array in arrays:
        out[name] = torch.from_dlpack(array)
    return out


def _is_url(path: str) -> bool:
    return path.startswith(("s3://", "http://", "https://"))


def load_file(path, device="cpu", *, framework="auto", backend=None, verify=False, names=None, progress=False,
              group=None, placement="replicate", shard_map=None, report=None, mmap=False, cache=None, share=False):
    """Loads a .safetensors file, a sharded checkpoint index or a directory holding either.

    Like safetensors.torch.load_file: returns {name: tensor} in file order.
      device     "cpu", "cuda", "cuda:N", an int (CUDA index) or a torch.device; also "pinned"
                 (page-locked host memory) for the "dlpack" framework. Any other form is a
                 DeviceError (a ValueError and an hbmio.Error) listing these; a CUDA device
                 this machine lacks is an hbmio.Error saying so.
      framework  "torch" (torch.Tensor), "numpy" (np.ndarray; host only; bfloat16/float8 tensors
                 raise TypeError naming the tensor), "dlpack" (arrays with __dlpack__), or "auto":
                 "torch" when torch imports, else "dlpack".
      backend    "auto", "posix", "uring" or "cufile"; None (the default): $HBMIO_BACKEND where
                 set, else "auto".
      verify     True (or "checksums"): recompute the checksums stored in each file
                 (hbmio.VerifyError, an hbmio.Error, on a mismatch); files without hbmio checksums
                 (any file another tool wrote) load unchecked with an hbmio.NotVerifiedWarning
                 naming them. "strict": such files are an hbmio.Error before anything is read.
                 At a URL each tensor is checked as soon as its bytes have arrived, and a
                 mismatch stops the load without fetching the rest.
      names      load only these tensors (a str is one name).
      progress   draw a progress bar on stderr.
      mmap       True: into host memory ("cpu", framework "torch" or "numpy", no verify), the
                 tensors are views of a private mapping of each local file, read on first touch,
                 as safetensors' own load_file does: it returns in about a millisecond whatever
                 the size, and a caller that touches a few tensors reads only those. A file
                 truncated while such tensors live makes touching them fail (SIGBUS); one
                 replaced by rename is safe. False (the default): every byte is read before
                 the call returns, and the tensors own their memory. hbmio.torch.load_file maps
                 by default, as safetensors.torch.load_file does. See hbmio/_mapped.py.
      group      a torch.distributed process group (e.g. dist.group.WORLD): the ranks divide the
                 reading, each byte is read from storage once, and with placement="replicate"
                 every rank gets every tensor (the runs travel by broadcast: NCCL on GPUs, gloo
                 on CPUs); with "shard" each rank gets its part, or what shard_map
                 ({name: rank}) gives it. Call it on every rank. A rank that fails makes every
                 rank raise. report={} is filled with this rank's and the group's bytes and
                 times. See hbmio/distributed.py.
      report     a dict, filled (without group) with what the load did: bytes, seconds,
                 gib_per_second, backend, bytes_direct, note, and paths: per file, the way its
                 bytes took and why, [{"file", "path", "reason", "bytes", "bytes_direct"}] with
                 "path" one of "gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix",
                 "remote", "cache-host", "cache-device", "cache-shared" (the node's resident cache, docs/cache.md: used where
                 HBMIO_CACHE names its socket). mmap=True reads nothing at load time and leaves
                 it as it was.
      cache      the node's resident cache (`hbmio cache serve`, docs/cache.md): None (the
                 default) asks it where HBMIO_CACHE names its socket (and asks it to take in
                 what it lacks with HBMIO_CACHE_ADD=on); True or "use" asks it (HBMIO_CACHE,
                 else the default socket); "add" also asks it to take in the files it lacks;
                 False or "off" never asks. A file it holds unchanged comes from it (into GPU
                 memory by its server's DMA); a cache that cannot help is a plain load.
      share      True: into a GPU ("cuda:N"), the files the resident cache holds in that GPU's
                 memory (`hbmio cache add --gpu N`) are not copied: their tensors are the
                 cache's own copy, mapped into this process (CUDA IPC) and read in place, so a
                 load takes milliseconds and no memory of its own. Read-only by agreement:
                 writing to such a tensor changes it for every process that shares it (the
                 cache goes on serving it as the file). The server keeps the copy while any
                 of these tensors lives (never evicting it meanwhile); the tensors stop working
                 if the server itself stops. Files it does not hold there load as usual;
                 report's paths say "cache-shared" for the shared ones. Asks the cache at
                 HBMIO_CACHE, else its default socket (not with cache="off").

    Torch on CUDA loads straight into one allocation from PyTorch's caching allocator; other
    loads land in hbmio's own memory, which the tensors share without a copy. The GIL is
    released while the data is read. A missing file raises hbmio.FileNotFoundError, both an
    hbmio.Error and a FileNotFoundError (as safetensors raises), with filename set."""
    path = _path_text(path, "load_file")
    framework = _framework(framework)
    backend = _backend(backend)
    names = _names(names)
    if names is not None and not names:
        # No tensor asked for, none loaded (the library reads an empty list as "every tensor"):
        # the checkpoint is still opened, so a missing or invalid one raises as any load's does.
        _hbmio._tensor_bytes(path, [])
        return {}
    if group is not None:
        if share:
            raise ValueError("share=True maps the resident cache's copies into this process's GPU: not with group= "
                             "(load each rank's part with share=True on its own)")
        if framework != "torch":
            raise ValueError("group= loads need framework='torch' (torch.distributed moves the data)")
        from . import distributed
        # The device (each rank's own) is checked in there, where a rank's failure reaches every
        # rank: one raising here would leave the others waiting in a collective.
        return distributed.load(path, device, group, placement, shard_map, backend, verify, names, report)
    device = _device_text(device)
    if framework == "numpy" and device != "cpu":
        raise ValueError(f"framework='numpy' loads into host memory only, not {device!r}")
    if share:
        if mmap or not (device == "cuda" or device.startswith("cuda:")) or cache is False or cache == "off" or _is_url(path):
            raise ValueError("share=True maps the resident cache's copies in GPU memory: device='cuda:N', a local "
                             f"checkpoint, the cache not turned off, without mmap (got device={device!r}, cache={cache!r})")
        _require_gpu(device, path)
        torch = _torch() if framework == "torch" else None
        total = _hbmio._tensor_bytes(path, names) if progress else 0
        with _ProgressBar(total, progress) as bar:
            if torch is not None:
                views = _hbmio._load_views(path, device, backend=backend, verify=verify, names=names, progress=bar.counter,
                                           report=report, cache=_cache_text(cache), share=True)
                return _torch_views(torch, *views, path)
            return _hbmio.load_file(path, device, backend=backend, verify=verify, names=names, progress=bar.counter,
                                    report=report, cache=_cache_text(cache), share=True)
    if mmap:
        if device != "cpu" or framework not in ("torch", "numpy") or verify or progress or _is_url(path):
            raise ValueError("mmap=True maps local files into host memory: device='cpu', framework 'torch' or 'numpy', "
                             "without verify= (checksums need every byte read) or progress=")
        from . import _mapped
        return _mapped.load(path, framework, names)
    _require_gpu(device, path)
    torch = _torch() if framework == "torch" else None
    if torch is not None:
        dev = _torch_target(torch, device)  # None for "pinned", which torch does not name
        if dev is not None and dev.type == "cuda":
            out = _load_torch_into(torch, path, dev, backend, verify, names, progress, report, _cache_text(cache))
            if out is not None:
                return out
        if dev is not None:
            device = "cpu" if dev.type == "cpu" else str(dev)
    total = _hbmio._tensor_bytes(path, names) if progress else 0
    with _ProgressBar(total, progress) as bar:
        arrays = _hbmio.load_file(path, device, backend=backend, verify=verify, names=names, progress=bar.counter,
                                  report=report, cache=_cache_text(cache))
    if framework == "torch":
        # One import per tensor: each has a storage of its own bytes, as the reference's do (views of
        # one import were 2 ms faster on 3,072 tensors, but torch.save of one of them wrote the
        # whole allocation, and safetensors' save_model refused a model assigned from them).
        return {name: torch.from_dlpack(array) for name, array in arrays.items()}
    if framework == "numpy":
        import numpy as np
        out = {}
        for name, array in arrays.items():
            try:
                out[name] = np.from_dlpack(array)
            except (TypeError, BufferError, ValueError, RuntimeError) as e:
                # A dtype NumPy lacks (bfloat16, float8, float4): refused as the reference's NumPy
                # mode refuses it (see _dtypes.py), the header telling which dtype it was. Any other
                # failure (NumPy's "array is too big" for a shape past its bounds) is NumPy's own.
                from ._dtypes import numpy_refusal
                from ._lazy import _NUMPY_DTYPES
                dtype = next((d for n, d, *_ in _hbmio.SafeOpen(path, cache="off")._entries() if n == name), None)
                if dtype in _NUMPY_DTYPES:
                    raise
                raise (numpy_refusal(name, dtype, path) if dtype else TypeError(f"tensor {name}: {e}")) from e
        return out
    return arrays


def open(path, framework="auto", device="cpu", *, backend=None, readahead=None, mmap=False, cache=None):  # noqa: A001 - safe_open's counterpart
    """Opens a checkpoint (a file, a sharded index or a directory) for access a tensor at a time,
    like safetensors.safe_open(path, framework, device):

        with hbmio.open("model.safetensors", framework="pt", device="cuda:0") as f:
            for name in f.offset_keys():          # file order: read ahead in batches
                state[name] = f.get_tensor(name)
            head = f.get_slice("lm_head.weight")[:1024]   # reads only those rows

    keys() (sorted), offset_keys() (file order), metadata() (None without one), get_tensor(name),
    get_slice(name) (get_shape(), get_dtype(), [ints, slices, ...]), get_tensors(). Headers are
    parsed and files opened once; an unknown name raises KeyError naming it. framework: "auto",
    "torch"/"pt", "numpy"/"np" or "dlpack", device and backend (None: $HBMIO_BACKEND, else
    "auto") as for load_file. readahead: bytes of tensors that a walk in file order may read
    before they are asked for (default 1 GiB, HBMIO_READAHEAD; 0 turns it off); see
    hbmio/_lazy.py. mmap=True (device "cpu"): tensors and slices are views of a private mapping
    of the file, as safetensors' own safe_open hands them out on the CPU: returned at once, read
    on first touch, and (as there) a file truncated while they live makes touching them fail;
    mmap=False (default) reads each into memory of its own. After the `with` block, keys(),
    get_tensor(), get_slice(), metadata() and the rest raise hbmio.ClosedError ("File is closed",
    as safe_open raises; it is also a safetensors.SafetensorError where safetensors is installed).
    cache: as load_file's, asked once here for every file (mmap=True maps the files themselves)."""
    return SafeOpen(path, framework, device, backend=backend, readahead=readahead, mmap=mmap, cache=cache)


def _nbytes(array) -> int:
    nbytes = getattr(array, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return memoryview(array).nbytes
    except TypeError:
        return 0


def read_into(path, array, offset=0, *, backend=None, progress=False):
    """Reads bytes [offset, offset + array.nbytes) of a file into `array`: any writable
    C-contiguous array with __dlpack__ or the buffer protocol, on the host or a CUDA device. A
    range past the end of the file raises hbmio.Error. backend=None: $HBMIO_BACKEND, else "auto".
    Returns {bytes, seconds, gib_per_second, backend, bytes_direct, note, paths} (paths: the way
    the file's bytes took and why, as load_file's report). The GIL is released during the read."""
    backend = _backend(backend)
    with _ProgressBar(_nbytes(array) if progress else 0, progress) as bar:
        return _hbmio._read_into(_os.fspath(path), array, offset, backend=backend, progress=bar.counter)


def write_from(path, array, offset=0, *, backend=None, sync=True):
    """Writes the bytes of `array` (C-contiguous, __dlpack__ or the buffer protocol, host or CUDA)
    into a file at `offset`, creating the file if it is missing and keeping its other bytes;
    sync=True fsyncs before returning. Not crash-safe like save_file: it writes in place.
    backend=None: $HBMIO_BACKEND, else "auto". Returns {bytes, seconds, gib_per_second, backend,
    bytes_direct, note, paths}, as read_into."""
    return _hbmio._write_from(_os.fspath(path), array, offset, backend=_backend(backend), sync=sync)


def _parse_size(size) -> int:
    """Bytes: an int, or text read by the hbmio command's own parser (_hbmio.parse_size, that is
    hbmio::parse_size in C++), so that max_shard_size="5GB" or HBMIO_READAHEAD=1GiB mean in Python what they mean on
    the command line. ValueError for anything else (negative, a float, text it refuses)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 0:
            raise ValueError(f"a size cannot be negative: {size}")
        return size
    if isinstance(size, str):
        return _hbmio.parse_size(size)
    raise ValueError(f"not a size: {size!r} (an int, or text like '5GB' or '2GiB')")


def _path_text(path, what) -> str:
    """`path` as str, or a TypeError saying what a path is: the extension's own would list its
    signature, internal types included (bytes are refused, as safetensors refuses them)."""
    text = _os.fspath(path) if isinstance(path, (str, _os.PathLike)) else None
    if not isinstance(text, str):
        raise TypeError(f"{what}: the path must be a str or an os.PathLike (such as pathlib.Path), "
                        f"not {type(path).__name__}" + (" (decode bytes first: path.decode())" if isinstance(path, bytes) else ""))
    return text


def _expect_dict(value, what):
    """TypeError unless `value` is a mapping: dict() of a list would say only "dictionary update
    sequence element #0 has length 3; 2 is required"."""
    if not isinstance(value, _Mapping):
        raise TypeError(f"{what} must be a dict, not {type(value).__name__}")


def _check_metadata(metadata):
    """metadata as a dict of str to str (what the format holds), or None; TypeError naming the
    entry that is not."""
    if metadata is None:
        return None
    _expect_dict(metadata, "metadata ({str: str})")
    metadata = dict(metadata)
    for key, value in metadata.items():
        for what, text in (("key", key), ("value", value)):
            if not isinstance(text, str):
                raise TypeError(f"metadata maps str to str: the {what} {text!r} (of {key!r}: {value!r}) is {type(text).__name__}, not str")
            if not _utf8(text):
                raise ValueError(f"metadata maps str to str: the {what} {text!r} (of {key!r}) is not encodable as UTF-8 "
                                 "(a lone surrogate), which the format's JSON header must be")
    return metadata


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _prepare_save(tensors, where) -> dict:
    """{name: array} checked as safetensors checks what it saves, before anything is written:
    names must be str (TypeError naming the key); torch tensors must be dense (ValueError), must not
    share memory (RuntimeError naming them, pointing to hbmio.torch.save_model; the library checks
    every array kind for that) and must be contiguous (ValueError naming the tensor: safetensors
    refuses a strided tensor rather than silently packing it). Arrays of other frameworks that
    are strided are copied into C order by the save."""
    where = _hbmio.shown_path(str(where))  # a URL's secrets stay out of messages
    _expect_dict(tensors, f"save to {where}: the tensors ({{name: tensor}})")
    tensors = dict(tensors)
    for key in tensors:
        if not isinstance(key, str):
            raise TypeError(f"save to {where}: tensor names must be str; the key {key!r} ({type(key).__name__}) is not")
        if not _utf8(key):
            raise ValueError(f"save to {where}: the tensor name {key!r} is not encodable as UTF-8 (a lone surrogate), "
                             "which the format's JSON header must be")
    # NumPy arrays in big-endian order ('>f4'): the format is little-endian and DLPack hands over
    # native order only, so they are saved as little-endian copies, as safetensors.numpy byteswaps
    # them (without this they were refused as "not an array").
    tensors = {name: t.astype(t.dtype.newbyteorder("<")) if getattr(getattr(t, "dtype", None), "byteorder", "") == ">" else t
               for name, t in tensors.items()}
    # Only torch tensors get torch's checks; torch is never imported for them (a torch tensor
    # exists only where torch is).
    torch = _sys.modules.get("torch")
    if torch is None or not any(isinstance(t, torch.Tensor) for t in tensors.values()):
        return tensors
    sparse = sorted(name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.layout != torch.strided)
    if sparse:
        raise ValueError(f"save to {where}: sparse tensors cannot be saved: {sparse}; make them dense first "
                         "(.to_dense(), which may make a much larger file)")
    # DLPack refuses tensors that require grad: the bytes are the same without the autograd record.
    tensors = {name: t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for name, t in tensors.items()}
    strided = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_contiguous()]
    if strided:
        # Tensors that share memory are reported first, as safetensors does: a strided tensor is
        # often a view of another one (a transpose of a tied weight).
        _hbmio._check_shared(tensors, where)
        raise ValueError(f"save to {where}: tensor {strided[0]!r} is not contiguous (its elements are not one "
                         "range in order), which safetensors refuses to save. If it is a view of another tensor, "
                         "save the whole tensor and slice it again after loading; otherwise save "
                         "the tensor's .contiguous()" + (f" (also not contiguous: {strided[1:]})" if strided[1:] else ""))
    return tensors


def save_file(tensors, path, metadata=None, *, checksums=True, backend=None, max_shard_size=None, progress=False,
              blocking=True, staging="pinned", pool_bytes=None, wait_if_busy=True, report=None):
    """Writes {name: array} as a safetensors file, crash-safe (an unnamed new file, fsync, rename,
    directory fsync): on any error the previous file at `path` is untouched and nothing of the new
    one is left. Ctrl-C (KeyboardInterrupt) stops the save before it publishes and removes what it
    wrote; a save that had published already finishes first. A process killed outright (SIGTERM,
    SIGKILL) leaves no partial file either where the file system has unnamed files (O_TMPFILE:
    ext4, XFS, btrfs, tmpfs); a sharded save's hidden directory is removed by the next save.

    Arrays: anything supporting DLPack (__dlpack__: torch, cupy, jax, hbmio's own) or the buffer
    protocol (NumPy, memoryview), on the host or a CUDA device. As safetensors.torch.save_file:
    names must be str (TypeError naming the key), and tensors that share memory are refused
    (RuntimeError naming them; hbmio.torch.save_model saves one of each group), as are torch
    tensors that are not contiguous (ValueError); strided arrays of other frameworks are copied.
    With checksums=True the XXH3-64 of each tensor goes into __metadata__ ("hbmio.xxh3.<name>").
    max_shard_size (bytes, or text like "5GB"/"2GiB", read as the hbmio command reads sizes):
    `path` is then a directory that receives a Hugging Face sharded checkpoint
    (model-0000K-of-0000N.safetensors and model.safetensors.index.json), each shard at most that
    many tensor bytes. backend=None: $HBMIO_BACKEND, else "auto".
    progress=True draws `done / total  (P%)  rate GiB/s` on stderr while the tensors are written.
    report={} (blocking saves) is filled as load_file's: bytes, seconds, backend, note, and per
    file written the way its bytes took and why ("paths").

    blocking=False: returns a SaveHandle as soon as every byte has been copied out of the arrays
    (the snapshot); the caller may then change or free them. Writing, checksums, fsync and the
    rename run in the background with the same guarantees; handle.result() waits and raises the
    save's error. staging="pinned" copies into a pool of page-locked host memory kept between
    saves (pool_bytes caps it: default a quarter of physical memory, at most 64 GiB; a larger
    state is copied as the writer drains the pool, and the call blocks for that long);
    staging="device" copies CUDA tensors into one spare device buffer instead (falls back to
    pinned without the room). One save per path at a time: another waits for it, or raises
    hbmio.Error (EBUSY) with wait_if_busy=False. An error nobody asked for is raised by the next
    save of the path; at exit, saves in flight are finished, and failures nobody saw are printed
    and make the exit status 1. Ctrl-C while the call blocks (copying a state larger than the
    pool, or waiting for an earlier save of the path) stops the save as it stops a blocking one:
    nothing is published and KeyboardInterrupt is raised (no handle is returned). A child of
    os.fork() has none of the parent's saves in flight (they go on in the parent only; it warns
    if there were some) and may save at once, to any path."""
    shard = 0 if max_shard_size is None else _parse_size(max_shard_size)
    if max_shard_size is not None and shard == 0:
        raise ValueError("max_shard_size must be at least 1 byte")
    path = _os.fspath(path)
    tensors = _prepare_save(tensors, path)
    metadata = _check_metadata(metadata)
    if not blocking:
        if progress:
            raise ValueError("progress=True draws a bar while the caller waits; with blocking=False nobody waits")
        if report is not None:
            raise ValueError("report= is filled when the save returns; with blocking=False use the handle's report()")
        _synchronize_cuda_streams(tensors)
        pool = 0 if pool_bytes is None else _parse_size(pool_bytes)
        return SaveHandle(_hbmio._save_file_async(tensors, path, metadata, checksums=checksums, backend=_backend(backend),
                                                  max_shard_size=shard, staging=staging, pool_bytes=pool,
                                                  wait_if_busy=wait_if_busy))
    # The bar's total: every array type save_file takes (torch, NumPy, CuPy, JAX, memoryview)
    # has nbytes.
    total = sum(int(getattr(t, "nbytes", 0)) for t in tensors.values()) if progress else 0
    with _ProgressBar(total, progress) as bar:
        _hbmio.save_file(tensors, path, metadata,
                         checksums=checksums, backend=_backend(backend), max_shard_size=shard, progress=bar.counter,
                         report=report)


def _synchronize_cuda_streams(tensors):
    # The snapshot copies with the CUDA runtime's own stream; work queued on the caller's current
    # torch stream (a step that writes the tensors) must be finished first, or the copy could take
    # bytes from before it. One synchronize per device involved.
    torch = _sys.modules.get("torch")  # the tensors are torch's only if torch is imported
    if torch is None:
        return
    devices = {t.device for t in tensors.values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


class SaveHandle:
    """A save running in the background (hbmio.save_file(..., blocking=False))."""

    __slots__ = ("_save",)

    def __init__(self, save):
        self._save = save

    @property
    def path(self) -> str:
        return self._save.path

    def done(self) -> bool:
        """True once the save is durable, or has failed."""
        return self._save.done()

    def result(self, timeout=None):
        """Waits until the save is durable (raises TimeoutError after `timeout` seconds) and
        raises its error: hbmio.Error naming the path and the step, as a synchronous save does.
        The previous file at the path is then untouched. timeout: seconds (int or float, inf
        meaning no limit, as None does); NaN is a ValueError (it would never compare as passed,
        so the wait would never end), a negative one waits no more than 0."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, _numbers.Real):
                raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
            timeout = float(timeout)
            if _math.isnan(timeout):
                raise ValueError(f"timeout must be a number of seconds or None, not NaN (the background save of {self.path})")
            timeout = max(timeout, 0.0)
        if not self._save._wait(timeout):
            raise TimeoutError(f"the background save of {self.path} is still running after {timeout} s")
        self._save._result()

    @property
    def report(self) -> dict:
        """snapshot_seconds (the call), stalled_seconds (of it, waiting for staging room or for an
        earlier save of the path), persist_seconds (call to durable; 0 while running),
        staged_bytes, staging ("pinned" or "device"), and paths: per file, the path its bytes took
        and why (as load_file's report=), empty until the save is durable."""
        return self._save._report()

    def __repr__(self):
        return f"<hbmio.SaveHandle {self.path!r} {'done' if self.done() else 'running'}>"


def _finish_saves():
    # Background saves still running at exit finish (nothing is left half-published); a failure
    # nobody asked about is said rather than lost, and the process exits with status 1, as it would
    # had the error been raised (a job runner must not take a lost checkpoint for success).
    failures = _hbmio._wait_for_all_saves()
    for failure in failures:
        print(f"hbmio: a background save failed and nobody waited for it: {failure}", file=_sys.stderr)
    if failures:
        # Python's exit status cannot be changed from an exit handler; the library's C exit hook
        # turns a status of 0 into 1 once Python has finished (every other exit handler has run
        # and the streams are flushed). A status already non-zero is kept.
        _hbmio._fail_exit_status()


_atexit.register(_finish_saves)  # after _hbmio._shutdown: atexit runs it first


def _after_fork_in_child():
    # The library gave this child empty registries and pools already (pthread_atfork in C++): the
    # parent's background saves have no thread here and go on in the parent only. Waiting for them
    # at exit or before another save of their path would hang forever, so the child has none;
    # it says so once, since a handle to one of them now raises instead of waiting.
    paths = _hbmio._saves_inherited_at_fork()
    if paths:
        import warnings
        warnings.warn(f"hbmio: this process was forked while {len(paths)} background save(s) were in flight "
                      f"({', '.join(paths)}); they go on in the parent only, and this process starts with none "
                      "(a handle to one of them raises hbmio.Error, ECHILD)", RuntimeWarning, stacklevel=2)


    # A multiprocessing worker started by fork ends with os._exit, past atexit: its background
    # saves would die with it, unfinished and unsaid. multiprocessing runs its finalizers first;
    # it clears them as the worker starts and then runs its after-fork hooks, so the finalizer is
    # registered from one of those.
    util = _sys.modules.get("multiprocessing.util")
    if util is not None:
        util.register_after_fork(_finish_saves, lambda _: util.Finalize(None, _finish_saves, exitpriority=0))


_os.register_at_fork(after_in_child=_after_fork_in_child)


def __getattr__(name):
    # hbmio.ClosedError, made at first use: its bases depend on whether safetensors is installed
    # (see _lazy._closed_error_type), and importing safetensors for it at every import of hbmio
    # would cost every user.
    if name == "ClosedError":
        from ._lazy import _closed_error_type
        return _closed_error_type()
    if name == "DtypeError":
        # Likewise made at first use by the binding (a TypeError, and a SafetensorError where
        # safetensors is installed): the type of the error it makes.
        return type(_hbmio._dtype_error(_errno.EINVAL, ""))
    raise AttributeError(f"module 'hbmio' has no attribute {name!r}")


from .integrations import use_in_transformers  # noqa: E402  (it imports from this module)
from ._stream import StateError, Stream, stream  # noqa: E402  (it imports from this module)
