"""hbmio as a drop-in for safetensors: where the point is parity, each test runs the same call
through safetensors and checks that hbmio behaves the same way (the exception type, the bytes,
what is returned).

GPU-only behaviour is checked here by what happens without a GPU; the tests that need one carry
the same skip mark as test_hbmio.py.
"""
from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import hbmio

torch = pytest.importorskip("torch", reason="torch is not installed")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed")
import safetensors.torch as st  # noqa: E402
import hbmio.numpy as hn  # noqa: E402
import hbmio.torch as ht  # noqa: E402

cuda = pytest.mark.skipif(hbmio.cuda_device_count() == 0,
                          reason=f"no CUDA device: {hbmio.cuda_unavailable_reason()}")
no_gpu = pytest.mark.skipif(hbmio.cuda_device_count() > 0, reason="checks what happens without a GPU")


def sample(tmp_path) -> pathlib.Path:
    path = tmp_path / "sample.safetensors"
    st.save_file({"head": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                  "h": torch.ones(5, dtype=torch.int64),
                  "e": torch.arange(4, dtype=torch.uint8)}, str(path), metadata={"format": "pt"})
    return path


def same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for name, t in b.items():
        assert a[name].dtype == t.dtype and a[name].shape == t.shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


# --- 1. missing files --------------------------------------------------------------------------

def test_missing_file_is_file_not_found_and_hbmio_error(tmp_path):
    missing = tmp_path / "absent.safetensors"
    with pytest.raises(FileNotFoundError):  # what safetensors raises
        st.load_file(str(missing))
    calls = {
        "load_file": lambda: hbmio.load_file(missing),
        "load_file numpy": lambda: hbmio.load_file(missing, framework="numpy"),
        "load_file dlpack": lambda: hbmio.load_file(missing, framework="dlpack"),
        "open": lambda: hbmio.open(missing),
        "read_into": lambda: hbmio.read_into(missing, np.zeros(8, np.uint8)),
        "torch.load_file": lambda: ht.load_file(missing),
        "numpy.load_file": lambda: hn.load_file(missing),
        "torch.load_model": lambda: ht.load_model(torch.nn.Linear(2, 2), missing),
    }
    for what, call in calls.items():
        with pytest.raises(FileNotFoundError) as info:
            call()
        e = info.value
        assert isinstance(e, hbmio.Error) and isinstance(e, OSError), what
        assert e.errno == errno.ENOENT and e.filename == str(missing), what
        assert str(missing) in str(e) and str(e).count(str(missing)) == 1, (what, str(e))  # named once


def test_other_errno_values_are_their_oserror_subclasses(tmp_path):
    with pytest.raises(IsADirectoryError) as info:
        hbmio.read_into(tmp_path, np.zeros(8, np.uint8))
    assert isinstance(info.value, hbmio.Error) and info.value.filename == str(tmp_path)
    with pytest.raises(NotADirectoryError) as info:
        hbmio.load_file(sample(tmp_path) / "inside")
    assert isinstance(info.value, hbmio.Error) and info.value.errno == errno.ENOTDIR
    if os.geteuid() != 0:  # root reads anything: no EACCES to provoke
        locked = sample(tmp_path)
        locked.chmod(0)
        with pytest.raises(PermissionError) as info:
            hbmio.load_file(locked)
        assert isinstance(info.value, hbmio.Error) and info.value.filename == str(locked)
    # A malformed header: hbmio.HeaderError (an hbmio.Error with EINVAL and, as the reference
    # raises, a safetensors.SafetensorError), not an OSError subclass of its errno.
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(hbmio.Error) as info:
        hbmio.load_file(garbage)
    assert type(info.value).__name__ == "HeaderError" and info.value.errno == errno.EINVAL
    assert isinstance(info.value, safetensors.SafetensorError) and not isinstance(info.value, ValueError)


# --- 2. hbmio.torch: load/save of bytes, save_model/load_model --------------------------------

