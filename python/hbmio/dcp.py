"""hbmio as storage for PyTorch Distributed Checkpoint (torch.distributed.checkpoint, DCP).

    import torch.distributed.checkpoint as dcp
    import hbmio.dcp

    dcp.save(state_dict, storage_writer=hbmio.dcp.StorageWriter("ckpt/step100"))
    future = dcp.async_save(state_dict, storage_writer=hbmio.dcp.StorageWriter("ckpt/step100"))
    dcp.load(state_dict, storage_reader=hbmio.dcp.StorageReader("ckpt/step100"))

Each rank writes its part of the state (whole tensors, or its chunks of sharded ones: DTensor,
FSDP) as one safetensors file through hbmio.save_file: crash-safe, with per-tensor checksums,
CPU or CUDA tensors. When every rank's file is durable the coordinator publishes, each with an
atomic rename and a directory fsync: model.safetensors.index.json (a Hugging Face index of every
stored tensor, so hbmio.load_file(directory) and safetensors read the files) and then DCP's
.metadata. A crash at any point leaves the directory holding the complete previous checkpoint
or the complete new one: data files carry the save's id in their names and never replace the
previous save's files, which are removed only after the new .metadata is in place. (A crash
between the two renames leaves the index naming the new files and .metadata the old ones: each
reader sees a whole checkpoint, DCP the old and an index reader the new.) Saves of one directory
that overlap (a dcp.async_save not waited for before the next) publish one at a time (a lock on
the directory, across processes of the host): the save that started last is the checkpoint, and
one that finishes after it is dropped with a warning, its files removed. A save removes the files
of the checkpoint it replaced, and those of saves that never published (a crash) once they are a
day old; a save still running keeps its files.

dcp.async_save stages through the writer (DCP's AsyncStager protocol, torch 2.4 and later): the
call stalls for one copy of the rank's tensors into staging memory that hbmio keeps between saves
(page-locked where CUDA is present, so a GPU state leaves the device in one device-to-host copy),
and the upload thread writes the files from there. StorageWriter(staging="device") copies CUDA
tensors into a device buffer instead (a device-to-device copy) where the device has the room. See
StorageWriter for the bound on that memory and what falls back to an ordinary copy.

Names in the files: a whole tensor is stored under its fully qualified name; a chunk of a
sharded tensor under "<name>@<offset>,<offset>,..." (its offset in each dimension); values
that are not tensors (DCP's BYTE_IO items) as uint8 tensors listed in the file's metadata under
"hbmio.dcp.bytes".
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import threading
import time
import uuid
import warnings
import weakref
import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import hbmio

try:
    # DCP's staging protocol: dcp.async_save calls a storage writer that implements it to make
    # the "training-safe" copy of the state, instead of copying the state itself first.
    from torch.distributed.checkpoint.staging import AsyncStager as _AsyncStager
except ImportError:  # torch before 2.4: async_save always stages with its own copy
    _AsyncStager = None

__all__ = ["StorageWriter", "StorageReader", "release_staging"]

_METADATA = ".metadata"
_INDEX = "model.safetensors.index.json"
_BYTES_KEY = "hbmio.dcp.bytes"
# model-<rank + 1>-of-<world>-<save id>.safetensors: the pattern of the files a save writes, and
# of those it may remove once a newer save has published.
_DATA_FILE = re.compile(r"^model-\d{5}-of-\d{5}-[0-9a-f]{12}\.safetensors$")
# Temporaries of a save of this directory that a crash left behind (hbmio's own named temporaries
# of data files, where the file system has no O_TMPFILE, and those of _publish): the data files'
# names are never saved again, so nothing else would ever remove them.
_LEFT_BEHIND = re.compile(r"^\.(model-\d{5}-of-\d{5}-[0-9a-f]{12}\.safetensors|model\.safetensors\.index\.json|\.metadata)"
                          r"(\.hbmio-tmp-|~[0-9a-f]{16}\.hbmio-tmp-)")


# When each save started (time.time_ns() at its plan), in its index's metadata: of saves of one
# directory that overlap, the one that started last stays the checkpoint.
_STARTED_KEY = "hbmio.dcp.started_ns"
# Data files no published checkpoint names are a crashed save's once this old: a save in flight
# publishes within its own run, and a day is far past the slowest rank's lead over the others.
_ABANDONED_AFTER_S = 24 * 3600


class _DirectoryLock:
    """flock on the checkpoint directory: one save publishes (and cleans up) at a time, across the
    processes of this host."""

    def __init__(self, path):
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self):
        import fcntl
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self._fd)  # releases the lock
        return False


def _read_index(directory) -> dict:
    try:
        with open(os.path.join(directory, _INDEX), "rb") as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _age(path, now) -> float:
    try:
        return now - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _in_use(path) -> bool:
    """Whether a save holds the temporary (hbmio locks its temporaries while it writes them)."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _remove(directory, names):
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where one item of the checkpoint is: its file (relative to the directory) and its name there."""
    file: str
    name: str


@dataclasses.dataclass(frozen=True)
class _RankFile:
    """The file a rank writes, decided by the coordinator (prepare_global_plan)."""
    file: str


def _fsync_directory(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_directory_durably(path):
    # A directory made here is named in its parent only once the parent is fsynced: without it a
    # power cut after the save could lose the whole checkpoint directory.
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    _make_directory_durably(parent)
    try:
        os.mkdir(path)
    except FileExistsError:  # another rank made it meanwhile
        pass
    _fsync_directory(parent)


def _publish(directory, name, data: bytes):
    # A new file beside the old one, made durable, renamed over it, the rename made durable: the
    # name holds the old bytes or the new ones, whatever happens.
    tmp = os.path.join(directory, f".{name}.hbmio-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        _fsync_directory(directory)
    except OSError as e:
        raise OSError(e.errno, f"the new {name} is in place in {directory}, but the fsync of the directory failed "
                               f"({e.strerror}): whether it is durable is unknown") from e


def _checkpoint_path(current, checkpoint_id, who, call):
    # dcp.save/dcp.load's checkpoint_id, when given, names the directory instead of the constructor's path.
    path = os.fspath(checkpoint_id) if checkpoint_id is not None else current
    if path is None:
        raise ValueError(f"hbmio.dcp.{who} needs a path (or {call}'s checkpoint_id)")
    return path


def _stored_name(index: MetadataIndex, whole: bool) -> str:
    if whole or index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _unshared(tensors: dict) -> dict:
    # hbmio.save_file refuses tensors whose bytes overlap (so does safetensors); a state dict may
    # hold the same tensor under two names (tied weights). Later ones that overlap an earlier one
    # are copied; tensors that merely share a storage without overlapping (views of one flat
    # buffer) are not.
    spans = []
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            start = t.data_ptr()
            spans.append((t.device, start, start + t.numel() * t.element_size(), name))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    out = dict(tensors)
    end_of = {}
    for device, start, end, name in spans:
        key = str(device)
        if start < end_of.get(key, 0):
            out[name] = tensors[name].clone()
        else:
            end_of[key] = end
    return out


# Staging of dcp.async_save (StorageWriter.stage). Each staged tensor must be one contiguous
# tensor, since DCP's planner resolves every item to a tensor; save_file's pinned pool lends 64 MiB
# blocks that a tensor's bytes are streamed through, so it cannot hold them. The staging here is
# one contiguous slab per save instead, kept between saves and bounded by the same capacity.
_ALIGN = 256  # each staged tensor starts at a multiple of this, as tensors in hbmio's files do
_SMALL_GRAIN = 2 << 20  # slab sizes are rounded up to this, or to _LARGE_GRAIN from it up:
_LARGE_GRAIN = 64 << 20  # a state that grows a little keeps its slab (the pool's block size)


def _round_up(n, grain):
    return (n + grain - 1) // grain * grain


def _slab_bytes(need):
    return max(_SMALL_GRAIN, _round_up(need, _SMALL_GRAIN if need < _LARGE_GRAIN else _LARGE_GRAIN))


class _Slab:
    """Host memory for one save's staged tensors: a uint8 tensor, page-locked (cudaHostRegister)
    where CUDA is present, so that device-to-host copies into it run at the link's speed."""

    def __init__(self, nbytes):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.pinned = False
        if torch.cuda.is_available():
            # Registered rather than taken from torch's pinned allocator, which rounds a request up
            # to a power of two (8 GiB pinned for a 6 GiB state).
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0
            if not self.pinned:
                warnings.warn(f"hbmio.dcp: page-locking {nbytes} bytes of staging memory failed (CUDA error {int(err)}); "
                              "staging uses pageable memory, so device-to-host copies into it are slower", RuntimeWarning)

    def start(self):
        return self.tensor.data_ptr()

    def free(self):
        # Unregistered before the memory goes back to the allocator (which may hand the addresses
        # out again, and registering them again would then fail).
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None


