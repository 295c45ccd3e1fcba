"""hbmio.stream over shards written by NumPy (np.save) and the reference safetensors: batches equal
to a plain NumPy read, every record once per epoch across ranks, reproducible shuffles, bad shards
named, early stops that leak nothing; the same into cuda:0 where there is a GPU."""

import ast
import errno
import gc
import os

import numpy as np
import pytest

import hbmio

torch = pytest.importorskip("torch")

needs_gpu = pytest.mark.skipif(hbmio.cuda_device_count() == 0, reason=f"no GPU: {hbmio.cuda_unavailable_reason()}")


def npy_shards(tmp_path, counts, record_shape=(5,), dtype=np.float32, seed=0):
    """Shards whose first column is the record's global id; the rest random. Returns (paths, all rows)."""
    rng = np.random.default_rng(seed)
    paths, parts, start = [], [], 0
    for i, n in enumerate(counts):
        a = rng.standard_normal((n, *record_shape)).astype(dtype)
        if n:
            a.reshape(n, -1)[:, 0] = np.arange(start, start + n)
        start += n
        paths.append(str(tmp_path / f"shard-{i:03d}.npy"))
        np.save(paths[-1], a)
        parts.append(a)
    return paths, np.concatenate(parts)


def ids(batch):
    return batch.reshape(batch.shape[0], -1)[:, 0].to(torch.int64).tolist()


def test_batches_equal_a_numpy_read(tmp_path):
    paths, rows = npy_shards(tmp_path, [40, 13, 77], record_shape=(3, 4))
    got = [b.clone() for b in hbmio.stream(paths, batch_size=32)]
    assert [b.shape[0] for b in got] == [32, 32, 32, 32, 2]
    assert all(b.dtype == torch.float32 and b.shape[1:] == (3, 4) for b in got)
    assert np.array_equal(torch.cat(got).numpy(), rows)
    # A glob and a directory name the same shards, sorted.
    for files in (str(tmp_path / "shard-*.npy"), str(tmp_path)):
        s = hbmio.stream(files, batch_size=1000)
        assert s.files == paths
        assert np.array_equal(next(s).numpy(), rows)
    # NumPy arrays where asked.
    batch = next(hbmio.stream(paths, batch_size=8, framework="numpy"))
    assert isinstance(batch, np.ndarray) and np.array_equal(batch, rows[:8])


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_record_once_per_epoch_across_ranks(tmp_path, world, shuffle):
    paths, rows = npy_shards(tmp_path, [50, 7, 0, 123, 64])
    per_epoch = [[] for _ in range(3)]
    for rank in range(world):
        s = hbmio.stream(paths, batch_size=10, shuffle=shuffle, seed=5, epochs=3, rank=rank, world=world)
        for batch in s:
            per_epoch[s.epoch] += ids(batch)
            # Each record is the row of the same id, whole.
            for r in batch.numpy():
                assert np.array_equal(r, rows[int(r[0])])
        assert s.stats()["epoch"] == 3
        assert len(s.epoch_stats) == 3
    for epoch in per_epoch:
        assert sorted(epoch) == list(range(len(rows)))
    if shuffle:
        assert per_epoch[0] != per_epoch[1]


def test_drop_last_gives_every_rank_the_same_whole_batches(tmp_path):
    paths, rows = npy_shards(tmp_path, [101])
    counts = []
    for rank in range(4):
        batches = list(hbmio.stream(paths, batch_size=8, drop_last=True, rank=rank, world=4))
        assert all(b.shape[0] == 8 for b in batches)
        counts.append(len(batches))
    assert counts == [3, 3, 3, 3]


def test_shuffles_are_reproducible(tmp_path):
    paths, _ = npy_shards(tmp_path, [100, 100, 56])

    def order(seed, epochs=2):
        s = hbmio.stream(paths, batch_size=16, shuffle=True, seed=seed, epochs=epochs)
        out = [[] for _ in range(epochs)]
        for batch in s:
            out[s.epoch] += ids(batch)
        return out

    a, b, c = order(1), order(1), order(2)
    assert a == b
    assert a[0] != a[1]
    assert a[0] != c[0]
    assert a[0] != list(range(256))


