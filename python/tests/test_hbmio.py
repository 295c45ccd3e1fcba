"""Tests of the Python package against the shared fixtures and the reference implementation.

Fixtures: $HBMIO_FIXTURES/safetensors, else ../shared/fixtures/safetensors beside the repository. A missing
fixture directory fails the run (it never silently skips). GPU tests skip with the reason.

Bytes are compared through hbmio._inspect(array), which imports the array through its __dlpack__
(the path torch/cupy/jax take) and copies its host bytes: NumPy has no bfloat16 or float8 dtypes,
so np.from_dlpack refuses those tensors; their raw bytes are what the manifest hashes. Every dtype
NumPy does have is additionally checked through np.from_dlpack (dtype, shape, bytes, no copy).
"""
from __future__ import annotations

import re
import gc
import errno
import hashlib
import json
import os
import pathlib
import textwrap
import threading

import numpy as np
import pytest

import hbmio

REPO = pathlib.Path(__file__).resolve().parents[2]
# $HBMIO_FIXTURES names the fixtures root (as for the C++ tests); the safetensors files are below it.
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"

# safetensors dtype -> (DLPack type code, bits, NumPy dtype or None where NumPy has none)
DTYPES = {
    "BOOL": (6, 8, np.bool_), "U8": (1, 8, np.uint8), "I8": (0, 8, np.int8),
    "F8_E5M2": (12, 8, None), "F8_E4M3": (10, 8, None),
    "I16": (0, 16, np.int16), "U16": (1, 16, np.uint16), "F16": (2, 16, np.float16), "BF16": (4, 16, None),
    "I32": (0, 32, np.int32), "U32": (1, 32, np.uint32), "F32": (2, 32, np.float32),
    "F64": (2, 64, np.float64), "I64": (0, 64, np.int64), "U64": (1, 64, np.uint64), "C64": (5, 64, np.complex64),
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest() -> dict:
    path = FIXTURES / "MANIFEST.json"
    assert path.is_file(), f"fixtures not found at {FIXTURES} (set HBMIO_FIXTURES)"
    return json.loads(path.read_text())


def manifest_files() -> list[str]:
    try:
        return sorted(manifest())
    except AssertionError:
        return ["<missing MANIFEST.json>"]


def check_tensor(name: str, array, expected: dict) -> None:
    info = hbmio._inspect(array)
    code, bits, np_dtype = DTYPES[expected["dtype"]]
    assert (info["code"], info["bits"]) == (code, bits), name
    assert list(info["shape"]) == expected["shape"], name
    assert info["device_type"] == 1, name  # kDLCPU
    assert sha256(info["bytes"]) == expected["sha256"], name
    if np_dtype is not None:
        view = np.from_dlpack(array)
        assert view.dtype == np_dtype and list(view.shape) == expected["shape"], name
        assert sha256(view.tobytes()) == expected["sha256"], name
        if view.size:  # zero-copy: NumPy sees hbmio's memory
            assert view.ctypes.data == info["data_ptr"], name


def expected_tensors(file: str) -> dict:
    return {k: v for k, v in manifest()[file].items() if k != "__metadata__"}


@pytest.fixture
def counters_settle():
    # Pooled engines hold pinned bounce buffers by design (until _release_engines): free them on
    # both sides so that only what the test itself leaked is counted.
    gc.collect()
    hbmio._release_engines()
    start = hbmio._memory_counters()
    yield start
    gc.collect()
    hbmio._release_engines()
    assert hbmio._memory_counters() == start, "hbmio memory leaked by the test"


# --- every fixture, every dtype ---------------------------------------------------------------

@pytest.mark.parametrize("file", manifest_files())
def test_fixture_matches_manifest(file, counters_settle):
    expected = expected_tensors(file)
    loaded = hbmio.load_file(FIXTURES / file)
    assert sorted(loaded) == sorted(expected)
    # file order, like safetensors
    assert list(loaded) == sorted(expected, key=lambda n: expected[n]["data_offsets"][0])
    for name, array in loaded.items():
        check_tensor(name, array, expected[name])


@pytest.mark.parametrize("which", ["directory", "index"])
def test_sharded_checkpoint(which, counters_settle):
    expected = {}
    for file, entries in manifest().items():
        if file.startswith("sharded/"):
            expected.update({k: v for k, v in entries.items() if k != "__metadata__"})
    assert expected, "no sharded fixture in the manifest"
    path = FIXTURES / "sharded"
    if which == "index":
        path = path / "model.safetensors.index.json"
    loaded = hbmio.load_file(path)
    assert sorted(loaded) == sorted(expected)
    for name, array in loaded.items():
        check_tensor(name, array, expected[name])


def test_names_selects_tensors(counters_settle):
    loaded = hbmio.load_file(FIXTURES / "dtypes.safetensors", names=["t_float32", "t_bfloat16"])
    assert sorted(loaded) == ["t_bfloat16", "t_float32"]
    expected = expected_tensors("dtypes.safetensors")
    for name, array in loaded.items():
        check_tensor(name, array, expected[name])


def test_verify_and_backends(counters_settle):
    names = [b["name"] for b in hbmio.backends()]
    assert names[:4] == ["posix", "uring", "cufile", "auto"]
    expected = expected_tensors("big.safetensors")
    for backend in ("posix", "uring", "auto"):
        loaded = hbmio.load_file(FIXTURES / "big.safetensors", backend=backend)
        for name, array in loaded.items():
            check_tensor(name, array, expected[name])


def test_open_is_lazy_and_like_safe_open(counters_settle):
    with hbmio.open(FIXTURES / "dtypes.safetensors") as f:
        expected = expected_tensors("dtypes.safetensors")
        assert sorted(f.keys()) == sorted(expected)
        assert f.metadata() == manifest()["dtypes.safetensors"]["__metadata__"]
        assert f.dtype("t_bfloat16") == "BF16" and f.shape("t_bfloat16") == [3, 5]
        check_tensor("t_bfloat16", f.get_tensor("t_bfloat16"), expected["t_bfloat16"])
        with pytest.raises(KeyError):
            f.get_tensor("nope")


# --- round trips with the reference implementation -------------------------------------------

def sample_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(6)
    out = {
        "bool": rng.integers(0, 2, (4, 3)).astype(np.bool_),
        "u8": rng.integers(0, 255, (7,), dtype=np.uint8),
        "i8": rng.integers(-100, 100, (2, 3, 4), dtype=np.int8),
        "i16": rng.integers(-1000, 1000, (5, 5), dtype=np.int16),
        "u16": rng.integers(0, 60000, (3,), dtype=np.uint16),
        "f16": rng.standard_normal((9, 2)).astype(np.float16),
        "i32": rng.integers(-10**6, 10**6, (4, 4), dtype=np.int32),
        "u32": rng.integers(0, 2**31, (6,), dtype=np.uint32),
        "f32": rng.standard_normal((33, 17)).astype(np.float32),
        "f64": rng.standard_normal((3, 1, 2)),
        "i64": rng.integers(-2**40, 2**40, (8,), dtype=np.int64),
        "u64": rng.integers(0, 2**62, (2, 2), dtype=np.uint64),
        "c64": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "strided": np.arange(40, dtype=np.int32).reshape(5, 8)[:, ::3],  # not contiguous: copied
    }
    return out


def test_save_then_load_hbmio_and_reference(tmp_path, counters_settle):
    from safetensors import safe_open
    from safetensors.numpy import load_file as ref_load

    arrays = sample_arrays()
    path = tmp_path / "out.safetensors"
    hbmio.save_file(arrays, path, {"format": "np", "who": "test"})
    back = hbmio.load_file(path, verify=True)
    assert sorted(back) == sorted(arrays)
    for name, a in arrays.items():
        got = np.from_dlpack(back[name])
        assert got.dtype == a.dtype and got.shape == a.shape, name
        np.testing.assert_array_equal(got, a, err_msg=name)
    ref = ref_load(str(path))
    for name, a in arrays.items():
        assert ref[name].dtype == a.dtype and ref[name].shape == a.shape, name
        np.testing.assert_array_equal(ref[name], a, err_msg=name)
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "np" and meta["who"] == "test"
    assert any(k.startswith("hbmio.xxh3.") for k in meta), "checksums=True stores checksums"
    hbmio.save_file(arrays, path, checksums=False)  # replaces the file
    with safe_open(str(path), "np") as f:
        assert not any(k.startswith("hbmio.xxh3.") for k in (f.metadata() or {}))


def test_reference_written_loads_in_hbmio(tmp_path, counters_settle):
    from safetensors.numpy import save_file as ref_save

    arrays = {k: np.ascontiguousarray(v) for k, v in sample_arrays().items()}
    path = tmp_path / "ref.safetensors"
    ref_save(arrays, str(path), metadata={"format": "np"})
    back = hbmio.load_file(path)
    for name, a in arrays.items():
        got = np.from_dlpack(back[name])
        assert got.dtype == a.dtype and got.shape == a.shape, name
        np.testing.assert_array_equal(got, a, err_msg=name)


def test_dtypes_numpy_lacks_round_trip_through_dlpack(tmp_path, counters_settle):
    # bf16 and float8 arrays from a load go back into save_file through __dlpack__; bytes identical.
    loaded = hbmio.load_file(FIXTURES / "dtypes.safetensors")
    path = tmp_path / "again.safetensors"
    hbmio.save_file(loaded, path)
    expected = expected_tensors("dtypes.safetensors")
    again = hbmio.load_file(path, verify=True)
    for name, array in again.items():
        check_tensor(name, array, expected[name])


def test_buffer_protocol_input(tmp_path, counters_settle):
    import array as pyarray

    path = tmp_path / "buf.safetensors"
    hbmio.save_file({"a": memoryview(pyarray.array("i", [1, 2, 3]))}, path)
    np.testing.assert_array_equal(np.from_dlpack(hbmio.load_file(path)["a"]), np.array([1, 2, 3], np.int32))


# --- lifetime -------------------------------------------------------------------------------

def test_last_array_keeps_memory_alive(counters_settle):
    start = counters_settle
    expected = expected_tensors("big.safetensors")
    loaded = hbmio.load_file(FIXTURES / "big.safetensors")
    hbmio._release_engines()  # count the load's memory alone, not the pooled engine's buffers
    during = hbmio._memory_counters()
    assert during["host_bytes"] - start["host_bytes"] >= sum(e["data_offsets"][1] - e["data_offsets"][0]
                                                            for e in expected.values())
    head = np.from_dlpack(loaded["head"])  # a NumPy view: it too keeps the load alive
    del loaded
    gc.collect()
    for _ in range(3):  # churn the allocator: freed memory would likely be reused
        hbmio.load_file(FIXTURES / "dtypes.safetensors")
        _ = bytearray(8 << 20)
        gc.collect()
    hbmio._release_engines()
    assert hbmio._memory_counters() == during, "memory freed while an array still uses it"
    assert sha256(head.tobytes()) == expected["head"]["sha256"]
    del head
    gc.collect()
    hbmio._release_engines()
    assert hbmio._memory_counters() == start


def test_memory_returns_after_many_loads(counters_settle):
    for _ in range(20):
        arrays = hbmio.load_file(FIXTURES / "layers.safetensors")
        views = [hbmio._inspect(a) for a in arrays.values()]
        del arrays, views
    gc.collect()  # counters_settle checks the counters are back at their start value


# --- errors ---------------------------------------------------------------------------------

def test_truncated_file_raises_error_naming_it(tmp_path, counters_settle):
    src = FIXTURES / "big.safetensors"
    bad = tmp_path / "truncated.safetensors"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(src.stat().st_size - 1000))
    with pytest.raises(hbmio.Error) as info:
        hbmio.load_file(bad)
    assert isinstance(info.value, OSError)
    assert str(bad) in str(info.value)
    assert info.value.errno is not None and info.value.path == str(bad)