class _StagingArena:
    """The process's staging slabs, shared by every StorageWriter (a DCP user makes a writer per
    save). A slab lent to a save is never lent again until that save has written its file (or its
    staged tensors are gone); a slab not lent is kept for the next save, up to the capacity."""

    def __init__(self):
        self._changed = threading.Condition()
        self._free = []        # slabs not lent
        self._lent = set()     # ids of the slabs lent
        self._allocated = 0    # bytes of every slab, lent or not
        self._in_use = 0       # bytes of the lent ones
        self._capacity = None  # bytes; None until first use

    def _capacity_locked(self):
        if self._capacity is None:
            # save_file's pool's capacity: a quarter of physical memory, at most 64 GiB.
            self._capacity = int(hbmio._hbmio._staging_pool()[0])
        return self._capacity

    def set_capacity(self, nbytes):
        with self._changed:
            self._capacity = int(nbytes)
            self._drop_free_locked(lambda: self._allocated > self._capacity)
            self._changed.notify_all()

    def stats(self):
        with self._changed:
            return {"capacity": self._capacity_locked(), "allocated": self._allocated, "in_use": self._in_use,
                    "slabs": len(self._free) + len(self._lent)}

    def _drop_free_locked(self, while_true):
        # The largest first: what needs room here usually needs much of it.
        self._free.sort(key=lambda slab: slab.nbytes)
        while self._free and while_true():
            slab = self._free.pop()
            self._allocated -= slab.nbytes
            slab.free()

    def acquire(self, need):
        """A slab of at least `need` bytes, waiting while slabs lent to saves in flight hold the
        room; None when `need` exceeds the capacity by itself."""
        with self._changed:
            while True:
                capacity = self._capacity_locked()
                if need > capacity:
                    return None
                fitting = [slab for slab in self._free if slab.nbytes >= need]
                if fitting:
                    slab = min(fitting, key=lambda s: s.nbytes)
                    self._free.remove(slab)
                    break
                size = min(_slab_bytes(need), capacity)
                # Slabs too small for this state make room for one that fits.
                self._drop_free_locked(lambda: self._allocated + size > capacity)
                if self._allocated + size <= capacity:
                    self._allocated += size  # counted before the lock is let go
                    try:
                        slab = _Slab(size)
                    except BaseException:
                        self._allocated -= size
                        raise
                    break
                # The room is lent to saves still writing: wait for one of them to finish, as a
                # background save waits for pool blocks.
                self._changed.wait(0.05)
            self._lent.add(id(slab))
            self._in_use += slab.nbytes
            return slab

    def give_back(self, slab):
        with self._changed:
            if id(slab) not in self._lent:
                return
            self._lent.discard(id(slab))
            self._in_use -= slab.nbytes
            if self._allocated <= self._capacity_locked():
                self._free.append(slab)
            else:  # the capacity shrank while it was lent
                self._allocated -= slab.nbytes
                slab.free()
            self._changed.notify_all()

    def release(self):
        with self._changed:
            dropped = len(self._free)
            self._drop_free_locked(lambda: True)
            return dropped


