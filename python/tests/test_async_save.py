"""hbmio.save_file(..., blocking=False): the file holds the tensors as they were at the call, byte
for byte (read back with the reference safetensors), whatever the caller does to them afterwards;
the pinned pool is reused and memory stays flat over many saves; failures in the background reach
result(), the next save of the path, or the exit handler; a process killed while a background
save persists leaves the complete old or complete new file.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hbmio

st_numpy = pytest.importorskip("safetensors.numpy", reason="the reference safetensors is not installed")


def state(seed, big=False):
    rng = np.random.default_rng(seed)
    out = {
        "embed": rng.integers(0, 255, size=(3 << 20,), dtype=np.uint8),
        "norm": rng.standard_normal(1000).astype(np.float32),
        "scalar": np.array(seed, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float16),
    }
    if big:
        out["big"] = rng.integers(0, 255, size=(70 << 20,), dtype=np.uint8)  # larger than a staging block
    return out


def snapshot(tensors):
    return {k: v.copy() for k, v in tensors.items()}


def assert_file_holds(path, expected):
    got = st_numpy.load_file(str(path))
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), f"{k}: the file does not hold the values at the call"


@pytest.mark.parametrize("big", [False, True], ids=["small", "larger-than-a-block"])
def test_the_file_holds_the_values_at_the_call(tmp_path, big):
    tensors = state(1, big)
    expected = snapshot(tensors)
    handle = hbmio.save_file(tensors, tmp_path / "m.safetensors", {"step": "1"}, blocking=False,
                             pool_bytes=128 << 20)
    for v in tensors.values():  # the next training step overwrites everything at once
        v[...] = 0 if v.dtype != np.float32 else np.float32(-1)
    handle.result()
    assert handle.done()
    assert_file_holds(tmp_path / "m.safetensors", expected)
    report = handle.report
    assert report["staging"] == "pinned"
    assert report["staged_bytes"] == sum(v.nbytes for v in expected.values())
    assert report["persist_seconds"] > 0 and report["snapshot_seconds"] >= report["stalled_seconds"] >= 0
    # The same bytes as a blocking save of the snapshot.
    hbmio.save_file(expected, tmp_path / "sync.safetensors", {"step": "1"})
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "sync.safetensors").read_bytes()


BLOCK = 64 << 20  # the pinned pool's block
ODD_SIZES = [1, 4095, 4097, (3 << 20) + 17, BLOCK - 5, 1000, BLOCK + (1 << 20) + 3, 0, 12345, (8 << 20) + 1,
             (31 << 20) + 4093]


def odd_state(seed):
    """Tensors of odd sizes, three pool blocks in all: the writer's rounds end inside tensors and
    off the 4 KiB grid."""
    rng = np.random.default_rng(seed)
    return {f"t{i:02}": rng.integers(0, 255, size=n, dtype=np.uint8) for i, n in enumerate(ODD_SIZES)}


def read_independently(path):
    """Each tensor's bytes, sliced at the offsets of the header as parsed here (nothing of hbmio's
    or the reference's readers)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in header.items()
            if k != "__metadata__"}


@pytest.mark.parametrize("blocks", [1, 3], ids=["pool-of-one-block", "pool-of-three"])
def test_writes_overlapping_the_snapshot_put_every_byte_where_it_belongs(tmp_path, blocks):
    """The writer takes what the snapshot has staged while the snapshot goes on (with a pool of
    one block, a round per block while the call waits for it): every byte lands where it belongs,
    nothing the caller wrote after the call returned does, and the file is the blocking save's."""
    tensors = odd_state(3)
    expected = snapshot(tensors)
    handle = hbmio.save_file(tensors, tmp_path / "m.safetensors", {"step": "3"}, blocking=False,
                             pool_bytes=blocks * BLOCK)
    for v in tensors.values():
        v[...] = 0
    handle.result()
    got = read_independently(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k] == v.tobytes(), f"{k}: the file does not hold the values at the call"
    hbmio.save_file(expected, tmp_path / "sync.safetensors", {"step": "3"})
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "sync.safetensors").read_bytes()