def test_bad_files_and_arguments(tmp_path, counters_settle):
    import errno

    with pytest.raises(hbmio.Error) as info:
        hbmio.load_file(tmp_path / "missing.safetensors")
    assert info.value.errno == errno.ENOENT
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(hbmio.Error, match="garbage.safetensors"):
        hbmio.load_file(garbage)
    with pytest.raises(hbmio.Error):
        hbmio.load_file(FIXTURES / "big.safetensors", device="nowhere")
    with pytest.raises(hbmio.Error):
        hbmio.load_file(FIXTURES / "big.safetensors", backend="nonsense")
    with pytest.raises(hbmio.Error):
        hbmio.save_file({"a": np.zeros(3)}, tmp_path / "no" / "such" / "dir.safetensors")
    with pytest.raises(TypeError):
        hbmio.save_file({"a": "not an array"}, tmp_path / "x.safetensors")
    assert not list(tmp_path.glob("x.safetensors*")), "a failed save leaves nothing behind"
    with pytest.raises(TypeError, match=r"the value 3 \(of 'layers': 3\) is int, not str"):
        hbmio.save_file({"a": np.zeros(3)}, tmp_path / "x.safetensors", {"ok": "yes", "layers": 3})
    with pytest.raises(TypeError, match="7"):
        hbmio.save_file({"a": np.zeros(3)}, tmp_path / "x.safetensors", {7: "seven"})
    assert not list(tmp_path.glob("x.safetensors*"))
    # Integrity entries given by the caller (e.g. metadata() of a file read earlier) describe
    # other bytes: the save replaces or drops them, so what it writes verifies and never lies.
    stale = {"hbmio.checksum": "xxh3-64+header", "hbmio.xxh3.a": "0000000000000000", "note": "kept"}
    hbmio.save_file({"a": np.arange(3)}, tmp_path / "y.safetensors", stale, checksums=False)
    assert hbmio.open(tmp_path / "y.safetensors").metadata() == {"note": "kept"}
    hbmio.save_file({"a": np.arange(3)}, tmp_path / "y.safetensors", stale)
    with hbmio.open(tmp_path / "y.safetensors") as f:
        assert f.metadata() == {"note": "kept"}  # hbmio's own entries are hbmio_metadata()'s
        assert f.hbmio_metadata()["hbmio.xxh3.a"] != "0000000000000000"
    hbmio.load_file(tmp_path / "y.safetensors", verify=True)


