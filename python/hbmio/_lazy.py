"""hbmio.open: a checkpoint opened for access a tensor (or a slice) at a time, like
safetensors.safe_open, which is how transformers, vLLM and TGI load.

The headers are parsed and the files opened once (hbmio::OpenedCheckpoint). Each tensor gets
memory of its own (torch.empty / numpy.empty, so nothing returned keeps another tensor's memory
alive) and is read straight into it through a pooled engine.

Read-ahead: a caller that walks the tensors in file order (what every framework does) would pay
one engine round trip per tensor. When get_tensor asks for the tensor after the previous one, the
tensors from there on are read ahead in file order, in batches of half the read-ahead budget,
each one engine request, two queued at once to a reader thread of the binding (so the
next batch starts the moment one ends), while at most `readahead` bytes (default 1 GiB,
HBMIO_READAHEAD) of tensors not yet asked for exist; each tensor the walk takes makes room for
more. The caller's thread allocates each batch when it queues it (a Python thread doing so would
compete with the caller for the interpreter lock: measured, it made the walk slower). A walk
backwards is read ahead backwards, half the budget at a time. Any other order reads just the
tensor asked for and pauses the read-ahead. What was read ahead and is skipped is dropped when the
walk passes it, and everything read ahead is freed by close() (or the end of a `with` block).

Small walks: where everything from the tensor asked for to the end of the checkpoint is at most
_SMALL_WALK bytes, the walk's first get_tensor reads all of it in one request on the caller's
thread and starts no reader: a model of many small shards (transformers opens one SafeOpen per
shard) would otherwise pay a reader's start-up per shard for reads that take microseconds. With
backend "auto", such a read takes an idle started engine, or else posix (see _small_backend).
"""
from __future__ import annotations

import errno as _errno
import operator as _operator
import os as _os
import threading as _threading

from . import _hbmio
from ._mapped import _mapped_bytes

_SMALL_WALK = 64 << 20

# safetensors dtype -> NumPy dtype name (NumPy has no bfloat16 or float8).
_NUMPY_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64", "I64": "int64", "U64": "uint64",
    "C64": "complex64",
}
_SUB_BYTE = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _small_backend(backend: str) -> str:
    """The engine for a small read: "auto" starts an engine with registered bounce buffers (about
    0.2 s on the development VM, more where they are pinned for a GPU), far more than a few MiB
    take to read, so a small read takes a started one where one is idle and else posix."""
    if backend != "auto" or _hbmio._idle_engines().get("auto", 0) > 0:
        return backend
    return "posix"


def _readahead_budget(readahead) -> int:
    if readahead is None:
        return _hbmio._configured_readahead()  # HBMIO_READAHEAD, else 1 GiB (the library's table)
    from . import _parse_size
    return _parse_size(readahead) if isinstance(readahead, str) else int(readahead)


class _Target:
    """Where tensors of a SafeOpen go and how their memory is made: torch (CPU or CUDA) or NumPy.
    `None` from make() means the fast path cannot represent the dtype (the caller falls back)."""

    def __init__(self, framework: str, device):
        from . import _TORCH_DTYPES, _device_text, _torch, _torch_target
        self.framework = framework
        self.torch = _torch() if framework == "torch" else None
        self.dev = None
        self.ok = False
        self.location = "cpu"  # hbmio's name of the memory the arrays are made in
        if framework == "torch":
            self.dev = _torch_target(self.torch, _device_text(device))
            self.ok = self.dev is not None and self.dev.type in ("cpu", "cuda")
            if self.ok and self.dev.type == "cuda":
                self.location = f"cuda:{self.dev.index}"  # _torch_target names the index
            self.dtypes = {k: getattr(self.torch, v, None) for k, v in _TORCH_DTYPES.items()}
        elif framework == "numpy":
            import numpy as np
            self.np = np
            self.ok = _device_text(device).lower() == "cpu"
            self.dtypes = {k: np.dtype(v) for k, v in _NUMPY_DTYPES.items()}

    def can(self, dtype: str) -> bool:
        return self.ok and self.dtypes.get(dtype) is not None

    def make(self, dtype: str, shape, nbytes: int):
        """(array of `dtype` and `shape`, the array whose memory to read into): one allocation of
        the array itself (one call: this runs once per tensor of a walk), or for an empty array a
        byte of its own, so that the address is never null."""
        if nbytes == 0:
            if self.torch is not None:
                raw = self.torch.empty(1, dtype=self.torch.uint8, device=self.dev)
            else:
                raw = self.np.empty(1, dtype=self.np.uint8)
            return raw[:0].view(self.dtypes[dtype]).reshape(shape), raw
        if self.torch is not None:
            array = self.torch.empty(shape, dtype=self.dtypes[dtype], device=self.dev)
        else:
            array = self.np.empty(shape, dtype=self.dtypes[dtype])
        return array, array

    def address(self, raw) -> int:
        """Where an array from make() starts (what _read takes with `location`)."""
        return raw.data_ptr() if self.torch is not None else raw.ctypes.data

    def before_reads(self):
        # PyTorch's caching allocator may hand out a block that work still queued on the current
        # stream frees; hbmio copies on streams of its own, so that work must finish first.
        if self.torch is not None and self.dev.type == "cuda":
            self.torch.cuda.current_stream(self.dev).synchronize()


