"""hbmio.dcp: torch.distributed.checkpoint (dcp.save, dcp.async_save, dcp.load) through hbmio's
StorageWriter and StorageReader. Results must equal the state saved and a round trip through
torch's own FileSystemWriter/FileSystemReader; the files must be safetensors that the reference
safetensors reads; a save over an older checkpoint must leave the old or the new one whole.
1 process, and 2 and 4 ranks on gloo with DTensor-sharded tensors (saved sharded one way, loaded
sharded another way). dcp.async_save stages through the writer: what a rank changes after the call
does not reach the checkpoint, and the staging memory is reused from save to save within its bound.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from _rank_exit import exit_rank

torch = pytest.importorskip("torch", reason="torch is not installed")
dcp = pytest.importorskip("torch.distributed.checkpoint", reason="torch.distributed.checkpoint is not available")
dist = pytest.importorskip("torch.distributed")
st_torch = pytest.importorskip("safetensors.torch", reason="the reference safetensors is not installed")

import hbmio  # noqa: E402
import hbmio.dcp  # noqa: E402


def make_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(64, 48, generator=g),
            "layers.0.w": torch.randn(48, 48, generator=g).to(torch.bfloat16),
            "layers.0.b": torch.randint(0, 100, (48,), generator=g, dtype=torch.int64),
            "mask": torch.rand(17, generator=g) > 0.5,
        },
        "optim": {"step": seed, "lr": 0.001 * seed, "name": f"adamw-{seed}"},
    }


def zeros_like_state(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def assert_state_equal(got, expected):
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        if isinstance(v, dict):
            assert_state_equal(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k].cpu(), v.cpu()), k
        else:
            assert got[k] == v, k


def test_save_and_load_in_one_process_equal_the_state_and_torchs_own_round_trip(tmp_path):
    state = make_state(1)
    dcp.save(state, storage_writer=hbmio.dcp.StorageWriter(tmp_path / "hbmio"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")))
    ours, theirs = zeros_like_state(state), zeros_like_state(state)
    dcp.load(ours, storage_reader=hbmio.dcp.StorageReader(tmp_path / "hbmio"))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path / "torch")))
    assert_state_equal(ours, state)
    assert_state_equal(ours, theirs)
    # With verify: every file's checksums checked on the way.
    verified = zeros_like_state(state)
    dcp.load(verified, storage_reader=hbmio.dcp.StorageReader(tmp_path / "hbmio", verify=True))
    assert_state_equal(verified, state)


def test_the_files_are_safetensors_with_a_hugging_face_index(tmp_path):
    state = make_state(2)
    dcp.save(state, storage_writer=hbmio.dcp.StorageWriter(tmp_path))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 1 and files[0].startswith("model-00001-of-00001-")
    ref = st_torch.load_file(str(tmp_path / files[0]))
    for name in state["model"]:
        assert torch.equal(ref[f"model.{name}"], state["model"][name]), name
    # hbmio reads the directory through the index, checksums verified.
    loaded = hbmio.load_file(tmp_path, framework="torch", verify=True)
    assert torch.equal(loaded["model.embed.weight"], state["model"]["embed.weight"])


def test_a_new_save_replaces_the_old_one_and_removes_its_files(tmp_path):
    dcp.save(make_state(3), storage_writer=hbmio.dcp.StorageWriter(tmp_path))
    old_files = {p.name for p in tmp_path.glob("model-*.safetensors")}
    new = make_state(4)
    dcp.save(new, storage_writer=hbmio.dcp.StorageWriter(tmp_path))
    now = {p.name for p in tmp_path.glob("model-*.safetensors")}
    assert now and not (now & old_files), "the old save's data files are still there"
    got = zeros_like_state(new)
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    assert_state_equal(got, new)
    assert not [p for p in tmp_path.iterdir() if ".hbmio-tmp-" in p.name]


def test_async_save(tmp_path):
    state = make_state(5)
    future = dcp.async_save(state, storage_writer=hbmio.dcp.StorageWriter(tmp_path))
    future.result()
    got = zeros_like_state(state)
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    assert_state_equal(got, state)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path, how):
    """A conj() or _neg_view() tensor is a flag on memory holding other values: the checkpoint holds
    the values, as torch's FileSystemWriter writes them (dcp.save wrote the memory)."""
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    state = {"conj": z.conj(), "neg": torch._neg_view(torch.arange(4.0))}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    writer = hbmio.dcp.StorageWriter(tmp_path)
    if how == "save":
        dcp.save(state, storage_writer=writer)
    else:
        dcp.async_save(state, storage_writer=writer).result()
    got = {"conj": torch.zeros(4, dtype=torch.complex64), "neg": torch.zeros(4)}
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    for k in expected:
        assert torch.equal(got[k], expected[k]), (k, got[k], expected[k])


