"""hbmio.stream over shards written by NumPy (np.save) and the reference safetensors: batches equal
to a plain NumPy read, every record once per epoch across ranks, reproducible shuffles, bad shards
named, early stops that leak nothing; the same into cuda:0 where there is a GPU."""

import ast
import errno
import gc
import os
import time
import re

import numpy as np
import pytest
from _rank_exit import exit_rank

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


def test_safetensors_shards_with_other_tensors_are_refused_unless_the_fields_are_named(tmp_path):
    """Without tensors=, a stream reads every tensor of the first shard from every shard, by name:
    a later shard holding another set (an extra attention_mask, a missing labels) is refused naming
    the difference (it was read position by position: the extra tensor's bytes came as the first's
    input_ids, and a shard with fewer tensors crashed the process). With tensors= it is read."""
    st = pytest.importorskip("safetensors.numpy")
    n = 4
    a, b, c = (str(tmp_path / f"{x}.safetensors") for x in "abc")
    st.save_file({"input_ids": np.full((n, 3), 1, np.int32), "labels": np.full((n, 3), 2, np.int32)}, a)
    st.save_file({"attention_mask": np.full((n, 3), 9, np.int32), "input_ids": np.full((n, 3), 1, np.int32),
                  "labels": np.full((n, 3), 2, np.int32)}, b)
    st.save_file({"input_ids": np.full((n, 3), 1, np.int32)}, c)
    with pytest.raises(hbmio.Error, match=r"b\.safetensors.*also has attention_mask.*tensors="):
        hbmio.stream([a, b], batch_size=n).fields
    with pytest.raises(hbmio.Error, match=r"c\.safetensors.*lacks labels"):
        hbmio.stream([a, c], batch_size=n).fields
    s = hbmio.stream([a, b], batch_size=n, tensors=["input_ids", "labels"], framework="numpy")
    got = [{k: v.copy() for k, v in batch.items()} for batch in s]
    assert len(got) == 2
    for batch in got:
        assert (batch["input_ids"] == 1).all() and (batch["labels"] == 2).all()


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


def test_stats_say_the_way_each_shards_bytes_took(tmp_path):
    paths, rows = npy_shards(tmp_path, [40, 13, 77], record_shape=(3, 4))
    s = hbmio.stream(paths, batch_size=32, epochs=2, backend="posix")
    for _ in s:
        pass
    stats = s.stats()
    # Every shard, its way (the backend asked for) and why; the bytes of two epochs' records.
    assert [os.path.basename(p["file"]) for p in stats["paths"]] == [os.path.basename(p) for p in paths]
    assert all(p["path"] == "posix" and p["reason"] for p in stats["paths"]), stats["paths"]
    assert sum(p["bytes"] for p in stats["paths"]) == stats["bytes"] == 2 * rows.nbytes
    assert all("paths" not in e for e in s.epoch_stats)  # a group of batches may span two epochs


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
    way = {p["path"] for p in s.stats()["paths"]}
    assert way and way <= {"uring", "posix", "gds-nvidia-fs", "gds-p2pdma", "cufile-compat"}, s.stats()["paths"]


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
    exit_rank()  # see _rank_exit.py


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