class SafeOpen(_hbmio.SafeOpen):
    """A checkpoint opened for lazy, per-tensor loads, like safetensors.safe_open: keys(),
    offset_keys(), metadata(), get_tensor(name), get_slice(name)[...], get_tensors(); a
    context manager. See hbmio.open."""

    def __init__(self, path, framework="auto", device="cpu", *, backend=None, readahead=None, mmap=False, cache=None):
        from . import _backend, _cache_text, _device_text, _framework, _require_gpu
        path = _os.fspath(path)
        # Bad arguments fail here, not at the first get_tensor: a framework or device form hbmio
        # does not know (ValueError), a GPU this machine lacks (hbmio.Error).
        self._resolved = _framework(framework)
        _require_gpu(_device_text(device), path)
        super().__init__(path, cache=_cache_text(cache))
        self._framework = framework
        self._device = device
        self._backend = _backend(backend)  # $HBMIO_BACKEND as it is at open()
        self._closed = False
        self._budget = max(0, _readahead_budget(readahead))
        self._entries_list = self._entries()  # (name, dtype, shape, bytes) in file order
        self._index = {e[0]: i for i, e in enumerate(self._entries_list)}
        self._target = None   # made at the first get_tensor (imports torch/numpy then)
        self._ahead = None    # _ReadAhead of a walk in file order
        self._slices = None   # _ReadAhead of a walk of slices, each taking the same part of its tensor
        self._last_rows = None  # (index, start, stop) of the last slice that was a range of rows
        self._ready = {}      # index -> tensor read ahead backwards and not yet asked for
        self._next = 0        # the index a walk in file order asks for next
        # Frameworks read one handle from several threads (transformers 5 materialises slices on a
        # pool of 4): the read-ahead state is changed under this lock.
        self._lock = _threading.RLock()
        # mmap=True on the CPU: tensors and slices are views of a private mapping of their file, as
        # safetensors' own safe_open hands them out (read on first touch; see _mapped_view).
        self._mmap = bool(mmap)
        self._maps = {}          # file index -> uint8 array over the whole mapping (None: not mappable)
        self._where = None     # (file index, byte offset) per tensor, fetched at the first mapping

    # --- safe_open's interface -------------------------------------------------------------
    def keys(self):
        """Tensor names, sorted (as safe_open's)."""
        self._check_open()
        return super().keys()

    def offset_keys(self):
        """Tensor names in file order."""
        self._check_open()
        return super().offset_keys()

    def metadata(self):
        """The __metadata__ map as the file's writer gave it, None without one. hbmio's own
        entries (checksums, "hbmio.*") are left out, as safetensors' readers never show keys
        the caller did not write: they are hbmio_metadata()."""
        self._check_open()
        full = super().metadata()
        if full is None:
            return None
        own = {k: v for k, v in full.items() if not k.startswith("hbmio.")}
        return own if own or len(own) == len(full) else None

    def hbmio_metadata(self):
        """hbmio's entries of __metadata__ (per-tensor checksums "hbmio.xxh3.NAME", the algorithm,
        the header's checksum); {} in a file without them."""
        self._check_open()
        return {k: v for k, v in (super().metadata() or {}).items() if k.startswith("hbmio.")}

    def get_tensor_meta(self, name):
        """`name`'s header entry without reading data (safetensors 0.9): .dtype, .shape,
        .data_offsets (within the data section of its file)."""
        self._check_open()
        from ._prefetch import TensorMeta
        i = self._lookup(name)
        _, dtype, shape, _ = self._entries_list[i]
        return TensorMeta(dtype, shape, self._data_offsets(i))

    def prefetch(self, plan=None, *, device=None, threads=8):
        """Loads the planned tensors into `device` (default: open()'s) in the background and
        returns a PrefetchLoader that hands each out once (take(name), or iterating (name,
        tensor) pairs as they land; names(); len(); close(); a context manager), as safetensors
        0.9's. plan: {name: None (whole) | slice of rows (step 1)}; None: every tensor whole.
        Reads only the planned bytes. framework torch; device "cpu" or CUDA. See hbmio/_prefetch.py."""
        self._check_open()
        if self._resolved != "torch":
            raise ValueError(f"prefetch needs framework='pt' (torch), not {self._framework!r}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"prefetch: threads must be a positive int, not {threads!r}")
        from ._prefetch import PrefetchLoader
        from . import _device_text, _require_gpu
        device = self._device if device is None else device
        _require_gpu(_device_text(device), self.path)
        return PrefetchLoader(self, plan, device, self._backend)

    def get_tensor(self, name, device=None, *, framework=None, backend=None, verify=False):
        """One tensor, on the device and in the framework given to open() (or those given here)."""
        self._check_open()
        return self._tensor(name, device, framework=framework, backend=backend, verify=verify)

    def _tensor(self, name, device=None, *, framework=None, backend=None, verify=False):
        i = self._lookup(name)
        own = (device is None or device == self._device) and (framework is None or framework == self._framework)
        if own and not verify:
            target = self._own_target()
            dtype = self._entries_list[i][1]
            if self._mmap:
                view = self._mapped_view(i, target)
                if view is not None:
                    return view
            if target.can(dtype):
                with self._lock:
                    return self._get(i, target, backend or self._backend)
        from . import load_file
        return load_file(self.path, self._device if device is None else device,
                         framework=self._framework if framework is None else framework,
                         backend=backend or self._backend, verify=verify, names=[name])[name]

    def get_slice(self, name):
        """A lazy view of one tensor: get_shape(), get_dtype(), and [...] (ints, slices, ...),
        reading only the bytes the slice needs. A slice taken inside the `with` block can still
        be read after it, as safetensors' can."""
        self._check_open()
        return _Slice(self, self._lookup(name))

    def get_tensors(self):
        """{name: tensor} of every tensor, read in file order (ahead, as a walk is), as safetensors'."""
        self._check_open()
        return {name: self._tensor(name) for name, *_ in self._entries_list}

    def close(self):
        """Frees what was read ahead (waiting for a read in flight). The SafeOpen stays usable;
        the end of a `with` block (__exit__) is what closes it."""
        with self._lock:
            self._close()

    def _close(self):
        for ahead in (self._ahead, self._slices):
            if ahead is not None:
                ahead.stop()
        self._ahead = self._slices = self._last_rows = None
        self._ready.clear()
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # As safe_open: after its `with` block the handle refuses every call ("File is closed").
        # transformers 5 calls __exit__ without having entered: the same end of use.
        with self._lock:
            self._close()
            self._closed = True
        return False

    def _check_open(self):
        if self._closed:
            raise _closed_error_type()(_errno.EBADF, f"File is closed: {_hbmio.shown_path(str(self.path))} was used after its `with` block")

    # --- internals --------------------------------------------------------------------------
    def _lookup(self, name) -> int:
        if not isinstance(name, str):  # the reference's TypeError, not a missing name
            raise TypeError(f"a tensor name is a str, not {name!r} ({type(name).__name__})")
        try:
            return self._index[name]
        except (KeyError, TypeError):
            raise _missing_tensor(name, self.path) from None

    def _mapped_view(self, i: int, target: _Target):
        """Tensor i as a view of a private (copy-on-write) mapping of its file, or None where it
        cannot be one: memory that is not the CPU's, a dtype the framework lacks, a file at a URL.
        The view keeps the mapping alive. As with safetensors' own safe_open, a file truncated while
        such views live makes touching them fail (SIGBUS); a file replaced by rename does not, as
        the mapping is of the file this handle opened (see hbmio/_mapped.py)."""
        _, dtype, shape, nbytes = self._entries_list[i]
        if target.location != "cpu" or not target.can(dtype) or dtype in _SUB_BYTE:
            return None
        with self._lock:
            if self._where is None:
                self._where = self._placements()
            f, offset = self._where[i]
            if f not in self._maps:
                self._maps[f] = self._map_file(f, target)
            base = self._maps[f]
        if base is None:
            return None
        if target.torch is not None:
            raw = _mapped_bytes(target.torch, base, offset, nbytes)  # a storage of its own, as load_file's
        else:
            raw = base[offset:offset + nbytes]
        element = self._ELEMENT.get(dtype, 1)
        if offset % element:
            raw = raw.clone() if target.torch is not None else raw.copy()  # views need aligned offsets
        return raw.view(target.dtypes[dtype]).reshape(shape)

    # Bytes per element where a view needs an aligned offset (every dtype the fast path maps).
    _ELEMENT = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}

    def _map_file(self, f: int, target: _Target):
        import mmap as _mmap_module
        fd = self._map_fd(f)
        if fd is None:
            return None
        try:
            # ACCESS_COPY: private pages, writable as torch.frombuffer wants, never written back.
            mapping = _mmap_module.mmap(fd, 0, access=_mmap_module.ACCESS_COPY)
        finally:
            _os.close(fd)  # the mapping holds the file
        if target.torch is not None:
            return mapping  # each tensor a frombuffer of its own bytes (_mapped_bytes)
        return target.np.frombuffer(mapping, dtype=target.np.uint8)

    def _own_target(self) -> _Target:
        if self._target is None:
            self._target = _Target(self._resolved, self._device)
        return self._target

    def _get(self, i: int, target: _Target, backend: str):
        # The tensor after the last one asked for, or one of the next few: threads that share a
        # walk (a pool materialising tensors in file order) ask slightly out of order. A walk
        # backwards (the one before the last) is read ahead backwards, in one batch at a time.
        sequential = self._next <= i < self._next + 4
        backwards = i == self._next - 2 and not sequential
        self._next = max(self._next, i + 1) if sequential else i + 1
        ahead = self._ahead
        if ahead is not None:
            if ahead.holds(i):
                return ahead.take(i, walk=sequential)
            if not sequential:
                ahead.pause()  # the walk stopped: read nothing more ahead until it resumes
        tensor = self._ready.pop(i, None)
        if tensor is not None:
            return tensor
        # Past its `with` block (a slice object kept from inside it reads on): nothing read ahead,
        # which nothing would free until the handle itself is collected.
        if sequential and self._budget > 0 and not self._closed and target.can(self._entries_list[i][1]):
            rest = self._small_rest(i, target)
            if rest is not None:  # the rest of a small checkpoint: one request, no reader thread
                made = self._read_now(rest, target, _small_backend(backend))
                tensor = made.pop(i)
                self._ready.update(made)
                return tensor
            # A walk in file order starts here (or moved past what was read ahead): read ahead from i.
            if ahead is not None:
                ahead.stop()
            self._ready.clear()
            self._ahead = _ReadAhead(self, i, target, backend)
            return self._ahead.take(i, walk=True)
        if backwards and self._budget > 0 and not self._closed:
            for k in [k for k in self._ready if k > i + 8]:
                del self._ready[k]
            batch = self._batch_back(i, target)
        else:
            batch = [i]
        made = self._read_now(batch, target, backend)
        tensor = made.pop(i)
        self._ready.update(made)
        return tensor

    def _small_rest(self, i: int, target: _Target):
        """Indices i.. to the end where they are all readable into `target`, not ready yet, and
        together at most _SMALL_WALK bytes (and the budget); else None."""
        if self._ahead is not None or self._ready:
            return None
        limit, total, rest = min(_SMALL_WALK, self._budget), 0, []
        for k in range(i, len(self._entries_list)):
            _, dtype, _, nbytes = self._entries_list[k]
            total += nbytes
            if total > limit or not target.can(dtype):
                return None
            rest.append(k)
        return rest

    def _rows_ahead(self, i: int, start: int, stop: int, target: _Target):
        """Rows [start, stop) of tensor i from a walk of slices read ahead, or None. A walk of
        slices that take the same part of each tensor in file order (tensor-parallel loading: rank
        r of t takes rows [r n / t, (r + 1) n / t) of every tensor) is read ahead like a walk of
        tensors, from the second such slice on; any other slice stops it."""
        rows = self._entries_list[i][2][0]
        ahead = self._slices
        if ahead is not None:
            if ahead.holds(i) and ahead.key(i) == (start, stop):
                return ahead.take(i, walk=True)
            ahead.stop()
            self._slices = None
        last, self._last_rows = self._last_rows, (i, start, stop)
        if self._budget <= 0 or last is None or self._closed:  # closed: as in _get
            return None
        j, a, b = last
        rows_j = self._entries_list[j][2][0]
        if not j < i <= j + 4 or a * rows != start * rows_j or b * rows != stop * rows_j:
            return None
        self._slices = _ReadAhead(self, i, target, self._backend, plan=_row_plan(self._entries_list, target, start, stop, rows))
        return self._slices.take(i, walk=True) if self._slices.holds(i) else None

    def _batch_back(self, first: int, target: _Target) -> list[int]:
        """`first`, then the tensors before it in file order that are not ready, up to half the budget."""
        batch, total = [first], self._entries_list[first][3]
        k = first - 1
        while k >= 0 and k not in self._ready:
            _, dtype, _, nbytes = self._entries_list[k]
            if not target.can(dtype) or total + nbytes > self._budget // 2:
                break
            batch.append(k)
            total += nbytes
            k -= 1
        return batch

    def _make(self, items, target):
        """Memory for reads of tensors: items (index, shape, bytes) -> ({index: array}, addresses)."""
        made, addresses = {}, []
        for k, shape, nbytes in items:
            made[k], raw = target.make(self._entries_list[k][1], shape, nbytes)
            addresses.append(target.address(raw))
        target.before_reads()
        return made, addresses

    def _read_now(self, batch, target, backend):
        made, addresses = self._make([(k, self._entries_list[k][2], self._entries_list[k][3]) for k in batch], target)
        self._read(batch, addresses, backend=backend, location=target.location)
        return made