def test_a_failed_async_save_does_not_make_a_later_one_of_its_writer_lose(tmp_path):
    """A save staged through a writer that failed before writing left its lease with the writer;
    the next save staged in the same slab took the failed one's call time, and lost to a save in
    between (its files deleted, the older checkpoint kept, a warning only)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "afile").write_bytes(b"")
    state = lambda v: {"w": torch.full((256,), float(v)), "step": v}  # noqa: E731
    writer = hbmio.dcp.StorageWriter(root)
    with pytest.raises(BaseException):
        dcp.async_save(state(1), storage_writer=writer, checkpoint_id=str(tmp_path / "afile" / "sub")).result()
    import gc
    gc.collect()  # the failed save's staged state, and with it the lease's finalizer
    dcp.save(state(2), storage_writer=hbmio.dcp.StorageWriter(root))
    dcp.async_save(state(3), storage_writer=writer, checkpoint_id=str(root)).result()
    got = state(0)
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(root))
    assert got["step"] == 3 and torch.equal(got["w"], torch.full((256,), 3.0))


def test_overlapping_saves_of_one_directory_leave_the_one_started_last(tmp_path):
    """Two dcp.async_save of one directory, the second started before the first has finished (the
    first is larger, so it finishes last): the directory holds the second, whole, and no file of
    the first; never a .metadata naming files another save removed."""
    import warnings
    for trial in range(3):
        d = tmp_path / f"t{trial}"
        first = {"w": torch.full((8 << 20,), 1.0)}
        second = {"w": torch.full((16,), 2.0)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f1 = dcp.async_save(first, storage_writer=hbmio.dcp.StorageWriter(d))
            f2 = dcp.async_save(second, storage_writer=hbmio.dcp.StorageWriter(d))
            f1.result()
            f2.result()
        meta = hbmio.dcp.StorageReader(d).read_metadata()
        named = {s.file for s in meta.storage_data.values()}
        on_disk = {p.name for p in d.glob("model-*.safetensors")}
        assert named <= on_disk, (named, on_disk)
        assert on_disk == named, f"files of the dropped save are left: {on_disk - named}"
        got = {"w": torch.zeros(16)}
        dcp.load(got, storage_reader=hbmio.dcp.StorageReader(d))
        assert torch.equal(got["w"], second["w"])


def test_one_writer_serves_overlapping_async_saves_to_other_directories(tmp_path):
    """One StorageWriter reused for dcp.async_save calls that overlap, each with its own
    checkpoint_id: DCP runs each on a thread of its own, and each directory must hold exactly its
    own save's state, whole (a save's directory and start were the writer's: a later save's
    reset moved an earlier save's files into its own directory)."""
    import warnings
    writer = hbmio.dcp.StorageWriter()
    for trial in range(3):
        states = {f"A{trial}": {"w": torch.full((8 << 20,), 1.0 + trial)},
                  f"B{trial}": {"v": torch.full((4,), 2.0 + trial)},
                  f"C{trial}": {"w": torch.full((1 << 20,), 3.0 + trial), "u": torch.arange(5.0)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            futures = [dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / name)
                       for name, state in states.items()]
            for f in futures:
                f.result()
        for name, state in states.items():
            d = tmp_path / name
            meta = hbmio.dcp.StorageReader(d).read_metadata()
            named = {s.file for s in meta.storage_data.values()}
            assert {p.name for p in d.glob("model-*.safetensors")} == named, name
            got = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(got, storage_reader=hbmio.dcp.StorageReader(d))
            for k in state:
                assert torch.equal(got[k], state[k]), (name, k)
    assert hbmio.dcp._arena.stats()["in_use"] == 0
    # A writer still pickles (DCP's process-based async_save sends it to another process), with
    # its settings and without this process's saves.
    import pickle
    copy = pickle.loads(pickle.dumps(hbmio.dcp.StorageWriter(tmp_path / "p", checksums=False)))
    assert copy.path == str(tmp_path / "p") and copy.checksums is False and copy.save_id is None


def test_an_unfinished_directory_is_refused_by_name(tmp_path, caplog):
    import inspect
    import torch.distributed.checkpoint.state_dict_loader as loader
    with pytest.raises(BaseException) as raised:  # CheckpointException is a BaseException
        dcp.load(zeros_like_state(make_state(1)), storage_reader=hbmio.dcp.StorageReader(tmp_path))
    # DCP wraps a rank's error in its CheckpointException (rank -> error in .failures).
    text = str(raised.value) + "".join(str(e) for e in getattr(raised.value, "failures", {}).values())
    if "rank local metadata" in inspect.getsource(loader):
        # This torch swallows read_metadata's error (it then looks for rank-local metadata) and
        # says only "metadata is None": the reader's reason is in the log.
        assert "metadata is None" in text, text
        assert any("no DCP metadata" in r.getMessage() and str(tmp_path) in r.getMessage() for r in caplog.records)
    else:
        assert "no DCP metadata" in text, text


# dcp.async_save stages through hbmio's writer only where torch has DCP's staging protocol.
needs_stager = pytest.mark.skipif(hbmio.dcp._AsyncStager is None,
                                  reason="this torch has no AsyncStager: async_save stages with its own copy")


def staged_tensors_bytes(state):
    total = 0
    for v in state.values():
        if isinstance(v, dict):
            total += staged_tensors_bytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def clone_state(state):
    return {k: clone_state(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def big_state(seed, mib=32):
    # Large enough that writing it takes longer than changing it: a save that read the caller's
    # tensors after async_save returned would catch the change.
    g = torch.Generator().manual_seed(seed)
    per = (mib << 20) // 4 // 4
    return {"model": {f"w{i}": torch.randn(per, generator=g) for i in range(4)},
            "bf": torch.randn(1001, generator=g).to(torch.bfloat16),
            "step": seed, "extra": {"lrs": [0.1 * seed, 0.2]}}


def test_async_save_stages_through_the_writer_and_later_changes_do_not_reach_the_checkpoint(tmp_path):
    staging = pytest.importorskip("torch.distributed.checkpoint.staging", reason="this torch has no AsyncStager")
    state = big_state(6)
    expected = clone_state(state)
    expected["extra"]["lrs"] = list(state["extra"]["lrs"])
    writer = hbmio.dcp.StorageWriter(tmp_path)
    assert isinstance(writer, staging.AsyncStager)
    future = dcp.async_save(state, storage_writer=writer)
    # The training step that follows the call: every tensor and the list change in place.
    for t in state["model"].values():
        t.fill_(-1.0)
    state["bf"].fill_(7)
    state["extra"]["lrs"].append(99.0)
    future.result()
    report = writer.last_staging
    assert report["staging"] == "pinned" and report["unpooled_bytes"] == 0
    assert report["staged_bytes"] == staged_tensors_bytes(expected)
    # The file, read by the reference safetensors, holds the bytes of the state as it was at the call.
    (data_file,) = tmp_path.glob("model-*.safetensors")
    ref = st_torch.load_file(str(data_file))
    for name, t in expected["model"].items():
        assert torch.equal(ref[f"model.{name}"].view(torch.uint8), t.view(torch.uint8)), name
    assert torch.equal(ref["bf"].view(torch.uint8), expected["bf"].view(torch.uint8))
    got = zeros_like_state(expected)
    got["extra"] = {"lrs": None}
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    assert_state_equal(got, expected)
    # The staging memory went back when the file was written.
    assert hbmio.dcp._arena.stats()["in_use"] == 0


@needs_stager
def test_fifty_async_saves_reuse_one_staging_slab(tmp_path):
    hbmio.dcp.release_staging()
    state = big_state(7, mib=8)
    held, slabs = [], set()
    for i in range(50):
        for t in state["model"].values():
            t.fill_(float(i))
        state["step"] = i
        future = dcp.async_save(state, storage_writer=hbmio.dcp.StorageWriter(tmp_path))
        future.result()
        stats = hbmio.dcp._arena.stats()
        held.append((stats["allocated"], stats["slabs"], stats["in_use"]))
        slabs.update(slab.start() for slab in hbmio.dcp._arena._free)
    # One slab, allocated by the first save, reused by the 49 others, free between saves.
    need = staged_tensors_bytes(state)
    assert need <= held[0][0] < need + (4 << 20), held[0]
    assert held == [(held[0][0], 1, 0)] * 50, sorted(set(held))
    assert len(slabs) == 1
    got = zeros_like_state(state)
    got["extra"] = {"lrs": None}
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    assert_state_equal(got, state)


@needs_stager
def test_staging_is_bounded_by_the_pool_capacity(tmp_path):
    hbmio.dcp.release_staging()
    capacity = hbmio.dcp._arena.stats()["capacity"]
    try:
        # Room for one save's slab: a second save staged while the first still writes waits for it.
        first, second = big_state(8, mib=6), big_state(9, mib=6)
        a = dcp.async_save(first, storage_writer=hbmio.dcp.StorageWriter(tmp_path / "a", pool_bytes=8 << 20))
        b = dcp.async_save(second, storage_writer=hbmio.dcp.StorageWriter(tmp_path / "b"))
        a.result()
        b.result()
        stats = hbmio.dcp._arena.stats()
        assert stats["allocated"] <= 8 << 20 and stats["slabs"] == 1 and stats["in_use"] == 0, stats
        for state, where in ((first, "a"), (second, "b")):
            got = zeros_like_state(state)
            got["extra"] = {"lrs": None}
            dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path / where))
            assert_state_equal(got, state)
        # A state larger than the capacity by itself: staged in memory of its own, and said so.
        large = big_state(10, mib=16)
        writer = hbmio.dcp.StorageWriter(tmp_path / "c")
        with pytest.warns(RuntimeWarning, match="exceed the staging capacity"):
            dcp.async_save(large, storage_writer=writer).result()
        assert writer.last_staging["unpooled_bytes"] == staged_tensors_bytes(large)
        assert hbmio.dcp._arena.stats()["allocated"] <= 8 << 20
        got = zeros_like_state(large)
        got["extra"] = {"lrs": None}
        dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path / "c"))
        assert_state_equal(got, large)
    finally:
        hbmio.dcp._arena.set_capacity(capacity)