def every_dtype() -> dict:
    gen = torch.Generator().manual_seed(3)
    out = {}
    for i, dt in enumerate(sorted({dt for dt in st._TYPES.values() if dt is not None}, key=str)):
        raw = torch.randint(0, 256, (6 * torch.empty((), dtype=dt).element_size(),), dtype=torch.uint8, generator=gen)
        if dt == torch.bool:
            raw &= 1
        out[f"t{i}"] = raw.view(dt).reshape(2, 3)
    out["scalar"] = torch.tensor(7.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def test_save_and_load_bytes_match_safetensors():
    tensors = every_dtype()
    for metadata in (None, {"format": "pt", "note": "ü"}):
        ours, theirs = ht.save(tensors, metadata), st.save(tensors, metadata)
        assert isinstance(ours, bytes)
        if metadata is None:
            assert ours == theirs  # the same layout, byte for byte
        else:  # safetensors writes metadata entries in hash order: the same header, the same data
            n = int.from_bytes(ours[:8], "little")
            assert ours[:8] == theirs[:8] and json.loads(ours[8:8 + n]) == json.loads(theirs[8:8 + n])
            assert ours[8 + n:] == theirs[8 + n:]
        same(ht.load(theirs), st.load(theirs))
        same(ht.load(bytearray(ours)), tensors)
    loaded = ht.load(ours)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in loaded.values() if t.nbytes), "memory of its own"
    assert ht.load(ht.save({})) == st.load(st.save({}))
    with pytest.raises(hbmio.Error) as info:  # the header checks every file load makes
        ht.load(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + b"x")
    assert info.value.errno == errno.EINVAL
    with pytest.raises(hbmio.Error):
        ht.load(b"short")
    w = torch.zeros(4)
    with pytest.raises(RuntimeError, match="save_model"):
        ht.save({"a": w, "b": w})
    with pytest.raises(ValueError, match="contiguous"):
        ht.save({"a": torch.zeros(3, 4).t()})


class Tied(torch.nn.Module):
    """A language-model shape: the output layer shares the embedding's weight."""

    def __init__(self, extra=False):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        if extra:
            self.more = torch.nn.Linear(2, 2)


