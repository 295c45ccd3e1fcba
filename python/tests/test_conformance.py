"""The same call through the reference (safetensors) and through hbmio's stand-ins: the same
result, or the same exception type with the words code matches on.

The cases run against the safetensors installed in the venv (0.8) and, in a child process, against
0.9 (scripts/test-env.sh installs its release candidate into build-python/safetensors-0.9):
test_the_cases_against_safetensors_0_9 at the end."""
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

import hbmio
import hbmio.numpy
import hbmio.torch

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
safetensors = pytest.importorskip("safetensors")
st_torch = pytest.importorskip("safetensors.torch")
st_numpy = pytest.importorskip("safetensors.numpy")

SAVE_REFUSALS = {
    "not a dict": ("notadict", "Expected a dict of [str, torch.Tensor]"),
    "a list": ([torch.zeros(2)], "Expected a dict of [str, torch.Tensor]"),
    "meta tensor": ({"a": torch.empty(3, device="meta")}, "Cannot copy out of meta tensor"),
    "strided": ({"a": torch.zeros(4, 4)[:, ::2]}, "non contiguous tensor: `a`"),
    "sparse": ({"a": torch.zeros(3, 3).to_sparse()}, "sparse tensors"),
    "not a tensor": ({"a": 3}, "Key `a` is invalid, expected torch.Tensor but received <class 'int'>"),
}


@pytest.mark.parametrize("case", sorted(SAVE_REFUSALS))
def test_save_refusals_match_the_reference(tmp_path, case):
    value, words = SAVE_REFUSALS[case]
    with pytest.raises(Exception) as ref:
        st_torch.save_file(value, str(tmp_path / "ref.safetensors"))
    with pytest.raises(Exception) as ours:
        hbmio.torch.save_file(value, tmp_path / "ours.safetensors")
    assert isinstance(ours.value, type(ref.value)), (type(ours.value), type(ref.value))
    assert words in str(ref.value) and words in str(ours.value), (str(ref.value), str(ours.value))
    assert not (tmp_path / "ours.safetensors").exists()


def test_a_missing_file_is_the_references_exception_type(tmp_path):
    from safetensors import safe_open
    missing = str(tmp_path / "notafile")
    for ref_call, our_call in ((lambda: st_torch.load_file(missing), lambda: hbmio.torch.load_file(missing)),
                               (lambda: safe_open(missing, "pt"), lambda: hbmio.open(missing, "pt"))):
        with pytest.raises(FileNotFoundError) as ref:
            ref_call()
        with pytest.raises(FileNotFoundError) as ours:
            our_call()
        # The reference's whole message, as code matching it sees it in ours.
        assert str(ref.value) == f"No such file or directory: {missing}", str(ref.value)
        assert str(ref.value) in str(ours.value), (str(ref.value), str(ours.value))
        assert isinstance(ours.value, hbmio.Error) and ours.value.filename == missing


def test_a_missing_file_through_the_numpy_stand_in(tmp_path):
    missing = str(tmp_path / "notafile")
    with pytest.raises(FileNotFoundError) as ref:
        st_numpy.load_file(missing)
    for mmap in (False, True):
        with pytest.raises(FileNotFoundError) as ours:
            hbmio.numpy.load_file(missing, mmap=mmap)
        assert str(ref.value) in str(ours.value), (str(ref.value), str(ours.value))