class _ReadAhead:
    """The read-ahead of a walk in file order from tensor `start`: batches of the tensors after it
    (half the budget each, one engine request), two queued at once to a reader of the
    binding (one thread, one engine: the next batch starts the moment the one before it ends)
    while the caller works; what was read and not yet taken stays within the budget. The
    caller's thread allocates the batches and queues them (as it takes tensors), so no Python
    thread competes with it for the interpreter. Used under the SafeOpen's lock.

    `plan(k)` says what is read of tensor k: (shape, byte offset, bytes, key), or None where the
    walk cannot be predicted (the read-ahead stops before k). Whole tensors by default; a walk of
    slices reads the same rows of each tensor (see _row_plan), and `key` is what the caller
    checks the request against."""

    _IN_FLIGHT = 2

    def __init__(self, owner: "SafeOpen", start: int, target: _Target, backend: str, plan=None):
        self._owner, self._target = owner, target
        self._plan = plan or self._whole
        self._queue = owner._read_queue(backend)  # reads the batches in order, on the library's pool
        self._count = len(owner._entries_list)
        self._budget = owner._budget
        self._ready = {}      # index -> (array, key) read and not yet taken
        self._sizes = {}      # index -> bytes, of what is ready or in flight
        self._batches = []    # (indices, {index: array}, batch number in the queue) in flight, oldest first
        self._failed = {}     # index -> the error of its batch's read
        self._held = 0        # bytes of _ready and of the batches in flight
        self._next = start    # first index not yet in a batch
        self._floor = start   # nothing below this index is ready
        self._paused = False  # an access out of order: start no new batch until the walk resumes
        self._keys = {}       # index -> the key of its plan
        self._fill()

    def _whole(self, k):
        _, dtype, shape, nbytes = self._owner._entries_list[k]
        return (shape, 0, nbytes, None) if self._target.can(dtype) else None

    def holds(self, i: int) -> bool:
        return i in self._ready or i in self._failed or any(i in made for _, made, _ in self._batches)

    def key(self, i: int):
        """The key of what is held for tensor i (its plan's)."""
        return self._keys.get(i)

    def take(self, i: int, walk: bool):
        """What was read of tensor i (waiting for its batch). `walk`: the access continues the walk
        in file order, so what it passed is dropped and new batches start; otherwise the
        read-ahead pauses."""
        for n, (_, made, _) in enumerate(self._batches):
            if i in made:
                self._collect(n)
                break
        self._keys.pop(i, None)
        if i in self._failed:
            error = self._failed.pop(i)
            self._held -= self._sizes.pop(i)
            raise error
        array = self._ready.pop(i)
        self._held -= self._sizes.pop(i)
        self._paused = not walk
        if walk:
            # What the walk passed without asking for it is not asked for any more (_floor:
            # nothing below it is ready, so each take looks at a few indices only).
            for k in range(self._floor, i - 8):
                if self._ready.pop(k, None) is not None:
                    self._held -= self._sizes.pop(k)
                    self._keys.pop(k, None)
            self._floor = max(self._floor, i - 8)
            self._fill()
        return array

    def pause(self):
        self._paused = True

    def stop(self):
        """Frees what was read ahead (waiting for the batch being read)."""
        # Dropping the queue skips the batches not started and waits for the one being read.
        self._batches, self._queue = [], None
        self._ready.clear()
        self._failed.clear()
        self._sizes.clear()
        self._keys.clear()
        self._held = 0

    def _collect(self, n: int):
        indices, made, batch = self._batches.pop(n)
        try:
            self._queue.wait(batch)
        except Exception as e:  # given to whoever takes these tensors; no new batches after it
            self._failed.update(dict.fromkeys(indices, e))
            self._next = self._count
            return
        self._ready.update(made)

    def _fill(self):
        """Starts batches while fewer than _IN_FLIGHT are in flight and the budget has room."""
        target = self._target
        while len(self._batches) < self._IN_FLIGHT and not self._paused and self._next < self._count:
            first = self._plan(self._next)
            if first is None:
                self._next = self._count  # the walk cannot be predicted past here
                return
            # A batch starts only when a whole one fits beside what is held: batches cut to fit
            # the room left would shrink to a tensor each, and each batch is one engine request
            # with a fixed cost at its start and end (bench/RESULTS.md, "Lazy access").
            limit = self._budget // 2
            if self._held > 0 and self._held + max(limit, first[2]) > self._budget:
                return
            plans, total = [(self._next, first)], first[2]
            k = self._next + 1
            while k < self._count:
                p = self._plan(k)
                if p is None or total + p[2] > limit:
                    break
                plans.append((k, p))
                total += p[2]
                k += 1
            end = k
            made, addresses = self._owner._make([(j, p[0], p[2]) for j, p in plans], target)
            for j, (_, _, nbytes, key) in plans:
                self._sizes[j] = nbytes
                self._keys[j] = key
            indices = [j for j, _ in plans]
            number = self._queue.push(indices, addresses, target.location, list(made.values()),
                                      [p[1] for _, p in plans], [p[2] for _, p in plans])
            self._batches.append((indices, made, number))
            self._held += total
            self._next = end


