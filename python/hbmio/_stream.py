"""hbmio.stream: training batches read from tensor shards into GPU (or host) memory ahead of the
step that uses them.

    for batch in hbmio.stream("data/*.npy", device="cuda", batch_size=4096, shuffle=True, seed=0, epochs=10):
        loss = model(batch)          # batch: a torch tensor on cuda:0, valid until the next batch

A thread of the library reads the next `read_ahead` batches through the engine (io_uring with
O_DIRECT and pinned bounce buffers, or GDS) into a fixed ring of `read_ahead + 1` batch buffers on
the device, while the caller computes on the current one; no worker processes, no pageable copies.
The ring is the stream's memory: nothing grows over an epoch.

A yielded batch is a view of a ring buffer: it stays valid until the next batch is asked for, after
which its buffer is read into again (once the work queued on the current CUDA stream by then has
finished, so kernels still reading it are safe). Keep a batch longer with `copy=True` (every
batch is a fresh tensor) or `batch.clone()`.

A stream resumes exactly: `stream.state_dict()` after any batch is a small dict of ints and strings
(torch.save and DCP's Stateful take it); `hbmio.stream(..., state=it)` or
`stream.load_state_dict(it)` continues with exactly the records not delivered yet, in the same
order on every rank, or, on another number of ranks, with the records no rank delivered divided
among the new ones (each once, none repeated).
"""

from __future__ import annotations

import atexit as _atexit
import errno as _errno
import glob as _glob
import operator as _operator
import os as _os
import sys as _sys
import weakref as _weakref

from . import _hbmio

# numpy type strings and torch dtypes -> the safetensors dtype names the library speaks.
_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16",
    "int32": "I32", "uint32": "U32", "float32": "F32", "complex64": "C64", "float64": "F64", "int64": "I64", "uint64": "U64",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
}


# Streams not closed yet: closed at exit, before the engines and the CUDA runtime go (atexit runs
# this before hbmio's _hbmio._shutdown, registered earlier).
_live: "_weakref.WeakSet[Stream]" = _weakref.WeakSet()


@_atexit.register
def _close_streams():
    for s in list(_live):
        s.close()


def _dtype_name(dtype) -> str:
    if dtype is None:
        raise ValueError("raw shards need dtype= (a numpy or torch dtype, or a name such as 'float32')")
    text = str(dtype)
    if text.startswith("torch."):  # torch.float32
        text = text[len("torch."):]
    elif isinstance(dtype, str) and text.upper() in _DTYPES.values():  # "F32", the library's own names
        return text.upper()
    elif text not in _DTYPES:  # np.float32, np.dtype("<f4"), "f4"
        try:
            import numpy as np
            text = np.dtype(dtype).name
        except (TypeError, ImportError):
            pass
    if text not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one hbmio streams ({', '.join(sorted(_DTYPES))})")
    return _DTYPES[text]


_U32 = 2**32 - 1
_U64 = 2**64 - 1
_MAX_READ_AHEAD = 4096  # the library's bound (kMaxReadAhead in src/ingest/stream.cpp)


class _OptionError(_hbmio.Error, ValueError):
    """A stream option out of its range: a ValueError, as a bad argument is, and an hbmio.Error
    (EINVAL), as the library raised for rank, world and read_ahead before Python checked them."""