def test_wrong_argument_types_say_what_is_expected(tmp_path):
    # A list where a {name: tensor} dict belongs: dict() of it would speak of "update sequence
    # element #0"; the message says a dict is expected, and nothing is written.
    with pytest.raises(TypeError, match=r"tensors \(\{name: tensor\}\) must be a dict, not list") as info:
        hbmio.save_file([np.zeros(3)], tmp_path / "x.safetensors")
    assert "sequence element" not in str(info.value)
    with pytest.raises(TypeError, match=r"metadata \(\{str: str\}\) must be a dict, not list"):
        hbmio.save_file({"a": np.zeros(3)}, tmp_path / "x.safetensors", [("format", "np")])
    assert not list(tmp_path.glob("x.safetensors*"))
    # A path as bytes: a TypeError saying what a path is, not the extension's signature with its
    # internal types.
    with pytest.raises(TypeError, match=r"str or an os.PathLike.*not bytes.*decode") as info:
        hbmio.load_file(b"model.safetensors")
    assert "_Progress" not in str(info.value) and "_hbmio" not in str(info.value)
    with pytest.raises(TypeError, match=r"str or an os.PathLike.*not int"):
        hbmio.load_file(3)


def test_failed_save_keeps_previous_file(tmp_path, counters_settle):
    path = tmp_path / "keep.safetensors"
    hbmio.save_file({"a": np.arange(4, dtype=np.int64)}, path)
    before = path.read_bytes()
    with pytest.raises(hbmio.Error):
        hbmio.save_file({"": np.zeros(2)}, path)  # an empty name is refused
    assert path.read_bytes() == before


# --- threads --------------------------------------------------------------------------------

def test_threads_load_concurrently(counters_settle):
    files = ["big.safetensors", "dtypes.safetensors", "layers.safetensors", "odd_sizes.safetensors"]
    expected = {f: {n: e["sha256"] for n, e in expected_tensors(f).items()} for f in files}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            barrier.wait()
            for k in range(6):
                f = files[(i + k) % len(files)]
                got = {n: sha256(hbmio._inspect(a)["bytes"]) for n, a in hbmio.load_file(FIXTURES / f).items()}
                assert got == expected[f], f
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --- frameworks and GPU ---------------------------------------------------------------------

def test_torch_module():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import hbmio.torch as ht

    loaded = ht.load_file(FIXTURES / "dtypes.safetensors")
    assert loaded["t_bfloat16"].dtype == torch.bfloat16 and tuple(loaded["t_bfloat16"].shape) == (3, 5)


def test_numpy_module(tmp_path, counters_settle):
    import hbmio.numpy as hn

    loaded = hn.load_file(FIXTURES / "big.safetensors")
    assert loaded["emb"].dtype == np.float32
    with pytest.raises(TypeError, match="t_bfloat16"):
        hn.load_file(FIXTURES / "dtypes.safetensors")
    del loaded


cuda = pytest.mark.skipif(hbmio.cuda_device_count() == 0,
                          reason=f"no CUDA device: {hbmio.cuda_unavailable_reason()}")


@cuda
def test_load_to_gpu_and_save_from_gpu(tmp_path, counters_settle):
    expected = expected_tensors("dtypes.safetensors")
    loaded = hbmio.load_file(FIXTURES / "dtypes.safetensors", device="cuda:0")
    for name, array in loaded.items():
        info = hbmio._inspect(array)
        assert info["device_type"] == 2 and list(info["shape"]) == expected[name]["shape"], name
    path = tmp_path / "gpu.safetensors"
    hbmio.save_file(loaded, path)  # straight from device memory
    del loaded
    for name, array in hbmio.load_file(path).items():
        check_tensor(name, array, expected[name])


@cuda
def test_torch_cuda_loads_into_the_caching_allocator(counters_settle):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import load_file as ref_load

    for file in ("dtypes.safetensors", "scalars_and_empty.safetensors", "big.safetensors"):
        ref = ref_load(str(FIXTURES / file), device="cuda:0")
        got = hbmio.load_file(FIXTURES / file, device="cuda:0", framework="torch")
        assert list(got) == list(ref), file
        storages = set()
        for name, t in got.items():
            assert t.device == torch.device("cuda", 0) and t.dtype == ref[name].dtype, name
            assert t.shape == ref[name].shape, name
            assert torch_bytes(t.cpu()) == torch_bytes(ref[name].cpu()), name
            storages.add(t.untyped_storage().data_ptr())
        assert len(storages) == 1, "one allocation holds every tensor of the load"
    # hbmio allocated no device memory of its own: the tensors live in PyTorch's allocator.
    hbmio._release_engines()
    assert hbmio._memory_counters()["device_bytes"] == counters_settle["device_bytes"]
    del got, ref
    reserved = torch.cuda.memory_reserved(0)
    for _ in range(3):  # repeated loads reuse the cached blocks
        again = hbmio.load_file(FIXTURES / "big.safetensors", device=0)
        del again
    assert torch.cuda.memory_reserved(0) == reserved
    assert isinstance(hbmio.load_file(FIXTURES / "dtypes.safetensors", device=torch.device("cuda:0"))["t_int8"],
                      torch.Tensor)