@needs_stager
def test_device_staging_without_a_gpu_stages_on_the_host(tmp_path):
    state = big_state(11, mib=4)
    writer = hbmio.dcp.StorageWriter(tmp_path, staging="device")
    dcp.async_save(state, storage_writer=writer).result()
    assert writer.last_staging["staging"] == "pinned"  # host tensors: nothing to stage on a device
    with pytest.raises(ValueError, match="staging must be"):
        hbmio.dcp.StorageWriter(tmp_path, staging="gpu")


@needs_stager
@pytest.mark.parametrize("staging", ["pinned", "device"])
def test_async_save_of_a_cuda_state_copies_it_once(tmp_path, staging):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(12)
    state = {f"w{i}": torch.randn(4 << 20, device="cuda", generator=g).to(torch.bfloat16) for i in range(4)}
    state["step"] = 12
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    writer = hbmio.dcp.StorageWriter(tmp_path, staging=staging)
    future = dcp.async_save(state, storage_writer=writer)
    for i in range(4):
        state[f"w{i}"].fill_(-3)  # queued on the current stream right after the call
    future.result()
    assert writer.last_staging["staging"] == staging and writer.last_staging["unpooled_bytes"] == 0
    if staging == "pinned":  # the slab is page-locked, so the copy runs at the link's speed
        assert all(slab.pinned for slab in hbmio.dcp._arena._free)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()}
    dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path))
    for k, v in expected.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