def _row_range(dims, shape):
    """(start, stop) where a slice's dims select rows [start, stop) of dimension 0 (step 1) and all
    of every other dimension, else None."""
    if not dims:
        return None
    a, b, step, is_int = dims[0]
    if is_int or step != 1 or b <= a:
        return None
    for (x, y, st, one), n in zip(dims[1:], shape[1:]):
        if one or st != 1 or x != 0 or y != n:
            return None
    return a, b


def _row_plan(entries, target, a, b, rows):
    """A read-ahead plan for a walk of slices that takes rows [a, b) of `rows` of one tensor and
    the same part of each tensor after it: rows [a * n / rows, b * n / rows) of a tensor of n rows,
    where those are whole numbers (tensor-parallel shards: rank r of t takes rows [r n / t,
    (r + 1) n / t)); None for any other tensor, which ends the prediction."""
    def plan(k):
        _, dtype, shape, nbytes = entries[k]
        if not shape or not target.can(dtype) or shape[0] == 0:
            return None
        n = shape[0]
        if (a * n) % rows or (b * n) % rows:
            return None
        ak, bk = a * n // rows, b * n // rows
        row = nbytes // n
        return [bk - ak] + list(shape[1:]), ak * row, (bk - ak) * row, (ak, bk)
    return plan


