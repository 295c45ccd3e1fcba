"""hbmio.open against safetensors.safe_open, on files made by the reference implementation.

Every fixture, every access order (file order, reverse, random), every get_slice index form,
scalars, empty tensors and every dtype NumPy or torch represents: the results must equal
safe_open's, byte for byte, in NumPy and in torch (on the CPU here; the GPU tests run the same
walks into cuda:0). Also the read-ahead's bound, a sharded index and directory, bad names and
indices, and files replaced or truncated after open.
"""
from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import pytest

import hbmio

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"
FILES = sorted(p.name for p in FIXTURES.glob("*.safetensors"))


def raw(array) -> bytes:
    """The bytes of a NumPy array or torch tensor (any dtype, any device)."""
    if hasattr(array, "detach"):
        import torch
        flat = array.detach().cpu().reshape(-1)
        if not flat.numel():
            return b""
        dense = torch.empty(flat.shape, dtype=flat.dtype)  # stride 1 whatever the source's strides
        dense.copy_(flat)
        return dense.view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(array).tobytes()


def same(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype) and raw(a) == raw(b)


def header_offsets(path) -> dict:
    import json
    import struct
    with open(path, "rb") as file:
        (n,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(n))
    return {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def test_fixtures_exist():
    assert FILES, f"no fixtures at {FIXTURES} (set HBMIO_FIXTURES)"


def frameworks():
    out = ["np"]
    try:
        import torch  # noqa: F401
        out.append("pt")
    except ImportError:
        pass
    return out


def representable(framework, dtype) -> bool:
    if framework == "np":
        return dtype not in ("BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2")
    return dtype not in ("F4", "F6_E2M3", "F6_E3M2")


@pytest.mark.parametrize("framework", frameworks())
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("order", ["file", "reverse", "random"])
def test_every_tensor_in_every_order_equals_safe_open(name, framework, order):
    path = FIXTURES / name
    with safe_open(path, framework) as ref, hbmio.open(path, framework=framework, readahead=1 << 20) as f:
        assert f.keys() == ref.keys()
        # File order, as the header's data_offsets say (tensors at one offset, empty ones, may
        # come in any order among themselves).
        assert sorted(f.offset_keys()) == sorted(ref.offset_keys())
        spans = [header_offsets(path)[k] for k in f.offset_keys()]
        assert spans == sorted(spans)
        assert f.metadata() == ref.metadata()
        keys = list(ref.offset_keys())
        if order == "reverse":
            keys.reverse()
        elif order == "random":
            random.Random(7).shuffle(keys)
        checked = 0
        for key in keys:
            if not representable(framework, f.get_slice(key).get_dtype()):
                continue
            assert same(f.get_tensor(key), ref.get_tensor(key)), key
            checked += 1
        assert checked > 0 or framework == "np"  # (NumPy has no bfloat16: some files have nothing for it)


def slice_keys(shape):
    """Index forms for a tensor of `shape`: ints (negative too), slices (steps, open ends,
    negative bounds, empty), '...', and mixes, in every dimension."""
    forms = [(), (Ellipsis,), (slice(None),)]
    if not shape:
        return forms
    n = shape[0]
    forms += [(0,), (-1,), (n - 1,), (slice(1, None),), (slice(None, max(1, n // 8)),), (slice(-2, None),),
              (slice(0, n, 2),), (slice(n // 2, n // 2),), (Ellipsis, 0), (slice(None), Ellipsis)]
    if len(shape) >= 2:
        m = shape[1]
        forms += [(slice(None), 0), (slice(None), -1), (slice(1, 3), slice(1, m - 1)), (0, slice(None, None, 3)),
                  (Ellipsis, slice(1, 2)), (slice(None), slice(m // 2, None)), (-1, -1)]
    if len(shape) >= 3:
        forms += [(0, 0), (slice(None), slice(None), 1), (Ellipsis, -1), (1, Ellipsis, 0), (slice(0, 1), 0, slice(None))]
    return forms


@pytest.mark.parametrize("framework", frameworks())
@pytest.mark.parametrize("name", FILES)
def test_get_slice_equals_safe_open(name, framework):
    path = FIXTURES / name
    with safe_open(path, framework) as ref, hbmio.open(path, framework=framework) as f:
        compared = 0
        for key in ref.offset_keys():
            mine, theirs = f.get_slice(key), ref.get_slice(key)
            assert mine.get_shape() == theirs.get_shape() and mine.get_dtype() == theirs.get_dtype(), key
            if not representable(framework, mine.get_dtype()):
                continue
            for index in slice_keys(mine.get_shape()):
                if check_index(ref, f, key, index) == "equal":
                    compared += 1
        assert compared > 0 or framework == "np"


def check_index(ref, f, key, index) -> str:
    """get_slice(key)[index] through hbmio against safe_open: the same result (shape, dtype,
    bytes), or a refusal of the same type (safetensors.SafetensorError where safe_open raises
    it, else the same builtin exception). Two failures of safe_open's NumPy mode are not copied
    (see hbmio/_lazy.py, _Slice): where it crashes converting a negative slice bound
    (OverflowError) or making a slice whose stop is before its start (SystemError), hbmio gives
    what NumPy gives for the whole tensor. Returns "equal" or "refused"."""
    try:
        expected = ref.get_slice(key)[index]
    except (OverflowError, SystemError):
        try:
            expected = ref.get_tensor(key)[index]
        except Exception as e:  # NumPy refuses it too: the same type
            with pytest.raises(type(e)):
                f.get_slice(key)[index]
            return "refused"
    except Exception as e:
        with pytest.raises(type(e) if type(e).__module__ == "builtins" else safetensors.SafetensorError) as got:
            f.get_slice(key)[index]
        assert isinstance(got.value, hbmio.Error), (key, index, got.value)
        return "refused"
    got = f.get_slice(key)[index]
    assert same(got, expected), (key, index, tuple(got.shape), tuple(expected.shape))
    return "equal"


def test_index_forms_match_safe_open_bools_lists_none_and_refusals(tmp_path):
    """Bools, empty and non-empty lists, None, np.bool_, negative and out-of-range ints and slice
    bounds, '...' (once and twice), too many indices, floats: in torch mode safe_open gives what
    torch gives ([True] on shape [6, 3] has shape [1, 6, 3], [False] [0, 6, 3]); in NumPy mode
    its own slicing (a bool is 0 or 1; a bare [] is no rows; a slice past the end is refused).
    hbmio must give the same result, or refuse with an error of the same type (also an
    hbmio.Error)."""
    path = str(tmp_path / "w.safetensors")
    from safetensors.numpy import save_file as reference_save
    reference_save({"w": np.arange(18, dtype=np.float32).reshape(6, 3), "s": np.array(3.0, dtype=np.float32),
                    "e": np.zeros((0, 3), np.float32), "c": np.arange(24, dtype=np.int16).reshape(2, 3, 4)}, path)
    forms = [True, False, (True, 2), (slice(None), True), (1, True), (True, True), (False, 1), np.bool_(True),
             np.bool_(False), [], [[]], [0, 1], [True], ([],), (slice(None), []), None, (None, 1), (Ellipsis, None),
             (), Ellipsis, (Ellipsis, Ellipsis), (Ellipsis, 1), (slice(None), Ellipsis, 1), (0, 0, 0, 0),
             -1, -6, -7, 6, 20, 2 ** 63, -(2 ** 63), np.int64(2), np.int32(-1), 1.0, "a",
             slice(None, 20), slice(2, None), slice(6, None), slice(7, None), slice(6, 6), slice(3, 3),
             (slice(2, None), -6), (slice(2, None), 20), (slice(2, None), -4), slice(-2, None), slice(None, -1),
             slice(-20, 20), slice(5, 2), slice(None, None, 2), slice(None, None, -1), slice(None, None, 0),
             slice(1.0, None), slice(True, None), slice(np.int64(1), None), (np.int64(1), slice(0, 2))]
    for framework in frameworks():
        with safe_open(path, framework) as ref, hbmio.open(path, framework=framework) as f:
            outcomes = {}
            for key in ("w", "s", "e", "c"):
                for index in forms:
                    outcomes[(key, repr(index))] = check_index(ref, f, key, index)
            # The cases of the issue, said outright (check_index compared them with the reference).
            if framework == "pt":
                assert tuple(f.get_slice("w")[True].shape) == (1, 6, 3)
                assert tuple(f.get_slice("w")[False].shape) == (0, 6, 3)
                assert tuple(f.get_slice("w")[True, 2].shape) == (1, 3)
            else:
                assert outcomes[("w", "[]")] == "equal" and tuple(f.get_slice("w")[[]].shape) == (0, 3)
                assert outcomes[("w", repr(slice(None, 20)))] == "refused"
                with pytest.raises(safetensors.SafetensorError):
                    f.get_slice("w")[np.bool_(True)]



def mapped_regions(path) -> list:
    """(start, end) of every mapping of `path` in this process, from /proc/self/maps."""
    real, out = os.path.realpath(path), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    return out


def address(array) -> int:
    return array.data_ptr() if hasattr(array, "data_ptr") else array.__array_interface__["data"][0]


@pytest.mark.parametrize("framework", frameworks())
@pytest.mark.parametrize("name", FILES)
def test_mmap_tensors_and_slices_equal_safe_open_and_are_views_of_the_file(name, framework):
    """hbmio.open(..., mmap=True) on the CPU: every tensor and every slice form gives what
    safe_open gives (or the same refusal), and each whole tensor whose offset suits its element
    size lies in a mapping of the file (a view, read on first touch), not in memory of its own."""
    path = FIXTURES / name
    item = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
            "I64": 8, "U64": 8, "F64": 8, "C64": 8}
    with safe_open(path, framework) as ref, hbmio.open(path, framework=framework, mmap=True) as f:
        data_start = 8 + int.from_bytes(open(path, "rb").read(8), "little")
        spans, viewed = header_offsets(path), 0
        for key in ref.offset_keys():
            shape, dtype = f.get_slice(key).get_shape(), f.get_slice(key).get_dtype()
            if not representable(framework, dtype):
                continue
            tensor = f.get_tensor(key)
            assert same(tensor, ref.get_tensor(key)), key
            begin, end = spans[key]
            if end > begin and dtype in item and (data_start + begin) % item[dtype] == 0:
                for whole in (tensor, f.get_slice(key)[...]) if framework == "pt" else (tensor,):
                    at = address(whole)
                    assert any(a <= at and at + (end - begin) <= b for a, b in mapped_regions(path)), key
                viewed += 1
            for index in slice_keys(shape):
                check_index(ref, f, key, index)
            # The bare forms transformers uses for every tensor (a fast path of their own).
            for index in (Ellipsis, slice(None)):
                check_index(ref, f, key, index)
        assert viewed > 0 or framework == "np" or all(e == b for b, e in spans.values())


def test_mmap_keeps_the_file_it_opened_and_refuses_what_it_cannot_map(tmp_path):
    """The mapping is made at the first tensor, of the file the handle opened: a file renamed over
    the path in between (how every safetensors writer publishes) is not what the tensors show."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as reference_save
    path = str(tmp_path / "m.safetensors")
    old = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    reference_save(old, path)
    with hbmio.open(path, framework="pt", mmap=True) as f:
        reference_save({"a": torch.zeros(1000, dtype=torch.float32), "b": torch.zeros(3, 5, dtype=torch.bfloat16)},
                       path + ".new")
        os.replace(path + ".new", path)
        a, rows = f.get_tensor("a"), f.get_slice("b")[1:]
        assert torch.equal(a, old["a"]) and torch.equal(rows, old["b"][1:])
        assert rows.is_contiguous()
    # Private pages: a write to a tensor never reaches the file; whether the next get_tensor of
    # the same handle sees it is as with the reference's handle.
    with safe_open(path, "pt") as ref, hbmio.open(path, framework="pt", mmap=True) as f:
        for handle in (ref, f):
            handle.get_tensor("a")[0] = 42
        assert f.get_tensor("a")[0] == ref.get_tensor("a")[0]
    with hbmio.open(path, framework="pt", mmap=True) as f:
        assert torch.equal(f.get_tensor("a"), torch.zeros(1000))

def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_gpu_walk_of_large_tensors_each_in_its_own_allocation(tmp_path):
    """A walk read ahead into cuda:0 where each tensor is an allocation of its own (torch gives a
    tensor over 10 MiB a cudaMalloc of its own, and consecutive ones are often adjacent in the
    address space): reads adjacent in the file and in address were joined into one request, whose
    copy across two allocations CUDA refused (cudaErrorInvalidValue: from_pretrained of a 6 GiB
    Llama inside use_in_transformers failed so). Every tensor, also with threads as transformers
    5 materialises them, equal to the file."""
    import concurrent.futures
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.mlp": torch.randn(2752 * 4, 4096, generator=g).to(torch.bfloat16) for i in range(4)}
    path = str(tmp_path / "big.safetensors")
    save_file(tensors, path)
    for threads in (0, 4):
        with hbmio.open(path, framework="pt", device="cuda:0") as f:
            keys = list(f.keys())
            if threads:
                with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                    got = dict(zip(keys, pool.map(lambda k: f.get_slice(k)[...], keys)))
            else:
                got = {k: f.get_tensor(k) for k in keys}
            torch.cuda.synchronize()
        for k in keys:
            assert got[k].is_cuda and torch.equal(got[k].cpu(), tensors[k]), (threads, k)


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("name", FILES)
def test_gpu_walks_and_slices_equal_safe_open(name):
    """Into cuda:0: every order and slice, compared with safe_open's (on the GPU too)."""
    path = FIXTURES / name
    with safe_open(path, "pt", device="cuda:0") as ref, hbmio.open(path, framework="pt", device="cuda:0", readahead=1 << 20) as f:
        keys = list(ref.offset_keys())
        for order in (keys, keys[::-1], random.Random(3).sample(keys, len(keys))):
            for key in order:
                if representable("pt", f.get_slice(key).get_dtype()):
                    got = f.get_tensor(key)
                    assert got.device.type == "cuda" and same(got, ref.get_tensor(key)), key
        for key in keys:
            if not representable("pt", f.get_slice(key).get_dtype()):
                continue
            for index in slice_keys(f.get_slice(key).get_shape()):
                try:
                    expected = ref.get_slice(key)[index]
                except Exception:
                    continue
                assert same(f.get_slice(key)[index], expected), (key, index)


def test_a_row_slice_reads_only_its_rows(tmp_path):
    """A slice of rows is one range: the engine reads its bytes (plus alignment), not the tensor."""
    path = tmp_path / "rows.safetensors"
    hbmio.save_file({"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}, path, checksums=False)
    with hbmio.open(path, framework="np") as f:
        part = f.get_slice("w")[128:256]
        assert part.shape == (128, 1024) and part[0, 0] == 128 * 1024 and part[-1, -1] == 256 * 1024 - 1
        column = f.get_slice("w")[:, 5]
        assert column.shape == (1024,) and (column == np.arange(1024) * 1024 + 5).all()
        block = f.get_slice("w")[10:20, 100:900]
        assert (block == np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)[10:20, 100:900]).all()


def test_unknown_names_and_bad_indices(tmp_path):
    path = FIXTURES / "layers.safetensors"
    with hbmio.open(path, framework="np") as f:
        with pytest.raises(KeyError, match="nope"):
            f.get_tensor("nope")
        with pytest.raises(KeyError, match="nope"):
            f.get_slice("nope")
        key = f.offset_keys()[0]
        s = f.get_slice(key)
        with pytest.raises(IndexError):
            s[s.get_shape()[0]]
        with pytest.raises(IndexError):
            s[(0,) * (len(s.get_shape()) + 1)]
        with pytest.raises(TypeError):
            s["x"]


def test_sharded_index_and_directory():
    pytest.importorskip("torch")  # the sharded fixture is bfloat16, which NumPy lacks
    sharded = FIXTURES / "sharded"
    index = next(sharded.glob("*.index.json"))
    with hbmio.open(sharded, framework="pt") as by_dir, hbmio.open(index, framework="pt") as by_index:
        assert by_dir.keys() == by_index.keys() and len(by_dir.keys()) > 1
        for key in by_dir.offset_keys():
            a, b = by_dir.get_tensor(key), by_index.get_tensor(key)
            assert same(a, b), key
        files = {}
        for shard in sharded.glob("*.safetensors"):
            with safe_open(shard, "pt") as ref:
                for key in ref.keys():
                    files[key] = ref.get_tensor(key)
        for key in by_dir.offset_keys():
            assert same(by_dir.get_tensor(key), files[key]), key


def _ahead_bytes(f):
    """Bytes of tensors read ahead and not yet taken (forwards and backwards), checked against the
    read-ahead's own count."""
    held = sum(f._entries_list[k][3] for k in f._ready)
    ahead = f._ahead
    if ahead is not None:
        counted = sum(f._entries_list[k][3] for k in list(ahead._ready) + list(ahead._failed))
        counted += sum(f._entries_list[k][3] for indices, _, _ in ahead._batches for k in indices)
        assert counted == ahead._held, (counted, ahead._held)
        held += counted
    return held


def test_readahead_stays_within_its_budget(tmp_path):
    path = tmp_path / "walk.safetensors"
    tensors = {f"t{i:03d}": np.full(64 << 10, i, dtype=np.uint8) for i in range(100)}
    hbmio.save_file(tensors, path)
    budget = 1 << 20  # 16 tensors of 64 KiB
    with hbmio.open(path, framework="np", readahead=budget) as f:
        most = 0
        for n, key in enumerate(f.offset_keys()):
            assert (f.get_tensor(key) == int(key[1:])).all()
            held = _ahead_bytes(f)
            assert held <= budget, (n, held)
            most = max(most, held)
        assert most > 0, "nothing was read ahead"
        # A walk that skips: every tensor still right, nothing skipped stays held.
        f.close()
        for key in f.offset_keys()[::3]:
            assert (f.get_tensor(key) == int(key[1:])).all()
            assert _ahead_bytes(f) <= budget
        # Backwards: read ahead backwards, within the budget, every tensor right.
        f.close()
        batches = 0
        for key in reversed(f.offset_keys()):
            batches += int(f._index[key]) not in f._ready
            assert (f.get_tensor(key) == int(key[1:])).all()
            assert _ahead_bytes(f) <= budget
        assert batches < 20, f"{batches} reads for 100 tensors walked backwards: no read-ahead"
    assert not f._ready and f._ahead is None


def test_readahead_pauses_when_the_walk_stops_and_resumes_with_it(tmp_path):
    path = tmp_path / "walk.safetensors"
    hbmio.save_file({f"t{i:03d}": np.full(64 << 10, i, dtype=np.uint8) for i in range(64)}, path)
    with hbmio.open(path, framework="np", readahead=512 << 10) as f:
        keys = f.offset_keys()
        assert (f.get_tensor(keys[0]) == 0).all()
        ahead = f._ahead
        assert ahead is not None and ahead._next > 1, "a walk in file order reads ahead"
        # Out of order (a random access): the read-ahead starts nothing new.
        assert (f.get_tensor(keys[40]) == 40).all()
        assert ahead._paused
        started = ahead._next
        for key in (keys[30], keys[2], keys[50]):
            assert (f.get_tensor(key) == int(key[1:])).all()
        assert ahead._next == started, "a paused read-ahead started batches"
        assert _ahead_bytes(f) <= 512 << 10
        # The walk resumes from where it is: read ahead again, every tensor right.
        for key in keys[51:]:
            assert (f.get_tensor(key) == int(key[1:])).all()
        assert f._ahead is not None and not f._ahead._paused
    assert f._ahead is None


def test_a_walk_of_tensor_parallel_slices_is_read_ahead_and_equals_safe_open(tmp_path):
    """vLLM's tensor-parallel load: rank r of t takes rows [r n / t, (r + 1) n / t) of every tensor,
    in file order. Tensors of other row counts, of one row, 1-D ones, and one whose rows do not
    divide (which stops the prediction) are among them; every slice equals safe_open's."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(5)
    shapes = [(64, 48), (32, 8), (128,), (64, 3, 5), (16, 16), (7, 4), (64, 48), (8,), (24, 2)] * 4
    tensors = {f"w{i:03d}": rng.integers(0, 255, size=s, dtype=np.uint8).astype(np.float32) for i, s in enumerate(shapes)}
    path = tmp_path / "tp.safetensors"
    save_file(tensors, str(path))
    for t in (1, 2, 4, 8):
        for r in range(t):
            with safe_open(path, "np") as ref, hbmio.open(path, framework="np", readahead=64 << 10) as f:
                engaged = 0
                for key in f.offset_keys():
                    n = f.get_slice(key).get_shape()[0]
                    part = slice(r * n // t, (r + 1) * n // t)
                    got, want = f.get_slice(key)[part], ref.get_slice(key)[part]
                    assert got.shape == want.shape and same(got, want), (t, r, key)
                    engaged += (f._slices if t > 1 else f._ahead) is not None  # t = 1: whole tensors, a walk
                    assert _ahead_bytes(f) <= 64 << 10
                    if f._slices is not None:
                        assert f._slices._held <= 64 << 10
                assert engaged > len(shapes) // 3, f"t={t} r={r}: the slices were hardly read ahead ({engaged})"
    # A walk whose slices change their part half-way: still every slice right.
    with safe_open(path, "np") as ref, hbmio.open(path, framework="np") as f:
        for n_key, key in enumerate(f.offset_keys()):
            n = f.get_slice(key).get_shape()[0]
            part = slice(0, n // 2) if n_key < 10 else slice(n // 2, n)
            assert same(f.get_slice(key)[part], ref.get_slice(key)[part]), key


def test_torch_row_slices_take_the_short_path_and_equal_safe_open(tmp_path):
    """framework "pt": `[a:b]` of rows goes straight to the read of rows (no per-dimension checks).
    Every bound torch accepts (negative, past either end, a stop before the start, numpy ints)
    gives safe_open's tensor, in a tensor-parallel walk (read ahead) and out of order (read
    alone); bounds that are not ints are refused as safe_open refuses them."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 48), (32, 8), (128,), (64, 3, 5), (16, 16), (7, 4), (1, 9)] * 3
    tensors = {f"w{i:03d}": torch.randint(0, 255, s, generator=gen).to(torch.bfloat16) for i, s in enumerate(shapes)}
    path = tmp_path / "rows.safetensors"
    save_file(tensors, str(path))
    with safe_open(path, "pt") as ref, hbmio.open(path, framework="pt", readahead=64 << 10) as f:
        keys = f.offset_keys()
        for t in (2, 4):
            for r in range(t):
                engaged = 0
                for key in keys:
                    n = f.get_slice(key).get_shape()[0]
                    part = slice(r * n // t, (r + 1) * n // t)
                    got = f.get_slice(key)[part]
                    assert torch.equal(got, ref.get_slice(key)[part]), (t, r, key)
                    engaged += f._slices is not None
                assert engaged > len(keys) // 3, f"t={t} r={r}: the slices were hardly read ahead ({engaged})"
        bounds = [None, 0, 1, 3, -1, -3, 6, 7, 8, 200, -200, np.int64(2), np.int32(-2)]
        for key in random.Random(4).sample(keys, 6) + keys[:2]:
            for a in bounds:
                for b in bounds:
                    index = slice(a, b)
                    assert torch.equal(f.get_slice(key)[index], ref.get_slice(key)[index]), (key, index)
        for index in (slice(1.5, 3), slice("a", None), slice(0, 4, 2), slice(0, 4, -1)):
            assert check_index(ref, f, keys[0], index) in ("equal", "refused")


@pytest.mark.parametrize("framework", ["numpy", "pt"])
def test_an_index_of_single_elements_arrays_in_the_index_and_too_many_indices_as_safe_open(tmp_path, framework):
    """An index of only ints gives what safe_open gives (a 0-d array in NumPy mode, never a NumPy
    scalar: torch.from_numpy and in-place writes need an array), on the short-runs path of a
    small tensor and on a large one; an index array is refused as safe_open refuses it, not with
    NumPy's "truth value is ambiguous"; too many indices beside a bad slice are refused as the
    framework's own indexing refuses them (torch counts first, safe_open's NumPy mode checks the
    slice first)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(5)
    tensors = {"x": rng.random(9, dtype=np.float32), "y": rng.random((3, 4), dtype=np.float32),
               "big": rng.random((512, 300), dtype=np.float32), "b": rng.random((4, 5)) > 0.5}
    path = tmp_path / "elements.safetensors"
    save_file(tensors, str(path))
    with safe_open(path, framework) as ref, hbmio.open(path, framework=framework) as f:
        for key, index in [("x", 3), ("x", -1), ("y", (1, 2)), ("y", (-1, 0)), ("big", (300, 7)), ("b", (2, 3)),
                           ("x", np.array([1, 0])), ("x", (slice(None, None, -1), 0)), ("x", (slice(None, None, 0), 0)),
                           ("y", (slice(0, 2), 1, 0)), ("y", (Ellipsis, np.array([1])))]:
            if check_index(ref, f, key, index) == "equal":
                assert type(f.get_slice(key)[index]) is type(ref.get_slice(key)[index]), (key, index)


def test_slices_kept_past_the_with_block_read_their_rows_and_nothing_ahead(tmp_path):
    # A slice object taken inside the `with` block still reads after it (as safe_open's do), but
    # starts no read-ahead: nothing would free it until the handle itself is collected.
    from safetensors.numpy import save_file
    tensors = {f"w{i:02d}": np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + i for i in range(24)}
    path = tmp_path / "kept.safetensors"
    save_file(tensors, str(path))
    with hbmio.open(path, framework="np") as f:
        kept = [f.get_slice(k) for k in f.offset_keys()]
    for i, s in enumerate(kept):
        assert same(s[8:16], tensors[f"w{i:02d}"][8:16]), i
        assert same(s[:], tensors[f"w{i:02d}"]), i
    assert f._slices is None and f._ahead is None and not f._ready, "read ahead past the with block"


def test_an_error_read_ahead_reaches_the_caller_at_its_tensor(tmp_path):
    path = tmp_path / "cut.safetensors"
    hbmio.save_file({f"t{i:03d}": np.full(64 << 10, i, dtype=np.uint8) for i in range(32)}, path)
    with hbmio.open(path, framework="np", readahead=512 << 10) as f:
        keys = f.offset_keys()
        # Cut the file inside tensor 20: the tensors before it still arrive whole and right; the
        # walk fails at (or before) the batch holding the cut, naming the file, never with other bytes.
        cut = f._entries_list[20]
        os.truncate(path, os.path.getsize(path) - (12 << 16) + 1000)
        got = 0
        with pytest.raises(hbmio.Error, match="cut.safetensors"):
            for key in keys:
                assert (f.get_tensor(key) == int(key[1:])).all(), key
                got += 1
        assert got <= 20, f"{got} tensors read past a cut in tensor 20 ({cut[0]})"


def test_replaced_and_truncated_files(tmp_path):
    path = tmp_path / "r.safetensors"
    hbmio.save_file({"a": np.full(1 << 20, 1, dtype=np.uint8), "b": np.full(1 << 20, 2, dtype=np.uint8)}, path)
    with hbmio.open(path, framework="np", readahead=0) as f:
        # Replaced (rename over it): the file as opened is read, whole, never a mix.
        hbmio.save_file({"a": np.full(1 << 20, 7, dtype=np.uint8), "b": np.full(1 << 20, 8, dtype=np.uint8)}, path)
        assert (f.get_tensor("a") == 1).all() and (f.get_tensor("b") == 2).all()
    with hbmio.open(path, framework="np", readahead=0) as f:
        # Truncated in place: an error naming the file, never other bytes.
        os.truncate(path, os.path.getsize(path) - (1 << 19))
        last = f.offset_keys()[-1]
        with pytest.raises(hbmio.Error, match="r.safetensors"):
            f.get_tensor(last)


def test_threads_sharing_one_handle(tmp_path):
    """Several threads reading one handle (transformers 5 materialises a file's slices on a pool
    of 4), with a small read-ahead budget so batches and prefetches overlap the reads: every
    tensor right, no error (the read-ahead state was shared unguarded and raised KeyError)."""
    import concurrent.futures
    path = tmp_path / "threads.safetensors"
    tensors = {f"t{i:03d}": np.full(16 << 10, i, dtype=np.uint8) for i in range(200)}
    hbmio.save_file(tensors, path)
    for round_ in range(5):
        with hbmio.open(path, framework="np", readahead=64 << 10) as f:
            keys = f.offset_keys()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda k: (k, f.get_slice(k)[...]), keys))
            for key, array in got:
                assert (array == int(key[1:])).all(), (round_, key)