# A write failing while the snapshot still copies: a file system that fills up at 40 MiB (by
# RLIMIT_FSIZE; SIGXFSZ ignored), a state of three pool blocks and a pool of one, so the snapshot
# cannot take a second block before the first is written.
FULL_MID_SNAPSHOT = textwrap.dedent("""
    import json, resource, signal, sys, numpy as np, hbmio
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    path, backend, sizes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rng = np.random.default_rng(4)
    tensors = {f"t{i:02}": rng.integers(0, 255, size=n, dtype=np.uint8) for i, n in enumerate(sizes)}
    resource.setrlimit(resource.RLIMIT_FSIZE, (40 << 20, 40 << 20))
    handle = hbmio.save_file(tensors, path, blocking=False, pool_bytes=64 << 20, backend=backend or None)
    out = {"staged": handle.report["staged_bytes"], "total": sum(v.nbytes for v in tensors.values())}
    try:
        handle.result()
        out["error"] = None
    except hbmio.Error as e:
        out["error"] = str(e)
    print(json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("backend", ["posix", ""], ids=["posix", "default-backend"])
def test_a_write_failing_mid_snapshot_fails_the_save_and_keeps_the_old_file(tmp_path, backend):
    path = tmp_path / "m.safetensors"
    hbmio.save_file(odd_state(5), path)
    old_bytes = path.read_bytes()
    run = subprocess.run([sys.executable, "-c", FULL_MID_SNAPSHOT, str(path), backend, json.dumps(ODD_SIZES)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["error"] and "File too large" in out["error"], out
    assert out["staged"] < out["total"], out  # the snapshot stopped instead of copying for nobody
    assert path.read_bytes() == old_bytes
    assert not [p for p in tmp_path.iterdir() if ".hbmio-tmp-" in p.name]


def test_torch_tensors_and_a_sharded_directory(tmp_path):
    torch = pytest.importorskip("torch")
    import hbmio.torch
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state(2, True).items()}
    expected = {k: v.numpy().copy() for k, v in tensors.items()}
    handle = hbmio.torch.save_file(tensors, tmp_path / "ckpt", max_shard_size="20MiB", blocking=False)
    for v in tensors.values():
        v.zero_()
    handle.result()
    loaded = hbmio.load_file(tmp_path / "ckpt", framework="numpy", verify=True)
    assert sorted(loaded) == sorted(expected)
    for k, v in expected.items():
        assert np.asarray(loaded[k]).tobytes() == v.tobytes(), k


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_hundred_saves_reuse_the_pool_and_memory_stays_flat(tmp_path):
    tensors = state(3)
    capacity = 64 << 20  # one block: every save reuses it
    handles = []

    def saves(n):
        # Four paths in rotation, up to five saves in flight (the fifth waits for the pool's block).
        for i in range(n):
            tensors["scalar"][...] = i
            handles.append(hbmio.save_file(tensors, tmp_path / f"s{i % 4}.safetensors", blocking=False, pool_bytes=capacity))
            if len(handles) > 4:
                handles.pop(0).result()
            _, allocated, _ = hbmio._hbmio._staging_pool()
            assert allocated <= capacity
        while handles:
            handles.pop(0).result()

    saves(20)  # the same pattern first: the pool's block, an engine per save in flight
    # The engine pool keeps up to 4 idle engines (tens of MiB of bounce buffers each); how many
    # saves overlap, and so how many engines it holds, depends on the machine's cores and load.
    # Its bound is checked, and it is emptied at both ends, so what is measured is what the saves
    # themselves keep.
    assert sum(hbmio._hbmio._idle_engines().values()) <= 4
    hbmio._hbmio._release_engines()
    before = rss_bytes()
    saves(100)
    assert sum(hbmio._hbmio._idle_engines().values()) <= 4
    hbmio._hbmio._release_engines()
    grown = rss_bytes() - before
    assert grown < 16 << 20, f"resident memory grew by {grown >> 20} MiB over 100 background saves"
    _, allocated, in_use = hbmio._hbmio._staging_pool()
    assert in_use == 0 and allocated <= capacity
    assert st_numpy.load_file(str(tmp_path / "s3.safetensors"))["scalar"] == 99


def test_one_save_of_a_path_at_a_time(tmp_path):
    path = tmp_path / "m.safetensors"
    first, second = state(4), state(5)
    hbmio.save_file(first, path)
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the save's rename waits for the lock of the file it replaces
        handle = hbmio.save_file(first, path, blocking=False)
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.2)
        with pytest.raises(hbmio.Error, match="still in flight"):
            hbmio.save_file(second, path, blocking=False, wait_if_busy=False)
    handle.result()
    hbmio.save_file(second, path, blocking=False).result()
    assert_file_holds(path, second)


def test_a_blocking_save_and_a_background_save_of_one_path_take_turns(tmp_path):
    """A background save started while a blocking save of the same path runs waits for it, so the
    newer state publishes last (it did not wait: the blocking save's older state won)."""
    import threading
    path = tmp_path / "m.safetensors"
    older = {"w": np.full(128 << 20, 1, dtype=np.uint8)}
    newer = {"w": np.full(4, 2, dtype=np.uint8)}
    hbmio.save_file(older, path)  # a file whose lock the next blocking save's rename waits on
    held = open(path, "rb")
    fcntl.flock(held, fcntl.LOCK_EX)
    blocking = threading.Thread(target=hbmio.save_file, args=(older, path))
    blocking.start()
    time.sleep(0.5)  # the blocking save is in its persist, waiting at the rename
    with pytest.raises(hbmio.Error, match="still in flight"):
        hbmio.save_file(newer, path, blocking=False, wait_if_busy=False)
    # The lock goes in a moment; meanwhile the background save waits (in the call) for its turn.
    threading.Timer(0.3, held.close).start()
    handle = hbmio.save_file(newer, path, blocking=False)
    assert handle.report["stalled_seconds"] > 0.1, handle.report
    blocking.join()
    handle.result()
    assert_file_holds(path, newer)


@pytest.mark.parametrize("how", ["load_file", "mmap", "open"])
def test_a_load_right_after_a_background_save_reads_what_it_publishes(tmp_path, how):
    """Read your own writes: a load of the path while this process's background save of it is in
    flight waits for it (it returned the file the save replaces)."""
    import threading
    path = tmp_path / "m.safetensors"
    older, newer = state(6), state(7)
    hbmio.save_file(older, path)
    held = open(path, "rb")
    fcntl.flock(held, fcntl.LOCK_EX)  # the save's rename waits for this lock
    handle = hbmio.save_file(newer, path, blocking=False)
    threading.Timer(0.3, held.close).start()
    if how == "open":
        with hbmio.open(path, framework="numpy") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
    else:
        got = hbmio.load_file(path, framework="numpy", mmap=how == "mmap")
    assert handle.done()
    assert sorted(got) == sorted(newer)
    for k, v in newer.items():
        assert got[k].tobytes() == v.tobytes(), k
    handle.result()


def test_a_sharded_save_of_nothing_loads_as_nothing(tmp_path):
    """An empty state saved with max_shard_size is one empty model.safetensors (no index naming no
    shard, which loads refuse), in the foreground and in the background."""
    for blocking in (True, False):
        out = tmp_path / f"empty-{blocking}"
        handle = hbmio.save_file({}, out, max_shard_size=1000, metadata={"step": "3"}, blocking=blocking)
        if not blocking:
            handle.result()
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        assert hbmio.load_file(out, framework="numpy") == {}
        with hbmio.open(out, framework="numpy") as f:
            assert list(f.keys()) == [] and f.metadata()["step"] == "3"


def test_one_save_at_a_time_whatever_the_spelling_of_the_path(tmp_path, monkeypatch):
    """"x", "./x", "d/./x" and a path through a symbolic link to the directory are one path: a
    second save waits for the first however it is spelled."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "link")
    first, second = state(4), state(5)
    hbmio.save_file(first, "d/m.safetensors")
    for spelling in ("./d/m.safetensors", "d/./m.safetensors", "link/m.safetensors", str(tmp_path / "d" / "m.safetensors")):
        with open(tmp_path / "d" / "m.safetensors", "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            handle = hbmio.save_file(first, "d/m.safetensors", blocking=False)
            with pytest.raises(hbmio.Error, match="still in flight"):
                hbmio.save_file(second, spelling, blocking=False, wait_if_busy=False)
        handle.result()
    hbmio.save_file(second, "link/m.safetensors", blocking=False).result()
    assert_file_holds(tmp_path / "d" / "m.safetensors", second)


def test_bad_arguments_are_raised_by_the_call(tmp_path):
    with pytest.raises(FileNotFoundError):
        hbmio.save_file(state(6), tmp_path / "missing" / "m.safetensors", blocking=False)
    with pytest.raises(ValueError, match="staging"):
        hbmio.save_file(state(6), tmp_path / "m.safetensors", blocking=False, staging="disk")
    with pytest.raises(ValueError, match="progress"):
        hbmio.save_file(state(6), tmp_path / "m.safetensors", blocking=False, progress=True)
    assert not (tmp_path / "m.safetensors").exists()


# A file system that fills up, by RLIMIT_FSIZE: writes past 1 MiB fail with EFBIG (SIGXFSZ ignored).
FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, numpy as np, hbmio
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    path, mode = sys.argv[1], sys.argv[2]
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    big = {"t": np.full(4 << 20, 7, dtype=np.uint8)}
    handle = hbmio.save_file(big, path, blocking=False, backend="posix")
    print("returned", flush=True)
    if mode == "wait":
        try:
            handle.result()
        except hbmio.Error as e:
            print("raised:", e, flush=True)
        try:
            hbmio.save_file({"u": np.ones(10, dtype=np.uint8)}, path, blocking=False).result()
            print("next save ok", flush=True)
        except hbmio.Error as e:
            print("next save raised:", e, flush=True)
    elif mode in ("next", "next-blocking"):
        del handle
        try:
            if mode == "next":
                hbmio.save_file({"u": np.ones(10, dtype=np.uint8)}, path, blocking=False).result()
            else:
                hbmio.save_file({"u": np.ones(10, dtype=np.uint8)}, path)
            print("next save ok", flush=True)
        except hbmio.Error as e:
            print("next save raised:", e, flush=True)
    # mode "exit": nobody asks; the exit handler waits and says so
""")


@pytest.mark.parametrize("mode", ["wait", "next", "next-blocking", "exit"])
def test_a_failure_in_the_background_is_never_lost(tmp_path, mode):
    path = tmp_path / "m.safetensors"
    old = {"old": np.arange(100, dtype=np.int32)}
    hbmio.save_file(old, path)
    old_bytes = path.read_bytes()
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(path), mode], capture_output=True, text=True, timeout=120)
    # A failure nobody saw makes the exit status 1, as the error would have had it been raised.
    assert run.returncode == (1 if mode == "exit" else 0), (run.returncode, run.stderr)
    assert run.stdout.startswith("returned")
    if mode == "wait":
        assert "raised:" in run.stdout and "File too large" in run.stdout, run.stdout
        assert "next save ok" in run.stdout, run.stdout
        assert_file_holds(path, {"u": np.ones(10, dtype=np.uint8)})
    elif mode in ("next", "next-blocking"):
        assert "next save raised:" in run.stdout and "never waited for" in run.stdout, run.stdout
        assert path.read_bytes() == old_bytes
    else:
        assert "a background save failed and nobody waited for it" in run.stderr, run.stderr
        assert path.read_bytes() == old_bytes
    assert not [p for p in tmp_path.iterdir() if ".hbmio-tmp-" in p.name]