from ._hbmio import Error  # noqa: E402  (after the class, which only names it at run time)

_closed_type = None
_closed_type_lock = _threading.Lock()


def _closed_error_type():
    """hbmio.ClosedError: what a SafeOpen raises after its `with` block. safe_open raises
    safetensors.SafetensorError there, so where safetensors is installed the error is also one of
    those, and code written for safe_open catches it unchanged; it is always an hbmio.Error.
    Made once, at first use (safetensors is not imported before it is needed)."""
    global _closed_type
    with _closed_type_lock:
        if _closed_type is None:
            bases = (Error,)
            try:
                from safetensors import SafetensorError
            except ImportError:  # not installed: nothing written for it can be running
                pass
            else:
                bases += (SafetensorError,)
            _closed_type = type("ClosedError", bases, {
                "__module__": "hbmio",
                "__doc__": "A SafeOpen used after its `with` block (hbmio.Error; also "
                           "safetensors.SafetensorError where safetensors is installed)."})
        return _closed_type


_slice_types = {}


def _slice_error(kind, message, family="Slice"):
    """An index get_slice refuses (or, with another `family`, a name or plan the reference
    refuses): an instance of `kind` (IndexError, TypeError, ValueError or KeyError: what hbmio
    raised before, and what NumPy and torch raise for such an index), of hbmio.Error (EINVAL) and,
    where safetensors is installed, of safetensors.SafetensorError, which safe_open raises for
    what it refuses: code written for either catches it unchanged. The classes are made once per
    family and kind, at first use (safetensors is not imported before it is needed)."""
    with _closed_type_lock:
        made = _slice_types.get((family, kind))
        if made is None:
            bases = (Error, kind)
            try:
                from safetensors import SafetensorError
            except ImportError:  # not installed: nothing written for it can be running
                pass
            else:
                bases += (SafetensorError,)
            made = _slice_types[(family, kind)] = type(f"{family}{kind.__name__}", bases, {
                "__module__": "hbmio",
                "__doc__": f"What hbmio refuses as safetensors does ({kind.__name__} and hbmio.Error; also "
                           "safetensors.SafetensorError where safetensors is installed)."})
    return made(_errno.EINVAL, message)


