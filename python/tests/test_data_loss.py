"""Data-loss regression test: a load racing a replacement of the file it reads.

A child process saves A and B in turn at one path with hbmio.save_file (same tensor names, dtypes
and shapes, different bytes, and metadata of different lengths, so the headers and every tensor's
offset in the file differ); this process loads the path again and again. Every load must return
exactly A or exactly B (every tensor from the same one), or raise hbmio.Error; never bytes that no
published file held. With verify=True, additionally never a checksum failure: every file ever
published carries valid checksums.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import hbmio

LOADS = 200
TIME_LIMIT = 20.0  # seconds, per test

# Run in this process and in the writer: the two contents, made the same way in both.
CONTENTS = r"""
import numpy as np
def contents():
    out = {}
    for tag, seed, meta in (("a", 1, "a"), ("b", 2, "b" * 3000)):
        rng = np.random.default_rng(seed)
        tensors = {f"layers.{i}.weight": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(4)}
        tensors["layers.4.bias"] = rng.integers(0, 1 << 30, size=(4097,), dtype=np.int64)
        out[tag] = (tensors, {"v": meta})
    return out
"""

WRITER = CONTENTS + r"""
import os, sys
import hbmio
path, stop = sys.argv[1], sys.argv[2]
both = contents()
hbmio.save_file(both["a"][0], path, metadata=both["a"][1])
print("ready", flush=True)
n = 0
while not os.path.exists(stop):
    tag = "b" if n % 2 == 0 else "a"
    # posix: no io_uring set-up per save, so a save takes a few ms and many land during the loads
    hbmio.save_file(both[tag][0], path, metadata=both[tag][1], backend="posix")
    n += 1
print(n, flush=True)
"""


def _contents():
    scope: dict = {}
    exec(CONTENTS, scope)  # noqa: S102 - our own constant, shared with the writer process
    return scope["contents"]()


def _which(loaded: dict, contents: dict) -> str:
    """'a' or 'b' where every tensor equals that content's exactly, else a description."""
    verdicts = {}
    for name in contents["a"][0]:
        got = loaded.get(name)
        if got is None:
            verdicts[name] = "missing"
            continue
        got = np.asarray(got)
        matches = [tag for tag in ("a", "b")
                   if got.dtype == contents[tag][0][name].dtype and got.shape == contents[tag][0][name].shape
                   and got.tobytes() == contents[tag][0][name].tobytes()]  # bytes, not values
        verdicts[name] = matches[0] if matches else "neither"
    if set(loaded) != set(contents["a"][0]):
        return f"tensors {sorted(loaded)}"
    kinds = set(verdicts.values())
    if len(kinds) == 1 and kinds <= {"a", "b"}:
        return kinds.pop()
    return ", ".join(f"{n}={v}" for n, v in verdicts.items())


@pytest.fixture
def race_dir(tmp_path):
    """A directory in memory (/dev/shm) where there is one: saves there cost no disk flush, so
    the writer replaces the file many times while the loads run (more chances to hit the race);
    else pytest's tmp_path."""
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = pathlib.Path(tempfile.mkdtemp(prefix="hbmio-race-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


def _race(directory: pathlib.Path, verify: bool):
    path = directory / "model.safetensors"
    stop = directory / "stop"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same hbmio as this process
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(stop)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        contents = _contents()
        seen = {"a": 0, "b": 0}
        errors = []
        wrong = []
        deadline = time.monotonic() + TIME_LIMIT
        for i in range(LOADS):
            if time.monotonic() > deadline:
                break
            try:
                loaded = hbmio.load_file(path, framework="numpy", verify=verify)
            except hbmio.Error as e:  # a clean failure is allowed, wrong data never
                errors.append(str(e))
                continue
            verdict = _which(loaded, contents)
            if verdict in seen:
                seen[verdict] += 1
            else:
                wrong.append(f"load {i}: {verdict}")
            del loaded
            if writer.poll() is not None:
                break
    finally:
        stop.touch()
        try:
            out, err = writer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            out, err = writer.communicate()
    assert writer.returncode == 0, f"the writer failed: {err}"
    saves = int(out.split()[-1])
    summary = f"{seen['a']} loads of A, {seen['b']} of B, {len(errors)} errors, {saves} saves"
    print(summary)
    assert not wrong, f"loads that returned neither A nor B ({summary}): {wrong[:5]}"
    if verify:
        # A failed check reads "verify of FILE ...: ... stored checksum X, computed Y" (or names
        # the tensor, stored and computed).
        bad = [e for e in errors if "verify of" in e or "checksum" in e.lower() or "computed" in e]
        assert not bad, f"false checksum failures ({summary}): {bad[:3]}"
    # The race ran: both versions were loaded (a writer too slow for that would test nothing).
    assert seen["a"] > 0 and seen["b"] > 0, summary
    assert saves >= 2, summary
    return seen, errors


def test_load_racing_replacement_is_old_or_new(race_dir):
    _race(race_dir, verify=False)


def test_verified_load_racing_replacement_never_fails_a_checksum(race_dir):
    _race(race_dir, verify=True)