@cuda
def test_torch_cuda_many_tensors_views_made_beside_the_read(tmp_path, counters_settle):
    """From hbmio._VIEWS_BESIDE_LOAD tensors on, the views are made while another thread reads:
    the result matches safetensors, and a failing read (a bad checksum) still raises here."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import load_file as ref_load

    count = hbmio._VIEWS_BESIDE_LOAD + 36
    gen = torch.Generator().manual_seed(3)
    tensors = {f"layer.{i:03d}": torch.randn(17, i % 7 + 1, generator=gen).to([torch.bfloat16, torch.float32, torch.int64][i % 3])
               for i in range(count)}
    path = tmp_path / "many.safetensors"
    hbmio.save_file(tensors, path)  # with checksums
    ref = ref_load(str(path), device="cuda:0")
    got = hbmio.load_file(path, device="cuda:0", verify=True)
    assert list(got) == list(ref)
    for name, t in got.items():
        assert t.dtype == ref[name].dtype and t.shape == ref[name].shape, name
        assert torch_bytes(t.cpu()) == torch_bytes(ref[name].cpu()), name
    del got
    with hbmio.open(path) as f:
        victim = list(f.keys())[count // 2]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:header])[victim]["data_offsets"][0]
    data[header + begin] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(hbmio.Error, match=victim):
        hbmio.load_file(path, device="cuda:0", verify=True)


def torch_bytes(t) -> bytes:
    """The raw bytes of a host tensor, any dtype (NumPy lacks bfloat16/float8), scalars included."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- drop-in semantics: frameworks, devices, safe_open ----------------------------------------

def test_framework_numpy_and_dlpack(counters_settle):
    from safetensors.numpy import load_file as ref_load

    ref = ref_load(str(FIXTURES / "big.safetensors"))
    got = hbmio.load_file(FIXTURES / "big.safetensors", framework="numpy")
    assert list(got) == list(ref)
    for name, a in got.items():
        assert isinstance(a, np.ndarray) and a.dtype == ref[name].dtype and a.shape == ref[name].shape, name
        assert a.tobytes() == ref[name].tobytes(), name
    scalars = hbmio.load_file(FIXTURES / "scalars_and_empty.safetensors", framework="np")
    ref = ref_load(str(FIXTURES / "scalars_and_empty.safetensors"))
    for name, a in ref.items():
        assert scalars[name].shape == a.shape and scalars[name].tobytes() == a.tobytes(), name
    with pytest.raises(TypeError, match="t_bfloat16"):
        hbmio.load_file(FIXTURES / "dtypes.safetensors", framework="numpy")
    with pytest.raises(ValueError, match="host memory only"):
        hbmio.load_file(FIXTURES / "big.safetensors", device="cuda:0", framework="numpy")
    with pytest.raises(ValueError, match="framework"):
        hbmio.load_file(FIXTURES / "big.safetensors", framework="tensorflow")
    neutral = hbmio.load_file(FIXTURES / "dtypes.safetensors", framework="dlpack")
    assert not isinstance(neutral["t_float32"], np.ndarray) and hasattr(neutral["t_float32"], "__dlpack__")
    auto = hbmio.load_file(FIXTURES / "dtypes.safetensors")
    try:
        import torch
    except ImportError:
        assert type(auto["t_float32"]) is type(neutral["t_float32"]), "auto without torch is dlpack"
    else:
        assert isinstance(auto["t_float32"], torch.Tensor), "auto with torch is torch"
    del got, scalars, neutral, auto


def test_device_arguments():
    assert hbmio._device_text(0) == "cuda:0" and hbmio._device_text(3) == "cuda:3"
    assert hbmio._device_text("cuda:1") == "cuda:1" and hbmio._device_text("cpu") == "cpu"
    with pytest.raises(TypeError):
        hbmio._device_text(True)
    if hbmio.cuda_device_count() == 0:
        with pytest.raises(hbmio.Error):  # an int is a CUDA index, and there is no CUDA here
            hbmio.load_file(FIXTURES / "dtypes.safetensors", device=0, framework="dlpack")


def test_open_context_manager_with_framework(counters_settle):
    from safetensors import safe_open

    with hbmio.open(FIXTURES / "big.safetensors", framework="np") as f, \
            safe_open(str(FIXTURES / "big.safetensors"), "np") as ref:
        assert sorted(f.keys()) == sorted(ref.keys())
        for name in ref.keys():
            got = f.get_tensor(name)
            assert isinstance(got, np.ndarray) and got.tobytes() == ref.get_tensor(name).tobytes(), name
        neutral = f.get_tensor("head", framework="dlpack")
        assert not isinstance(neutral, np.ndarray)
        with pytest.raises(KeyError):
            f.get_tensor("nope")
    del got, neutral
    with pytest.raises(ValueError, match="framework"):
        hbmio.open(FIXTURES / "big.safetensors", framework="jax")


def test_torch_matches_safetensors_torch(tmp_path, counters_settle):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import load_file as ref_load

    def same(got, ref):
        assert list(got) == list(ref)
        for name, t in got.items():
            assert isinstance(t, torch.Tensor) and t.dtype == ref[name].dtype and t.shape == ref[name].shape, name
            assert t.device.type == "cpu", name
            assert torch_bytes(t) == torch_bytes(ref[name]), name

    from safetensors.numpy import save_file as ref_save

    every_dtype = tmp_path / "sample.safetensors"  # complex64 and unsigned ints beside the fixtures' dtypes
    ref_save({k: np.ascontiguousarray(v) for k, v in sample_arrays().items()}, str(every_dtype))
    for path in [FIXTURES / f for f in ("dtypes.safetensors", "scalars_and_empty.safetensors", "big.safetensors")] + [
            every_dtype]:
        ref = ref_load(str(path))
        same(hbmio.load_file(path, framework="torch"), ref)
        same(hbmio.load_file(path, device=torch.device("cpu"), framework="pt"), ref)
        # The CUDA fast path's view building, exercised on the host: one torch.empty, views of it.
        same(hbmio._load_torch_into(torch, str(path), torch.device("cpu"), "auto", False, None, False), ref)
        # share=True's: views of each allocation the load's tensors lie in, made from _load_views.
        same(hbmio._torch_views(torch, *hbmio._hbmio._load_views(str(path), "cpu"), str(path)), ref)
    # Past _VIEWS_BESIDE_LOAD tensors the views are made while the load runs; dtypes interleaved,
    # scalars and empty tensors among them, a subset by name.
    many = tmp_path / "many.safetensors"
    gen = torch.Generator().manual_seed(3)
    kinds = [(torch.bfloat16, (3, 5)), (torch.float32, ()), (torch.int8, (7,)), (torch.float16, (2, 0, 4)), (torch.int64, (2, 3, 2))]
    tensors = {f"t{i:03d}": (torch.randn(kinds[i % 5][1], generator=gen) * 50).to(kinds[i % 5][0]) for i in range(150)}
    from safetensors.torch import save_file as ref_save_torch
    ref_save_torch(tensors, str(many))
    ref = ref_load(str(many))
    # In the file's order as load_file gives it (the reference orders empty tensors at one offset
    # by its hash map, so its order is compared as a set).
    ref = {n: ref[n] for n in hbmio.load_file(many)}
    got = hbmio._load_torch_into(torch, str(many), torch.device("cpu"), "auto", False, None, False)
    same(got, ref)
    assert all(got[n].stride() == ref[n].contiguous().stride() for n in ref)
    subset = ["t149", "t003", "t072"]
    got = hbmio._load_torch_into(torch, str(many), torch.device("cpu"), "auto", False, subset, False)
    same(got, {n: ref[n] for n in hbmio.load_file(many, names=subset)})
    import hbmio.torch as ht
    same(ht.load_file(FIXTURES / "dtypes.safetensors"), ref_load(str(FIXTURES / "dtypes.safetensors")))
    views = hbmio._hbmio._load_views(str(many), "cpu", names=subset)
    bases, names, groups, arrays = views
    assert len(bases) == 1 and not arrays and all(g[4] == 0 for g in groups), "one allocation: every tensor a view of it"
    same(hbmio._torch_views(torch, *views, str(many)), {n: ref[n] for n in hbmio.load_file(many, names=subset)})


