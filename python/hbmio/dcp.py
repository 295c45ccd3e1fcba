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
reader sees a whole checkpoint, DCP the old and an index reader the new.) One save of a
directory at a time: a save removes the data files of every other save of its directory once it
has published, so an earlier dcp.async_save of the same directory must be waited for first.

Names in the files: a whole tensor is stored under its fully qualified name; a chunk of a
sharded tensor under "<name>@<offset>,<offset>,..." (its offset in each dimension); values
that are not tensors (DCP's BYTE_IO items) as uint8 tensors listed in the file's metadata under
"hbmio.dcp.bytes".
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import uuid
import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import hbmio

__all__ = ["StorageWriter", "StorageReader"]

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


class StorageWriter(_StorageWriter):
    """Writes a DCP checkpoint as safetensors files through hbmio (see the module's text).

    path: the checkpoint's directory (created if needed; dcp.save's checkpoint_id replaces it).
    checksums: XXH3-64 of each tensor in its file (hbmio.StorageReader(verify=True) checks them).
    backend: hbmio's I/O path (None: $HBMIO_BACKEND, else "auto")."""

    def __init__(self, path=None, *, checksums=True, backend=None):
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.checksums = checksums
        self.backend = backend
        self.save_id = None
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id=None) -> None:
        self.path = _checkpoint_path(self.path, checkpoint_id, "StorageWriter", "dcp.save")
        self.save_id = None

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
        save_id = self.save_id = uuid.uuid4().hex[:12]
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
                tensor = data.detach()
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
        hbmio.save_file(_unshared(tensors), os.path.join(self.path, file), metadata, checksums=self.checksums,
                        backend=self.backend)
        future: Future = Future()
        future.set_result(results)
        return future

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
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _publish(self.path, _INDEX, (json.dumps(index, indent=2) + "\n").encode())
        _publish(self.path, _METADATA, pickle.dumps(metadata))
        # The previous save's data files, now unreferenced, and temporaries of saves a crash cut
        # short (this save's own are gone: every rank's write returned).
        keep = set(weight_map.values())
        for entry in os.listdir(self.path):
            if (_DATA_FILE.match(entry) and entry not in keep) or _LEFT_BEHIND.match(entry):
                try:
                    os.unlink(os.path.join(self.path, entry))
                except FileNotFoundError:
                    pass

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