_arena = _StagingArena()


def _fresh_arena_in_child():
    # A child of os.fork() has none of the parent's saves in flight, so slabs lent to them would
    # never come back there; as save_file's pool, the child starts with an empty arena.
    global _arena
    _arena = _StagingArena()


os.register_at_fork(after_in_child=_fresh_arena_in_child)


def release_staging() -> int:
    """Frees the staging memory that dcp.async_save through hbmio.dcp.StorageWriter keeps between
    saves (slabs lent to saves still writing are kept); returns how many slabs were freed."""
    return _arena.release()


class _Lease:
    """The staging memory of one save: a slab of the arena (or none, where the state exceeds its
    capacity), and device buffers (staging="device"). Given back once, by whichever comes first:
    write_data having written the file, or the last staged tensor going away."""

    def __init__(self):
        self.slab = None
        self.device_buffers = []
        self.called_ns = None  # when the async save it stages for was called (StorageWriter.stage)
        self._returned = False
        self._lock = threading.Lock()

    def spans(self):
        out = []
        slab = self.slab  # give_back may clear it meanwhile (a finalizer, on another thread)
        if slab is not None:
            out.append((slab.start(), slab.start() + slab.nbytes))
        for buffer in list(self.device_buffers):
            out.append((buffer.data_ptr(), buffer.data_ptr() + buffer.numel()))
        return out

    def holds(self, tensor):
        ptr = tensor.data_ptr()
        return any(start <= ptr < end for start, end in self.spans())

    def give_back(self):
        with self._lock:
            if self._returned:
                return
            self._returned = True
        slab, self.slab = self.slab, None  # a lease given back holds nothing: its slab may stage the next save
        if slab is not None:
            _arena.give_back(slab)
        self.device_buffers = []  # back to torch's caching allocator, which reuses the blocks


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # its name before torch 2.5
        from torch.distributed._tensor import DTensor
    return DTensor