def test_views_made_by_groups_are_each_tensor_exactly(tmp_path, counters_settle):
    """Loads into one allocation make the views of one weight of every layer with one call
    (view_groups in load.cpp): tensors of a dtype and shape whose names differ only in their numbers,
    a constant step apart. Layers numbered past 9 (so 10 sorts before 2), two weights of one shape in
    each layer (not a constant step together), scalars, empty tensors and a layer whose weight has
    another dtype: every tensor must still be the reference's, in file order, each its own view."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import load_file as ref_load, save_file as ref_save
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in range(12):
        p = f"model.layers.{layer}."
        tensors[p + "mlp.gate.weight"] = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
        tensors[p + "mlp.up.weight"] = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
        tensors[p + "mlp.down.weight"] = torch.randn(4, 6, generator=gen).to(torch.float16 if layer == 7 else torch.bfloat16)
        tensors[p + "scale"] = torch.tensor(float(layer))
        tensors[p + "empty"] = torch.zeros(0, 3)
    tensors["lm_head.weight"] = torch.randn(5, 4, generator=gen)
    path = tmp_path / "layers.safetensors"
    ref_save(tensors, str(path))
    order = list(hbmio.load_file(path))  # file order
    ref = {n: ref_load(str(path))[n] for n in order}

    def check(got, want):
        assert list(got) == list(want)
        for name, t in got.items():
            r = want[name]
            assert t.dtype == r.dtype and t.shape == r.shape and t.stride() == r.contiguous().stride(), name
            assert torch_bytes(t) == torch_bytes(r), name

    opened = hbmio._hbmio.SafeOpen(str(path), cache="off")
    names, groups = hbmio._hbmio._plan_summary(opened, None)[4].groups()
    assert names == order
    # The 49 non-empty tensors: lm_head 1 group, scales 1, gate, up and down 2 each (layer 7's F16 down breaks the
    # step), that down 1 (each empty tensor is a group of its own: several lie at one offset).
    nonempty = [g for g in groups if 0 not in g[2]]
    assert len(nonempty) <= 9 and max(len(g[0]) for g in nonempty) == 12, nonempty
    got = hbmio._load_torch_into(torch, str(path), torch.device("cpu"), "auto", False, None, False)
    check(got, ref)
    # Each is a view of its own bytes: writing one leaves its group's others as they were.
    got["model.layers.3.mlp.gate.weight"].fill_(7)
    for name in order:
        if name != "model.layers.3.mlp.gate.weight":
            assert torch_bytes(got[name]) == torch_bytes(ref[name]), name
    subset = ["model.layers.11.mlp.up.weight", "lm_head.weight", "model.layers.2.mlp.up.weight", "model.layers.10.scale"]
    want = {n: ref[n] for n in hbmio.load_file(path, names=subset)}
    check(hbmio._load_torch_into(torch, str(path), torch.device("cpu"), "auto", False, subset, False), want)
    check(hbmio._torch_views(torch, *hbmio._hbmio._load_views(str(path), "cpu", names=subset), str(path)), want)
    check(hbmio._torch_views(torch, *hbmio._hbmio._load_views(str(path), "cpu"), str(path)), ref)


def test_views_of_a_load_hand_over_what_is_no_whole_element_view_as_its_own_array(tmp_path, counters_settle):
    """Sub-byte dtypes (F4: two values a byte) and a tensor whose bytes do not start on a whole
    element of its allocation (the format allows any offset; the resident cache's shared copies
    keep the file's offsets) cannot be typed views of it: _load_views hands them over as arrays of
    their own, with the reference's dtype, shape and bytes."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip(f"torch {torch.__version__} has no float4_e2m1fn_x2")
    from safetensors.torch import load_file as ref_load

    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
                         "c": {"dtype": "F4", "shape": [2, 4], "data_offsets": [11, 15]}}).encode()
    path = tmp_path / "odd.safetensors"
    data = bytes([1, 2, 3]) + np.array([1.5, -2.0], "<f4").tobytes() + bytes([0x12, 0x34, 0x56, 0x78])
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    views = hbmio._hbmio._load_views(str(path), "cpu")
    bases, names, groups, arrays = views
    assert names == ["a", "b", "c"], names
    assert [g[0] for g in groups][:1] == [["a"]] and "c" in [a[0] for a in arrays], (groups, arrays)
    got = hbmio._torch_views(torch, *views, str(path))
    ref = ref_load(str(path))
    assert list(got) == ["a", "b", "c"]
    for name in ref:
        assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape, name
        assert torch_bytes(got[name]) == torch_bytes(ref[name]), name