def test_save_model_and_load_model_match_safetensors(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ht.save_model(model, ours, metadata={"format": "pt"})
    st.save_model(model, str(theirs), metadata={"format": "pt"})
    mine, ref = st.load_file(str(ours)), st.load_file(str(theirs))
    same(mine, ref)
    assert "head.weight" not in mine and "embed.weight" in mine  # one name per shared memory
    with safetensors.safe_open(str(ours), "pt") as a, safetensors.safe_open(str(theirs), "pt") as b:
        assert b.metadata().items() <= a.metadata().items()  # {dropped: kept} and the caller's entries

    for source in (ours, theirs):
        for kind in (lambda: Tied(), lambda: Tied(extra=True)):
            torch.manual_seed(1)  # what the file does not fill starts equal in both
            got = kind()
            torch.manual_seed(1)
            want = kind()
            result = ht.load_model(got, source, strict=False)
            expected = st.load_model(want, str(source), strict=False)
            assert sorted(result[0]) == sorted(expected[0]) and sorted(result[1]) == sorted(expected[1])
            same(got.state_dict(), want.state_dict())
            assert got.head.weight is got.embed.weight
        with pytest.raises(RuntimeError, match="more.weight") as info:
            ht.load_model(Tied(extra=True), source)
        with pytest.raises(RuntimeError):
            st.load_model(Tied(extra=True), str(source))
        assert "Missing key(s)" in str(info.value)
    # A file holding both tied names: reported as unexpected, as safetensors reports it.
    both = tmp_path / "both.safetensors"
    st.save_file({k: v.clone() for k, v in model.state_dict().items()}, str(both))
    assert sorted(ht.load_model(Tied(), both, strict=False)[1]) == sorted(st.load_model(Tied(), str(both), strict=False)[1])
    # force_contiguous=False refuses strided tensors, with the hint safetensors adds.
    strided = torch.nn.Module()
    strided.w = torch.nn.Parameter(torch.zeros(3, 4).t())
    with pytest.raises(ValueError, match="force_contiguous=True"):
        ht.save_model(strided, tmp_path / "s.safetensors", force_contiguous=False)
    ht.save_model(strided, tmp_path / "s.safetensors")  # the default packs it, as safetensors' does
    assert st.load_file(str(tmp_path / "s.safetensors"))["w"].shape == (4, 3)


# --- 3. shared memory, strided tensors -------------------------------------------------------

def test_tensors_sharing_memory_are_refused_like_safetensors(tmp_path):
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    cases = [{"a": w, "b": w}, {"a": w, "b": w[1]}, {"x": w[:2], "y": w[1:3]}]
    for tensors in cases:
        with pytest.raises(RuntimeError):
            st.save_file(tensors, str(tmp_path / "ref.safetensors"))
        for save in (hbmio.save_file, ht.save_file):
            target = tmp_path / "out.safetensors"
            with pytest.raises(RuntimeError, match="share memory") as info:
                save(tensors, target)
            text = str(info.value)
            assert all(f"'{name}'" in text for name in tensors) and "save_model" in text and str(target) in text
            assert not target.exists(), "nothing written"
    # Views of one storage that do not overlap are separate tensors (safetensors saves them too).
    halves = {"lo": w[:2], "hi": w[2:]}
    st.save_file(halves, str(tmp_path / "ref.safetensors"))
    hbmio.save_file(halves, tmp_path / "halves.safetensors")
    same(st.load_file(str(tmp_path / "halves.safetensors")), st.load_file(str(tmp_path / "ref.safetensors")))
    # Any array kind: NumPy views of one buffer, requires_grad parameters.
    a = np.zeros(8, np.float32)
    with pytest.raises(RuntimeError, match="'a', 'b'"):
        hbmio.save_file({"a": a, "b": a[2:5]}, tmp_path / "np.safetensors")
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="share memory"):
        hbmio.save_file({"p": p, "q": p}, tmp_path / "p.safetensors")
    hbmio.save_file({"p": p}, tmp_path / "p.safetensors")  # requires_grad alone is fine, as in safetensors