def npy_bytes(a, pad=0, shape=None):
    """a as np.save writes it (format 1.0), with `pad` more spaces in the header (the data then
    starts further on, as another writer's header may make it) or another shape claimed."""
    d = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (a.dtype.str, shape or tuple(a.shape)) + " " * pad
    d += " " * (-(10 + len(d) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d.encode() + a.tobytes()


# What a shard is renamed over with: valid .npy files a reader at the old header's offsets and
# dtype would misread without noticing.
REPLACEMENTS = {
    "another header length": lambda a: npy_bytes(a, pad=64),  # the same records 64 bytes further on
    "another dtype": lambda a: npy_bytes(a.view(np.int32) + 1),
    "another record count": lambda a: npy_bytes(np.concatenate([a, a]) + 1),
    "the same size, other bytes": lambda a: npy_bytes(a + 1),  # a new inode, nothing else changed
}


def rename_over(path, data):
    with open(path + ".next", "wb") as f:
        f.write(data)
    os.rename(path + ".next", path)


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_shard_renamed_over_is_read_as_the_file_its_header_came_from(tmp_path, replacement):
    # Few shards: each keeps the descriptor its header was read through, so the stream gives the
    # original bytes; the old code opened the path again and read the new file at the old offsets.
    paths, rows = npy_shards(tmp_path, [4, 4, 4])
    # One shard a batch and two buffers: shard 2 is read only after batch 0 is given back.
    s = hbmio.stream(paths, batch_size=4, read_ahead=1, framework="numpy", copy=True)
    assert s.fields  # the headers are read
    rename_over(paths[2], REPLACEMENTS[replacement](np.load(paths[2])))
    got = np.concatenate(list(s))
    assert got.tobytes() == rows.tobytes()


def rewrite_in_place(path, data):
    with open(path, "r+b") as f:  # np.save to the same path: the same inode, truncated and rewritten
        f.truncate(0)
        f.write(data)


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_shard_rewritten_in_place_is_refused_never_misread(tmp_path, replacement):
    # A shard kept open (one of the first 64) rewritten in place after its header was read: the
    # descriptor sees the new bytes, which the old header would misread. The stream raises naming
    # it before any of its records (every batch handed out is the original's).
    paths, rows = npy_shards(tmp_path, [4, 4, 4])
    s = hbmio.stream(paths, batch_size=4, read_ahead=1, framework="numpy", copy=True)
    assert s.fields
    first = next(s)
    assert first.tobytes() == rows[:4].tobytes()
    time.sleep(0.02)  # the same size: only the times tell (a timestamp tick later than the scan's)
    rewrite_in_place(paths[2], REPLACEMENTS[replacement](np.load(paths[2])))
    delivered = 1
    with pytest.raises(hbmio.Error, match=rf"{re.escape(paths[2])}.*changed"):
        for batch in s:
            assert batch.tobytes() == rows[delivered * 4:delivered * 4 + 4].tobytes(), delivered
            delivered += 1
    assert delivered == 2


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_shard_renamed_over_is_refused_when_opened_again(tmp_path, replacement):
    # More shards than the 64 descriptors kept: a shard is opened again by path (one never kept
    # open, and one closed to make room and needed again in epoch 1); it must be the file its
    # header came from, or the stream raises naming it.
    paths, rows = npy_shards(tmp_path, [2] * 80)

    def refused(s, path, delivered):
        with pytest.raises(hbmio.Error, match=rf"{re.escape(path)}.*replaced"):
            for batch in s:
                at = s.index * 2
                assert batch.tobytes() == rows[at:at + 2].tobytes()
                delivered += 1
        return delivered

    s = hbmio.stream(paths, batch_size=2, read_ahead=1, framework="numpy")
    assert s.fields
    original = np.load(paths[70])
    rename_over(paths[70], REPLACEMENTS[replacement](original))
    assert refused(s, paths[70], 0) == 70
    rename_over(paths[70], npy_bytes(original))

    s = hbmio.stream(paths, batch_size=2, read_ahead=1, framework="numpy", epochs=2)
    for _ in range(71):
        next(s)  # batches 0-70; at most 71 read by now, shards 0-6 closed
    rename_over(paths[0], REPLACEMENTS[replacement](np.load(paths[0])))
    assert refused(s, paths[0], 71) == 80


def test_a_header_that_lies_is_named(tmp_path):
    liar = tmp_path / "liar.npy"
    data = npy_bytes(np.zeros((10, 5), np.float32), shape=(2**60 + 10, 5))
    liar.write_bytes(data)
    # 2^60 + 10 records of 20 bytes wrap to 2^62 + 200 bytes; named, with the claim and the size.
    with pytest.raises(hbmio.Error, match=rf"liar\.npy.*header lies.*{2**60 + 10} records.*the file is {len(data)} bytes"):
        next(hbmio.stream(str(liar), batch_size=4))


def test_huge_batches_are_one_batch_of_everything(tmp_path):
    paths, rows = npy_shards(tmp_path, [37, 5])
    for shuffle in (False, True):
        got = list(hbmio.stream(paths, batch_size=2**62, shuffle=shuffle, framework="numpy"))
        assert len(got) == 1
        assert sorted(got[0][:, 0].tolist()) == list(range(42))


@pytest.mark.parametrize("option, value, error, says", [
    ("batch_size", 2.5, TypeError, "batch_size must be an int"),
    ("batch_size", "3", TypeError, "batch_size must be an int"),
    ("batch_size", True, TypeError, "batch_size must be an int"),
    ("batch_size", 0, ValueError, "batch_size must be a positive number of records, 1 to 18446744073709551615, not 0"),
    ("batch_size", 2**64, ValueError, "batch_size must be .*, not 18446744073709551616"),
    ("batch_bytes", 1.5, TypeError, "batch_bytes must be an int"),
    ("batch_bytes", 0, ValueError, "batch_bytes must be a positive number of bytes"),
    ("seed", -1, ValueError, "seed must be an unsigned 64-bit int, 0 to 18446744073709551615, not -1"),
    ("seed", 2**64, ValueError, "seed must be .*, not 18446744073709551616"),
    ("seed", 1.5, TypeError, "seed must be an int"),
    ("shuffle_window", -1, ValueError, "shuffle_window must be a number of records"),
    ("shuffle_window", 2**64, ValueError, "shuffle_window must be a number of records"),
    ("read_ahead", 0, ValueError, "read_ahead must be a number of batches, 1 to 4096, not 0"),
    ("read_ahead", -1, ValueError, "read_ahead must be a number of batches, 1 to 4096, not -1"),
    ("read_ahead", 2**32, ValueError, "read_ahead must be a number of batches, 1 to 4096"),
    ("epochs", -1, ValueError, "epochs must be"),
    ("epochs", 2**64, ValueError, "epochs must be"),
    ("rank", -1, ValueError, "rank must be .* 0 to 4294967294, not -1"),
    ("rank", 3, ValueError, "rank 3 is not in a world of 2"),
    ("world", 0, ValueError, "world must be the number of processes, 1 to 4294967295, not 0"),
    ("world", 2**32, ValueError, "world must be .*, not 4294967296"),
    ("world", 2.0, TypeError, "world must be an int"),
    ("shuffle", "False", TypeError, "shuffle must be True or False"),
    ("drop_last", 2, TypeError, "drop_last must be True or False"),
    ("record_shape", (4, -1), ValueError, r"record_shape\[1\] must be a dimension"),
])
def test_options_are_checked_by_name_and_range(tmp_path, option, value, error, says):
    paths, _ = npy_shards(tmp_path, [10])
    options = {"batch_size": 4, "rank": 0, "world": 2}
    if option == "batch_bytes":
        del options["batch_size"]
    if option == "record_shape":
        paths, options["dtype"] = [str(tmp_path / "r.bin")], "float32"
        (tmp_path / "r.bin").write_bytes(b"\0" * 64)
    options[option] = value
    with pytest.raises(error, match=says) as e:
        hbmio.stream(paths, **options)
    assert "incompatible function arguments" not in str(e.value)
    if error is ValueError:
        assert isinstance(e.value, hbmio.Error)  # what the library raised before Python checked


def test_integers_of_other_types_are_integers(tmp_path):
    # NumPy's integers, and flags as 0/1 or NumPy bools.
    paths, _ = npy_shards(tmp_path, [10])
    s = hbmio.stream(paths, batch_size=np.int64(4), seed=np.uint64(2**64 - 1), read_ahead=np.int32(3), shuffle=np.True_,
                     drop_last=0, shuffle_window=np.uint8(5))
    assert [b.shape[0] for b in s] == [4, 4, 2]


def test_directory_entries_that_are_not_files_are_named(tmp_path):
    paths, _ = npy_shards(tmp_path, [4, 4])
    os.symlink(tmp_path / "gone.npy", tmp_path / "shard-002.npy")
    with pytest.raises(FileNotFoundError, match=r"shard-002\.npy is a dangling symlink") as e:
        hbmio.stream(str(tmp_path), batch_size=4)
    assert e.value.errno == errno.ENOENT
    os.remove(tmp_path / "shard-002.npy")
    os.mkdir(tmp_path / "more")
    with pytest.raises(IsADirectoryError, match=r"more is a subdirectory") as e:
        hbmio.stream(str(tmp_path), batch_size=4)
    assert e.value.errno == errno.EISDIR
    # Named by a glob, they reach the library, which names them too.
    os.symlink(tmp_path / "gone.npy", tmp_path / "shard-002.npy")
    with pytest.raises(FileNotFoundError, match=r"shard-002\.npy"):
        next(hbmio.stream(str(tmp_path / "shard-*.npy"), batch_size=4))


# ---- resuming: state_dict / state= / load_state_dict ----

RESUME_COUNTS = [17, 23, 11]  # 51 records; batches of 4; shuffle windows of 12 (several per epoch)
RESUME_OPTIONS = dict(batch_size=4, seed=7, shuffle_window=12, framework="numpy")


@pytest.fixture(scope="module")
def id_shards(tmp_path_factory):
    """Shards whose records are their global index (int64, shape (1,)): a batch names its records exactly."""
    d = tmp_path_factory.mktemp("resume")
    paths, start = [], 0
    for i, n in enumerate(RESUME_COUNTS):
        paths.append(str(d / f"ids-{i}.npy"))
        np.save(paths[-1], np.arange(start, start + n, dtype=np.int64).reshape(n, 1))
        start += n
    return paths


def batch_ids(b):
    return [int(x) for x in b[:, 0]]


def walk(paths, rank, world, **options):
    """Every batch of a rank (as id lists) and the state_dict after each: states[k] after k batches."""
    s = hbmio.stream(paths, rank=rank, world=world, **RESUME_OPTIONS, **options)
    batches, states = [], [s.state_dict()]
    for b in s:
        batches.append(batch_ids(b))
        states.append(s.state_dict())
    return batches, states


def resumed(paths, state, rank, world, **options):
    return [batch_ids(b) for b in hbmio.stream(paths, rank=rank, world=world, state=state, **RESUME_OPTIONS, **options)]


def flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("before", [1, 2, 3, 4, 5])
def test_a_resume_at_every_batch_continues_the_epoch_exactly(id_shards, before, shuffle, drop_last):
    opts = dict(shuffle=shuffle, drop_last=drop_last)
    runs = [walk(id_shards, r, before, **opts) for r in range(before)]
    full = [batches for batches, _ in runs]
    whole = flat(b for batches in full for b in batches)
    assert len(whole) == len(set(whole))
    if not drop_last:
        assert sorted(whole) == list(range(sum(RESUME_COUNTS)))
    most = max(len(b) for b in full)
    assert len(full[0]) == most  # rank 0 has the most batches: its state speaks for all
    for k in range(most + 1):
        # Ranks in lockstep save the same state (but for who saved it).
        lockstep = [{**states[k], "rank": 0} for _, states in runs if len(states) > k]
        assert all(s == lockstep[0] for s in lockstep)
        source = k % before if len(full[k % before]) >= k else 0
        state = runs[source][1][k]
        given = [batches[:k] for batches in full]
        for after in range(1, 6):
            rest = [resumed(id_shards, state, r, after, **opts) for r in range(after)]
            if after == before:  # every rank goes on with exactly its own batches
                assert [g + r for g, r in zip(given, rest)] == full, (k, after)
                continue
            got = flat(b for batches in given + rest for b in batches)
            assert len(got) == len(set(got)), (k, after)  # none twice
            if not drop_last:
                assert sorted(got) == sorted(whole), (k, after)  # every record once
            else:
                assert set(got) <= set(whole), (k, after)
                # Only what does not make a whole batch on every new rank is dropped; every rank as many.
                assert len(whole) - len(got) < after * 4, (k, after)
                assert len({len(r) for r in rest}) == 1 and all(len(b) == 4 for r in rest for b in r), (k, after)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resume_across_epochs(id_shards, drop_last):
    opts = dict(shuffle=True, drop_last=drop_last, epochs=2)
    for before, after in [(2, 3), (3, 2), (2, 2), (4, 1)]:
        fresh = [[], []]  # epoch 1 of an uninterrupted run of `after` ranks, per rank
        for r in range(after):
            s = hbmio.stream(id_shards, rank=r, world=after, **RESUME_OPTIONS, **opts)
            fresh[1].append([batch_ids(b) for b in s if s.epoch == 1])
        runs = [walk(id_shards, r, before, **opts) for r in range(before)]
        per_epoch = len(runs[0][0]) // 2
        for k in range(len(runs[0][0]) + 1):  # every batch of both epochs, the boundary included
            state = runs[0][1][k]
            assert state["epoch"] == (0 if k <= per_epoch else 1)
            rest = []
            for r in range(after):
                s = hbmio.stream(id_shards, rank=r, world=after, state=state, **RESUME_OPTIONS, **opts)
                rest.append([(s.epoch, batch_ids(b)) for b in s])
            if k >= per_epoch:  # at the boundary or in epoch 1
                if k == per_epoch or after == before:
                    expected = [batches[k - per_epoch:] if after == before else batches for batches in fresh[1]]
                    if after == before:  # the same ranks: each continues its own epoch 1
                        expected = [full[per_epoch:][k - per_epoch:] for full, _ in runs]
                    assert [[b for _, b in r] for r in rest] == expected, (before, after, k)
                continue
            # Mid epoch 0: its rest once, then epoch 1 as an uninterrupted run of `after` ranks has it.
            assert [[b for e, b in r if e == 1] for r in rest] == fresh[1], (before, after, k)
            got = flat(b for full, _ in runs for b in full[:k]) + flat(b for r in rest for e, b in r if e == 0)
            assert len(got) == len(set(got))
            if not drop_last:
                assert sorted(got) == list(range(sum(RESUME_COUNTS)))


@pytest.mark.parametrize("world", [4, 6])
def test_ranks_in_different_epochs_resume_exactly_on_the_same_ranks(id_shards, world):
    # Without drop_last, 51 records on 4 ranks are parts of 13, 13, 13 and 12: 4, 4, 4 and 3
    # batches of 4. Stepping in lockstep, rank 3 goes on into epoch 1 while the others finish epoch
    # 0, and so on. At every step, every rank's state (or one with every rank's progress) resumes
    # each rank with exactly its own rest, in order, across the epochs.
    opts = dict(shuffle=True, epochs=3)
    runs = [walk(id_shards, r, world, **opts) for r in range(world)]
    steps = min(len(batches) for batches, _ in runs)
    mixed = 0
    for k in range(steps + 1):
        states = [st[k] for _, st in runs]
        progress = [(st["epoch"], st["batches"]) for st in states]
        mixed += len({e for e, _ in progress}) > 1
        expected = [batches[k:] for batches, _ in runs]
        assert [resumed(id_shards, states, r, world, **opts) for r in range(world)] == expected, k
        low = min(range(world), key=lambda r: progress[r][0])
        s = hbmio.stream(id_shards, rank=low, world=world, **RESUME_OPTIONS, **opts)
        for _ in range(k):
            next(s)
        assert s.progress == progress[low]
        one = s.state_dict(rank_batches=progress)
        assert [resumed(id_shards, one, r, world, **opts) for r in range(world)] == expected, k
        if len({e for e, _ in progress}) > 1:
            assert one["rank_epochs"] != ""
            # Not from a rank ahead (its epoch's pool may not be the earliest's), not on other ranks.
            ahead = max(range(world), key=lambda r: progress[r][0])
            s = hbmio.stream(id_shards, rank=ahead, world=world, **RESUME_OPTIONS, **opts)
            for _ in range(k):
                next(s)
            with pytest.raises(ValueError, match=f"take the state on rank {low}"):
                s.state_dict(rank_batches=progress)
            with pytest.raises(hbmio.StateError, match="different epochs"):
                resumed(id_shards, states, 0, world + 1, **opts)
    assert mixed > 0


def test_an_endless_stream_stops_before_the_last_epoch_there_is(id_shards):
    state = walk(id_shards, 0, 1)[1][1]
    with pytest.raises(hbmio.StateError, match="streams stop before it"):
        resumed(id_shards, dict(state, epoch=2**64 - 1), 0, 1, epochs=0)
    per_epoch = len(walk(id_shards, 0, 1)[0])
    s = hbmio.stream(id_shards, rank=0, world=1, epochs=0, state=dict(state, epoch=2**64 - 2, batches=per_epoch - 2),
                     **RESUME_OPTIONS)
    assert [s.epoch for _ in s] == [2**64 - 2] * 2  # the rest of that epoch, then the end (never epoch 0 again)


def test_a_state_taken_before_a_resumed_ranks_first_batch_is_of_its_own_epoch(tmp_path):
    # 13 records on 4 ranks, one a batch: parts of 4, 3, 3, 3. After 4 steps in lockstep rank 0
    # is at (epoch 0, 4 batches) and the others at (1, 1). Resumed, rank 0 takes one more batch:
    # every rank is at (1, 1). Rank 1's state, taken before its first batch since the resume, with
    # every rank's progress, is of epoch 1 (its position still gives epoch 0, where it resumed
    # from), and resumes every rank with exactly its own rest.
    path = str(tmp_path / "ids.npy")
    np.save(path, np.arange(13, dtype=np.int64).reshape(13, 1))
    opts = dict(batch_size=1, framework="numpy", epochs=3)
    full = []
    for r in range(4):
        full.append([(e, int(b[0, 0])) for e, b in ((s.epoch, b) for s in [hbmio.stream([path], rank=r, world=4, **opts)] for b in s)])
    runs = [hbmio.stream([path], rank=r, world=4, **opts) for r in range(4)]
    for _ in range(4):
        for s in runs:
            next(s)
    states = [s.state_dict() for s in runs]
    assert [s.progress for s in runs] == [(0, 4), (1, 1), (1, 1), (1, 1)]
    assert states[1]["format"] == "hbmio.stream 1" and states[1]["rank_epochs"] == ""
    r0 = hbmio.stream([path], rank=0, world=4, state=states, **opts)
    next(r0)
    r1 = hbmio.stream([path], rank=1, world=4, state=states, **opts)
    progress = [r0.progress] + [r1.progress] * 3
    assert progress == [(1, 1)] * 4
    state = r1.state_dict(rank_batches=progress)
    assert state["epoch"] == 1 and state["format"] == "hbmio.stream 1"
    for r in range(4):
        s = hbmio.stream([path], rank=r, world=4, state=state, **opts)
        assert [(s.epoch, int(b[0, 0])) for b in s] == full[r][len(full[r]) // 3 + 1:], r
    # The list of the ranks' states, taken then: mixed epochs, format 2 (an older hbmio refuses it).
    mixed = [s.state_dict() for s in runs]
    merged = hbmio._stream._merge_states(mixed)
    assert merged["format"] == "hbmio.stream 2" and merged["rank_epochs"] == "0,1,1,1"
    with pytest.raises(hbmio.StateError, match="format"):
        hbmio.stream([path], rank=0, world=4, state=dict(mixed[0], format="hbmio.stream 2"), **opts)


def test_elastic_resumes_chain_and_ranks_out_of_lockstep_give_every_state(id_shards):
    n = sum(RESUME_COUNTS)
    opts = dict(shuffle=True)
    # 3 ranks -> 2 -> 5: every record once.
    got, states = [], []
    for r in range(3):
        batches, st = walk(id_shards, r, 3, **opts)
        got += flat(batches[:2])
        states.append(st[2])
    mid = []
    for r in range(2):
        s = hbmio.stream(id_shards, rank=r, world=2, state=states[r % 3], **RESUME_OPTIONS, **opts)
        got += batch_ids(next(s))
        mid.append(s.state_dict())
    assert mid[0]["pool"] != ""  # the pieces of the epoch no rank had delivered
    assert {**mid[0], "rank": 0} == {**mid[1], "rank": 0}
    for r in range(5):
        got += flat(resumed(id_shards, mid[r % 2], r, 5, **opts))
    assert sorted(got) == list(range(n))
    # Ranks not in lockstep: rank 0 took 3 batches, rank 1 one. Every rank's state (or one with
    # rank_batches) resumes them: on the same ranks each goes on with its own, on 3 all once.
    full = [walk(id_shards, r, 2, **opts)[0] for r in range(2)]
    s0 = walk(id_shards, 0, 2, **opts)[1][3]
    s1 = walk(id_shards, 1, 2, **opts)[1][1]
    for state in ([s0, s1], (s1, s0)):
        assert [resumed(id_shards, state, r, 2, **opts) for r in range(2)] == [full[0][3:], full[1][1:]]
    s = hbmio.stream(id_shards, rank=0, world=2, **RESUME_OPTIONS, **opts)
    for _ in range(3):
        next(s)
    one = s.state_dict(rank_batches=[3, 1])
    assert one["rank_batches"] == "3,1"
    got = flat(full[0][:3] + full[1][:1]) + flat(b for r in range(3) for b in resumed(id_shards, one, r, 3, **opts))
    assert sorted(got) == list(range(n))
    with pytest.raises(ValueError, match="every rank"):
        resumed(id_shards, [s0], 0, 2, **opts)
    # Every rank's state saved right after a resume on another number of ranks, before any batch
    # (a job preempted again at once): they still give the world they resumed from, and as a list
    # they resume every rank, each record once.
    for w1, w2, w3 in ((3, 2, 4), (2, 3, 1), (2, 4, 3)):
        got, states = [], []
        for r in range(w1):
            batches, st = walk(id_shards, r, w1, **opts)
            got += flat(batches[:1])
            states.append(st[1])
        again = [hbmio.stream(id_shards, rank=r, world=w2, state=states[0], **RESUME_OPTIONS, **opts).state_dict()
                 for r in range(w2)]
        for r in range(w3):
            got += flat(resumed(id_shards, again, r, w3, **opts))
        assert sorted(got) == list(range(n)), (w1, w2, w3)


def test_the_state_is_small_plain_and_survives_torch_save_and_load_state_dict(id_shards, tmp_path):
    import json
    s = hbmio.stream(id_shards, shuffle=True, **RESUME_OPTIONS)
    first = [batch_ids(next(s)) for _ in range(3)]
    state = s.state_dict()
    assert all(isinstance(v, (int, str)) for v in state.values()) and len(json.dumps(state)) < 600
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")
    rest = [batch_ids(b) for b in s]
    assert resumed(id_shards, json.loads(json.dumps(loaded)), 0, 1, shuffle=True) == rest
    # load_state_dict on a stream part-way: from the next batch it asks for.
    t = hbmio.stream(id_shards, shuffle=True, **RESUME_OPTIONS)
    next(t)
    t.load_state_dict(loaded)
    assert [batch_ids(b) for b in t] == rest
    assert len(first + rest) == 13


def test_a_stream_is_a_dcp_stateful(id_shards, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings
    s = hbmio.stream(id_shards, shuffle=True, **RESUME_OPTIONS)
    next(s), next(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"stream": s}, checkpoint_id=str(tmp_path / "ckpt"))
        rest = [batch_ids(b) for b in s]
        t = hbmio.stream(id_shards, shuffle=True, **RESUME_OPTIONS)
        dcp.load({"stream": t}, checkpoint_id=str(tmp_path / "ckpt"))
    assert [batch_ids(b) for b in t] == rest


def test_a_state_of_other_shards_or_options_is_refused(id_shards, tmp_path):
    s = hbmio.stream(id_shards, shuffle=True, **RESUME_OPTIONS)
    next(s)
    state = s.state_dict()
    opts = dict(RESUME_OPTIONS, shuffle=True)

    def refused(paths=id_shards, state=state, says="", **change):
        with pytest.raises(ValueError, match=says):
            hbmio.stream(paths, state=state, **dict(opts, **change))

    refused(says="seed=7; this stream's is seed=8", seed=8)
    refused(says="shuffle=1; this stream's is shuffle=0", shuffle=False)
    refused(says="drop_last", drop_last=True)
    refused(says="shuffle_window", shuffle_window=0)
    refused(says="batches of 4 records; this stream's are 5", batch_size=5)
    # Other shards: one fewer, another size, other records of the same bytes, the same sizes with another header.
    refused(id_shards[:2], says="other shards")
    other = tmp_path / "other"
    other.mkdir()
    for i, n in enumerate(RESUME_COUNTS):
        np.save(other / f"ids-{i}.npy", np.arange(n + (i == 1), dtype=np.int64).reshape(-1, 1))
    refused(sorted(str(p) for p in other.iterdir()), says="other shards")
    for i, n in enumerate(RESUME_COUNTS):
        np.save(other / f"ids-{i}.npy", np.arange(2 * n, dtype=np.int32).reshape(n, 2))
    refused(sorted(str(p) for p in other.iterdir()), says="records :I32\\[2\\]|is of records")
    # Not a state, or a damaged one.
    refused(state={"epoch": 0}, says="not a stream state")
    refused(state=dict(state, batches="x"), says="'batches'")
    refused(state=dict(state, pool="5:3"), says="pieces")
    refused(state=dict(state, rank_batches="1,2,3"), says="3 ranks for a world of 1")
    # The same shards copied elsewhere resume (names, sizes and headers, not directories).
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in id_shards:
        (copy / os.path.basename(p)).write_bytes(open(p, "rb").read())
    rest = [batch_ids(b) for b in s]
    assert resumed(sorted(str(p) for p in copy.iterdir()), state, 0, 1, shuffle=True) == rest


@needs_gpu
def test_a_pinned_batch_is_not_read_into_before_its_copy_to_the_gpu_has_run(tmp_path):
    # The usual pinned-loader step: batch.to("cuda", non_blocking=True), then the next batch. The
    # copy runs later, behind the work already queued on the stream (here a long one): the batch's
    # buffer must not be read into again before it has, or the GPU gets another batch's bytes.
    torch = pytest.importorskip("torch")
    paths, rows = npy_shards(tmp_path, [64] * 16, record_shape=(4096,))
    s = hbmio.stream(paths, "pinned", batch_size=64, read_ahead=1)
    a = torch.randn(4096, 4096, device="cuda")
    copies = []
    for batch in s:
        for _ in range(8):  # keep the stream busy, so the copy below waits
            a = a @ a
            a /= a.norm()
        copies.append(batch.to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    got = torch.cat(copies).cpu().numpy()
    assert got.shape == rows.shape
    assert np.array_equal(got, rows), "a copy to the GPU read a buffer already read into again"