def test_every_torch_dtype_both_ways_with_the_reference(tmp_path, counters_settle):
    """hbmio writes, the reference reads (and the other way) every dtype the two share through torch:
    bf16, the float8 family with the FNUZ variants, complex64, unsigned ints; scalars and empty tensors.
    Random bytes in every tensor, so that a swapped or reinterpreted tensor cannot compare equal."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import load_file as ref_load, save_file as ref_save
    import safetensors.torch as st_torch

    # The reference's own table of names -> torch dtypes (those this torch has).
    shared = {name: dt for name, dt in st_torch._TYPES.items() if dt is not None}
    for must in ("BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64", "U16", "U32", "U64"):
        assert must in shared, f"torch {torch.__version__} or safetensors lacks {must}"
    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for i, (name, dt) in enumerate(sorted(shared.items())):
        for suffix, shape in (("", (3 + i % 4, 5)), ("_scalar", ()), ("_empty", (0, 2))):
            itemsize = torch.empty((), dtype=dt).element_size()
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
            if dt == torch.bool:
                raw = raw & 1  # only 0 and 1 are bools
            tensors[f"t_{name}{suffix}"] = raw.view(dt).reshape(shape)

    def same(got, want, who):
        assert sorted(got) == sorted(want), who
        for key, t in want.items():
            g = got[key]
            assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), (who, key, g.dtype, t.dtype)
            assert torch_bytes(g) == torch_bytes(t), (who, key)

    ours = tmp_path / "hbmio.safetensors"
    hbmio.save_file(tensors, ours)
    same(ref_load(str(ours)), tensors, "reference reads hbmio's file")
    same(hbmio.load_file(ours, framework="torch", verify=True), tensors, "hbmio reads its own file")
    with open(ours, "rb") as f:  # the dtype names written are the reference's names
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {k: v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
        f"t_{n}{s}": n for n in shared for s in ("", "_scalar", "_empty")}

    theirs = tmp_path / "reference.safetensors"
    ref_save(tensors, str(theirs))
    same(hbmio.load_file(theirs, framework="torch"), tensors, "hbmio reads the reference's file")


# --- the engine pool ----------------------------------------------------------------------------

def test_engines_are_reused_and_released(counters_settle):
    hbmio._release_engines()
    assert hbmio._idle_engines() == {}
    for _ in range(3):
        hbmio.load_file(FIXTURES / "layers.safetensors", backend="posix")
        hbmio.load_file(FIXTURES / "layers.safetensors", backend="uring")
    assert hbmio._idle_engines() == {"posix": 1, "uring": 1}, "sequential loads reuse one engine"

    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(4):
                hbmio.load_file(FIXTURES / "big.safetensors", backend="posix")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert 1 <= hbmio._idle_engines()["posix"] <= 4, "the pool keeps at most 4 idle engines a backend"
    assert hbmio._release_engines() >= 2
    assert hbmio._idle_engines() == {}
    with pytest.raises(hbmio.Error):  # an unknown backend is refused, and nothing is pooled for it
        hbmio.load_file(FIXTURES / "big.safetensors", backend="nonsense")
    assert hbmio._idle_engines() == {}


# --- raw ranges: read_into / write_from ---------------------------------------------------------

@pytest.mark.parametrize("backend", ["posix", "uring", "auto"])
def test_read_into_matches_fromfile(tmp_path, backend, counters_settle):
    path = tmp_path / "raw.bin"
    data = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)
    data.tofile(path)
    for offset, count in [(0, data.size), (1, 4095), (4096, 4097), (777, 1000), (data.size - 5, 5), (10, 0)]:
        out = np.full(count, 0xAB, dtype=np.uint8)
        stats = hbmio.read_into(path, out, offset, backend=backend)
        np.testing.assert_array_equal(out, np.fromfile(path, dtype=np.uint8, count=count, offset=offset))
        assert stats["bytes"] == count
        assert set(stats) == {"bytes", "seconds", "gib_per_second", "backend", "bytes_direct", "wake_seconds", "drain_seconds",
                              "copy_wait_seconds", "note", "paths"}
        assert 0 <= stats["wake_seconds"] <= stats["seconds"] and 0 <= stats["drain_seconds"] <= stats["seconds"]
        # The way the file's bytes took (none for an empty read), and why.
        assert [(p["file"], p["bytes"]) for p in stats["paths"]] == ([(str(path), count)] if count else [])
        assert all(p["path"] in ("uring", "posix") and p["reason"] for p in stats["paths"])
    floats = np.zeros((7, 3), dtype=np.float32)  # any dtype: its nbytes bytes
    hbmio.read_into(path, floats, 8, backend=backend)
    assert floats.tobytes() == data[8:8 + 84].tobytes()
    buf = bytearray(100)  # the buffer protocol
    hbmio.read_into(path, buf, 50, backend=backend)
    assert bytes(buf) == data[50:150].tobytes()
    with pytest.raises(hbmio.Error):
        hbmio.read_into(path, np.zeros(200, np.uint8), data.size - 100, backend=backend)  # past the end


def test_read_into_refuses_bad_arrays(tmp_path, counters_settle):
    import errno

    path = tmp_path / "raw.bin"
    np.arange(256, dtype=np.uint8).tofile(path)
    ro = np.zeros(10, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        hbmio.read_into(path, ro)
    with pytest.raises(ValueError, match="read-only"):
        hbmio.read_into(path, b"0123456789")
    with pytest.raises(ValueError, match="contiguous"):
        hbmio.read_into(path, np.zeros((4, 4), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="expected an array"):
        hbmio.read_into(path, "not an array")
    with pytest.raises(hbmio.Error) as info:
        hbmio.read_into(tmp_path / "missing.bin", np.zeros(4, np.uint8))
    assert info.value.errno == errno.ENOENT and "missing.bin" in str(info.value)


@pytest.mark.parametrize("backend", ["posix", "uring"])
def test_write_from_creates_and_writes_in_place(tmp_path, backend, counters_settle):
    path = tmp_path / "new.bin"
    data = np.random.default_rng(2).integers(0, 256, 10000, dtype=np.uint8)
    stats = hbmio.write_from(path, data, backend=backend)
    assert stats["bytes"] == data.size
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.uint8), data)
    patch = np.arange(300, dtype=np.int16)  # 600 bytes at 4000; the rest of the file is kept
    hbmio.write_from(path, patch, 4000, backend=backend, sync=False)
    expected = data.copy()
    expected[4000:4600] = np.frombuffer(patch.tobytes(), np.uint8)
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.uint8), expected)
    hbmio.write_from(path, b"tail", 10000, backend=backend)  # read-only input is fine for writes
    assert path.read_bytes()[10000:] == b"tail" and path.stat().st_size == 10004
    with pytest.raises(ValueError, match="contiguous"):
        hbmio.write_from(path, np.zeros((4, 4), np.uint8)[::2])
    with pytest.raises(hbmio.Error):
        hbmio.write_from(tmp_path / "no" / "dir.bin", data)


@cuda
def test_read_into_and_write_from_gpu(tmp_path, counters_settle):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    path = tmp_path / "gpu.bin"
    data = np.random.default_rng(3).integers(0, 256, 5 * 4096 + 9, dtype=np.uint8)
    data.tofile(path)
    dev = torch.empty(4096 + 7, dtype=torch.uint8, device="cuda:0")
    hbmio.read_into(path, dev, 100)
    assert dev.cpu().numpy().tobytes() == data[100:100 + 4096 + 7].tobytes()
    hbmio.write_from(tmp_path / "out.bin", dev)
    assert (tmp_path / "out.bin").read_bytes() == data[100:100 + 4096 + 7].tobytes()


# --- progress -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["posix", "uring"])
def test_progress_counter_reaches_the_total(backend, counters_settle):
    total = hbmio._hbmio._tensor_bytes(str(FIXTURES / "big.safetensors"))
    assert total == sum(e["data_offsets"][1] - e["data_offsets"][0]
                        for e in expected_tensors("big.safetensors").values())
    counter = hbmio._hbmio._Progress()
    loaded = hbmio._hbmio.load_file(str(FIXTURES / "big.safetensors"), backend=backend, progress=counter)
    assert counter.done == total
    del loaded


def test_loads_and_the_progress_bar_start_no_python_thread(tmp_path, capfd, monkeypatch):
    # The faces start no thread of their own (the library's pool draws the bar and runs the load
    # beside which a torch load builds its views): with Thread.start refused, a load of many
    # tensors, with a progress bar, gives every tensor's bytes.
    torch = pytest.importorskip("torch", reason="torch is not installed")
    state = {f"t{i:03d}": torch.arange(i, i + 1000, dtype=torch.float32) for i in range(200)}
    hbmio.save_file(state, tmp_path / "many.safetensors")

    def refused(self):
        raise AssertionError(f"hbmio started a Python thread: {self.name}")

    monkeypatch.setattr(threading.Thread, "start", refused)
    loaded = hbmio.load_file(tmp_path / "many.safetensors", progress=True)
    assert list(loaded) == list(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert "(100%)" in capfd.readouterr().err


def test_a_background_load_told_to_stop_raises_ecanceled_and_the_next_load_is_whole(tmp_path):
    # _load_into(background=True) (a torch load into a GPU builds its views meanwhile): cancel()
    # stops its reads; wait() then raises ECANCELED, the destination is not written after it
    # returns, and a load right after (same pooled engine) gives every byte.
    state = {f"t{i:02d}": np.full(16 << 20, i + 1, dtype=np.uint8) for i in range(64)}  # 1 GiB
    path = tmp_path / "big.safetensors"
    hbmio.save_file(state, path)
    opened = hbmio._hbmio.SafeOpen(str(path), cache="off")
    plan = hbmio._hbmio._plan(opened, None)
    dest = np.zeros(plan[-1].offset + plan[-1].size, dtype=np.uint8)
    job = hbmio._hbmio._load_into(opened, dest, backend="auto", entries=False, background=True)
    job.cancel()
    with pytest.raises(hbmio.Error) as stopped:
        job.wait()
    assert stopped.value.errno == errno.ECANCELED, stopped.value
    after = dest.copy()
    gc.collect()
    assert np.array_equal(dest, after), "the destination was written after wait() returned"
    job = hbmio._hbmio._load_into(opened, dest, backend="auto", entries=False, background=True)
    job.wait()
    for t in plan:
        assert (dest[t.offset:t.offset + t.size] == int(t.name[1:]) + 1).all(), t.name


LOAD_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time, numpy as np, hbmio
    path, total = sys.argv[1], int(sys.argv[2])
    counter = hbmio._hbmio._Progress()

    def interrupt_once_reading():  # Ctrl-C, as the terminal sends it, once the load has begun
        while counter.done == 0:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_reading, daemon=True).start()
    try:
        hbmio._hbmio.load_file(path, "cpu", backend="posix", progress=counter)
        print("loaded", flush=True)
    except KeyboardInterrupt:
        print("interrupted", "stopped" if counter.done < total else "finished", flush=True)
    got = hbmio.load_file(path, framework="numpy")
    ok = sorted(got) == [f"t{i:02d}" for i in range(32)] and all((got[f"t{i:02d}"] == i + 1).all() for i in range(32))
    print("ok" if ok else "wrong bytes", flush=True)
""")