def _tensors_of(obj, out):
    """The tensors _walk gives to its on_tensor, in the same order (DTensors' local tensors)."""
    if isinstance(obj, _dtensor_type()):
        out.append(obj._local_tensor)
    elif _is_sharded_tensor(obj):
        pass
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors_of(v, out)
    return out


def _walk(obj, on_tensor):
    """`obj` with each tensor replaced by on_tensor(tensor) (DTensors by a DTensor of the same
    spec over on_tensor(local tensor)); containers rebuilt, other values deep-copied, as DCP's own
    staging does (a value the caller changes after async_save returned must not reach the file)."""
    DTensor = _dtensor_type()
    if isinstance(obj, DTensor):
        return DTensor(on_tensor(obj._local_tensor), obj._spec, requires_grad=False)
    if _is_sharded_tensor(obj):
        # FSDP1's ShardedTensor: staged as DCP's own stager does, by a copy of its own (not into
        # the staging slab).
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
        return _copy_state_dict({"t": obj}, _create_cpu_state_dict({"t": obj}))["t"]
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, on_tensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_walk(v, on_tensor) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    if isinstance(obj, (int, float, str, bytes)) or obj is None:
        return obj
    return copy.deepcopy(obj)


def _is_sharded_tensor(obj):
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:
        return False
    return isinstance(obj, ShardedTensor)


def _stageable(t):
    # What a slab can hold as a view: a dense tensor of a dtype with whole bytes per element.
    return t.layout == torch.strided and not t.is_quantized and t.dtype.itemsize > 0 and t.device.type != "meta"


