"""hbmio.open(...).prefetch(plan, device=, threads=): safetensors 0.9's PrefetchLoader on hbmio.

A loader reads the planned tensors (whole, or a step-1 slice of rows of dimension 0) of an opened
checkpoint into the device in the background and hands each out once, by take(name) or by
iterating (name, tensor) pairs in readiness order. Only the planned bytes are read: a row slice
of a C-ordered tensor is one contiguous byte range.

How: every planned tensor gets its memory up front (it will all be on the device anyway): each
batch of up to _BATCH bytes one allocation, its tensors views of it laid out as in the file, so
a batch of many small tensors is one allocation and one engine request (as the reference's, an
allocation is freed once every tensor of it handed out is dropped and the loader is closed).
The reads are queued in file order, each batch as soon as its tensors exist, to one reader of the binding (hbmio::ReadQueue), which reads what is queued by then as one
engine request (so a plan reads at load_file's rate, without a pause per batch) and marks each
batch done as soon as its own bytes have landed (the engine tells each read as it lands): the
first tensors are handed out while the rest are still being read. `threads` is accepted for the reference's signature: hbmio's
engines bring their own workers (HBMIO_WORKERS), which is where the parallel reads happen.
A tensor handed out is complete on every stream: a read is told landed only once its copies
are done. close() (or the end of a `with` block) stops what has not started, waits for what
is being read, and frees every tensor not taken.
"""
from __future__ import annotations

import operator as _operator

_BATCH = 64 << 20


class TensorMeta:
    """A tensor's header entry, read without its data: dtype (the safetensors name, e.g. "F32"),
    shape and data_offsets (begin, end within the data section), as safetensors 0.9 gives them."""

    __slots__ = ("dtype", "shape", "data_offsets")

    def __init__(self, dtype, shape, data_offsets):
        self.dtype, self.shape, self.data_offsets = dtype, list(shape), tuple(data_offsets)

    def __repr__(self):
        return f"TensorMeta {{ dtype: {self.dtype!r}, shape: {self.shape}, data_offsets: {self.data_offsets} }}"

    def __eq__(self, other):
        return isinstance(other, TensorMeta) and (self.dtype, self.shape, self.data_offsets) == (
            other.dtype, other.shape, other.data_offsets)