def _missing_tensor(name, path):
    """KeyError (what hbmio raised before), hbmio.Error and safetensors.SafetensorError (what
    safe_open raises), with the reference's words first."""
    return _slice_error(KeyError, f"File does not contain tensor {name}: no tensor named {name!r} in {_hbmio.shown_path(str(path))}",
                        family="Missing")


class _Slice:
    """safetensors' get_slice object: get_shape(), get_dtype(), and indexing.

    Indices mean what they mean to safe_open (safetensors 0.8) in the same framework. With
    framework "pt" that is torch's indexing of the whole tensor: ints, slices (bounds clamped)
    and '...' are read as the bytes they select; any other form torch takes (True/False, None,
    lists, tensors, several '...') is given to torch over the whole tensor, as safe_open does, so
    `[True]` on shape [6, 3] has shape [1, 6, 3] and `[False]` [0, 6, 3]. With "np" (and
    "dlpack") it is safe_open's own slicing: ints (a bool is 0 or 1) within the dimension, slices
    with a positive step whose start is inside it and whose stop is not past its end, one '...',
    and a bare [] (no rows); it refuses None, lists of indices, np.bool_ and the rest. A refused
    index raises an IndexError, TypeError or ValueError that is also an hbmio.Error and a
    safetensors.SafetensorError (see _slice_error). Two failures of safe_open's NumPy mode are
    not copied: a negative slice bound (OverflowError there) and a stop before the start
    (SystemError there) select what NumPy selects."""

    # A slice is read as one range per contiguous run of its bytes while runs are at least this
    # long (or the rows covering them would be much larger); shorter runs (a column of a matrix)
    # are read as the rows that cover them, and the slice is taken in memory.
    _MIN_RUN = 64 << 10
    _MAX_RUNS = 4096

    def __init__(self, owner: SafeOpen, index: int):
        self._owner = owner
        self._index = index
        self._name, self._dtype, self._shape, self._nbytes = owner._entries_list[index]

    def get_shape(self):
        return list(self._shape)

    def get_dtype(self):
        return self._dtype

    def __getitem__(self, key):
        owner = self._owner
        if type(key) is slice and owner._resolved == "torch" and not owner._mmap and self._shape and self._dtype != "F4" \
                and key.step in (None, 1):
            # Rows [a:b], a tensor-parallel rank's part of every tensor in a walk: straight to the
            # read-ahead of rows. The general path below (checks per dimension) costs as much per
            # call as the reference's whole get_slice, which a walk of thousands of small tensors
            # pays thousands of times (bench/RESULTS.md, "Whole-file prefetch and row plans").
            try:
                a, b, _ = key.indices(self._shape[0])  # torch's reading of [a:b]: bounds clamped
            except TypeError:
                a = None  # bounds that are not ints: the general path names the error
            if a is not None and 0 < b - a < self._shape[0]:
                target = owner._own_target()
                if target.can(self._dtype):
                    with owner._lock:
                        array = owner._rows_ahead(self._index, a, b, target)
                    if array is None:  # not (yet) a walk: the rows, one byte range
                        row = self._nbytes // self._shape[0]
                        array = self._read_runs(target, [b - a] + list(self._shape[1:]), [a * row], (b - a) * row)
                    return array
        if owner._mmap and (key is Ellipsis or _whole_slice(key) and self._shape) and owner._resolved == "torch":
            # The whole tensor of a mapped handle, as transformers 5 asks for every tensor: the
            # view itself, without the general path's per-dimension work (tens of microseconds a
            # tensor, which made a model of many small tensors load slower than stock).
            target = owner._own_target()
            if self._dtype != "F4" and target.can(self._dtype):
                view = owner._mapped_view(self._index, target)
                if view is not None:
                    return view
        if owner._resolved == "torch" and (self._dtype == "F4" or not _plain_torch_index(key, len(self._shape))):
            # F4: torch holds it packed (float4_e2m1fn_x2, the last dimension half the file's), so
            # the index is torch's on that tensor. (safetensors 0.8 and 0.9 raise RuntimeError for
            # every slice of F4 that is not empty: docs/python.md.)
            return self._torch_index(key)
        dims = _normalize(key, self._shape, self._name, strict=owner._resolved != "torch")
        target = owner._own_target()
        if not target.can(self._dtype):
            if owner._resolved == "numpy" or self._dtype in ("F6_E2M3", "F6_E3M2"):
                from ._dtypes import numpy_refusal, packed_refusal  # the reference's refusals
                raise (numpy_refusal if owner._resolved == "numpy" else packed_refusal)(self._name, self._dtype, owner.path)
            raise TypeError(f"tensor {self._name!r} ({self._dtype}): get_slice needs a dtype that "
                            f"{owner._resolved} represents on {owner._device!r}")
        out_shape = [len(range(a, b, s)) for a, b, s, is_int in dims if not is_int]
        if owner._mmap:
            view = owner._mapped_view(self._index, target)
            if view is not None:  # a view of the mapping, as safe_open's slices on the CPU are
                index = tuple(a if is_int else slice(a, b, s) for a, b, s, is_int in dims)
                # Contiguous, as the reference's slices are: a strided view would refuse .view().
                if target.torch is not None:
                    return view[index].contiguous()
                # The trailing Ellipsis keeps an index of ints a 0-d array of the mapping: NumPy's
                # scalar for it would make a BOOL byte such as 0x02 True (0x01).
                part = view[index + (Ellipsis,)]
                return part if part.flags.c_contiguous else part.copy(order="C")
        if all(a == 0 and b == n and s == 1 for (a, b, s, _), n in zip(dims, self._shape)):
            tensor = owner._tensor(self._name)  # the whole tensor: read ahead as a walk is
            return tensor.reshape(out_shape)
        if any(len(range(a, b, s)) == 0 for a, b, s, _ in dims):
            array, _ = target.make(self._dtype, out_shape, 0)
            return array
        rows = _row_range(dims, self._shape)
        if rows is not None:
            with owner._lock:
                array = owner._rows_ahead(self._index, rows[0], rows[1], target)
            if array is not None:
                return array
        item = self._nbytes // max(1, _prod(self._shape))
        runs, run_bytes = _runs(dims, self._shape, item)
        slice_bytes = len(runs) * run_bytes
        covering = _covering(dims, self._shape, item)
        if len(runs) <= self._MAX_RUNS and (run_bytes >= self._MIN_RUN or covering[1] > 8 * slice_bytes):
            return self._read_runs(target, out_shape, runs, run_bytes)
        # Short runs: the rows covering the slice, then the slice of them in memory (a copy).
        (first, length), rows = covering, dims[0]
        block_shape = [len(range(rows[0], rows[1]))] + list(self._shape[1:])
        block = self._read_runs(target, block_shape, [first], length)
        index = tuple((a - rows[0] if d == 0 else a) if is_int else slice(a - rows[0] if d == 0 else a, b - rows[0] if d == 0 else b, s)
                      for d, (a, b, s, is_int) in enumerate(dims))
        # (The trailing '...' keeps an all-int index an array: NumPy gives a scalar for block[i, j],
        # safe_open a 0-d array.)
        result = block[index + (Ellipsis,)]
        # A copy of its own: a view would keep all the covering rows alive.
        return result.clone(memory_format=target.torch.contiguous_format) if target.torch is not None else result.copy()

    def _read_runs(self, target, shape, offsets, run_bytes):
        """A new array of `shape` holding the runs of `run_bytes` at `offsets` of this tensor, one
        after another."""
        owner = self._owner
        array, raw = target.make(self._dtype, shape, len(offsets) * run_bytes)
        target.before_reads()
        base = target.address(raw)
        owner._read([self._index] * len(offsets), [base + k * run_bytes for k in range(len(offsets))], offsets=offsets,
                    lengths=[run_bytes] * len(offsets), backend=owner._backend, location=target.location)
        return array

    def _torch_index(self, key):
        # An index form beyond ints, slices and one '...' (True/False, None, lists, tensors, ...):
        # safe_open's torch mode gives what torch gives for the whole tensor, errors included, so
        # hbmio does the same, reading the whole tensor (as safe_open does).
        tensor = self._owner._tensor(self._name)
        try:
            result = tensor[key]
        except (IndexError, TypeError, ValueError) as e:  # torch's refusal, as one of get_slice's
            kind = next(k for k in (IndexError, TypeError, ValueError) if isinstance(e, k))
            raise _slice_error(kind, f"tensor {self._name!r}: index {key!r}: {e}") from e
        # A copy of its own where it is a part: a view would keep the whole tensor alive.
        if result.numel() < tensor.numel():
            result = result.clone()
        return result


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