def test_safetensors_shards_written_by_the_reference(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(1)
    paths, tokens, labels = [], [], []
    for i, n in enumerate([30, 45]):
        t = rng.integers(0, 50000, (n, 16), dtype=np.int64)
        lab = rng.integers(0, 2, (n,), dtype=np.uint8)
        paths.append(str(tmp_path / f"part-{i}.safetensors"))
        st.save_file({"tokens": t, "labels": lab}, paths[-1])
        tokens.append(t)
        labels.append(lab)
    tokens, labels = np.concatenate(tokens), np.concatenate(labels)
    s = hbmio.stream(paths, batch_size=20)
    assert s.fields == [("labels", "U8", ()), ("tokens", "I64", (16,))]
    got = [{k: v.clone() for k, v in b.items()} for b in s]  # a view is read into again after the next batch
    assert all(set(b) == {"tokens", "labels"} for b in got)
    assert np.array_equal(torch.cat([b["tokens"] for b in got]).numpy(), tokens)
    assert np.array_equal(torch.cat([b["labels"] for b in got]).numpy(), labels)
    one = next(hbmio.stream(paths, batch_size=75, tensors="tokens"))
    assert np.array_equal(one.numpy(), tokens)


def test_raw_records(tmp_path):
    data = np.arange(64 * 6, dtype=np.int32).reshape(64, 6)
    path = tmp_path / "records.bin"
    data.tofile(path)
    for dtype in (np.int32, torch.int32, "int32", "I32"):
        batches = [b.clone() for b in hbmio.stream(path, batch_size=20, dtype=dtype, record_shape=(6,))]
        assert np.array_equal(torch.cat(batches).numpy(), data)
    # batch_bytes: whole records.
    s = hbmio.stream(path, batch_bytes="1KiB", dtype="int32", record_shape=(6,))
    assert next(s).shape == (1024 // 24, 6)


def test_copies_outlive_the_next_batch(tmp_path):
    paths, rows = npy_shards(tmp_path, [64])
    kept = list(hbmio.stream(paths, batch_size=8, copy=True, read_ahead=1))
    assert np.array_equal(torch.cat(kept).numpy(), rows)


def test_bad_shards_are_named(tmp_path):
    paths, _ = npy_shards(tmp_path, [10, 10])
    # Another dtype.
    odd = str(tmp_path / "odd.npy")
    np.save(odd, np.zeros((10, 5), dtype=np.float64))
    with pytest.raises(hbmio.Error, match="odd.npy") as e:
        list(hbmio.stream(paths + [odd], batch_size=4))
    assert "F64" in str(e.value)
    # Another record shape.
    np.save(odd, np.zeros((10, 6), dtype=np.float32))
    with pytest.raises(hbmio.Error, match=r"odd\.npy.*\[6\]"):
        list(hbmio.stream(paths + [odd], batch_size=4))
    # A truncated shard: the byte where its records stop.
    with open(paths[1], "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.truncate(size - 3)
    with pytest.raises(hbmio.Error, match=rf"shard-001\.npy.*offset {size - 3}.*partial record"):
        list(hbmio.stream(paths, batch_size=4))
    # Raw records that do not divide the file.
    raw = tmp_path / "r.bin"
    raw.write_bytes(b"\0" * 100)
    with pytest.raises(hbmio.Error, match=r"r\.bin.*offset 96.*partial record of 4 bytes"):
        next(hbmio.stream(raw, batch_size=4, dtype="float32", record_shape=(8,)))
    # Missing files: the FileNotFoundError Python raises too.
    with pytest.raises(FileNotFoundError, match="gone.npy") as e:
        next(hbmio.stream([paths[0], str(tmp_path / "gone.npy")], batch_size=4))
    assert e.value.errno == errno.ENOENT
    with pytest.raises(FileNotFoundError, match="no shard files match"):
        hbmio.stream(str(tmp_path / "*.nothing"), batch_size=4)
    # Options that cannot work, at once.
    with pytest.raises(ValueError, match="one of them"):
        hbmio.stream(paths, batch_size=4, batch_bytes="1MiB")
    with pytest.raises(ValueError, match="raw shards need dtype"):
        hbmio.stream(raw, batch_size=4, record_shape=(8,), dtype=None, format="raw")
    with pytest.raises(hbmio.Error, match="rank 3 is not in a world of 2"):
        hbmio.stream(paths, batch_size=4, rank=3, world=2)


def thread_count():
    return len(os.listdir("/proc/self/task"))


def test_stopping_early_leaks_nothing(tmp_path):
    paths, _ = npy_shards(tmp_path, [500, 500])
    list(hbmio.stream(paths, batch_size=16))  # the pooled engine and its threads exist from here on
    threads, buffers = thread_count(), hbmio._memory_counters()["host_buffers"]
    for taken in (0, 1, 7):
        with hbmio.stream(paths, batch_size=16, shuffle=True, epochs=None) as s:
            for _ in range(taken):
                next(s)
        with pytest.raises(StopIteration):
            next(s)
    s = hbmio.stream(paths, batch_size=16, epochs=None)
    next(s)
    del s  # never closed: the garbage collector stops it
    gc.collect()
    assert thread_count() == threads
    assert hbmio._memory_counters()["host_buffers"] == buffers


def test_progress_says_the_rate_and_the_wait(tmp_path, capfd):
    paths, _ = npy_shards(tmp_path, [64])
    list(hbmio.stream(paths, batch_size=16, epochs=2, progress=True))
    err = capfd.readouterr().err
    assert err.count("hbmio.stream: epoch") == 2
    assert "waited" in err and "GiB/s" in err


@needs_gpu
@pytest.mark.parametrize("shuffle", [False, True])
def test_into_cuda(tmp_path, shuffle):
    paths, rows = npy_shards(tmp_path, [300, 211], record_shape=(64,))
    s = hbmio.stream(paths, device="cuda", batch_size=50, shuffle=shuffle, epochs=2)
    seen = [[] for _ in range(2)]
    for batch in s:
        assert batch.is_cuda
        # A kernel still reading the batch when the next one is asked for: its buffer must not
        # be read into before that kernel ends.
        total = (batch.double() * 2).sum()
        host = batch.cpu().numpy()
        for r in host:
            assert np.array_equal(r, rows[int(r[0])])
        seen[s.epoch] += [int(r[0]) for r in host]
        assert total.item() == pytest.approx(2 * host.astype(np.float64).sum())
    for epoch in seen:
        assert sorted(epoch) == list(range(len(rows)))


def _stream_rank(rank, world, init_file, files, out):
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        # No rank= or world=: the initialised process group says them.
        s = hbmio.stream(files, batch_size=7, shuffle=True, seed=3, epochs=2)
        got = [[], []]
        for batch in s:
            got[s.epoch] += ids(batch)
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            f.write(repr((s._rank, s._world, got)))
    finally:
        dist.destroy_process_group()


def test_torch_distributed_ranks_split_every_epoch(tmp_path):
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp = pytest.importorskip("torch.multiprocessing")
    paths, rows = npy_shards(tmp_path, [40, 33, 29])
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_stream_rank, args=(2, str(tmp_path / "init"), paths, str(out)), nprocs=2, join=True)
    results = [ast.literal_eval((out / f"rank{r}").read_text()) for r in range(2)]
    assert [(r, w) for r, w, _ in results] == [(0, 2), (1, 2)]
    for epoch in range(2):
        assert sorted(results[0][2][epoch] + results[1][2][epoch]) == list(range(len(rows)))