def test_ctrl_c_during_a_load_stops_it_and_hbmio_keeps_working(tmp_path):
    # Ctrl-C in the middle of load_file (the GIL released, the load on the library's pool): the
    # load is told to stop, so it ends before its last byte (2 GiB through one thread's preads
    # take hundreds of milliseconds; the signal is looked for every 50), KeyboardInterrupt reaches
    # the caller, and the next load is whole.
    import subprocess
    import sys
    path = tmp_path / "big.safetensors"
    hbmio.save_file({f"t{i:02d}": np.full(64 << 20, i + 1, dtype=np.uint8) for i in range(32)}, path)
    total = 32 * (64 << 20)
    child = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(path), str(total)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.split() == ["interrupted", "stopped", "ok"], (child.returncode, child.stdout,
                                                                                              child.stderr[-2000:])


def test_progress_bar_on_stderr(tmp_path, capfd, counters_settle):
    loaded = hbmio.load_file(FIXTURES / "big.safetensors", progress=True)
    out, err = capfd.readouterr()
    total = hbmio._hbmio._tensor_bytes(str(FIXTURES / "big.safetensors")) / (1 << 20)
    assert out == "" and err.endswith("\n")
    last = err.rstrip("\n").split("\r")[-1].rstrip()
    assert re.fullmatch(rf"{total:.2f} MiB / {total:.2f} MiB  \(100%\)  [0-9.]+ GiB/s", last), err
    del loaded
    hbmio.read_into(FIXTURES / "big.safetensors", np.zeros(3 << 20, np.uint8), progress=True)
    err = capfd.readouterr().err
    assert err.rstrip("\n").split("\r")[-1].startswith("3.00 MiB / 3.00 MiB  (100%)"), err
    hbmio.load_file(FIXTURES / "dtypes.safetensors")
    assert capfd.readouterr().err == "", "no output without progress=True"


