"""The node's resident cache (docs/cache.md) seen from Python: with HBMIO_CACHE naming the socket of
an `hbmio cache serve` process, hbmio.load_file and hbmio.open take the files it holds from it,
without a change to the calling code, and say so in their report; every tensor is compared with
safetensors' own read of the file."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import hbmio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hbmio_command import hbmio_command  # noqa: E402

safetensors_numpy = pytest.importorskip("safetensors.numpy")




HBMIO = hbmio_command()
pytestmark = pytest.mark.skipif(HBMIO is None, reason="no hbmio command (pip install . puts it beside the interpreter; or set HBMIO_CLI)")


@pytest.fixture
def server():
    sockets = tempfile.mkdtemp(prefix="hbmio-cache-", dir="/tmp")  # a socket path has at most 107 bytes
    socket = os.path.join(sockets, "cache.sock")
    proc = subprocess.Popen([HBMIO, "cache", "serve", "--socket", socket, "--host-memory", "64MiB"],
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(500):
            if subprocess.run([HBMIO, "cache", "status", "--socket", socket], capture_output=True).returncode == 0:
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"the cache server did not answer: {proc.stderr.read() if proc.poll() is not None else ''}")
        yield socket
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def sample(path, seed):
    rng = np.random.default_rng(seed)
    tensors = {f"w{i}": rng.standard_normal((64, 257)).astype(np.float32) for i in range(6)}
    safetensors_numpy.save_file(tensors, str(path))
    return tensors


def test_loads_take_held_files_from_the_cache_and_report_it(server, tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    expected = sample(path, 1)
    monkeypatch.setenv("HBMIO_CACHE", server)
    report = {}
    got = hbmio.load_file(str(path), framework="numpy", report=report)
    assert [p["path"] for p in report["paths"]] != ["cache-host"]  # not held yet: read from the file
    subprocess.run([HBMIO, "cache", "add", "--wait", "--socket", server, str(path)], check=True, capture_output=True)

    report = {}
    got = hbmio.load_file(str(path), framework="numpy", report=report)
    assert [p["path"] for p in report["paths"]] == ["cache-host"], report
    assert "from the resident cache" in report["note"]
    # The command's --json: the library's status object (status_json), named and versioned.
    import json
    status = json.loads(subprocess.run([HBMIO, "cache", "status", "--socket", server, "--json", "-"], check=True,
                                       capture_output=True, text=True).stdout)
    assert status["command"] == "cache status" and status["version"] and status["socket"] == server
    assert status["hits"] >= 1 and status["host_bytes"] == os.path.getsize(path)
    assert [(e["path"], e["bytes"], e["tier"]) for e in status["entries"]] == [(str(path), os.path.getsize(path), "host")]
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)

    # The file replaced: never served from the old copy.
    expected = sample(path, 2)
    report = {}
    got = hbmio.load_file(str(path), framework="numpy", report=report)
    assert [p["path"] for p in report["paths"]] != ["cache-host"]
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)


def test_a_file_open_for_writing_is_not_read_in(server, tmp_path, monkeypatch):
    # A writer may be in the middle of one long write, whose times were set when it began: a copy
    # read in meanwhile could mix old and new bytes and still match them after. While any process
    # has the file open for writing, the server does not read it in; once it is closed, it does.
    path = tmp_path / "model.safetensors"
    expected = sample(path, 5)
    add = [HBMIO, "cache", "add", "--wait", "--socket", server, str(path)]
    with open(path, "r+b"):
        refused = subprocess.run(add, capture_output=True, text=True)
        assert refused.returncode != 0 and "refused" in refused.stdout + refused.stderr, refused
    status = subprocess.run([HBMIO, "cache", "status", "--socket", server], check=True, capture_output=True, text=True).stdout
    assert "0 file(s)" in status, status
    subprocess.run(add, check=True, capture_output=True)
    monkeypatch.setenv("HBMIO_CACHE", server)
    report = {}
    got = hbmio.load_file(str(path), framework="numpy", report=report)
    assert [p["path"] for p in report["paths"]] == ["cache-host"], report
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)


def test_a_stopped_cache_is_a_plain_load(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    expected = sample(path, 3)
    monkeypatch.setenv("HBMIO_CACHE", str(tmp_path / "nobody.sock"))
    report = {}
    got = hbmio.load_file(str(path), framework="numpy", report=report)
    assert "the resident cache could not help" in report["note"]
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)


def test_cache_argument_adds_uses_and_turns_it_off(server, tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    expected = sample(path, 4)
    monkeypatch.delenv("HBMIO_CACHE", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", os.path.dirname(server))  # cache=True's default socket
    os.rename(server, os.path.join(os.path.dirname(server), "hbmio-cache.sock"))  # the server's socket, by that name
    report = {}
    hbmio.load_file(str(path), framework="numpy", report=report, cache="add")
    assert [p["path"] for p in report["paths"]] != ["cache-host"]
    for _ in range(250):  # the server reads it in the background
        report = {}
        got = hbmio.load_file(str(path), framework="numpy", report=report, cache=True)
        if [p["path"] for p in report["paths"]] == ["cache-host"]:
            break
        time.sleep(0.02)
    assert [p["path"] for p in report["paths"]] == ["cache-host"], report
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)
    report = {}
    hbmio.load_file(str(path), framework="numpy", report=report, cache=False)
    assert [p["path"] for p in report["paths"]] != ["cache-host"]
    assert "resident cache" not in report["note"]
    with hbmio.open(str(path), framework="numpy", cache="use") as f:  # walks, slices and prefetch alike
        np.testing.assert_array_equal(f.get_tensor("w2"), expected["w2"])
        np.testing.assert_array_equal(f.get_slice("w3")[2:10], expected["w3"][2:10])
        assert {p["path"] for p in f.report()["paths"]} == {"cache-host"}, f.report()
    pytest.importorskip("torch")
    with hbmio.open(str(path), framework="pt", cache="use") as f, f.prefetch() as loader:
        for name, value in loader:
            np.testing.assert_array_equal(value.numpy(), expected[name])
        assert {p["path"] for p in f.report()["paths"]} == {"cache-host"}, f.report()
    with pytest.raises(ValueError, match="cache must be"):
        hbmio.load_file(str(path), cache="sometimes")


def test_share_is_refused_where_it_cannot_map_gpu_memory(tmp_path):
    path = tmp_path / "model.safetensors"
    sample(path, 5)
    for kwargs in ({"device": "cpu"}, {"device": "cuda:0", "cache": "off"}, {"device": "cuda:0", "mmap": True}):
        with pytest.raises(ValueError, match="share=True maps the resident cache's copies in GPU memory"):
            hbmio.load_file(str(path), share=True, **kwargs)
    with pytest.raises(ValueError, match="not with group="):
        hbmio.load_file(str(path), "cuda:0", share=True, group=object(), framework="torch")


def test_shared_tensors_are_the_caches_gpu_copy_held_while_they_live(tmp_path):
    """share=True: the tensors are the server's copy in GPU memory, mapped here, equal to the file;
    two loads map the same memory; the server counts the shares and gets them back when the tensors
    are gone, and when a process holding them is killed."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    import json
    sockets = tempfile.mkdtemp(prefix="hbmio-cache-", dir="/tmp")
    socket = os.path.join(sockets, "cache.sock")
    proc = subprocess.Popen([HBMIO, "cache", "serve", "--socket", socket, "--host-memory", "64MiB", "--gpu-memory", "64MiB"],
                            stderr=subprocess.PIPE, text=True)

    def status():
        out = subprocess.run([HBMIO, "cache", "status", "--socket", socket, "--json", "-"], capture_output=True, text=True)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def shares_become(n):
        for _ in range(250):
            if status()["shares"] == n:
                break
            time.sleep(0.02)
        return status()["shares"]

    try:
        for _ in range(500):
            if status() is not None:
                break
            time.sleep(0.02)
        path = tmp_path / "model.safetensors"
        expected = sample(path, 6)
        subprocess.run([HBMIO, "cache", "add", "--wait", "--gpu", "0", "--socket", socket, str(path)], check=True, capture_output=True)
        report = {}
        os.environ["HBMIO_CACHE"] = socket
        try:
            got = hbmio.load_file(str(path), "cuda:0", share=True, report=report)
            assert [p["path"] for p in report["paths"]] == ["cache-shared"], report
            assert report["bytes"] == 0, report
            for name, value in expected.items():
                np.testing.assert_array_equal(got[name].cpu().numpy(), value)
            again = hbmio.load_file(str(path), "cuda:0", share=True)
            assert all(again[n].data_ptr() == got[n].data_ptr() for n in expected)
            assert shares_become(2) == 2
            del got, again
            assert shares_become(0) == 0
            # A process that holds shared tensors and is killed gives them back by dying.
            child = subprocess.Popen([sys.executable, "-c", (
                "import sys, time, hbmio\n"
                f"t = hbmio.load_file({str(path)!r}, 'cuda:0', share=True)\n"
                "print('held', flush=True)\n"
                "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
            assert child.stdout.readline().strip() == "held"
            assert shares_become(1) == 1
            child.kill()
            child.wait()
            assert shares_become(0) == 0
            # A shared copy keeps the file's offsets: a tensor at one that is no whole element of
            # the allocation (F32 at data byte 3, the data starting on 8 bytes) comes over as its own
            # array, the others as views; all equal to a plain load, byte for byte.
            odd = tmp_path / "odd.safetensors"
            header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
                                 "c": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [11, 23]}}).encode()
            header += b" " * (-(8 + len(header)) % 8)
            odd.write_bytes(len(header).to_bytes(8, "little") + header + bytes([1, 2, 3]) +
                            np.array([1.5, -2.0], "<f4").tobytes() + bytes(range(7, 19)))
            subprocess.run([HBMIO, "cache", "add", "--wait", "--gpu", "0", "--socket", socket, str(odd)], check=True,
                           capture_output=True)
            report = {}
            shared = hbmio.load_file(str(odd), "cuda:0", share=True, report=report)
            assert [p["path"] for p in report["paths"]] == ["cache-shared"], report
            plain = hbmio.load_file(str(odd), "cuda:0", cache="off")
            assert list(shared) == list(plain) == ["a", "b", "c"]
            for name, t in plain.items():
                assert shared[name].dtype == t.dtype and shared[name].shape == t.shape, name
                assert torch.equal(shared[name].cpu().view(torch.uint8), t.cpu().view(torch.uint8)), name
            del shared
            assert shares_become(0) == 0
        finally:
            os.environ.pop("HBMIO_CACHE", None)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)