def test_result_refuses_a_nan_timeout(tmp_path):
    """timeout=nan never compares as passed: it was a wait without end. It is a ValueError now,
    raised at once, whether or not the save is done; other bad types are a TypeError."""
    handle = hbmio.save_file(state(2), tmp_path / "m.safetensors", blocking=False)
    with pytest.raises(ValueError, match="NaN"):
        handle.result(timeout=float("nan"))
    with pytest.raises(TypeError):
        handle.result(timeout="1")
    handle.result(timeout=float("inf"))  # no limit, as None
    handle.result(timeout=-1)  # done: a negative timeout is 0
    assert_file_holds(tmp_path / "m.safetensors", state(2))


# os.fork() while background saves are in flight (or just finished: the test holds either way).
# The parent's two saves are 128 MiB each, fork follows their calls at once. The child saves to
# the parent's path and to one of its own, with a pool smaller than its state (so its snapshot
# needs blocks given back), leaves one save to the exit handler and makes a blocking one, and
# exits. Before the fix the child hung at exit, on the save of the parent's path, or on the pool.
FORK = textwrap.dedent("""
    import os, sys, numpy as np, hbmio
    shared, mine, other = sys.argv[1:4]
    parent = {f"p{k}": np.full(64 << 20, k + 1, dtype=np.uint8) for k in range(2)}
    to_shared = hbmio.save_file(parent, shared, blocking=False, pool_bytes=512 << 20)
    to_mine = hbmio.save_file(parent, mine, blocking=False)
    done_before = to_shared.done() and to_mine.done()
    pid = os.fork()
    if pid == 0:
        child = {"c": np.full(96 << 20, 9, dtype=np.uint8)}
        try:
            hbmio.save_file(child, shared, blocking=False, pool_bytes=64 << 20).result()
            hbmio.save_file(child, other, blocking=False, pool_bytes=64 << 20).result()
            hbmio.save_file(child, other + ".exit", blocking=False, pool_bytes=64 << 20)  # the exit handler waits
            hbmio.save_file(child, other + ".blocking")
            print("child saved", flush=True)
        except hbmio.Error as e:
            print("child save raised:", e, flush=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status), "done before fork", done_before, flush=True)
    to_shared.result()
    to_mine.result()
    print("parent saved", flush=True)
""")