@pytest.mark.parametrize("max_shard_size", [None, 5000])
def test_save_progress(tmp_path, capfd, max_shard_size):
    state = {f"t{i}": np.arange(1000 * (i + 1), dtype=np.float32) for i in range(4)}
    counter = hbmio._hbmio._Progress()
    hbmio._hbmio.save_file(state, str(tmp_path / "c.safetensors"), None, max_shard_size=max_shard_size or 0,
                           progress=counter)
    assert counter.done == sum(a.nbytes for a in state.values()), "every tensor byte once, headers not counted"
    capfd.readouterr()
    hbmio.save_file(state, tmp_path / "bar", max_shard_size=max_shard_size, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and err.endswith("\n")
    nbytes = sum(a.nbytes for a in state.values())
    kib = f"{nbytes / 1024:.2f} KiB"  # hbmio::format_size's unit for these 39 KiB
    assert err.rstrip("\n").split("\r")[-1].startswith(f"{kib} / {kib}  (100%)  "), err
    hbmio.save_file(state, tmp_path / "quiet", max_shard_size=max_shard_size)
    assert capfd.readouterr().err == "", "no output without progress=True"


# --- sharded saves ------------------------------------------------------------------------------

@pytest.mark.parametrize("max_shard_size", [1000, "2KB", "1KiB"])
def test_sharded_save_loads_back(tmp_path, max_shard_size, counters_settle):
    from safetensors.numpy import load_file as ref_load

    arrays = {k: np.ascontiguousarray(v) for k, v in sample_arrays().items()}
    out = tmp_path / "model"
    hbmio.save_file(arrays, out, {"format": "np"}, max_shard_size=max_shard_size)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert sorted(index["weight_map"]) == sorted(arrays)
    limit = hbmio._parse_size(max_shard_size)
    seen = {}
    for shard in shards:  # the reference reads each shard on its own
        part = ref_load(str(out / shard))
        assert sum(a.nbytes for a in part.values()) <= limit or len(part) == 1, shard
        for name, a in part.items():
            assert index["weight_map"][name] == shard
            seen[name] = a
    for name, a in arrays.items():
        assert seen[name].dtype == a.dtype and seen[name].shape == a.shape, name
        np.testing.assert_array_equal(seen[name], a, err_msg=name)
    back = hbmio.load_file(out, framework="numpy", verify=True)
    assert sorted(back) == sorted(arrays)
    for name, a in arrays.items():
        assert back[name].dtype == a.dtype and back[name].tobytes() == a.tobytes(), name
    del back


def test_parse_size():
    assert hbmio._parse_size(123) == 123
    assert hbmio._parse_size("5GB") == 5 * 10**9 and hbmio._parse_size("2GiB") == 2 << 30
    # The command line's parser: decimal KB/MB/GB as Hugging Face, binary K/M/G and KiB/MiB/GiB.
    assert hbmio._parse_size("500MB") == 500 * 10**6 and hbmio._parse_size("64k") == 64 << 10
    assert hbmio._parse_size("1.5MiB") == 3 << 19 and hbmio._parse_size("4096") == 4096
    assert hbmio._parse_size("2KB") == 2000 and hbmio._parse_size("2K") == 2048
    for bad in ("", "5 parsecs", "GB", -1, 1.5, None, "5Gb", "5gb"):
        with pytest.raises(ValueError):
            hbmio._parse_size(bad)
    with pytest.raises(ValueError):
        hbmio.save_file({"a": np.zeros(2)}, "/nonexistent/x", max_shard_size=0)


def test_missing_file_errno_and_path(tmp_path):
    import errno

    missing = tmp_path / "absent.safetensors"
    for call in (lambda: hbmio.load_file(missing), lambda: hbmio.open(missing)):
        with pytest.raises(hbmio.Error) as info:
            call()
        assert isinstance(info.value, OSError) and info.value.errno == errno.ENOENT
        assert str(missing) in str(info.value)


# --- DLPack into CuPy and JAX on the GPU: no copy -------------------------------------------------

@cuda
def test_dlpack_into_cupy_without_a_copy(counters_settle):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    expected = expected_tensors("big.safetensors")
    arrays = hbmio.load_file(FIXTURES / "big.safetensors", device="cuda:0", framework="dlpack")
    for name, array in arrays.items():
        info = hbmio._inspect(array)
        c = cupy.from_dlpack(array)
        assert c.data.ptr == info["data_ptr"], f"{name}: cupy copied the tensor"
        assert list(c.shape) == expected[name]["shape"], name
        assert sha256(cupy.asnumpy(c).tobytes()) == expected[name]["sha256"], name
    del arrays, c


@cuda
def test_dlpack_into_jax_without_a_copy(counters_settle):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax sees no GPU")
    expected = expected_tensors("big.safetensors")
    arrays = hbmio.load_file(FIXTURES / "big.safetensors", device="cuda:0", framework="dlpack")
    for name, array in arrays.items():
        info = hbmio._inspect(array)
        j = jax.dlpack.from_dlpack(array)
        assert j.unsafe_buffer_pointer() == info["data_ptr"], f"{name}: jax copied the tensor"
        assert list(j.shape) == expected[name]["shape"], name
        assert sha256(np.asarray(j).tobytes()) == expected[name]["sha256"], name
        del j
    del arrays


def test_verify_on_files_without_checksums(tmp_path):
    """verify=True loads another tool's file and says it could not check it; "strict" refuses it;
    a damaged file with checksums is a VerifyError (EIO), never errno text alone."""
    import warnings
    from safetensors.numpy import save_file as reference_save
    plain = tmp_path / "plain.safetensors"
    reference_save({"w": np.arange(16, dtype=np.float32)}, str(plain))
    with pytest.warns(hbmio.NotVerifiedWarning, match="plain.safetensors"):
        got = hbmio.load_file(plain, framework="numpy", verify=True)
    assert got["w"].tobytes() == np.arange(16, dtype=np.float32).tobytes()
    with pytest.warns(hbmio.NotVerifiedWarning):
        hbmio.load_file(plain, framework="numpy", verify="checksums")
    with pytest.raises(hbmio.Error, match="nothing to verify against") as raised:
        hbmio.load_file(plain, framework="numpy", verify="strict")
    assert not isinstance(raised.value, hbmio.VerifyError)
    with pytest.raises(ValueError, match="verify must be"):
        hbmio.load_file(plain, framework="numpy", verify="bytes-please")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without verify, or with checksums present
        hbmio.load_file(plain, framework="numpy")
        ours = tmp_path / "ours.safetensors"
        hbmio.save_file({"w": np.arange(16, dtype=np.float32)}, ours)
        hbmio.load_file(ours, framework="numpy", verify="strict")
    data = bytearray(ours.read_bytes())
    data[-1] ^= 1
    ours.write_bytes(bytes(data))
    with pytest.raises(hbmio.VerifyError, match="verification failed") as raised:
        hbmio.load_file(ours, framework="numpy", verify=True)
    assert raised.value.errno == errno.EIO


def test_metadata_and_names_that_cannot_be_saved_say_which_side_is_wrong(tmp_path):
    path = tmp_path / "m.safetensors"
    t = {"x": np.zeros(2, dtype=np.float32)}
    with pytest.raises(TypeError, match=r"the key 1 \(of 1: 'v'\) is int, not str"):
        hbmio.save_file(t, path, metadata={1: "v"})
    with pytest.raises(TypeError, match=r"the value 2 \(of 'k': 2\) is int, not str"):
        hbmio.save_file(t, path, metadata={"k": 2})
    with pytest.raises(ValueError, match="not encodable as UTF-8"):
        hbmio.save_file(t, path, metadata={"k": "bad\udc80"})
    with pytest.raises(ValueError, match=r"tensor name 'x\\udc80' is not encodable as UTF-8"):
        hbmio.save_file({"x\udc80": np.zeros(2, dtype=np.float32)}, path)
    assert not path.exists()
