"""Mapped loads into host memory (load_file(mmap=True); hbmio.torch.load_file's default): equal byte
for byte to the reference's load of the reference's own files, views of the file's pages (not
copies), and safe across a replacement by rename."""
import os
import pathlib

import pytest

import hbmio
import hbmio.numpy
import hbmio.torch

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
st_torch = pytest.importorskip("safetensors.torch")

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"
FILES = sorted(p.name for p in FIXTURES.glob("*.safetensors")) if FIXTURES.is_dir() else []


def raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("name", FILES)
def test_mapped_loads_equal_the_reference(name):
    want = st_torch.load_file(str(FIXTURES / name))
    for got in (hbmio.load_file(FIXTURES / name, mmap=True), hbmio.torch.load_file(FIXTURES / name)):
        assert list(got) == list(want)  # file order, as the reference
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert raw(got[k]) == raw(want[k]), k


def test_a_sharded_checkpoint_maps_every_shard():
    index = FIXTURES / "sharded"
    want = hbmio.load_file(index)  # a copied load: the independent read
    got = hbmio.load_file(index, mmap=True)
    assert sorted(got) == sorted(want)
    for k in want:
        assert raw(got[k]) == raw(want[k]), k


def test_a_mapped_sharded_load_takes_each_tensor_from_the_shard_its_index_names(tmp_path):
    """A shard may hold a tensor the index gives to another shard (a stale copy) or none at all: a
    mapped load returns what a copied load returns, the index's tensors from the index's shards."""
    st_torch.save_file({"a": torch.ones(4), "b": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    st_torch.save_file({"a": torch.full((4,), 2.0), "c": torch.arange(3.0), "extra": torch.zeros(1)},
                       str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                                            "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(__import__("json").dumps(index))
    copied = hbmio.load_file(tmp_path)
    assert sorted(copied) == ["a", "b", "c"] and raw(copied["a"]) == raw(torch.ones(4))
    for got in (hbmio.load_file(tmp_path, mmap=True), hbmio.torch.load_file(tmp_path),
                hbmio.load_file(tmp_path / "model.safetensors.index.json", mmap=True)):
        assert sorted(got) == ["a", "b", "c"], list(got)
        for name in copied:
            assert raw(got[name]) == raw(copied[name]), name
    got = hbmio.load_file(tmp_path, mmap=True, names=["a"])
    assert list(got) == ["a"] and raw(got["a"]) == raw(torch.ones(4))
    with pytest.raises(KeyError, match="extra"):
        hbmio.load_file(tmp_path, mmap=True, names=["extra"])


def test_mapped_tensors_are_views_of_the_file_and_survive_a_rename_over_it(tmp_path):
    path = tmp_path / "m.safetensors"
    first = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    st_torch.save_file(first, str(path))
    got = hbmio.torch.load_file(path)
    # Views of one mapping (each with a storage of its own bytes): the tensors lie as far apart as
    # in the file, not in copies of their own.
    import json
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    apart = header["b"]["data_offsets"][0] - header["a"]["data_offsets"][0]
    assert got["b"].data_ptr() - got["a"].data_ptr() == apart
    assert got["a"].untyped_storage().nbytes() == 4096 * 4
    # Writes go to private pages: the file is not changed.
    got["a"][0] = 99
    assert hbmio.load_file(path)["a"][0] == 0
    # A new version published by rename (as every safetensors writer does): the old one stays.
    st_torch.save_file({"a": torch.zeros(4096), "b": torch.zeros(3, 5, dtype=torch.bfloat16)}, str(tmp_path / "n"))
    os.replace(tmp_path / "n", path)
    assert torch.equal(got["a"][1:], first["a"][1:]) and torch.equal(got["b"], first["b"])


def test_names_numpy_and_refusals(tmp_path):
    path = tmp_path / "m.safetensors"
    hbmio.save_file({"x": np.arange(10, dtype=np.int16), "y": np.ones((2, 2), dtype=np.float64)}, str(path))
    got = hbmio.numpy.load_file(path, mmap=True, names=["y"])
    assert list(got) == ["y"] and np.array_equal(got["y"], np.ones((2, 2)))
    with pytest.raises(KeyError, match="nope"):
        hbmio.load_file(path, mmap=True, names=["nope"])
    for kwargs in ({"verify": True}, {"device": "cuda:0"}, {"framework": "dlpack"}):
        with pytest.raises(ValueError, match="mmap=True"):
            hbmio.load_file(path, mmap=True, **kwargs)
    # A verified load through the drop-in is a copied one (checksums need every byte).
    copied = hbmio.torch.load_file(path, verify=True)
    assert copied["x"].untyped_storage().nbytes() < os.path.getsize(path)
    # A damaged header is refused by the same parser as every load.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(hbmio.Error):
        hbmio.load_file(bad, mmap=True)
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(hbmio.Error):
        hbmio.load_file(tmp_path / "empty.safetensors", mmap=True)


def test_an_empty_names_list_loads_nothing_on_every_path(tmp_path):
    """names=[] asks for no tensor: {} whether copied, mapped, NumPy or torch (a copied load read
    the list as "every tensor" while a mapped one gave none); a missing file still raises."""
    path = tmp_path / "m.safetensors"
    hbmio.save_file({"a": np.ones(2, dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}, str(path))
    for kwargs in ({}, {"mmap": True}, {"framework": "numpy"}, {"framework": "numpy", "mmap": True}):
        assert hbmio.load_file(path, names=[], **kwargs) == {}, kwargs
    assert hbmio.torch.load_file(path, names=[]) == {} and hbmio.torch.load_file(path, names=[], mmap=False) == {}
    assert hbmio.numpy.load_file(path, names=()) == {}
    with pytest.raises(FileNotFoundError):
        hbmio.load_file(tmp_path / "missing.safetensors", names=[])


def test_a_mapped_numpy_slice_to_one_element_keeps_its_bytes(tmp_path):
    """A BOOL byte other than 0 and 1 sliced down to one element comes back as stored (NumPy's
    scalar for it had made 0x02 into 0x01), as the reference's slices and hbmio's copied ones give."""
    import json
    import struct
    from safetensors import safe_open
    header = json.dumps({"t": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]},
                         "m": {"dtype": "U8", "shape": [2, 2], "data_offsets": [3, 7]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "b.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00\x02\xff" + b"\x01\x02\x03\x04")
    with safe_open(str(path), "np") as ref:
        for name, index in (("t", 1), ("t", 2), ("t", slice(1, 3)), ("m", (1, 0)), ("m", 1)):
            want = ref.get_slice(name)[index]
            for mmap in (True, False):
                with hbmio.open(path, framework="np", mmap=mmap) as f:
                    got = f.get_slice(name)[index]
                assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (name, index, mmap)
                assert np.shape(got) == np.shape(want), (name, index, mmap)


def test_each_cpu_tensor_has_a_storage_of_its_own(tmp_path):
    """As the reference's: torch.save of one loaded tensor writes its bytes, not the file's, and
    safetensors' save_model takes a model whose parameters were assigned from a load (it raised
    "None is covering the entire storage" when every tensor was a view of one allocation or mapping)."""
    import io
    path = tmp_path / "m.safetensors"
    state = {"emb": torch.randn(64, 33), "head": torch.randn(17, 8).to(torch.float16), "empty": torch.zeros(0, 3),
             "odd": torch.arange(5, dtype=torch.int8)}
    st_torch.save_file(state, str(path))
    loads = {"mapped": hbmio.torch.load_file(path), "copied": hbmio.torch.load_file(path, mmap=False),
             "hbmio.load_file": hbmio.load_file(path)}
    with hbmio.open(path, framework="pt", mmap=True) as f:
        loads["open(mmap=True)"] = {k: f.get_tensor(k) for k in f.keys()}
    for how, loaded in loads.items():
        for name, t in loaded.items():
            assert torch.equal(t, state[name]), (how, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (how, name)
        saved = io.BytesIO()
        torch.save(loaded["head"], saved)
        assert saved.getbuffer().nbytes < 17 * 8 * 2 + 2048, how

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Parameter(torch.empty(64, 33))
                self.head = torch.nn.Parameter(torch.empty(17, 8, dtype=torch.float16))

        model = Model()
        model.load_state_dict({k: loaded[k] for k in ("emb", "head")}, assign=True)
        st_torch.save_model(model, str(tmp_path / f"{how}.safetensors"))
        assert torch.equal(st_torch.load_file(str(tmp_path / f"{how}.safetensors"))["head"], state["head"]), how