def _rows(name, key, shape):
    """(start, stop) of a plan's slice over dimension 0 of `shape`; ValueError for what the
    reference refuses (a step other than 1, a slice of a 0-d tensor)."""
    if not isinstance(key, slice):
        from ._lazy import _slice_error  # also SafetensorError, as the reference's refusals are
        raise _slice_error(TypeError, f"prefetch plan for {name!r}: expected None or a slice of rows, got {type(key).__name__}",
                           family="Plan")
    if not shape:
        from ._lazy import _slice_error
        raise _slice_error(ValueError, f"cannot slice rows of the 0-d tensor {name}: a prefetch plan's slice needs rows",
                           family="Plan")
    if key.step not in (None, 1):
        from ._lazy import _slice_error
        raise _slice_error(ValueError, f"prefetch plan slices must have step 1, got {key.step!r} for {name}", family="Plan")
    start, stop, _ = key.indices(shape[0])
    return start, max(start, stop)


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def _batch_memory(target, batch):
    """One allocation for a batch's tensors, each a view of it, laid out in file order with no gap
    but what each dtype's alignment needs: whole tensors then lie in memory as in the file, so the
    binding reads the batch as one request rather than one per tensor, and one allocation replaces
    one per tensor (each costs microseconds on a GPU). Returns (the allocation, {name: tensor},
    the address of each tensor's bytes)."""
    torch = target.torch
    places, at = [], 0
    for _, _, dtype, _, _, nbytes in batch:
        at = -(-at // dtype.itemsize) * dtype.itemsize
        places.append(at)
        at += nbytes
    raw = torch.empty(max(-(-at // 16) * 16, 16), dtype=torch.uint8, device=target.dev)
    base = raw.data_ptr()
    views = {}  # dtype -> the allocation seen as that dtype
    strides = {}  # shape -> its C-order strides (a model repeats a few shapes thousands of times)
    made, addresses = {}, []
    for (_, name, dtype, shape, _, _), at in zip(batch, places):
        view = views.get(dtype)
        if view is None:
            view = views[dtype] = raw.view(dtype)
        key = tuple(shape)
        step = strides.get(key)
        if step is None:
            step = strides[key] = _contiguous_strides(shape)
        made[name] = view.as_strided(shape, step, at // dtype.itemsize)
        addresses.append(base + at)
    return raw, made, addresses


class PrefetchLoader:
    """See hbmio/_prefetch.py. Made by SafeOpen.prefetch()."""

    def __init__(self, owner, plan, device, backend):
        from ._lazy import _Target
        self._owner = owner
        entries = owner._entries_list
        if plan is None:
            plan = {name: None for name, *_ in entries}
        elif not isinstance(plan, dict):
            raise TypeError(f"prefetch plan: expected a dict {{name: None | slice}}, got {type(plan).__name__}")
        from ._dtypes import torch_shape
        target = _Target("torch", device)
        items = []  # (index, name, torch dtype, torch shape, byte offset in the tensor, bytes)
        for name, key in plan.items():
            i = owner._lookup(name)
            _, dtype, shape, nbytes = entries[i]
            # F4 as the reference gives it: float4_e2m1fn_x2, two values a byte (_dtypes.torch_shape).
            torch_dtype = getattr(target.torch, "float4_e2m1fn_x2", None) if dtype == "F4" else target.dtypes.get(dtype)
            if not target.ok or torch_dtype is None:
                raise TypeError(f"prefetch: tensor {name!r} has dtype {dtype}, which torch cannot represent here")
            if key is None:
                rows, start, size = list(shape), 0, nbytes
            else:
                a, b = _rows(name, key, shape)
                # Rows that do not start and end on whole bytes (F4's two values a byte, in a 1-D
                # tensor or an odd row length) cannot be read as a byte range.
                if shape[0] and ((a * nbytes) % shape[0] or (b * nbytes) % shape[0]):
                    raise ValueError(f"prefetch plan for {name!r}: rows {a}..{b} of a {dtype} tensor of shape {list(shape)} "
                                     "do not start and end on whole bytes")
                rows = [b - a] + list(shape[1:])
                start, size = (a * nbytes // shape[0], (b - a) * nbytes // shape[0]) if shape[0] else (0, 0)
            items.append((i, name, torch_dtype, torch_shape(name, dtype, rows, owner.path), start, size))
        items.sort(key=_operator.itemgetter(0))  # file order: the reads run forward through the file
        self._names = [it[1] for it in items]
        self._untaken = set(self._names)
        self._ready = {}        # name -> tensor read and not yet handed out
        self._batch_of = {}     # name -> batch number
        self._batches = []      # (reader, number, {name: tensor}) in push order; None once collected
        self._batch_names = []  # the names of each batch, in file order
        self._errors = {}       # batch number -> the error its read raised
        self._closed = False
        self._reader = owner._read_queue(backend)
        self._order = 0         # the next batch to collect when iterating
        batches, batch, total = [], [], 0
        for it in items:
            if batch and total + it[5] > _BATCH:
                batches.append(batch)
                batch, total = [], 0
            batch.append(it)
            total += it[5]
        if batch:
            batches.append(batch)
        # Each batch is queued as soon as its tensors exist: making thousands of tensors takes as
        # long as reading them, so the reads start with the first batch rather than after the
        # last one is made; the reader takes what has been queued by each time it starts a read.
        self._numbers = []
        for batch in batches:
            raw, made, addresses = _batch_memory(target, batch)
            for name in made:
                self._batch_of[name] = len(self._batches)
            self._batches.append(made)
            self._batch_names.append(list(made))
            target.before_reads()
            # The batch is one allocation (`raw`): its tensors adjacent in the file are one request.
            self._numbers.append(self._reader.push([it[0] for it in batch], addresses, target.location, raw,
                                                   [it[4] for it in batch], [it[5] for it in batch], one_allocation=True))

    def _collect(self, k):
        made = self._batches[k]
        if made is None:
            if k in self._errors:  # every tensor of a batch that failed raises its error
                raise self._errors[k]
            return
        self._batches[k] = None
        try:
            self._reader.wait(self._numbers[k])  # raises the read's error
        except BaseException as e:
            self._errors[k] = e
            raise
        self._ready.update(made)

    # --- the reference's interface ---------------------------------------------------------
    def take(self, name):
        """`name`'s tensor, waiting for its bytes if they have not landed yet; each tensor once."""
        self._check_open()
        if name not in self._untaken:
            known = name in self._batch_of
            raise KeyError(f"prefetch: tensor {name!r} " + ("was taken already" if known else "is not in this loader's plan"))
        self._collect(self._batch_of[name])
        self._untaken.discard(name)
        return self._ready.pop(name)

    def names(self):
        """The names this loader hands out, in file order."""
        return list(self._names)

    def __len__(self):
        return len(self._untaken)

    def __iter__(self):
        """(name, tensor) of every tensor not taken yet, as their batches land (in file order)."""
        while self._untaken and self._order < len(self._batches):
            self._check_open()
            k = self._order
            self._collect(k)
            for name in self._batch_names[k]:
                if name in self._untaken:
                    self._untaken.discard(name)
                    yield name, self._ready.pop(name)
            self._order += 1

    def close(self):
        """Stops the background load (waiting for the batch being read) and frees every tensor not
        taken yet; tensors handed out keep their memory."""
        self._reader = None  # dropping the reader stops the reads not started, waits for those in flight
        self._batches = [None] * len(self._batches)
        self._ready.clear()
        self._untaken.clear()
        self._closed = True

    def _check_open(self):
        if self._closed:
            raise ValueError("prefetch: the loader is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