_INT64 = range(-(1 << 63), 1 << 63)


def _whole_slice(key) -> bool:
    """Whether `key` is [:] (compared bound by bound: a bound may be an array)."""
    return type(key) is slice and key.start is None and key.stop is None and key.step is None


def _plain_torch_index(key, ndim) -> bool:
    """Whether torch reads `key` as get_slice's own path does: ints (not bools, within int64),
    slices and at most one '...', no more of them than `ndim` (torch refuses more, as _normalize
    does). Anything else goes to torch itself (_Slice._torch_index)."""
    items = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in items) > 1:
        return False  # torch takes several
    for k in items:
        if k is Ellipsis or isinstance(k, slice):
            continue
        if isinstance(k, bool) or not isinstance(k, int) and type(k).__module__ != "numpy":
            return False
        try:
            if _operator.index(k) not in _INT64:
                return False
        except TypeError:  # np.bool_, floats: torch's error
            return False
    return True


def _normalize(key, shape, name, strict=True):
    """(start, stop, step, is_int) per dimension, as safetensors reads `key`. strict (NumPy mode):
    safe_open's own rules (see _Slice); otherwise (torch mode, given only ints, slices and '...')
    torch's: slice bounds are clamped. Refusals are _slice_error's."""
    if isinstance(key, list) and not key and strict:
        key = slice(0, 0)  # safe_open's NumPy mode reads a bare [] as no rows
    several = isinstance(key, tuple)
    if not several:
        key = (key,)
    # (By identity: an array in the index compares element-wise.)
    ellipses = [i for i, k in enumerate(key) if k is Ellipsis]
    if len(ellipses) > 1:
        raise _slice_error(IndexError, f"tensor {name!r}: an index can only have a single ellipsis ('...')")
    if ellipses:
        at = ellipses[0]
        key = key[:at] + (slice(None),) * max(0, len(shape) - len(key) + 1) + key[at + 1:]
    # safe_open's NumPy mode converts every slice (bounds, then step) before it looks at the shape:
    # a bad slice is named as such even where there are too many indices. torch counts the indices
    # of a tuple first (a lone slice it applies, bad or not).
    if not strict and several and len(key) > len(shape):
        raise _slice_error(IndexError, f"tensor {name!r}: too many indices ({len(key)}) for its {len(shape)} dimension(s)")
    for k in key:
        if isinstance(k, slice):
            for b in (k.start, k.stop, k.step):
                try:
                    b is None or _operator.index(b)
                except TypeError:
                    raise _slice_error(TypeError, f"tensor {name!r}: slice {k!r}: its bounds and step must be ints "
                                                  f"or None, not {type(b).__name__}") from None
            if k.step is not None and _operator.index(k.step) <= 0:
                raise _slice_error(ValueError, f"tensor {name!r}: slice {k!r}: its step must be positive")
    if len(key) > len(shape):
        raise _slice_error(IndexError, f"tensor {name!r}: too many indices ({len(key)}) for its {len(shape)} dimension(s)")
    given = len(key)  # safe_open checks the slices of the index (with '...' spelled out), not the rest
    if strict and any(isinstance(k, slice) and _negative_bound(k) for k in key):
        # safe_open's NumPy mode fails converting the index before it checks any slice of it: the
        # whole index is then read as NumPy reads it (see _Slice).
        given = 0
    key = key + (slice(None),) * (len(shape) - len(key))
    dims = []
    for d, (k, n) in enumerate(zip(key, shape)):
        if isinstance(k, slice):
            try:
                start, stop, step = k.indices(n)
            except TypeError as e:
                raise _slice_error(TypeError, f"tensor {name!r}: slice {k!r} of dimension {d}: {e}") from None
            except ValueError as e:  # a step of 0
                raise _slice_error(ValueError, f"tensor {name!r}: slice {k!r} of dimension {d}: {e}") from None
            if step <= 0:
                raise _slice_error(ValueError, f"tensor {name!r}: slice steps must be positive (dimension {d}: {k!r})")
            if strict and d < given and _strict_slice_refused(k, n):
                raise _slice_error(IndexError, f"tensor {name!r}: slice {_slice_text(k)} is out of bounds for dimension {d} "
                                               f"of size {n} (its start must be inside the dimension and its stop at most {n})")
            dims.append((start, max(start, stop), step, False))
            continue
        if strict and type(k).__module__ == "numpy" and type(k).__name__ == "bool":
            raise _slice_error(TypeError, f"tensor {name!r}: index {k!r} of dimension {d} is a NumPy bool; "
                                          "safe_open takes an int, a slice or '...'")
        try:
            i = _operator.index(k)
        except TypeError:
            what = "an int, a slice, '...' or a bare []" if strict else "an int, a slice or '...'"
            raise _slice_error(TypeError, f"tensor {name!r}: index {k!r} of dimension {d} is not {what}") from None
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise _slice_error(IndexError, f"tensor {name!r}: index {i} is out of bounds for dimension {d} of size {n}")
        dims.append((j, j + 1, 1, True))
    return dims


