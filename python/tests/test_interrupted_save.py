"""save_file stopped part way: by Ctrl-C (KeyboardInterrupt) and by SIGTERM/SIGKILL.

A child process saves 384 MiB over an existing checkpoint and is signalled once its save is
writing. Afterwards the path must hold the complete old checkpoint or the complete new one, and no
temporary file may be left in the directory: Ctrl-C stops the save before it publishes and removes
what it wrote; SIGTERM and SIGKILL end the process outright, and the new file, written unnamed
(O_TMPFILE), vanishes with it.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hbmio

CHILD = textwrap.dedent("""
    import sys, numpy as np, hbmio
    path = sys.argv[1]
    tensors = {f"t{i}": np.full(48 << 20, i + 7, dtype=np.uint8) for i in range(8)}
    print("ready", flush=True)
    try:
        hbmio.save_file(tensors, path, backend="posix")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
    print("saved", flush=True)
""")


def temporaries(directory: pathlib.Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".hbmio-tmp-" in p.name]


def writing(pid: int, directory: pathlib.Path) -> bool:
    """Whether the child holds its new file open: unnamed ("DIR/#N (deleted)") or a temporary name."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(f"{directory}/#") or ".hbmio-tmp-" in link for link in links)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_save_leaves_the_old_checkpoint_and_nothing_else(tmp_path, sig):
    path = tmp_path / "m.safetensors"
    old = {"old": np.arange(1000, dtype=np.int32)}
    hbmio.save_file(old, path)
    old_bytes = path.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not writing(child.pid, tmp_path):
            assert child.poll() is None, "the child ended before its save started writing"
            assert time.monotonic() < deadline, "the child's save never started writing"
            time.sleep(0.005)
        child.send_signal(sig)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert temporaries(tmp_path) == [], f"left behind: {temporaries(tmp_path)}"
    loaded = hbmio.load_file(path, framework="numpy", verify=True)
    if sig == signal.SIGINT:
        # KeyboardInterrupt reaches the caller once the save has stopped (or, had it published
        # already, finished): the file is then the old one or the whole new one.
        assert child.returncode == 3 and "interrupted" in out, (child.returncode, out)
    else:
        assert child.returncode == -sig, child.returncode
    if path.read_bytes() != old_bytes:
        assert sorted(loaded) == [f"t{i}" for i in range(8)], sorted(loaded)
        assert all(int(loaded[f"t{i}"][0]) == i + 7 for i in range(8))
    else:
        assert list(loaded) == ["old"]


def test_ctrl_c_while_another_process_holds_the_files_lock_stops_the_save(tmp_path):
    """A save waits for a rewrite in place of the file (a flock on it) before it publishes; Ctrl-C
    during that wait stops the save at once, the old file in place, nothing left behind."""
    import fcntl
    path = tmp_path / "m.safetensors"
    hbmio.save_file({"old": np.arange(1000, dtype=np.int32)}, path)
    old_bytes = path.read_bytes()
    holder = open(path, "rb")
    fcntl.flock(holder, fcntl.LOCK_EX)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"

        def written():  # bytes the child has written (its 384 MiB save, then it waits for the lock)
            with open(f"/proc/{child.pid}/io") as io:
                return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
        deadline = time.monotonic() + 60
        while written() < 384 << 20:
            assert child.poll() is None, "the save did not wait for the lock"
            assert time.monotonic() < deadline, "the child's save never wrote its data"
            time.sleep(0.01)
        time.sleep(0.5)  # its fsync
        assert child.poll() is None, "the save did not wait for the lock"
        started = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=20)
        stopped_in = time.monotonic() - started
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 3 and "interrupted" in out, (child.returncode, out)
    assert stopped_in < 5, f"Ctrl-C took {stopped_in:.1f} s while the lock was held"
    assert path.read_bytes() == old_bytes
    assert temporaries(tmp_path) == [], f"left behind: {temporaries(tmp_path)}"