# Saves in a loop over one directory; the parent kills the process at some point of one.
SAVER = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp, hbmio.dcp
    path, mode = sys.argv[1], sys.argv[2]
    print("ready", flush=True)
    for i in range(1000):
        state = {f"t{k}": torch.full((6 << 20,), float(i * 4 + k)) for k in range(4)}
        if mode == "async_save":
            dcp.async_save(state, storage_writer=hbmio.dcp.StorageWriter(path)).result()
        else:
            dcp.save(state, storage_writer=hbmio.dcp.StorageWriter(path))
        print(i, flush=True)
""")


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_killed_save_leaves_the_old_or_the_new_checkpoint(tmp_path, mode):
    for delay in (0.2, 0.6, 1.0, 1.5, 2.2):
        child = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), mode], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        if not (tmp_path / ".metadata").exists():
            continue  # killed before the first save published
        got = {f"t{k}": torch.zeros(6 << 20) for k in range(4)}
        dcp.load(got, storage_reader=hbmio.dcp.StorageReader(tmp_path, verify=True))
        first = got["t0"][0].item()
        for k in range(4):  # every tensor of one and the same save
            assert torch.all(got[f"t{k}"] == first + k), delay


def _rank(rank, world, init_file, path, out):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = {f"w{i}": torch.arange(i * 1000, i * 1000 + 24 * 40, dtype=torch.float32).reshape(24, 40) for i in range(3)}
        state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        state["bias"] = torch.arange(7, dtype=torch.int32)  # a plain tensor, the same on every rank
        state["step"] = 42
        dcp.save(state, storage_writer=hbmio.dcp.StorageWriter(path))
        # Loaded sharded another way (by columns) and replicated: each rank reads its own part.
        by_columns = {k: distribute_tensor(torch.zeros(24, 40), mesh, [Shard(1)]) for k in full}
        replicated = {k: distribute_tensor(torch.zeros(24, 40), mesh, [Replicate()]) for k in full}
        for target in (by_columns, replicated):
            target.update(bias=torch.zeros(7, dtype=torch.int32), step=0)
            dcp.load(target, storage_reader=hbmio.dcp.StorageReader(path))
            for k, v in full.items():
                assert torch.equal(target[k].full_tensor(), v), k
            assert torch.equal(target["bias"], state["bias"]) and target["step"] == 42
        dist.barrier()
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()
    exit_rank()  # see _rank_exit.py


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_save_their_shards_and_load_them_sharded_another_way(tmp_path, world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp = pytest.importorskip("torch.multiprocessing")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), str(ckpt), str(out)), nprocs=world, join=True)
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}" for r in range(world)]
    # One file per rank, each holding its rows of every sharded tensor, readable by safetensors.
    files = sorted(ckpt.glob("model-*.safetensors"))
    assert len(files) == world
    rows = 0
    for f in files:
        tensors = st_torch.load_file(str(f))
        rows += sum(t.shape[0] for name, t in tensors.items() if name.startswith("w0"))
    assert rows == 24


def _async_rank(rank, world, init_file, path, out):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        held = []
        for save in range(3):
            full = {f"w{i}": torch.arange(save + i * 1000, save + i * 1000 + 256 * 1024, dtype=torch.float32).reshape(256, 1024)
                    for i in range(3)}
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
            state["bias"] = torch.arange(7, dtype=torch.int32) + save
            state["step"] = save
            writer = hbmio.dcp.StorageWriter(path)
            future = dcp.async_save(state, storage_writer=writer)
            # The step after the call changes this rank's shards and the plain tensor in place.
            for k in full:
                state[k].to_local().fill_(-1.0)
            state["bias"].fill_(-1)
            future.result()
            local = sum(state[k].to_local().numel() * 4 for k in full) + 7 * 4
            assert writer.last_staging["staged_bytes"] == local and writer.last_staging["unpooled_bytes"] == 0
            stats = hbmio.dcp._arena.stats()
            held.append((stats["allocated"], stats["slabs"], stats["in_use"]))
            target = {k: distribute_tensor(torch.zeros(256, 1024), mesh, [Shard(1)]) for k in full}
            target.update(bias=torch.zeros(7, dtype=torch.int32), step=0)
            dcp.load(target, storage_reader=hbmio.dcp.StorageReader(path))
            for k, v in full.items():
                assert torch.equal(target[k].full_tensor(), v), (save, k)
            assert torch.equal(target["bias"], torch.arange(7, dtype=torch.int32) + save) and target["step"] == save
        assert held == [held[0]] * 3 and held[0][1:] == (1, 0), held  # one slab, reused, free between saves
        dist.barrier()
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()
    exit_rank()  # see _rank_exit.py


@needs_stager
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_async_save_what_they_held_at_the_call(tmp_path, world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp = pytest.importorskip("torch.multiprocessing")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_async_rank, args=(world, str(tmp_path / "init"), str(ckpt), str(out)), nprocs=world, join=True)
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}" for r in range(world)]
    # The last save's files, read by the reference safetensors: each rank's rows of the tensors as
    # they were at the call.
    files = sorted(ckpt.glob("model-*.safetensors"))
    assert len(files) == world
    rows = {}
    for f in files:
        for name, t in st_torch.load_file(str(f)).items():
            if name.startswith("w0"):
                offset = int(name.split("@")[1].split(",")[0]) if "@" in name else 0
                rows[offset] = t
    whole = torch.cat([rows[o] for o in sorted(rows)])
    assert torch.equal(whole, torch.arange(2, 2 + 256 * 1024, dtype=torch.float32).reshape(256, 1024))