def _negative_bound(k: slice) -> bool:
    try:
        return any(b is not None and _operator.index(b) < 0 for b in (k.start, k.stop))
    except TypeError:
        return False  # refused as it is by slice.indices


def _strict_slice_refused(k: slice, n: int) -> bool:
    """safe_open's NumPy mode refuses a slice whose start is not inside the dimension or whose stop
    is past its end (it does not clamp). A negative bound is NumPy's (see _Slice)."""
    start = 0 if k.start is None else _operator.index(k.start)
    stop = n if k.stop is None else _operator.index(k.stop)
    if start < 0 or stop < 0:
        return False
    return start >= n or stop > n


def _slice_text(k: slice) -> str:
    text = ("" if k.start is None else str(k.start)) + ":" + ("" if k.stop is None else str(k.stop))
    return text + (f":{k.step}" if k.step is not None else "")


def _runs(dims, shape, item):
    """The byte offsets (within the tensor) of the slice's contiguous runs, in C order, and the
    length of each. The dimensions after the last partly selected one, d, are whole: a run is
    d's selected range times them (or one index of d times them, where d has a step), and there
    is one run per index of the dimensions before it."""
    stride = [item * _prod(shape[j + 1:]) for j in range(len(shape))]  # bytes per index of each dimension
    m = len(shape)
    while m > 0 and dims[m - 1][:3] == (0, shape[m - 1], 1):
        m -= 1
    if m == 0:
        return [0], item * _prod(shape)
    d = m - 1
    start, stop, step, _ = dims[d]
    if step == 1:
        run, outer, offsets = (stop - start) * stride[d], range(d), [start * stride[d]]
    else:
        run, outer, offsets = stride[d], range(d + 1), [0]
    for j in outer:
        a, b, st, _ = dims[j]
        offsets = [o + i * stride[j] for o in offsets for i in range(a, b, st)]
    return offsets, run


def _covering(dims, shape, item):
    """(offset, length) of the rows of dimension 0 that cover the slice."""
    row = item * _prod(shape[1:])
    start, stop, _, _ = dims[0]
    return start * row, (stop - start) * row
