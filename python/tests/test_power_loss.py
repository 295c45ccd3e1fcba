"""Power loss at every step of a save, and disk errors at every step, through CrashFS (crashfs.py).

For each save shape, the save runs once over the old checkpoint on a CrashFS mount, which logs
every operation and records every distinct state a power cut after each one could leave (file
data up to its last fsync, optionally torn; directory operations as ordered prefixes). Each state
is then served through the mount, as after a reboot, and must hold the complete old or the
complete new checkpoint, pass `hbmio ckpt verify`, and take the next save: after it, the path holds
exactly that save's checkpoint and no temporary is left. Then each write, fsync, rename and
directory fsync of the save fails in turn (EIO, ENOSPC): the save must fail naming the step (or,
failing after it published, say so), keep the old checkpoint, and never publish after a failed
fsync (no retry: fsyncgate).

Every point of every shape, in about 20 s; `pytest -s` prints the campaign's figures (README,
"Power loss"). O_DIRECT: the saves use the uring engine with O_DIRECT, as on a local disk; the
mount uses direct_io, so the kernel accepts O_DIRECT opens and passes every write through
unbuffered, and the durability calls (fsync, rename, directory fsync) reach CrashFS in the order
hbmio makes them. FUSE has no O_TMPFILE, so saves here take their
named-temporary path (the one a crash can leave behind, which the next save must clean up).
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

mfusepy = pytest.importorskip("mfusepy", reason="mfusepy (a FUSE binding) is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import crashfs  # noqa: E402
from hbmio_command import hbmio_command  # noqa: E402





HBMIO = hbmio_command()


def fuse_usable():
    if not os.path.exists("/dev/fuse") or not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no usable /dev/fuse here"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (Debian: fuse3)"
    if HBMIO is None:
        return "no hbmio command (pip install . puts it beside the interpreter; or set HBMIO_CLI)"
    return None


pytestmark = pytest.mark.skipif(fuse_usable() is not None, reason=fuse_usable() or "")


def cli(*args, check=True):
    run = subprocess.run([HBMIO, *args], capture_output=True, text=True, timeout=120)
    if check and run.returncode != 0:
        raise AssertionError(f"hbmio {' '.join(args)} exited {run.returncode}: {run.stderr}")
    return run


def generate(target, seed, *extra):
    # Six tensors of 20 KiB (three shards of two at 45 KiB), written by the uring engine with
    # O_DIRECT, as a save on a local disk is.
    return ["ckpt", "generate", target, "--count", "6", "--tensor-size", "20KiB", "--dtype", "U8", "--seed", str(seed),
            "--backend", "uring", *extra]


# The Python saves run in one long-lived process (torch is imported once, not per save), which
# takes "background|dcp TARGET SEED" lines and answers "ok" or "error MESSAGE".
WORKER = """
import sys, warnings
warnings.simplefilter("ignore")
import numpy as np, hbmio
try:
    import torch, torch.distributed.checkpoint as dcp, hbmio.dcp
except ImportError:
    torch = None