def test_fork_during_a_background_save(tmp_path):
    shared, mine, other = (str(tmp_path / n) for n in ("shared.safetensors", "mine.safetensors", "other.safetensors"))
    run = subprocess.run([sys.executable, "-c", FORK, shared, mine, other], capture_output=True, text=True,
                         timeout=120)  # the bound on a hang, not a measurement
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "child exit 0" in run.stdout and "parent saved" in run.stdout, (run.stdout, run.stderr)
    parent = {f"p{k}": np.full(64 << 20, k + 1, dtype=np.uint8) for k in range(2)}
    child = {"c": np.full(96 << 20, 9, dtype=np.uint8)}
    assert_file_holds(mine, parent)
    if hbmio.cuda_device_count() == 0:  # (CUDA, used by pinned staging there, cannot be used after fork)
        assert "child saved" in run.stdout, (run.stdout, run.stderr)
        for path in (other, other + ".exit", other + ".blocking"):
            assert_file_holds(path, child)
        # The shared path holds one of the two states whole: whichever save published last.
        got = st_numpy.load_file(shared)
        assert sorted(got) in (sorted(parent), sorted(child))
        assert_file_holds(shared, parent if "p0" in got else child)
    # The child says once that it inherited saves in flight, and only if there were some.
    warned = run.stderr.count("forked while")
    assert warned <= 1, run.stderr
    if "done before fork True" in run.stdout:
        assert warned == 0, run.stderr
    if warned:
        assert shared in run.stderr or mine in run.stderr, run.stderr
    assert not [p for p in tmp_path.iterdir() if ".hbmio-tmp-" in p.name]