def _int_option(name: str, value, lo: int, hi: int, what: str) -> int:
    """`value` as an int in [lo, hi]. TypeError naming the option for anything but an integer (int()
    would make 2.5 into 2 and parse "3"; a bool is a flag, not a count); ValueError naming it and
    its range for one outside it (the C++ call would refuse it with nanobind's signature dump)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int ({what}), not {type(value).__name__} {value!r}")
    v = _operator.index(value)
    if not lo <= v <= hi:
        raise _OptionError(_errno.EINVAL, f"{name} must be {what}, {lo} to {hi}, not {v}")
    return v


def _flag(name: str, value) -> bool:
    """True or False (1, 0 and NumPy's bools too); TypeError naming the option for anything else:
    bool("False") is True."""
    if isinstance(value, bool):
        return value
    if getattr(value, "shape", None) == () and str(getattr(value, "dtype", "")) == "bool":  # numpy.bool_
        return bool(value)
    if not isinstance(value, float) and hasattr(type(value), "__index__") and _operator.index(value) in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {type(value).__name__} {value!r}")


def _directory_files(text: str) -> list[str]:
    """The files of a shard directory, sorted. An entry that is not a file is refused by name, not
    skipped: a dangling symlink or a subdirectory would otherwise drop its shards unnoticed."""
    found = []
    for name in sorted(_os.listdir(text)):
        path = _os.path.join(text, name)
        if _os.path.isfile(path):
            found.append(path)
        elif _os.path.islink(path) and not _os.path.exists(path):
            raise FileNotFoundError(_errno.ENOENT, f"shard directory {text}: {name} is a dangling symlink (to "
                                    f"{_os.readlink(path)!r}, which does not exist); remove it or restore its target")
        elif _os.path.isdir(path):
            raise IsADirectoryError(_errno.EISDIR, f"shard directory {text}: {name} is a subdirectory; a shard directory "
                                    f"holds only shard files (a glob such as {_os.path.join(text, '*.npy')!r} picks some)")
        else:
            raise _OptionError(_errno.EINVAL, f"shard directory {text}: {name} is not a regular file")
    return found


def _files(files) -> list[str]:
    if isinstance(files, (str, bytes)) or hasattr(files, "__fspath__"):
        text = _os.fsdecode(_os.fspath(files))
        if _os.path.isdir(text):
            found = _directory_files(text)
        elif _glob.has_magic(text):
            found = sorted(_glob.glob(text))
        else:
            found = [text]
        if not found:
            raise FileNotFoundError(f"no shard files match {text!r}")
        return found
    out = [_os.fsdecode(_os.fspath(f)) for f in files]
    if not out:
        raise ValueError("no shard files given")
    return out


def _rank_world(rank, world, group):
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ValueError("give rank= and world= together (or group=)")
    else:
        dist = None
        if group is not None or "torch.distributed" in _sys.modules:
            import torch.distributed as dist
            if group is None and not dist.is_initialized():
                dist = None
        if dist is None:
            return 0, 1
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    rank = _int_option("rank", rank, 0, _U32 - 1, "this process's index among world")
    world = _int_option("world", world, 1, _U32, "the number of processes")
    if rank >= world:
        raise _OptionError(_errno.EINVAL, f"rank {rank} is not in a world of {world} (rank is 0 to world - 1)")
    return rank, world


_STATE_FORMAT = "hbmio.stream 1"
# A state whose ranks are in different epochs ("rank_epochs"): an hbmio that knows only format 1
# would read its rank_batches as counts of "epoch" and repeat records, so it must refuse it.
_STATE_FORMAT_EPOCHS = "hbmio.stream 2"
# key -> type of a state_dict's values (all ints and strings: torch.save, DCP and JSON take them).
_STATE_KEYS = {"format": str, "epoch": int, "world": int, "pool": str, "batches": int, "rank": int, "rank_batches": str,
               "batch_size": int, "seed": int, "shuffle": int, "drop_last": int, "shuffle_window": int, "fields": str,
               "fingerprint": str}


class StateError(_hbmio.Error, ValueError):
    """A stream state that does not belong to the stream it is loaded into (other shards, other
    options) or is not a stream state: a ValueError naming the mismatch, and an hbmio.Error (EINVAL)."""


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(":", ",").split(",")] if text else []
    except ValueError:
        raise StateError(_errno.EINVAL, f"the stream state's {what} {text!r} is not integers separated by commas") from None


def _state_value(v):
    # DCP may give back a 0-d tensor or a NumPy int for an int; strings stay strings.
    if not isinstance(v, (int, str)) and hasattr(v, "item") and tuple(getattr(v, "shape", (0,))) == ():
        v = v.item()
    return v


def _check_state(state) -> dict:
    if not isinstance(state, dict):
        raise StateError(_errno.EINVAL, f"a stream state is a dict (stream.state_dict()), not {type(state).__name__}")
    if state.get("format") not in (_STATE_FORMAT, _STATE_FORMAT_EPOCHS):
        raise StateError(_errno.EINVAL, f"not a stream state of this hbmio: its format is {state.get('format')!r}, not "
                         f"{_STATE_FORMAT!r} or {_STATE_FORMAT_EPOCHS!r}")
    out = {}
    for key, kind in _STATE_KEYS.items():
        value = _state_value(state.get(key))
        if key not in state or not isinstance(value, kind) or (kind is int and isinstance(value, str)):
            raise StateError(_errno.EINVAL, f"the stream state's {key!r} is {'missing' if key not in state else repr(value)}, "
                             f"not {'a string' if kind is str else 'an int'}")
        out[key] = int(value) if kind is int else value
    # Where ranks were in different epochs, each rank's (written since ranks could be; a state
    # without it has every rank in "epoch").
    epochs = _state_value(state.get("rank_epochs", ""))
    if not isinstance(epochs, str):
        raise StateError(_errno.EINVAL, f"the stream state's 'rank_epochs' is {epochs!r}, not a string")
    if (state["format"] == _STATE_FORMAT_EPOCHS) != bool(epochs):
        raise StateError(_errno.EINVAL, f"a stream state of format {state['format']!r} "
                         f"{'without' if not epochs else 'with'} rank_epochs")
    out["rank_epochs"] = epochs
    return out


def _merge_states(states) -> dict:
    """The states every rank of one world saved at one moment -> one, with every rank's batches
    (and, where ranks were in different epochs, every rank's epoch)."""
    states = [_check_state(s) for s in states]
    if not states:
        raise StateError(_errno.EINVAL, "no stream states given")
    first = states[0]
    # States that differ in nothing but the rank that saved them are one moment of ranks in
    # lockstep (any one resumes them all).
    same = lambda s: {k: v for k, v in s.items() if k != "rank"}  # noqa: E731
    if len(states) > 1 and all(same(s) == same(first) for s in states):
        return first
    world = first["world"]
    for s in states:
        for key in _STATE_KEYS:
            if key not in ("batches", "rank", "rank_batches", "epoch", "pool") and s[key] != first[key]:
                raise StateError(_errno.EINVAL, f"the stream states disagree on {key!r}: {first[key]!r} (rank {first['rank']}) "
                                 f"and {s[key]!r} (rank {s['rank']}): they are not of one moment of one stream")
        if not 0 <= s["rank"] < world:
            raise StateError(_errno.EINVAL, f"a stream state of rank {s['rank']} in a world of {world}")
    # Each rank's (epoch, batches, pool of that epoch), from its own state: a state saved before
    # its rank delivered anything since a resume gives every rank's, as it resumed.
    at = [None] * world
    for s in states:
        counts = _ints(s["rank_batches"], "rank_batches")
        epochs = _ints(s["rank_epochs"], "rank_epochs")
        k = s["rank"]
        if counts and len(counts) != world or epochs and len(epochs) != world:
            raise StateError(_errno.EINVAL, f"the stream state of rank {k} gives {len(counts)} ranks' batches and {len(epochs)} "
                             f"ranks' epochs for a world of {world}")
        epoch = epochs[k] if epochs else s["epoch"]
        mine = (epoch, counts[k] if counts else s["batches"], s["pool"] if epoch == s["epoch"] else "")
        if at[k] is not None and at[k] != mine:
            raise StateError(_errno.EINVAL, f"two stream states of rank {k} say different things: {at[k]} and {mine}")
        at[k] = mine
    if None in at:
        raise StateError(_errno.EINVAL, f"stream states of ranks {[r for r, c in enumerate(at) if c is not None]} of a "
                         f"world of {world}: give every rank's (or one, for ranks in lockstep)")
    low = min(e for e, _, _ in at)
    pools = {pool for e, _, pool in at if e == low}
    if len(pools) > 1 or any(pool for e, _, pool in at if e > low):
        raise StateError(_errno.EINVAL, f"the stream states disagree on 'pool' ({sorted(pools)}): they are not of one "
                         f"moment of one stream")
    mixed = any(e != low for e, _, _ in at)
    return dict(first, format=_STATE_FORMAT_EPOCHS if mixed else _STATE_FORMAT, epoch=low, pool=pools.pop(), batches=at[first["rank"]][1],
                rank_batches=",".join(str(c) for _, c, _ in at), rank_epochs=",".join(str(e) for e, _, _ in at) if mixed else "")


class Stream:
    """An iterable of training batches over shard files; see hbmio.stream.

    Also a DCP Stateful: state_dict() and load_state_dict() save and resume where it is."""

    def __init__(self, files, device="cpu", batch_size=None, *, batch_bytes=None, shuffle=False, seed=None,
                 shuffle_window=None, drop_last=False, epochs=1, read_ahead=2, format="auto", tensors=None, dtype=None,
                 record_shape=None, rank=None, world=None, group=None, framework="auto", copy=False, backend=None,
                 progress=False, state=None):
        from . import _backend, _device_text, _framework, _parse_size, _require_gpu, _torch
        if (batch_size is None) == (batch_bytes is None):
            raise ValueError("give batch_size (records) or batch_bytes, one of them")
        # Every option is checked here, by name and range, before the C++ call (whose refusals of
        # a negative or oversized int are nanobind's signature dump, and which truncates floats).
        if batch_size is not None:
            batch_size = _int_option("batch_size", batch_size, 1, _U64, "a positive number of records")
        if batch_bytes is not None:
            if isinstance(batch_bytes, str):
                batch_bytes = _parse_size(batch_bytes)
            batch_bytes = _int_option("batch_bytes", batch_bytes, 1, _U64, "a positive number of bytes, or text like '64MiB'")
        epochs = 0 if epochs is None else _int_option("epochs", epochs, 0, _U64, "a number of passes over the data (0: until closed)")
        seed = 0 if seed is None else _int_option("seed", seed, 0, _U64, "an unsigned 64-bit int")
        shuffle_window = 0 if shuffle_window is None else _int_option(
            "shuffle_window", shuffle_window, 0, _U64, "a number of records (0: 16 batches)")
        read_ahead = _int_option("read_ahead", read_ahead, 1, _MAX_READ_AHEAD, "a number of batches")
        shuffle, drop_last = _flag("shuffle", shuffle), _flag("drop_last", drop_last)
        copy, progress = _flag("copy", copy), _flag("progress", progress)
        record_shape = [_int_option(f"record_shape[{i}]", d, 0, _U64, "a dimension") for i, d in enumerate(record_shape or ())]
        self._files = _files(files)
        device = _device_text(device)
        _require_gpu(device)
        self._framework = _framework(framework)
        torch = _torch() if self._framework == "torch" else None
        if device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}" if torch is not None else "cuda:0"
        self._device = device
        self._torch = torch
        self._single = isinstance(tensors, str)  # one named tensor: batches are that tensor, not a dict
        names = [tensors] if self._single else list(tensors or [])
        fmt = format
        if fmt == "raw" and dtype is None:
            _dtype_name(None)  # says what to give
        self._rank, self._world = _rank_world(rank, world, group)
        self._args = (self._files, "pinned" if device == "pinned" else device, batch_size or 0, batch_bytes or 0, fmt, names,
                      _dtype_name(dtype) if dtype is not None else None, record_shape, read_ahead, drop_last, epochs, shuffle,
                      seed, shuffle_window, self._rank, self._world, _backend(backend))
        self._options = {"seed": seed, "shuffle": int(shuffle), "drop_last": int(drop_last), "shuffle_window": shuffle_window}
        self._copy = copy
        self._progress = progress
        self._held = False
        self._closed = False
        self._stream = None
        self.epoch = None  # the epoch and index (within the epoch, on this rank) of the last batch
        self.index = None
        self._open(None if state is None else self._resume_of(state))
        _live.add(self)

    def _open(self, resume) -> None:
        self._stream = None
        try:
            self._stream = _hbmio._Stream(*self._args, resume)
            if resume is not None:
                self._stream.sizes()  # waits for the headers: the state is checked against them
        except _hbmio.Error as e:
            if self._stream is not None:
                self._stream.close()
            text = str(e)
            if "the stream state" in text:  # the library's check against the headers: "... (the stream state ...)"
                text = text[text.index("the stream state"):]
                raise StateError(_errno.EINVAL, text[:-1] if text.endswith(")") else text) from None
            raise

    # ---- resuming ----
    def _resume_of(self, state) -> dict:
        s = _merge_states(state) if isinstance(state, (list, tuple)) else _check_state(state)
        for key, mine in self._options.items():  # named here, before the headers are read
            if s[key] != mine:
                raise StateError(_errno.EINVAL, f"the stream state is of {key}={s[key]!r}; this stream's is {key}={mine!r}")
        pool = _ints(s["pool"], "pool")
        counts = _ints(s["rank_batches"], "rank_batches") or [s["batches"]]
        epochs = _ints(s["rank_epochs"], "rank_epochs")
        if epochs and (len(epochs) != s["world"] or len(counts) != s["world"]):
            raise StateError(_errno.EINVAL, f"the stream state gives the epochs of {len(epochs)} ranks and the batches of "
                             f"{len(counts)} for a world of {s['world']}")
        if len(pool) % 2:
            raise StateError(_errno.EINVAL, f"the stream state's pool {s['pool']!r} is not pieces first:end")
        if s["world"] < 1 or len(counts) not in (1, s["world"]):
            raise StateError(_errno.EINVAL, f"the stream state gives the batches of {len(counts)} ranks for a world of "
                             f"{s['world']}")
        if min([s["epoch"], s["batch_size"], s["seed"], s["shuffle_window"], *pool, *counts, *epochs]) < 0:
            raise StateError(_errno.EINVAL, "the stream state holds a negative number")
        return {"epoch": s["epoch"], "pool": pool, "world": s["world"], "batches": counts, "epochs": epochs, "fingerprint": s["fingerprint"],
                "fields": s["fields"], "batch_records": s["batch_size"], "seed": s["seed"],
                "shuffle_window": s["shuffle_window"], "shuffle": bool(s["shuffle"]), "drop_last": bool(s["drop_last"])}

    def state_dict(self, rank_batches=None) -> dict:
        """Where this rank is, after the batches yielded so far (the one in hand included): a small
        dict of ints and strings (no record lists) for torch.save, DCP (a Stream is a Stateful) or
        JSON. Loaded by hbmio.stream(..., state=) or load_state_dict into a stream over the same
        shards (names, sizes and headers: its "fingerprint") with the same batch_size, shuffle,
        seed, shuffle_window and drop_last, on any number of ranks.

        "epoch" is the epoch in progress, "pool" the part of its record order divided among
        "world" ranks ("": all of it; after a resume on another number of ranks, the pieces no
        rank had delivered), "batches" how many batches this rank yielded of its part. The state
        is the same on every rank that yielded as many batches (ranks in lockstep, as DDP's are;
        "rank" says which saved it and is not used), so any one rank's state resumes them all
        (DCP keeps one). For ranks not in lockstep, give rank_batches: every rank's `progress`
        (all-gathered), or load the list of every rank's states. Without drop_last, a rank with a
        batch fewer goes on into the next epoch while the others finish theirs: such a state
        ("rank_epochs" says each rank's epoch) resumes on as many ranks as saved it.

        rank_batches: one entry per rank, each (epoch, batches) as `progress` gives it, or a
        number of batches of this rank's epoch. With (epoch, batches) entries, take the state
        on a rank in the earliest of their epochs."""
        if self._closed:
            raise ValueError("the stream is closed: take its state_dict before closing it")
        p = self._stream.position()
        counts, epochs, epoch = list(p["batches"]), list(p["epochs"]), p["epoch"]
        if rank_batches is not None:
            counts, epochs = [], []
            for i, c in enumerate(rank_batches):
                if isinstance(c, (tuple, list)) and len(c) == 2:
                    epochs.append(_int_option(f"rank_batches[{i}][0]", c[0], 0, _U64 - 1, "an epoch"))
                    c = c[1]
                counts.append(_int_option(f"rank_batches[{i}]", c, 0, _U64, "a number of batches, or (epoch, batches)"))
            if len(counts) != p["world"]:
                raise ValueError(f"rank_batches gives {len(counts)} ranks' batches; the epoch is divided among {p['world']}")
            if epochs and len(epochs) != len(counts):
                raise ValueError("rank_batches: give every rank's (epoch, batches), or every rank's batches")
            mine = self.progress[0]
            if epochs and mine != min(epochs):
                low = epochs.index(min(epochs))
                raise ValueError(f"rank_batches puts rank {low} in epoch {epochs[low]}, before this rank's {mine}: take "
                                 f"the state on rank {low}, or load the list of every rank's state_dict()")
            if epochs and epochs[self._rank] != mine:
                raise ValueError(f"rank_batches puts this rank ({self._rank}) in epoch {epochs[self._rank]}; it is in {mine}")
            # The state's epoch is the earliest given (this rank's): before this rank's first batch
            # after a resume, the position still gives the epoch and pool it resumed from, which
            # may be earlier; a later epoch is divided whole.
            epoch = min(epochs) if epochs else mine
            if epoch != p["epoch"]:
                p = dict(p, pool=[])
            epochs = epochs if epochs and len(set(epochs)) > 1 else []
        mine = counts[self._rank] if len(counts) > 1 and self._rank < len(counts) else counts[0]
        return {"format": _STATE_FORMAT_EPOCHS if epochs else _STATE_FORMAT, "epoch": epoch, "world": p["world"],
                "pool": ",".join(f"{a}:{b}" for a, b in zip(p["pool"][::2], p["pool"][1::2])),
                "batches": mine, "rank": self._rank, "rank_batches": ",".join(map(str, counts)) if len(counts) > 1 else "",
                "rank_epochs": ",".join(map(str, epochs)),
                "batch_size": p["batch_records"], **self._options, "fields": p["fields"], "fingerprint": p["fingerprint"]}

    @property
    def progress(self) -> tuple:
        """(epoch, batches): the epoch this rank is in and the batches it yielded of its part of
        it, the one in hand included; what state_dict(rank_batches=) takes from every rank."""
        if self._closed:
            raise ValueError("the stream is closed")
        p = self._stream.position()
        if p["epochs"]:
            return p["epochs"][self._rank], p["batches"][self._rank]
        return p["epoch"], p["batches"][self._rank] if len(p["batches"]) > 1 else p["batches"][0]

    def load_state_dict(self, state) -> None:
        """Continue from `state` (a state_dict() of this stream or of any rank of one over the same
        shards and options, or the list of every rank's states of one moment): the batches after
        it, from the next one asked for. The batch in hand goes back to the ring. StateError (a
        ValueError) names what does not match."""
        if self._closed:
            raise ValueError("the stream is closed")
        resume = self._resume_of(state)
        self._stream.close()
        self._held = False
        self.epoch = self.index = None
        try:
            self._open(resume)
        except BaseException:
            self._closed = True  # the old stream is gone and the new one refused the state
            raise

    # ---- what the shards hold ----
    @property
    def fields(self) -> list[tuple]:
        """[(name, dtype, record_shape)] of every batch ("" names the array of .npy/raw shards)."""
        return [(name, dtype, tuple(shape)) for name, dtype, shape, _ in self._stream.fields()]

    @property
    def records_per_epoch(self) -> int:
        """Records this rank reads per epoch."""
        return self._stream.sizes()[0]

    @property
    def batches_per_epoch(self) -> int:
        records, batch = self._stream.sizes()
        return (records + batch - 1) // batch

    @property
    def files(self) -> list[str]:
        return list(self._files)

    # ---- iteration ----
    def __iter__(self):
        return self

    def _cuda_stream(self) -> int:
        """The stream whose queued work may still read the batch given back: its buffer is read
        into again only after that work. Pinned batches: the current device's current stream (a
        copy to the GPU with non_blocking=True runs there later), where CUDA is in use at all."""
        if self._torch is None or not self._held:
            return 0
        if self._device.startswith("cuda"):
            return self._torch.cuda.current_stream(self._torch.device(self._device)).cuda_stream
        if self._device == "pinned" and self._torch.cuda.is_initialized():
            return self._torch.cuda.current_stream().cuda_stream
        return 0

    def _convert(self, arrays):
        if self._framework == "torch":
            out = [self._torch.from_dlpack(a) for a in arrays]
            if self._copy:
                out = [t.clone() for t in out]
        elif self._framework == "numpy":
            import numpy as np
            out = [np.array(a, copy=True) if self._copy else np.from_dlpack(a) for a in arrays]
        else:
            out = list(arrays)
        return out

    def __next__(self):
        if self._closed:
            raise StopIteration
        got = self._stream.next(self._cuda_stream())
        if got is None:
            self._held = False
            raise StopIteration
        self._held = True
        self.epoch, self.index, records, last, arrays = got
        out = self._convert(arrays)
        if last and self._progress:
            self._report(self._stream.epoch_stats()[-1])
        names = [f[0] for f in self._stream.fields()]
        if names == [""] or self._single:
            return out[0]
        return dict(zip(names, out))

    def _report(self, s: dict) -> None:
        print(f"hbmio.stream: epoch {s['epoch']}: {s['batches']} batches, {s['records']} records, "
              f"{s['bytes'] / 2**30:.2f} GiB in {s['seconds']:.2f} s ({s['gib_per_second']:.2f} GiB/s, "
              f"{s['records_per_second']:.0f} records/s); waited {s['wait_seconds']:.3f} s for data",
              file=_sys.stderr, flush=True)

    # ---- statistics ----
    def stats(self) -> dict:
        """The stream so far: batches, records, bytes, seconds (from the first batch asked for),
        read_seconds (the library's thread inside the engine), wait_seconds (the caller waiting for
        data: near 0 when reading keeps up with the steps), records_per_second, gib_per_second,
        epoch (epochs completed), and paths: per shard, the way its bytes took and why (as
        load_file's report; a group of batches counts once its whole read is done, so the paths
        trail the bytes a little until the stream ends), and groups: the engine requests that read
        the batches (count, seconds, and of those the workers' wake_seconds, the requests' tails
        drain_seconds and the time blocked on copies to the GPU copy_wait_seconds, summed; the
        uring backend's, 0 for the others): where a stream below the page cache's rate loses it."""
        return self._stream.stats()

    @property
    def epoch_stats(self) -> list[dict]:
        """stats() of each completed epoch (its "epoch" is its number), without paths (a group of
        batches may span two epochs: see stats())."""
        return self._stream.epoch_stats()

    # ---- the end ----
    def close(self) -> None:
        """Stops reading (what is in flight completes first). Batches already yielded stay readable
        memory, but the stream yields no more. Idempotent; also at the end of a `with` block."""
        if not self._closed:
            self._closed = True
            if self._stream is not None:
                self._stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def __repr__(self):
        return (f"hbmio.Stream({len(self._files)} shard files -> {self._device}, rank {self._rank} of {self._world}"
                f"{', closed' if self._closed else ''})")


def stream(files, device="cpu", batch_size=None, **options) -> Stream:
    """Batches of the records of tensor shard files, read into `device` ahead of use.

    files: a list of paths, a glob ("data/*.npy", sorted) or a directory (its files, sorted). Every
        shard has the same fields; records are along the first dimension.
        .npy: one array per file (C order, a little-endian dtype torch has).
        .safetensors: the tensors named by tensors= (default: all, in name order, and then every
            shard must hold the same ones) side by side; a batch is a dict {name: tensor}, or one
            tensor when tensors= is one name.
        anything else: raw records; give dtype= and record_shape=.
    device: "cuda", "cuda:N", "cpu" or "pinned".
    batch_size: records per batch; or batch_bytes= (all fields together, whole records; "64MiB").
    shuffle, seed, shuffle_window: shards shuffled, then records within windows of shuffle_window
        consecutive records (default 16 batches), from (seed, epoch): the same order on every run
        and every rank with the same seed (None: 0), another in every epoch.
    drop_last: give every rank the same number of whole batches (DDP steps in lockstep); without
        it each rank's last batch may be short and ranks may differ by one record.
    epochs: passes over the data (0 or None: until closed). A batch's epoch is in stream.stats().
    read_ahead: batches read ahead of the one being used (the ring holds read_ahead + 1).
    rank, world / group: which part of each epoch this process reads (default: torch.distributed's
        rank and world size when it is initialised, else all of it). Across ranks every record is
        read once per epoch.
    copy: yield batches of their own (a copy each) instead of views valid until the next batch.
    state: a stream.state_dict() to continue from (see Stream.state_dict): exactly the records not
        delivered yet, in the same order on every rank; with another number of ranks, the records
        no rank delivered divided among the new ones (with drop_last, as whole batches: what does
        not make one on every rank is dropped). A state of other shards or options raises
        StateError (a ValueError) naming the difference.
    framework: "torch" (default where installed), "numpy" (host memory) or "dlpack".
    progress: print each epoch's rate and the time waited for data to stderr.

    Errors (a missing file, a shard that is not a whole number of records, a shard whose dtype or
    record shape differs from the first one's, a read failure) are hbmio.Error naming the file and
    byte, raised by the next() that asks for the batch they stop.
    """
    return Stream(files, device, batch_size, **options)