def _file(header: bytes, data: bytes = b"", length=None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


MALFORMED = {
    "invalid JSON": _file(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}', b"\0" * 4),
    "unknown dtype": _file(b'{"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "offsets past the data": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 4),
    "shape and size disagree": _file(b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', b"\0" * 8),
    "overlapping tensors": _file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                 b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', b"\0" * 12),
    "header length past the file": _file(b'{}', length=10**6),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_safetensor_errors_as_in_the_reference(tmp_path, case):
    """A malformed file the reference refuses with SafetensorError: hbmio refuses it with an error
    that is a SafetensorError too (and an hbmio.Error naming the file)."""
    import safetensors
    from safetensors import safe_open
    path = tmp_path / "bad.safetensors"
    path.write_bytes(MALFORMED[case])
    with pytest.raises(safetensors.SafetensorError):
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    for call in (lambda: hbmio.open(path, "pt"), lambda: hbmio.load_file(path), lambda: hbmio.torch.load_file(path)):
        with pytest.raises(safetensors.SafetensorError) as ours:
            call()
        assert isinstance(ours.value, hbmio.Error) and "bad.safetensors" in str(ours.value), str(ours.value)



# --- dtypes ------------------------------------------------------------------------------------
# Every dtype the reference writes from torch: (torch dtype name, safetensors code). Values are
# made from random bytes, so every bit pattern of the narrow float kinds is exercised.
TORCH_DTYPES = [("bool", "BOOL"), ("uint8", "U8"), ("int8", "I8"), ("int16", "I16"), ("uint16", "U16"),
                ("int32", "I32"), ("uint32", "U32"), ("int64", "I64"), ("uint64", "U64"), ("float16", "F16"),
                ("bfloat16", "BF16"), ("float32", "F32"), ("float64", "F64"), ("complex64", "C64"),
                ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("float8_e8m0fnu", "F8_E8M0"), ("float4_e2m1fn_x2", "F4")]


def _tensor(name, shape=(3, 4), seed=0):
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if name == "bool":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n])


@pytest.mark.parametrize("name,code", TORCH_DTYPES, ids=[c for _, c in TORCH_DTYPES])
def test_every_dtype_saves_and_loads_as_the_reference(tmp_path, name, code):
    """The same bytes from save and save_file, and the same tensors from each other's files,
    through every way hbmio loads into torch on the CPU."""
    tensors = {"t": _tensor(name), "u": _tensor(name, (2, 2, 6), seed=1)}
    ref_bytes = st_torch.save(tensors)
    assert _header(ref_bytes)["t"]["dtype"] == code
    assert hbmio.torch.save(tensors) == ref_bytes
    hbmio.torch.save_file(tensors, tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == ref_bytes
    (tmp_path / "ref.safetensors").write_bytes(ref_bytes)
    path = str(tmp_path / "ref.safetensors")
    expected = st_torch.load_file(path)
    for loaded in (hbmio.torch.load_file(path), hbmio.torch.load_file(path, mmap=False), hbmio.torch.load(ref_bytes),
                   hbmio.load_file(path)):
        assert list(loaded) == list(expected)
        for key in expected:
            _same(loaded[key], expected[key])
    with hbmio.open(path, "pt") as ours, safetensors.safe_open(path, "pt") as ref:
        assert ours.get_slice("t").get_shape() == ref.get_slice("t").get_shape()
        assert ours.get_slice("t").get_dtype() == ref.get_slice("t").get_dtype() == code
        for key in ref.keys():
            _same(ours.get_tensor(key), ref.get_tensor(key))


def _file(header_entries: dict, data: bytes) -> bytes:
    header = json.dumps(header_entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def test_f4_is_packed_as_the_reference_packs_it(tmp_path):
    """float4_e2m1fn_x2 [2, 3] is F4 [2, 6] in the file (two values a byte), and back."""
    t = _tensor("float4_e2m1fn_x2", (2, 3))
    data = hbmio.torch.save({"a": t})
    assert _header(data)["a"] == {"dtype": "F4", "shape": [2, 6], "data_offsets": [0, 6]}
    assert data == st_torch.save({"a": t})
    # An empty last dimension stays empty; a scalar (one pair) is refused by both.
    for shape in ((0,), (3, 0)):
        empty = torch.zeros(shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        assert hbmio.torch.save({"a": empty}) == st_torch.save({"a": empty})
    scalar = torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(safetensors.SafetensorError) as ref:
        st_torch.save({"a": scalar})
    with pytest.raises(safetensors.SafetensorError) as ours:
        hbmio.torch.save({"a": scalar})
    assert "does not end up at a byte boundary" in str(ref.value) and "does not end up at a byte boundary" in str(ours.value)


def test_slices_of_f4_index_the_packed_tensor(tmp_path):
    """The reference's get_slice of F4 fails (RuntimeError: it reshapes the bytes to the file's
    shape); hbmio's indexes the tensor get_tensor gives (docs/python.md lists the difference)."""
    t = _tensor("float4_e2m1fn_x2", (4, 3))
    path = tmp_path / "f4.safetensors"
    st_torch.save_file({"a": t}, str(path))
    with safetensors.safe_open(str(path), "pt") as ref:
        assert ref.get_slice("a").get_shape() == [4, 6]
        with pytest.raises(RuntimeError):
            ref.get_slice("a")[1:3]
    with hbmio.open(path, "pt") as f:
        assert f.get_slice("a").get_shape() == [4, 6] and f.get_slice("a").get_dtype() == "F4"
        for key in ((slice(1, 3),), (0,), (Ellipsis, slice(0, 2)), (slice(None), 1)):
            _same(f.get_slice("a")[key], t[key].contiguous())


def test_f4_with_an_odd_last_dimension_is_refused_as_the_reference_refuses_it(tmp_path):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(_file({"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, b"\x12\x34\x56"))
    words = "f4_x2 dtype requires that the last dim be divisible by 2 in torch: got [2, 3]"
    with pytest.raises(safetensors.SafetensorError) as ref:
        st_torch.load_file(str(path))
    assert words in str(ref.value)
    for call in (lambda: hbmio.torch.load_file(path), lambda: hbmio.torch.load_file(path, mmap=False),
                 lambda: hbmio.open(path, "pt").get_tensor("a"), lambda: hbmio.torch.load(path.read_bytes())):
        with pytest.raises(safetensors.SafetensorError) as ours:
            call()
        assert words in str(ours.value) and isinstance(ours.value, hbmio.Error), str(ours.value)


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_f6_which_no_framework_has_is_the_references_error(tmp_path, code):
    path = tmp_path / "f6.safetensors"
    path.write_bytes(_file({"a": {"dtype": code, "shape": [4], "data_offsets": [0, 3]}}, b"\x01\x02\x03"))
    for ref_call, our_calls in (
            (lambda: st_torch.load_file(str(path)),
             [lambda: hbmio.torch.load_file(path), lambda: hbmio.torch.load_file(path, mmap=False),
              lambda: hbmio.open(path, "pt").get_tensor("a"), lambda: hbmio.torch.load(path.read_bytes())]),
            (lambda: st_numpy.load_file(str(path)),
             [lambda: hbmio.numpy.load_file(path), lambda: hbmio.numpy.load_file(path, mmap=True),
              lambda: hbmio.open(path, "np").get_tensor("a"), lambda: hbmio.open(path, "np").get_slice("a")[:]])):
        with pytest.raises(safetensors.SafetensorError) as ref:
            ref_call()
        assert str(ref.value) == f"Dtype not understood: {code}"
        for call in our_calls:
            with pytest.raises(safetensors.SafetensorError) as ours:
                call()
            assert str(ref.value) in str(ours.value), str(ours.value)
            assert isinstance(ours.value, hbmio.DtypeError) and isinstance(ours.value, TypeError)
    # A header entry is still readable without the data, as the reference's is.
    with hbmio.open(path, "pt") as f, safetensors.safe_open(str(path), "pt") as ref:
        assert f.get_slice("a").get_shape() == ref.get_slice("a").get_shape() == [4]
        assert f.get_slice("a").get_dtype() == ref.get_slice("a").get_dtype() == code


NUMPY_LACKS = ["BF16", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F4"]


@pytest.mark.parametrize("code", NUMPY_LACKS)
def test_dtypes_numpy_lacks_are_refused_as_the_reference_refuses_them(tmp_path, code):
    """safetensors.numpy asks NumPy for the dtype and fails where NumPy has none: TypeError for
    bfloat16, AttributeError for the float8 kinds and F4. Ours is an instance of the reference's
    type (and a TypeError, as hbmio's was) with the reference's words."""
    path = tmp_path / "lacks.safetensors"
    path.write_bytes(_file({"a": {"dtype": code, "shape": [4], "data_offsets": [0, 8 if code == "BF16" else
                                                                               2 if code == "F4" else 4]}},
                           bytes(8 if code == "BF16" else 2 if code == "F4" else 4)))
    with pytest.raises(Exception) as ref:
        st_numpy.load_file(str(path))
    assert type(ref.value) in (TypeError, AttributeError), repr(ref.value)
    for call in (lambda: hbmio.numpy.load_file(path), lambda: hbmio.numpy.load_file(path, mmap=True),
                 lambda: hbmio.open(path, "np").get_tensor("a"), lambda: hbmio.open(path, "np").get_slice("a")[:2],
                 lambda: hbmio.load_file(path, framework="numpy")):
        with pytest.raises(Exception) as ours:
            call()
        assert isinstance(ours.value, type(ref.value)) and isinstance(ours.value, TypeError), repr(ours.value)
        assert str(ref.value) in str(ours.value), (str(ref.value), str(ours.value))


# --- metadata ----------------------------------------------------------------------------------

# One entry at most: the reference writes several in the order of a Rust HashMap, which changes
# from run to run (and from call to call); hbmio writes them sorted (see the next test).
METADATA = {"None": None, "empty": {}, "one entry": {"format": "pt"}}


@pytest.mark.parametrize("case", sorted(METADATA))
def test_metadata_forms_are_written_byte_for_byte(tmp_path, case):
    """None writes no "__metadata__", {} writes "__metadata__":{} and a dict its entries: the
    reference's bytes for each, through save, save_file and both stand-ins; and metadata() reads
    each back as the reference does (None, {}, the dict)."""
    metadata = METADATA[case]
    t = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(3, dtype=torch.bfloat16)}
    ref = st_torch.save(t, metadata=metadata)
    assert ("__metadata__" in _header(ref)) == (metadata is not None)
    assert hbmio.torch.save(t, metadata=metadata) == ref
    hbmio.torch.save_file(t, tmp_path / "t.safetensors", metadata=metadata)
    assert (tmp_path / "t.safetensors").read_bytes() == ref
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(3, dtype=np.int16)}
    ref = st_numpy.save(arrays, metadata=metadata)
    assert hbmio.numpy.save(arrays, metadata=metadata) == ref
    hbmio.numpy.save_file(arrays, tmp_path / "n.safetensors", metadata=metadata)
    assert (tmp_path / "n.safetensors").read_bytes() == ref
    (tmp_path / "ref.safetensors").write_bytes(ref)
    with safetensors.safe_open(str(tmp_path / "ref.safetensors"), "np") as f:
        expected = f.metadata()
    for loaded in (hbmio.numpy.load(ref), st_numpy.load(ref)):
        assert list(loaded) == ["b", "a"] or sorted(loaded) == ["a", "b"]
        np.testing.assert_array_equal(loaded["b"], arrays["b"])
    assert expected == metadata
    with hbmio.open(tmp_path / "n.safetensors", "np") as f:
        assert f.metadata() == expected


def test_several_metadata_entries_are_written_sorted():
    """The reference's order of several entries is its hash map's (it differs between two calls
    of one process); hbmio's is sorted, the same every time. Same entries, same length."""
    metadata = {"z": "1", "a": "2", "m": "3", "format": "pt"}
    t = {"a": torch.ones(3)}
    ours, ref = hbmio.torch.save(t, metadata=metadata), st_torch.save(t, metadata=metadata)
    assert len(ours) == len(ref) and _header(ours) == _header(ref)
    assert list(_header(ours)["__metadata__"]) == sorted(metadata)


def test_big_endian_arrays_are_saved_little_endian_as_the_reference_saves_them(tmp_path):
    arrays = {"a": np.arange(6, dtype=">i4").reshape(2, 3), "b": np.linspace(0, 1, 4).astype(">f8"),
              "c": np.arange(3, dtype="<u2")}
    ref = st_numpy.save(arrays)
    assert hbmio.numpy.save(arrays) == ref
    hbmio.numpy.save_file(arrays, tmp_path / "be.safetensors")
    assert (tmp_path / "be.safetensors").read_bytes() == ref
    for name, value in hbmio.numpy.load(ref).items():
        np.testing.assert_array_equal(value, arrays[name])


# --- names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["get_tensor", "get_slice", "get_tensor_meta", "prefetch"])
def test_an_unknown_name_is_the_references_exception_type(tmp_path, call):
    """safe_open raises SafetensorError ("File does not contain tensor zz") where hbmio raised a
    bare KeyError; now the error is both (and an hbmio.Error), and says the reference's words."""
    path = str(tmp_path / "t.safetensors")
    safetensors.torch.save_file({"a": _tensor("float32")}, path)
    with safetensors.safe_open(path, "pt") as ref, hbmio.open(path, framework="pt") as ours:
        for f, kinds in ((ref, (safetensors.SafetensorError,)), (ours, (safetensors.SafetensorError, KeyError, hbmio.Error))):
            if not hasattr(f, call):  # prefetch and get_tensor_meta: safetensors 0.9
                continue
            with pytest.raises(kinds) as e:
                if call == "prefetch":
                    f.prefetch({"zz": None})
                else:
                    getattr(f, call)("zz")
            assert all(isinstance(e.value, k) for k in kinds), type(e.value).__mro__
            if f is ours or call != "prefetch":  # 0.9's prefetch refuses the CPU before it looks at names
                assert "File does not contain tensor zz" in str(e.value)


@pytest.mark.parametrize("plan", ["step", "zero_d", "not_a_slice"])
def test_a_refused_prefetch_plan_is_the_references_exception_type(tmp_path, plan):
    path = str(tmp_path / "t.safetensors")
    safetensors.torch.save_file({"a": _tensor("float32"), "s": torch.tensor(1.0)}, path)
    wanted = {"step": {"a": slice(0, 2, 2)}, "zero_d": {"s": slice(0, 1)}, "not_a_slice": {"a": 3}}[plan]
    with hbmio.open(path, framework="pt") as ours:
        with pytest.raises(safetensors.SafetensorError) as e:
            ours.prefetch(wanted)
        assert isinstance(e.value, hbmio.Error)
    with safetensors.safe_open(path, "pt") as ref:
        if hasattr(ref, "prefetch"):  # 0.9: SafetensorError (on the CPU for the device, before the plan)
            with pytest.raises(safetensors.SafetensorError):
                ref.prefetch(wanted)


def _public_names(module) -> list:
    """The functions and classes a module offers as its own or re-exports from safetensors:
    modules (os, sys, torch, np) and typing/collections helpers it imports are not its API."""
    import types
    names = []
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if getattr(value, "__module__", "") in ("typing", "collections"):
            continue
        names.append(name)
    return names


def _not_offered() -> set:
    """Names docs/python.md lists as not offered (its "Not offered" table)."""
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "python.md").read_text()
    section = docs.split("### Not offered", 1)[1].split("\n#", 1)[0]
    return {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}


@pytest.mark.parametrize("pair", ["torch", "numpy"])
def test_every_public_name_of_the_reference_is_offered_or_documented(pair):
    reference, ours = (st_torch, hbmio.torch) if pair == "torch" else (st_numpy, hbmio.numpy)
    names = _public_names(reference)
    assert {"load_file", "save_file", "load", "save", "serialize", "deserialize"} <= set(names), names
    missing = [n for n in names if not hasattr(ours, n) and f"{reference.__name__.split('.')[-1]}.{n}" not in _not_offered()]
    assert not missing, f"{reference.__name__} names neither in {ours.__name__} nor in docs/python.md: {missing}"


def test_serialize_and_deserialize_match_the_reference(tmp_path):
    arrays = {"x": np.arange(12, dtype=np.int32).reshape(3, 4), "y": np.ones(5, dtype=np.float16)}
    bf16 = torch.arange(4, dtype=torch.bfloat16)
    f4 = _tensor("float4_e2m1fn_x2", (2, 2))
    def specs_of(spec_type):
        specs = {k: spec_type(dtype=v.dtype.name, shape=v.shape, data_ptr=v.ctypes.data, data_len=v.nbytes)
                 for k, v in arrays.items()}
        specs["z"] = spec_type(dtype="bfloat16", shape=[4], data_ptr=bf16.data_ptr(), data_len=8)
        specs["w"] = spec_type(dtype="float4_e2m1fn_x2", shape=f4.shape, data_ptr=f4.data_ptr(), data_len=4)
        assert specs["w"].shape == [2, 4] and specs["w"].dtype == "F4"
        return specs

    ref = safetensors.serialize(specs_of(safetensors.TensorSpec), metadata={"k": "v"})
    # The reference's specs and hbmio's own (its serialize takes only its own) give its bytes.
    for specs in (specs_of(safetensors.TensorSpec), specs_of(hbmio.torch.TensorSpec)):
        assert hbmio.torch.serialize(specs, metadata={"k": "v"}) == ref
        assert hbmio.numpy.serialize(specs, metadata={"k": "v"}) == ref
        hbmio.torch.serialize_file(specs, tmp_path / "s.safetensors")
        assert (tmp_path / "s.safetensors").read_bytes() == safetensors.serialize(specs_of(safetensors.TensorSpec))
    ours, theirs = hbmio.torch.deserialize(ref), safetensors.deserialize(ref)
    assert sorted(ours, key=lambda e: e[0]) == sorted(theirs, key=lambda e: e[0])
    # A length that disagrees with the dtype and shape is refused by both.
    for spec_type, serialize in ((safetensors.TensorSpec, safetensors.serialize),
                                 (hbmio.torch.TensorSpec, hbmio.torch.serialize)):
        with pytest.raises(safetensors.SafetensorError) as e:
            serialize({"x": spec_type(dtype="int32", shape=[3, 4], data_ptr=arrays["x"].ctypes.data, data_len=8)})
        assert "invalid shape, data type, or offset for tensor" in str(e.value)


def test_storage_ptr_and_size_are_the_references():
    base = torch.zeros(10)
    for t in (base, base[2:], base.view(2, 5), torch.empty(3, device="meta"), torch.zeros(0)):
        assert hbmio.torch.storage_ptr(t) == st_torch.storage_ptr(t)
        assert hbmio.torch.storage_size(t) == st_torch.storage_size(t)


# --- safetensors 0.9 ---------------------------------------------------------------------------

SAFETENSORS_0_9 = pathlib.Path(__file__).parents[2] / "build-python" / "safetensors-0.9"


@pytest.mark.skipif(os.environ.get("HBMIO_CONFORMANCE_CHILD") == "1", reason="this is the child run")
def test_the_cases_against_safetensors_0_9():
    """Every case of this file again, in a child process whose `safetensors` is 0.9's (its release
    candidate, which scripts/test-env.sh installs into build-python/safetensors-0.9)."""
    if not (SAFETENSORS_0_9 / "safetensors").is_dir():
        pytest.skip(f"safetensors 0.9 is not installed in {SAFETENSORS_0_9} (scripts/test-env.sh installs it)")
    env = dict(os.environ, HBMIO_CONFORMANCE_CHILD="1",
               PYTHONPATH=os.pathsep.join([str(SAFETENSORS_0_9)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    version = subprocess.run([sys.executable, "-c", "import safetensors; print(safetensors.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("0.9"), version
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, f"against safetensors {version}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    # Every case ran there: the only ones skipped are the two that start child runs.
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "2 skipped" in summary and "deselected" not in summary, summary


@pytest.mark.skipif(os.environ.get("HBMIO_CONFORMANCE_CHILD") == "1", reason="this is the child run")
def test_the_index_forms_against_safetensors_0_9():
    """test_lazy.py's comparisons with safe_open (every fixture, access order, slice and index form,
    valid and refused) again, in a child process whose `safetensors` is 0.9's."""
    if not (SAFETENSORS_0_9 / "safetensors").is_dir():
        pytest.skip(f"safetensors 0.9 is not installed in {SAFETENSORS_0_9} (scripts/test-env.sh installs it)")
    env = dict(os.environ, HBMIO_CONFORMANCE_CHILD="1",
               PYTHONPATH=os.pathsep.join([str(SAFETENSORS_0_9)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    lazy = pathlib.Path(__file__).with_name("test_lazy.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(lazy), "-k", "safe_open or index_forms"],
                         env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, f"test_lazy.py against safetensors 0.9:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