# A multiprocessing worker started by fork ends with os._exit, past atexit: its background save
# must still be finished before it goes (it was dropped, the file never written, exit status 0).
MP_WORKER = textwrap.dedent("""
    import multiprocessing as mp, sys, numpy as np, hbmio
    def work(path):
        hbmio.save_file({"w": np.full(96 << 20, 5, dtype=np.uint8)}, path, blocking=False)
    if __name__ == "__main__":
        p = mp.get_context("fork").Process(target=work, args=(sys.argv[1],))
        p.start()
        p.join()
        print("worker exit", p.exitcode)
""")


def test_a_fork_started_worker_finishes_its_background_save(tmp_path):
    path = str(tmp_path / "w.safetensors")
    run = subprocess.run([sys.executable, "-c", MP_WORKER, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "worker exit 0" in run.stdout, (run.stdout, run.stderr)
    assert_file_holds(path, {"w": np.full(96 << 20, 5, dtype=np.uint8)})


# Ctrl-C while save_file(blocking=False) blocks in its snapshot (a state 4 times the pool). The
# interrupt comes from inside the process, from a thread started by an array's __dlpack__ (called
# as the save collects the arrays): it waits until the pinned pool has blocks in use, that is until
# the snapshot is copying (it cannot finish before the writer has drained three pools' worth), and
# then sends SIGINT as the terminal would. Before the fix the KeyboardInterrupt came after the
# call had returned, and the save ran on to publish.
INTERRUPTED = textwrap.dedent("""
    import _thread, sys, time, numpy as np, hbmio
    path = sys.argv[1]

    def press_ctrl_c_during_the_snapshot():
        while hbmio._hbmio._staging_pool()[2] == 0:  # no block in use yet: not copying yet
            time.sleep(0.001)
        _thread.interrupt_main()  # SIGINT, as the terminal sends it

    class Interrupting:
        def __init__(self, array):
            self.array = array
        def __dlpack__(self, **kwargs):
            _thread.start_new_thread(press_ctrl_c_during_the_snapshot, ())
            return self.array.__dlpack__(**kwargs)
        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    big = {f"t{k}": np.full(64 << 20, k + 1, dtype=np.uint8) for k in range(4)}
    big["last"] = Interrupting(np.full(1 << 20, 7, dtype=np.uint8))
    try:
        hbmio.save_file(big, path, blocking=False, pool_bytes=64 << 20)
        print("returned a handle", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def test_ctrl_c_during_a_blocking_snapshot_stops_the_save(tmp_path):
    path = tmp_path / "m.safetensors"
    old = {"old": np.arange(100, dtype=np.int32)}
    hbmio.save_file(old, path)
    old_bytes = path.read_bytes()
    run = subprocess.run([sys.executable, "-c", INTERRUPTED, str(path)], capture_output=True, text=True,
                         timeout=120)  # the bound on a hang, not a measurement
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stdout.strip() == "interrupted", (run.stdout, run.stderr)
    # The process has exited (its exit handler waited for every save): nothing was published.
    assert path.read_bytes() == old_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


# Background saves in a loop, each over the last; the parent kills the process at some point of
# a persist.
SAVER = textwrap.dedent("""
    import sys, numpy as np, hbmio
    path = sys.argv[1]
    print("ready", flush=True)
    for i in range(1000):
        tensors = {f"t{k}": np.full(24 << 20, (i * 8 + k) % 251, dtype=np.uint8) for k in range(4)}
        hbmio.save_file(tensors, path, blocking=False, backend="posix").result()
        print(i, flush=True)
""")


def test_a_process_killed_while_a_background_save_persists_leaves_a_whole_checkpoint(tmp_path):
    path = tmp_path / "m.safetensors"
    for delay in (0.05, 0.3, 0.7, 1.1):
        child = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(delay)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        if not path.exists():
            continue  # killed before the first save published: nothing there, as before it
        got = st_numpy.load_file(str(path))
        assert sorted(got) == [f"t{k}" for k in range(4)]
        first = int(got["t0"][0])
        for k in range(4):  # every tensor of one and the same save
            assert np.all(got[f"t{k}"] == (first + k) % 251), delay
        hbmio.load_file(path, framework="numpy", verify=True)  # its checksums hold
        assert not [p for p in tmp_path.iterdir() if ".hbmio-tmp-" in p.name]


@pytest.mark.skipif(hbmio.cuda_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("staging", ["pinned", "device"])
def test_cuda_tensors_changed_by_the_next_step(tmp_path, staging):
    torch = pytest.importorskip("torch")
    import hbmio.torch
    gen = torch.Generator(device="cuda").manual_seed(7)
    tensors = {f"w{i}": torch.randn(1 << 20, device="cuda", generator=gen) for i in range(8)}
    expected = {k: v.cpu().numpy().copy() for k, v in tensors.items()}
    handle = hbmio.torch.save_file(tensors, tmp_path / "m.safetensors", blocking=False, staging=staging)
    for v in tensors.values():
        v.mul_(3).add_(1)  # queued on the current stream right after the call
    handle.result()
    assert handle.report["staging"] == staging
    assert_file_holds(tmp_path / "m.safetensors", expected)
