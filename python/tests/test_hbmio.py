"""Tests of the Python package against the shared fixtures and the reference implementation.

Fixtures: $HBMIO_FIXTURES/safetensors, else ../shared/fixtures/safetensors beside the repository. A missing
fixture directory fails the run (it never silently skips). GPU tests skip with the reason.

Bytes are compared through hbmio._inspect(array), which imports the array through its __dlpack__
(the path torch/cupy/jax take) and copies its host bytes: NumPy has no bfloat16 or float8 dtypes,
so np.from_dlpack refuses those tensors; their raw bytes are what the manifest hashes. Every dtype
NumPy does have is additionally checked through np.from_dlpack (dtype, shape, bytes, no copy).
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import pathlib
import shutil
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
    gc.collect()
    start = hbmio._memory_counters()
    yield start
    gc.collect()
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
    assert hbmio._memory_counters() == during, "memory freed while an array still uses it"
    assert sha256(head.tobytes()) == expected["head"]["sha256"]
    del head
    gc.collect()
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