for line in sys.stdin:
    kind, target, seed = line.split()
    try:
        if kind == "background":
            rng = np.random.default_rng(int(seed))
            t = {f"t{i}": rng.integers(0, 255, 20 << 10, dtype=np.uint8) for i in range(6)}
            hbmio.save_file(t, target, blocking=False, backend="uring").result()
        else:
            g = torch.Generator().manual_seed(int(seed))
            state = {f"w{i}": torch.randn(5000, generator=g) for i in range(4)}
            dcp.save(state, storage_writer=hbmio.dcp.StorageWriter(target))
        print("ok", flush=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        text = str(e) + " " + " ".join(str(f) for f in getattr(e, "failures", {}).values())
        print("error " + text.replace(chr(10), " | "), flush=True)
"""


class _Worker:
    def __init__(self):
        self.process = None

    def run(self, kind, target, seed):
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True)
        self.process.stdin.write(f"{kind} {target} {seed}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        ok = answer == "ok"
        return subprocess.CompletedProcess(kind, 0 if ok else 1, "", "" if ok else answer or "the worker died")

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
            self.process.stdout.close()


WORKER_PROCESS = _Worker()


def python_save(target, seed):
    return ["py", "background", target, str(seed)]


def dcp_save(target, seed):
    return ["py", "dcp", target, str(seed)]


def dcp_view(path: Path):
    """What torch.distributed.checkpoint loads from `path` ({name: bytes}), None without a checkpoint."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    import hbmio.dcp
    if not (path / ".metadata").exists():
        return None
    state = {f"w{i}": torch.zeros(5000) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=hbmio.dcp.StorageReader(path, verify=True))
    return {k: v.numpy().tobytes() for k, v in state.items()}


# name: (how the old checkpoint is made, or None; the save; the next save)
SHAPES = {
    "file over a file": (lambda t: generate(t, 1), lambda t: generate(t, 2, "--force"), lambda t: generate(t, 3, "--force")),
    "file into an empty directory": (None, lambda t: generate(t, 2), lambda t: generate(t, 3, "--force")),
    "sharded over sharded": (lambda t: generate(t, 1, "--max-shard-size", "45KiB"),
                             lambda t: generate(t, 2, "--max-shard-size", "45KiB", "--force"),
                             lambda t: generate(t, 3, "--max-shard-size", "45KiB", "--force")),
    "checksum rewrite": (lambda t: generate(t, 1, "--no-checksums"), lambda t: ["ckpt", "checksum", t],
                         lambda t: generate(t, 3, "--force")),
    "background save (Python)": (lambda t: generate(t, 1), lambda t: python_save(t, 2), lambda t: generate(t, 3, "--force")),
    "DCP save over one (hbmio.dcp)": (lambda t: dcp_save(t, 1), lambda t: dcp_save(t, 2), lambda t: dcp_save(t, 3)),
    "DCP save into a new directory": (None, lambda t: dcp_save(t, 2), lambda t: dcp_save(t, 3)),
}
# How a shape's checkpoint is read: its files' bytes, or what DCP loads (a DCP directory keeps the
# previous save's files for a while, by design).
VIEWS = {"DCP save over one (hbmio.dcp)": dcp_view, "DCP save into a new directory": dcp_view}


def view(shape, target):
    return VIEWS.get(shape, contents)(target)


def needs(shape):
    if shape in VIEWS:
        pytest.importorskip("torch.distributed.checkpoint", reason="the DCP shape needs torch")


def run_step(argv):
    if argv[0] == "py":  # a Python save (background, DCP)
        return WORKER_PROCESS.run(*argv[1:])
    return cli(*argv, check=False)


def contents(path: Path):
    """The checkpoint at `path`: its bytes (a file) or {name: bytes} of its checkpoint files (a
    directory); None when nothing is there."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if not p.name.startswith(".")}
    return path.read_bytes() if path.exists() else None


def temporaries(directory: Path):
    return [p.name for p in directory.iterdir() if ".hbmio-tmp-" in p.name]


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    fs = crashfs.CrashFS(tear=True)
    where = tmp_path_factory.mktemp("crashfs") / "mnt"
    try:
        mounted = crashfs.Mount(where, fs).__enter__()
    except RuntimeError as e:  # e.g. a container without the right to mount
        pytest.skip(str(e))
    try:
        yield Path(where), fs
    finally:
        WORKER_PROCESS.close()
        mounted.__exit__(None, None, None)


def prepare(mount, shape):
    where, fs = mount
    fs.load(crashfs.State(0, 0, {1: {}}, {}, {1: "d"}))
    target = str(where / ("ckpt" if "sharded" in shape or "DCP" in shape else "m.safetensors"))
    setup, _, _ = SHAPES[shape]
    if setup is not None:
        made = run_step(setup(target))
        assert made.returncode == 0, made.stderr
    fs.make_durable()
    return Path(target), fs.snapshot()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_power_loss_at_every_step_leaves_the_old_or_the_new_checkpoint(mount, shape, record_property):
    needs(shape)
    where, fs = mount
    target, initial = prepare(mount, shape)
    old = view(shape, target)
    # The old checkpoint is checked the way it can be: by its checksums where it has them (a file
    # about to get its checksums has none), and by its bytes always.
    old_verifies = old is not None and cli("ckpt", "verify", str(target), check=False).returncode == 0
    _, save, next_save = SHAPES[shape]
    fs.start()
    run = run_step(save(str(target)))
    fs.stop()
    assert run.returncode == 0, run.stderr
    new = view(shape, target)
    assert new is not None and new != old
    log, states = list(fs.log), list(fs.states)
    assert any(kind == "fsync" or kind == "fdatasync" for kind, _ in log), log
    # What the next save leaves, made independently: from the old checkpoint, no crash.
    fs.load(initial)
    assert run_step(next_save(str(target))).returncode == 0
    after_next = view(shape, target)
    lost = []
    for state in states:
        fs.load(state)
        what = f"power cut after {state.after} of {len(log)} operations ({log[state.after - 1] if state.after else 'none'}), " \
               f"{state.prefix} directory operations kept{', torn' if state.torn else ''}"
        try:
            now = view(shape, target)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be read is lost
            lost.append(f"{what}: unreadable: {e}")
            continue
        if now not in (old, new):
            lost.append(f"{what}: neither the old nor the new checkpoint")
            continue
        if state.after == len(log) and now != new:  # once the save has returned, it must survive
            lost.append(f"{what}: the save returned, yet a power cut now brings back the old checkpoint")
            continue
        if now is not None and (now == new or old_verifies):
            verify = cli("ckpt", "verify", str(target), check=False)
            if verify.returncode != 0:
                lost.append(f"{what}: ckpt verify failed: {verify.stderr.strip()}")
                continue
        again = run_step(next_save(str(target)))
        if again.returncode != 0:
            lost.append(f"{what}: the next save failed: {again.stderr.strip()}")
            continue
        result = view(shape, target)
        if result != after_next or temporaries(target.parent) or (target.is_dir() and temporaries(target)):
            lost.append(f"{what}: after the next save: {'temporaries left: ' + str(temporaries(target.parent)) if temporaries(target.parent) else 'not its checkpoint'}")
    fs.load(initial)
    record_property("crash_points", len(log))
    record_property("states_checked", len(states))
    print(f"\n{shape}: {len(log)} crash points, {len(states)} states checked, {len(lost)} lost")
    assert not lost, "\n".join(lost[:10])


FAULT_KINDS = ("write", "fsync", "fdatasync", "rename", "exchange", "fsync dir")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_disk_error_at_every_step_keeps_the_old_checkpoint(mount, shape):
    needs(shape)
    where, fs = mount
    target, initial = prepare(mount, shape)
    old = view(shape, target)
    _, save, next_save = SHAPES[shape]
    fs.start()
    assert run_step(save(str(target))).returncode == 0
    fs.stop()
    points = [i for i, (kind, _) in enumerate(fs.log) if kind in FAULT_KINDS]
    problems = []
    tried = 0
    for index in points:
        for err in (errno.EIO, errno.ENOSPC):
            fs.load(initial)
            fs.start(fail={index: err})
            run = run_step(save(str(target)))
            fs.stop()
            log = list(fs.log)
            failed = [i for i, (kind, _) in enumerate(log) if kind.endswith("FAILED")]
            what = f"{os.strerror(err)} at operation {index} ({log[failed[0]] if failed else 'not reached'})"
            if not failed:
                continue  # this run took another path (the failure point moved): nothing to judge
            tried += 1
            # Published: a rename (or exchange) onto the checkpoint's own name came before the failure
            # (renames inside a sharded save's temporary directory publish nothing).
            # (a DCP save publishes by renaming its .metadata into place).
            published = any(kind in ("rename", "exchange") and detail.split(" -> ")[1] in (f"/{target.name}", f"/{target.name}/.metadata")
                            for kind, detail in log[:failed[0]])
            if run.returncode == 0:
                problems.append(f"{what}: the save reported success")
                continue
            if os.strerror(err) not in run.stderr:
                problems.append(f"{what}: the error does not say what failed: {run.stderr.strip()}")
            now = view(shape, target)
            if not published and now != old:
                problems.append(f"{what}: the old checkpoint changed before anything was published")
            if published and "durable" not in run.stderr:
                problems.append(f"{what}: failed after publishing, and did not say so: {run.stderr.strip()}")
            # fsyncgate: after a failed fsync of a file nothing of it may be published.
            kind = log[failed[0]][0]
            if kind.startswith("fsync ") or kind.startswith("fdatasync "):
                if any(k in ("rename", "exchange") for k, _ in log[failed[0] + 1:]):
                    problems.append(f"{what}: published after a failed fsync")
            again = run_step(next_save(str(target)))
            if again.returncode != 0 or temporaries(target.parent):
                problems.append(f"{what}: the next save failed or left temporaries: {again.stderr.strip()}")
    fs.load(initial)
    print(f"\n{shape}: {len(points)} fault points, {tried} faults injected, {len(problems)} problems")
    assert tried >= len(points), f"only {tried} of {2 * len(points)} faults were reached"
    assert not problems, "\n".join(problems[:10])


def test_the_campaign_catches_a_save_that_is_not_crash_safe(mount):
    # The harness itself: a save that rewrites the file in place (truncate, write, fsync) must
    # leave states holding neither checkpoint, or the campaign above proves nothing.
    where, fs = mount
    target, initial = prepare(mount, "file over a file")
    old = contents(target)
    new_bytes = cli("ckpt", "info", str(target)).stdout.encode() * 50
    fs.start()
    with open(target, "r+b") as f:
        f.truncate(0)
        f.write(new_bytes)
        f.flush()
        os.fsync(f.fileno())
    fs.stop()
    states = list(fs.states)
    bad = 0
    for state in states:
        fs.load(state)
        bad += contents(target) not in (old, new_bytes)
    fs.load(initial)
    assert bad > 0, f"none of {len(states)} states of an in-place rewrite was caught"