def _stage_state(state_dict, staging):
    """The staged copy of `state_dict` and its lease (see StorageWriter.stage)."""
    # First pass: every tensor and where its copy goes.
    tensors = _tensors_of(state_dict, [])
    host_bytes, device_bytes = 0, {}
    place = []  # per tensor: ("host", offset) / (device, offset) / None (a copy of its own)
    for t in tensors:
        if not _stageable(t):
            place.append(None)
            continue
        nbytes = t.numel() * t.element_size()
        if staging == "device" and t.device.type == "cuda":
            at = device_bytes.get(t.device, 0)
            device_bytes[t.device] = _round_up(at + nbytes, _ALIGN)
            place.append((t.device, at))
        else:
            place.append(("host", host_bytes))
            host_bytes = _round_up(host_bytes + nbytes, _ALIGN)
    lease = _Lease()
    report = {"staging": "device" if device_bytes else "pinned", "staged_bytes": 0, "unpooled_bytes": 0}
    device_base = {}
    for device, nbytes in device_bytes.items():
        buffer = None
        try:
            free, _ = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if nbytes <= free + cached:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            buffer = None
        if buffer is None:
            # No room on the device: this device's tensors go to the host slab, as save_file's
            # device staging falls back to its pinned pool.
            for i, p in enumerate(place):
                if p is not None and p[0] == device:
                    place[i] = ("host", host_bytes)
                    host_bytes = _round_up(host_bytes + tensors[i].numel() * tensors[i].element_size(), _ALIGN)
            report["staging"] = "pinned"
            report["device_fallback"] = f"{device} did not have {nbytes} bytes free"
        else:
            lease.device_buffers.append(buffer)
            device_base[device] = buffer
    if host_bytes:
        lease.slab = _arena.acquire(host_bytes)
        if lease.slab is None:
            warnings.warn(f"hbmio.dcp: the state's {host_bytes} bytes exceed the staging capacity "
                          f"({_arena.stats()['capacity']} bytes, hbmio.dcp.StorageWriter(pool_bytes=...)): "
                          "this save stages into memory of its own, allocated for it and freed after it",
                          RuntimeWarning, stacklevel=3)
    # Second pass: the copies, in the same order.
    order = iter(range(len(tensors)))
    keep_alive = []

    def on_tensor(t):
        i = next(order)
        p = place[i]
        nbytes = t.numel() * t.element_size()
        if p is None:
            staged = t.detach().to("cpu", copy=True)
        else:
            where, offset = p
            if where == "host":
                base = lease.slab.tensor if lease.slab is not None else None
            else:
                base = device_base[where]
            if base is None:
                staged = torch.empty(t.shape, dtype=t.dtype)
                report["unpooled_bytes"] += nbytes
            else:
                staged = base[offset:offset + nbytes].view(t.dtype).view(t.shape)
            # Asynchronous from the device into page-locked memory; synchronized below.
            staged.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            report["staged_bytes"] += nbytes
        keep_alive.append(staged)
        return staged

    try:
        with torch.no_grad():
            staged_dict = _walk(state_dict, on_tensor)
        for device in {t.device for t in tensors if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()
    except BaseException:
        lease.give_back()  # nothing of this save will be written
        raise
    if keep_alive:
        # Every staged tensor holds the token: once the last of them is gone, the lease is given
        # back (write_data gives it back earlier, as soon as the file is written).
        token = _LeaseToken()
        weakref.finalize(token, lease.give_back)
        for staged in keep_alive:
            staged._hbmio_staging = token
    return staged_dict, lease, report


class _LeaseToken:
    """Held by each tensor of one staged state; its finalizer gives the save's lease back."""
    __slots__ = ("__weakref__",)


_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class StorageWriter(_StorageWriter, *((_AsyncStager,) if _AsyncStager is not None else ())):
    """Writes a DCP checkpoint as safetensors files through hbmio (see the module's text).

    path: the checkpoint's directory (created if needed; dcp.save's checkpoint_id replaces it).
    checksums: XXH3-64 of each tensor in its file (hbmio.StorageReader(verify=True) checks them).
    backend: hbmio's I/O path (None: $HBMIO_BACKEND, else "auto").

    dcp.async_save stages through this writer (DCP's AsyncStager: stage() returns the staged state
    and DCP's upload thread saves that). staging="pinned" (the default) copies every tensor of the
    rank's state into one slab of host memory, page-locked where CUDA is present, kept between
    saves for the next one (by any writer of the process) and bounded like save_file's pinned
    pool: pool_bytes caps it (default that pool's capacity: a quarter of physical memory, at most
    64 GiB; it is a capacity of its own, beside the pool's). A save waits for room while earlier
    saves still writing hold it; a state larger than the cap is copied into memory allocated for
    that save (a warning says so). staging="device" copies CUDA tensors into a buffer on their
    device (from torch's caching allocator, so later saves reuse its blocks) where the device has
    the room, else into the slab. The staged memory is given back once the rank's file is written.
    last_staging: what the last stage() did (staging, staged_bytes, unpooled_bytes, stage_seconds).
    Where torch has no AsyncStager (before 2.4), async_save stages with its own copy, as DCP does
    for any writer; staging and pool_bytes then do nothing."""

    # stage() returns once the copies are complete: nothing for async_save to wait for after it.
    _synchronize_after_execute = False

    def __init__(self, path=None, *, checksums=True, backend=None, staging="pinned", pool_bytes=None):
        super().__init__()
        # What one save needs from reset() to finish(): DCP runs each async save on a thread of its
        # own, from its reset() to its finish(), and a writer may serve overlapping async saves (to
        # other directories too), so that state is per thread, never the writer's.
        self._save = threading.local()
        self._path = None if path is None else os.fspath(path)
        self.checksums = checksums
        self.backend = backend
        if staging not in ("pinned", "device"):
            raise ValueError(f"staging must be 'pinned' or 'device', not {staging!r}")
        self.staging = staging
        if pool_bytes is not None:
            _arena.set_capacity(hbmio._parse_size(pool_bytes))
        if _AsyncStager is None and (staging != "pinned" or pool_bytes is not None):
            _warn_once("no_stager", f"hbmio.dcp: torch {torch.__version__} has no AsyncStager "
                                    "(torch.distributed.checkpoint.staging, torch 2.4 and later): dcp.async_save "
                                    "stages the state with its own copy, and staging/pool_bytes do nothing")
        self.last_staging = None
        self._leases = []  # of the saves staged through this writer and not yet written
        self.rank = 0
        self.is_coordinator = True

    def __getstate__(self):
        # A writer sent to another process (DCP's process-based async_save) takes its settings, not
        # this process's saves in flight or their staging.
        state = self.__dict__.copy()
        state["_leases"] = []
        state["_save"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._save = threading.local()

    @property
    def path(self):
        """The directory of the save running on this thread (its checkpoint_id), else the writer's."""
        return getattr(self._save, "path", self._path)

    @path.setter
    def path(self, value):
        self._path = None if value is None else os.fspath(value)

    @property
    def save_id(self):
        return getattr(self._save, "save_id", None)

    def stage(self, state_dict):
        """DCP's AsyncStager.stage: a copy of `state_dict` that changes made to it after this
        returns do not reach (tensors in hbmio's staging memory, other values deep-copied)."""
        called_ns = time.time_ns()  # an async save starts at its call (see finish)
        started = time.perf_counter()
        staged, lease, report = _stage_state(state_dict, self.staging)
        lease.called_ns = called_ns
        self._leases.append(lease)
        report["stage_seconds"] = time.perf_counter() - started
        self.last_staging = report
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns with the copies complete."""

    def close(self) -> None:
        """Nothing to free: the staging memory belongs to the process (hbmio.dcp.release_staging
        frees what no save holds)."""

    def reset(self, checkpoint_id=None) -> None:
        path = _checkpoint_path(self.path, checkpoint_id, "StorageWriter", "dcp.save")
        self._save.__dict__.clear()
        self._save.path = path

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        if not kwargs.get("use_collectives", True):
            raise ValueError("hbmio.dcp.StorageWriter publishes one checkpoint for all ranks: use_collectives=False "
                             "(a metadata file per rank) is not supported")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _make_directory_durably(self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One id for the whole save, chosen here and sent to every rank with its file name.
        save_id = self._save.save_id = uuid.uuid4().hex[:12]
        # When the save started, to order overlapping saves of the directory (finish): an async
        # save's call (its staging's, found in write_data), else now.
        self._save.started_ns = time.time_ns()
        world = len(plans)
        return [dataclasses.replace(plan, storage_data=_RankFile(f"model-{i + 1:05d}-of-{world:05d}-{save_id}.safetensors"))
                for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        file = plan.storage_data.file
        tensors, results, byte_items = {}, [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                name = _stored_name(item.index, True)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                byte_items.append(name)
            else:
                # A conjugate or negative view is a flag on memory that holds the other values: the
                # file gets the values (as torch's FileSystemWriter writes them), not the memory.
                tensor = data.detach().resolve_conj().resolve_neg()
                chunk = item.tensor_data.chunk
                whole = list(chunk.sizes) == list(item.tensor_data.size) and not any(chunk.offsets)
                name = _stored_name(item.index, whole)
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()
            if name in tensors:
                raise ValueError(f"two items of the checkpoint would be stored as {name!r} in {file}")
            tensors[name] = tensor
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=_Stored(file, name)))
        metadata = {_BYTES_KEY: json.dumps(sorted(byte_items))} if byte_items else None
        # This save's staging: the lease holding the staged state DCP's planner resolves items of
        # (another save's may still be writing).
        staged = getattr(planner, "state_dict", None)
        ours = [t for t in (_tensors_of(staged, []) if isinstance(staged, dict) else tensors.values())
                if isinstance(t, torch.Tensor) and t.numel() > 0]
        called = [lease.called_ns for lease in list(self._leases) if any(lease.holds(t) for t in ours)]
        if called:
            self._save.started_ns = min(called)
        try:
            hbmio.save_file(_unshared(tensors), os.path.join(self.path, file), metadata, checksums=self.checksums,
                            backend=self.backend)
        finally:
            self._give_back_staging(ours)
        future: Future = Future()
        future.set_result(results)
        return future

    def _give_back_staging(self, ours):
        # The staging of the save whose file was just written (the leases holding its staged
        # tensors, and any holding none), now free for the next save. Never another save's: its
        # persist may still be reading it.
        leases = list(self._leases)  # stage() may add one meanwhile, on the caller's thread
        mine = [lease for lease in leases if not lease.spans() or any(lease.holds(t) for t in ours)]
        for lease in mine:
            self._leases.remove(lease)
            lease.give_back()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Called on the coordinator once every rank's write_data has returned: every data file is
        # durable. The index first, DCP's .metadata last: the checkpoint is published by that rename.
        storage = {}
        weight_map = {}
        total = 0
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
                weight_map[r.storage_data.name] = r.storage_data.file
                total += r.size_in_bytes
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        started = getattr(self._save, "started_ns", None) or time.time_ns()
        index = {"metadata": {"total_size": total, _STARTED_KEY: started}, "weight_map": dict(sorted(weight_map.items()))}
        keep = set(weight_map.values())
        with _DirectoryLock(self.path):
            published = _read_index(self.path)
            published_meta = published.get("metadata")
            published_started = published_meta.get(_STARTED_KEY, 0) if isinstance(published_meta, dict) else 0
            if isinstance(published_started, int) and published_started > started:
                # A save that started after this one has published: it is the checkpoint.
                _remove(self.path, keep)
                _warn_once(("superseded", self.path),
                           f"hbmio.dcp: a save of {self.path} finished after a later save had published; the later one "
                           "is the checkpoint and this one's files were removed (overlapping saves of one directory)")
                return
            _publish(self.path, _INDEX, (json.dumps(index, indent=2) + "\n").encode())
            _publish(self.path, _METADATA, pickle.dumps(metadata))
            # The replaced checkpoint's files; files of saves that never published (a crash) once
            # they are old; temporaries a crash left, unless a save still holds them.
            replaced_map = published.get("weight_map")
            replaced = {f for f in replaced_map.values() if isinstance(f, str)} if isinstance(replaced_map, dict) else set()
            now = time.time()
            stale = []
            for entry in os.listdir(self.path):
                if entry in keep:
                    continue
                path = os.path.join(self.path, entry)
                if entry in replaced and _DATA_FILE.match(entry):
                    stale.append(entry)
                elif _DATA_FILE.match(entry) and _age(path, now) > _ABANDONED_AFTER_S:
                    stale.append(entry)
                elif _LEFT_BEHIND.match(entry) and not _in_use(path):
                    stale.append(entry)
            _remove(self.path, stale)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class StorageReader(_StorageReader):
    """Reads a DCP checkpoint that hbmio.dcp.StorageWriter wrote, through hbmio.open: each rank reads
    only the bytes of the chunks it asks for, straight into the device of the tensors it loads into.

    verify=True loads each stored tensor a rank needs whole and checks it against its stored
    checksum (and the file's header checksum) before it is used.

    Why verify defaults to False although StorageWriter's files carry checksums: a checksum covers
    a whole stored tensor, so checking it means reading the whole tensor, while a DCP load usually
    needs a part of each (a rank of a resharded load asks for its rows only): with N ranks each
    sharding a tensor, verifying reads N times the bytes the load needs, far beyond a cost worth
    paying on every load. The files are written crash-safe (a reader never sees a half-written
    one), so what verify adds is detection of corruption at rest; ask for it where storage is not
    trusted, or check a checkpoint once with `hbmio ckpt verify`."""

    def __init__(self, path=None, *, verify=False, backend=None):
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.verify = verify
        self.backend = backend
        self.storage_data = None

    def reset(self, checkpoint_id=None) -> None:
        self.path = _checkpoint_path(self.path, checkpoint_id, "StorageReader", "dcp.load")

    def read_metadata(self, *args, **kwargs) -> Metadata:
        where = os.path.join(self.path, _METADATA)
        try:
            with open(where, "rb") as f:
                metadata = pickle.load(f)
        except FileNotFoundError:
            message = f"{where}: no DCP metadata (not a checkpoint hbmio.dcp.StorageWriter finished)"
            # Some torch versions (2.11) catch this error, try a rank-local metadata file, and then
            # report only "metadata is None": the reason goes to the log as well.
            logging.getLogger("hbmio.dcp").error(message)
            raise FileNotFoundError(message) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"{self.path}: the checkpoint's metadata has no storage data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file = {}
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            per_file.setdefault(stored.file, []).append((item, stored))
        for file, items in per_file.items():
            path = os.path.join(self.path, file)
            # Read on the device of the first tensor loaded from the file. Without verify, opened
            # lazily: get_slice reads only the rows (or covering ranges) of the chunk this rank
            # asks for. With verify, the file's tensors are loaded whole, each checked against its
            # stored checksum, and the chunks cut from them.
            targets = [None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach() for item, _ in items]
            device = next((str(t.device) for t in targets if t is not None), "cpu")
            if self.verify:
                loaded = hbmio.load_file(path, device=device, framework="torch", backend=self.backend, verify=True,
                                         names=sorted({stored.name for _, stored in items}))
                tensor_of, slice_of = loaded.__getitem__, lambda name, index: loaded[name][index]
                opened = None
            else:
                opened = hbmio.open(path, framework="pt", device=device, backend=self.backend)
                tensor_of, slice_of = opened.get_tensor, lambda name, index: opened.get_slice(name)[index]
            try:
                for (item, stored), target in zip(items, targets):
                    if target is None:
                        planner.load_bytes(item, io.BytesIO(tensor_of(stored.name).cpu().numpy().tobytes()))
                        continue
                    index = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(item.storage_offsets, item.lengths))
                    source = slice_of(stored.name, index) if index else tensor_of(stored.name)
                    if target.size() != source.size():
                        raise ValueError(f"{path}: {stored.name}{list(index)} has shape {list(source.size())}, "
                                         f"the tensor it loads into {list(target.size())}")
                    target.copy_(source)
                    planner.commit_tensor(item, target)
            finally:
                if opened is not None:
                    opened.close()
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(checkpoint_id), _METADATA))