def test_strided_torch_tensors_are_refused_like_safetensors(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    with pytest.raises(ValueError):
        st.save_file({"t": t}, str(tmp_path / "ref.safetensors"))
    for save in (hbmio.save_file, ht.save_file):
        with pytest.raises(ValueError, match=r"[`']t[`'].*contiguous"):  # the drop-in: the reference's words
            save({"t": t}, tmp_path / "out.safetensors")
    # A strided view of a tensor also saved: the shared memory is what is reported, as safetensors does.
    w = torch.zeros(4, 4)
    with pytest.raises(RuntimeError):
        st.save_file({"w": w, "wt": w.t()}, str(tmp_path / "ref.safetensors"))
    with pytest.raises(RuntimeError, match="share memory"):
        hbmio.save_file({"w": w, "wt": w.t()}, tmp_path / "out.safetensors")
    # NumPy arrays (no torch semantics to match) are still written in C order.
    hbmio.save_file({"n": np.arange(12, dtype=np.int32).reshape(3, 4).T}, tmp_path / "n.safetensors")
    assert (hbmio.load_file(tmp_path / "n.safetensors", framework="numpy")["n"] == np.arange(12).reshape(3, 4).T).all()


# --- 4. keys and values of the wrong type -----------------------------------------------------

def test_a_key_that_is_not_a_str_is_a_type_error_naming_it(tmp_path):
    w = torch.zeros(2)
    with pytest.raises(TypeError):
        st.save_file({1: w}, str(tmp_path / "ref.safetensors"))
    for save in (hbmio.save_file, ht.save_file):
        with pytest.raises(TypeError, match=r"key 1 \(int\)"):
            save({1: w}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"key 1 \(int\)"):
        hbmio.save_file({1: np.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"key \(1, 2\) \(tuple\)"):  # the binding itself, below the Python checks
        hbmio._hbmio.save_file({(1, 2): np.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(TypeError, match="tensor a"):
        hbmio.save_file({"a": 3}, tmp_path / "x.safetensors")
    # The reference's ValueError and words (test_conformance.py), and a TypeError as before.
    with pytest.raises(TypeError, match="Key `a` is invalid, expected torch.Tensor"):
        ht.save_file({"a": np.zeros(2)}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


# --- 5. CUDA without a GPU --------------------------------------------------------------------

@no_gpu
def test_cuda_without_a_gpu_is_an_hbmio_error_saying_so(tmp_path):
    path = sample(tmp_path)
    calls = [lambda d=d, f=f: hbmio.load_file(path, device=d, framework=f)
             for d in ("cuda", "cuda:0", "cuda:3", 0, torch.device("cuda"), torch.device("cuda", 1))
             for f in ("torch", "dlpack")]
    calls += [lambda: hbmio.open(path, framework="pt", device="cuda:0"), lambda: ht.load_file(path, device="cuda"),
              lambda: ht.load_model(torch.nn.Linear(2, 2), path, device="cuda")]
    for call in calls:
        with pytest.raises(hbmio.Error, match="no GPU") as info:
            call()
        assert info.value.errno == errno.ENODEV
    # A CPU handle's get_tensor asked for another device: the same.
    with hbmio.open(path, framework="pt") as f, pytest.raises(hbmio.Error, match="no GPU"):
        f.get_tensor("head", device="cuda")


@cuda
def test_a_gpu_this_machine_lacks_is_named(tmp_path):
    count = hbmio.cuda_device_count()
    with pytest.raises(hbmio.Error, match=f"no such GPU; this machine has {count}"):
        hbmio.load_file(sample(tmp_path), device=f"cuda:{count}")
    loaded = hbmio.load_file(sample(tmp_path), device=torch.device("cuda", 0))
    assert loaded["head"].device == torch.device("cuda", 0)


# --- 6. use after the with block ----------------------------------------------------------------

def test_a_handle_used_after_its_with_block_raises_like_safe_open(tmp_path):
    path = sample(tmp_path)
    calls = {
        "keys": lambda f: f.keys(), "offset_keys": lambda f: f.offset_keys(), "metadata": lambda f: f.metadata(),
        "get_tensor": lambda f: f.get_tensor("head"), "get_slice": lambda f: f.get_slice("head"),
        "get_tensors": lambda f: f.get_tensors(),
    }
    with safetensors.safe_open(str(path), "pt") as ref, hbmio.open(path, "pt") as ours:
        ref_slice, our_slice = ref.get_slice("head"), ours.get_slice("head")
    for what, call in calls.items():
        with pytest.raises(safetensors.SafetensorError) as expected:
            call(ref)
        with pytest.raises(safetensors.SafetensorError) as got:  # the same type as safe_open's ...
            call(ours)
        assert isinstance(got.value, hbmio.Error) and isinstance(got.value, hbmio.ClosedError), what  # ... and hbmio's
        assert "closed" in str(expected.value).lower() and "closed" in str(got.value).lower(), what
        assert str(path) in str(got.value), what
    # A slice taken inside the block still reads, in both.
    assert torch.equal(our_slice[1:], ref_slice[1:]) and torch.equal(our_slice[...], ref_slice[...])
    # close() only frees what was read ahead; inside the block the handle stays usable.
    with hbmio.open(path, "pt") as f:
        f.close()
        assert f.keys() == ["e", "h", "head"]


# --- 7. HBMIO_BACKEND ---------------------------------------------------------------------------

def test_hbmio_backend_is_the_default_of_every_call(tmp_path, monkeypatch):
    path = sample(tmp_path)
    buf = np.zeros(16, np.uint8)
    calls = {
        "load_file": lambda **b: hbmio.load_file(path, **b),
        "load_file numpy": lambda **b: hbmio.load_file(path, framework="numpy", **b),
        "load_file torch": lambda **b: ht.load_file(path, **b),
        "open": lambda **b: hbmio.open(path, framework="np", **b).get_tensor("head"),
        "read_into": lambda **b: hbmio.read_into(path, buf, **b),
        "write_from": lambda **b: hbmio.write_from(tmp_path / "raw.bin", buf, **b),
        "save_file": lambda **b: hbmio.save_file({"a": np.zeros(3)}, tmp_path / "s.safetensors", **b),
        "torch save_file": lambda **b: ht.save_file({"a": torch.zeros(3)}, tmp_path / "t.safetensors", **b),
    }
    monkeypatch.setenv("HBMIO_BACKEND", "nosuchbackend")
    for what, call in calls.items():
        with pytest.raises(hbmio.Error, match="backend"):
            call()
        call(backend="posix")  # a backend given wins over the variable
    monkeypatch.setenv("HBMIO_BACKEND", "posix")
    assert hbmio.read_into(path, buf)["backend"] == "posix"
    assert hbmio.write_from(tmp_path / "raw.bin", buf)["backend"] == "posix"
    monkeypatch.delenv("HBMIO_BACKEND")
    for call in calls.values():
        call()  # auto


# --- 8. device forms ----------------------------------------------------------------------------

def test_device_forms(tmp_path):
    path = sample(tmp_path)
    for device in ("cpu", "CPU", "host", torch.device("cpu")):
        assert hbmio.load_file(path, device=device)["head"].device.type == "cpu"
        with hbmio.open(path, "pt", device=device) as f:
            assert f.get_tensor("head").device.type == "cpu"
    for device in ("gpu", "mps", "cuda:x", "cuda:-1", "cuda:", "meta", torch.device("meta"), -1):
        for call in (lambda: hbmio.load_file(path, device=device), lambda: hbmio.open(path, device=device),
                     lambda: ht.load_file(path, device=device)):
            with pytest.raises(ValueError, match=r"'cpu', 'cuda', 'cuda:N'") as info:
                call()
            assert isinstance(info.value, hbmio.Error) and info.value.errno == errno.EINVAL  # as before
    with pytest.raises(TypeError):
        hbmio.load_file(path, device=1.0)


# --- 9. names= as one str -----------------------------------------------------------------------

def test_a_str_given_as_names_is_one_name(tmp_path):
    path = sample(tmp_path)
    ref = st.load_file(str(path))
    for framework in ("torch", "numpy", "dlpack"):
        assert list(hbmio.load_file(path, framework=framework, names="head")) == ["head"], framework
    same(ht.load_file(path, names="head"), {"head": ref["head"]})
    assert list(hn.load_file(path, names="h")) == ["h"]
    assert list(hbmio.load_file(path, names=("head", "e"))) == ["head", "e"]
    with pytest.raises(TypeError, match="names"):
        hbmio.load_file(path, names=[b"head"])


# --- 10. sizes ------------------------------------------------------------------------------------

def test_sizes_are_read_by_the_command_lines_parser():
    for text in ("4096", "0", "64K", "64k", "16MiB", "1.5GiB", "5GB", "500MB", "2KB", "1TiB"):
        assert hbmio._parse_size(text) == hbmio._hbmio.parse_size(text), text
    assert hbmio._parse_size(123) == 123
    for bad in ("", "5 parsecs", "GB", "-1", "0x100", "1e3", " 5GB"):
        with pytest.raises(ValueError):
            hbmio._hbmio.parse_size(bad)
        with pytest.raises(ValueError):
            hbmio._parse_size(bad)
    for bad in (-1, 1.5, None, True):
        with pytest.raises(ValueError):
            hbmio._parse_size(bad)


# --- 11. the hbmio command --------------------------------------------------------------------------

def test_the_wheel_installs_the_hbmio_command():
    # Where pip puts scripts: the environment's bin/ for an ordinary install, <target>/bin beside
    # the package for `pip install --target` (how the GPU machine's runs install it).
    places = [pathlib.Path(sysconfig.get_path("scripts")) / "hbmio",
              pathlib.Path(hbmio.__file__).resolve().parents[1] / "bin" / "hbmio"]
    command = next((p for p in places if p.is_file()), None)
    assert command, f"none of {[str(p) for p in places]}: `pip install .` did not install the hbmio command"
    done = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hbmio {hbmio.__version__}"  # the same build as the module


# --- 12. verification failures ----------------------------------------------------------------------

def test_a_failed_verification_is_a_verify_error(tmp_path):
    path = tmp_path / "checked.safetensors"
    hbmio.save_file({"a": np.arange(4096, dtype=np.int32), "b": np.ones(64, np.float32)}, path)  # with checksums
    with open(path, "r+b") as f:  # one byte of tensor a's data, past the header
        f.seek(-(64 * 4) - 100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    hbmio.load_file(path, framework="numpy")  # not verified: loads
    for call in (lambda: hbmio.load_file(path, framework="numpy", verify=True),
                 lambda: ht.load_file(path, verify=True),
                 lambda: hbmio.open(path, "np").get_tensor("a", verify=True)):
        with pytest.raises(hbmio.VerifyError, match="tensor 'a'") as info:
            call()
        e = info.value
        assert isinstance(e, hbmio.Error) and e.errno == errno.EIO and e.filename == str(path)
    # Other failures are not VerifyError: a missing file, a file without checksums asked to verify.
    with pytest.raises(hbmio.Error) as info:
        hbmio.load_file(tmp_path / "absent.safetensors", verify=True)
    assert not isinstance(info.value, hbmio.VerifyError)


def test_device_none_and_load_models_results_are_the_references(tmp_path):
    """device=None loads into host memory, and load_model returns (set, list), as safetensors does."""
    import torch
    import safetensors.torch as st
    import hbmio.torch
    model = torch.nn.Linear(3, 2)
    path = str(tmp_path / "m.safetensors")
    st.save_model(model, path)
    assert hbmio.torch.load_model(model, path) == st.load_model(model, path) == (set(), [])
    missing, unexpected = hbmio.torch.load_model(torch.nn.Linear(3, 2, bias=False), path, strict=False)
    reference = st.load_model(torch.nn.Linear(3, 2, bias=False), path, strict=False)
    assert (type(missing), type(unexpected)) == (type(reference[0]), type(reference[1])) == (set, list)
    assert (missing, unexpected) == reference
    got = hbmio.load_file(path, device=None)
    assert all(t.device.type == "cpu" for t in got.values())
    with hbmio.open(path, framework="pt", device=None) as f:
        assert f.get_tensor("weight").device.type == "cpu"


def test_bad_devices_frameworks_and_names_raise_what_the_reference_raises(tmp_path):
    """A bad device or framework is a SafetensorError as in the reference (and still the
    ValueError and hbmio.Error hbmio raised before); a name that is no str is a TypeError."""
    import numpy as np
    import safetensors
    import hbmio.numpy
    path = tmp_path / "m.safetensors"
    hbmio.numpy.save_file({"x": np.arange(3, dtype=np.int32)}, str(path))
    for device in ("gpu", "cpu:0", -1):
        for call in (lambda: hbmio.load_file(path, device=device), lambda: hbmio.open(path, device=device)):
            with pytest.raises(safetensors.SafetensorError) as raised:
                call()
            assert isinstance(raised.value, (ValueError, hbmio.Error, hbmio.DeviceError)), device
    for framework in ("PT", "jax"):
        with pytest.raises(safetensors.SafetensorError) as raised:
            hbmio.load_file(path, framework=framework)
        assert isinstance(raised.value, ValueError) and isinstance(raised.value, hbmio.FrameworkError)
    with hbmio.open(path, framework="np") as f:
        with pytest.raises(TypeError):
            f.get_tensor(1)
        with pytest.raises(TypeError):
            f.get_slice(None)
