"""safetensors 0.9's API on hbmio.open: prefetch(plan) loaders (each tensor handed out once, row
plans reading only their rows, byte-equal to the reference's tensors) and get_tensor_meta; and the
drop-in's metadata: hbmio.torch writes what the reference writes, metadata() shows only the
caller's keys."""
import json
import os
import pathlib
import shutil

import pytest

import hbmio
import hbmio.torch

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("HBMIO_FIXTURES", REPO.parent / "shared" / "fixtures")) / "safetensors"
DEVICES = ["cpu"] + (["cuda:0"] if hbmio.cuda_device_count() > 0 else [])


def raw(t):
    t = t.cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture
def model(tmp_path, monkeypatch):
    # Batches of 16 KiB, so that a few tensors make several batches of one engine request, each
    # handed out as its own bytes land.
    monkeypatch.setattr("hbmio._prefetch._BATCH", 16 << 10)
    torch.manual_seed(0)
    state = {f"layer{i}.w": torch.randn(37 + i, 129) for i in range(12)}
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.zeros(0, 4)
    state["half"] = torch.randn(9, 7).to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    st_torch.save_file(state, str(path))
    return path, state


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_whole_file_hands_each_tensor_out_once(model, device):
    path, state = model
    with hbmio.open(path, framework="pt", device=device) as f:
        with f.prefetch() as loader:
            with safe_open(str(path), "pt") as ref:
                assert loader.names() == list(ref.offset_keys())  # file order
            assert len(loader) == len(state)
            first = loader.take("layer3.w")
            got = dict(loader)  # the rest, as they land
            assert len(loader) == 0
            with pytest.raises(KeyError, match="taken already"):
                loader.take("layer3.w")
            with pytest.raises(KeyError, match="not in this loader's plan"):
                loader.take("nope")
    got["layer3.w"] = first
    assert sorted(got) == sorted(state)
    for k, t in state.items():
        assert got[k].device.type == torch.device(device).type
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert raw(got[k]) == raw(t), k


@pytest.mark.parametrize("device", DEVICES)
def test_row_plans_read_only_their_rows(model, device):
    path, state = model
    plan = {"layer0.w": slice(0, 5), "layer5.w": slice(10, None), "layer11.w": slice(-3, None), "half": None,
            "layer2.w": slice(30, 10), "empty": slice(0, 0)}
    with hbmio.open(path, framework="pt", device=device) as f:
        loader = f.prefetch(plan)
        got = {name: loader.take(name) for name in reversed(loader.names())}
        loader.close()
    for name, key in plan.items():
        want = state[name] if key is None else state[name][key]
        assert got[name].shape == want.shape and raw(got[name]) == raw(want), name


def test_plans_the_reference_refuses_are_refused(model):
    path, _ = model
    with hbmio.open(path, framework="pt") as f:
        with pytest.raises(ValueError, match="step"):
            f.prefetch({"layer0.w": slice(0, 4, 2)})
        with pytest.raises(ValueError, match="0-d"):
            f.prefetch({"scalar": slice(0, 1)})
        with pytest.raises(KeyError):
            f.prefetch({"nope": None})
    with hbmio.open(path, framework="np") as f:
        with pytest.raises(ValueError, match="framework"):
            f.prefetch()


def test_close_frees_what_was_not_taken(model):
    path, _ = model
    with hbmio.open(path, framework="pt") as f:
        loader = f.prefetch()
        kept = loader.take("layer0.w")
        loader.close()
        assert len(loader) == 0 and list(loader) == []
        with pytest.raises(ValueError, match="closed"):
            loader.take("layer1.w")
    assert kept.shape == (37, 129)  # handed out before close(): still its own


def test_get_tensor_meta_matches_the_header(model):
    path, state = model
    with hbmio.open(path, framework="pt") as f:
        metas = {k: f.get_tensor_meta(k) for k in f.keys()}
    import json
    blob = path.read_bytes()
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    for k, m in metas.items():
        assert m.dtype == header[k]["dtype"] and m.shape == header[k]["shape"]
        assert m.data_offsets == tuple(header[k]["data_offsets"]), k


def test_drop_in_saves_are_the_references_bytes(tmp_path):
    torch.manual_seed(1)
    state = {"a": torch.randn(3, 4), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(2, 2).to(torch.bfloat16)}
    import json
    for metadata in (None, {"format": "pt"}, {"format": "pt", "note": "x", "z": "1"}):
        st_torch.save_file(state, str(tmp_path / "ref.safetensors"), metadata=metadata)
        hbmio.torch.save_file(state, tmp_path / "ours.safetensors", metadata=metadata)
        ours, ref = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "ref.safetensors").read_bytes()
        if metadata is None or len(metadata) == 1:
            assert ours == ref
        else:  # the reference writes metadata keys in a hash map's order, which changes from run to run
            n = int.from_bytes(ref[:8], "little")
            assert len(ours) == len(ref) and ours[:8] == ref[:8] and ours[8 + n:] == ref[8 + n:]
            assert json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + n])
        with hbmio.open(tmp_path / "ours.safetensors", framework="pt") as f:
            assert f.metadata() == metadata
            assert f.hbmio_metadata() == {}
    # hbmio.save_file keeps its checksums, which metadata() does not show.
    hbmio.save_file(state, str(tmp_path / "checked.safetensors"), metadata={"format": "pt"})
    with hbmio.open(tmp_path / "checked.safetensors", framework="pt") as f, \
            safe_open(str(tmp_path / "checked.safetensors"), "pt") as ref:
        assert f.metadata() == {"format": "pt"}
        assert set(f.hbmio_metadata()) == {k for k in ref.metadata() if k.startswith("hbmio.")} != set()
    hbmio.save_file(state, str(tmp_path / "checked2.safetensors"))
    with hbmio.open(tmp_path / "checked2.safetensors", framework="pt") as f:
        assert f.metadata() is None and f.hbmio_metadata()


def test_backend_names_of_the_reference_are_accepted_and_unknown_ones_refused_at_once(model, monkeypatch):
    import safetensors
    path, state = model
    monkeypatch.delenv("HBMIO_BACKEND", raising=False)
    for name in ("mmap", "pread"):  # how safetensors reads: hbmio's own choice here
        with hbmio.open(path, framework="pt", backend=name) as f:
            assert raw(f.get_tensor("layer1.w")) == raw(state["layer1.w"])
        assert raw(hbmio.torch.load_file(path, backend=name)["half"]) == raw(state["half"])
    for call in (lambda: hbmio.open(path, framework="pt", backend="bogus"),
                 lambda: hbmio.torch.load_file(path, backend="bogus"),
                 lambda: hbmio.load_file(path, backend="bogus")):
        with pytest.raises(safetensors.SafetensorError, match='"bogus" is invalid') as e:  # the reference's type
            call()
        assert isinstance(e.value, hbmio.Error) and isinstance(e.value, ValueError)



def test_a_failed_read_reaches_every_tensor_of_its_batch(model, monkeypatch, tmp_path):
    """A file cut short after it was opened: each tensor whose batch could not be read raises the
    read's hbmio.Error when taken (a second tensor of that batch too, not a KeyError); with small
    batches, those before the cut are handed out intact."""
    path, state = model
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(path, copy)
    for file, batch in ((path, 1 << 30), (copy, 16 << 10)):  # one batch for all; then many
        monkeypatch.setattr("hbmio._prefetch._BATCH", batch)
        with hbmio.open(file, framework="pt") as f:
            names = f.offset_keys()
            last = next(n for n in reversed(names) if state[n].numel())
            os.truncate(file, os.path.getsize(file) - 64)  # the last tensor's bytes cut short
            with f.prefetch() as loader:
                with pytest.raises(hbmio.Error, match="ended"):
                    loader.take(last)
                if batch == 1 << 30:
                    with pytest.raises(hbmio.Error, match="ended"):
                        loader.take(names[0])
                else:
                    assert raw(loader.take(names[0])) == raw(state[names[0]])


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_is_one_allocation_of_views_in_every_dtype(tmp_path, device):
    """The tensors of a batch are views of one allocation laid out as in the file (padding only
    where a dtype's alignment needs it: an odd-sized U8 before an F32), each contiguous, aligned
    and byte-equal to the reference's, F4 as torch's float4_e2m1fn_x2; and the reference's
    fixture of every dtype."""
    torch.manual_seed(1)
    state = {"a_bytes": torch.randint(0, 255, (7,), dtype=torch.uint8), "b_f32": torch.randn(5, 3),
             "c_bool": torch.rand(9) > 0.5, "d_i64": torch.arange(11), "e_bf16": torch.randn(4, 4).to(torch.bfloat16),
             "f_f8": torch.randn(13).to(torch.float8_e4m3fn), "g_c64": torch.randn(3, dtype=torch.complex64),
             "h_scalar": torch.tensor(2.5, dtype=torch.float64), "i_empty": torch.zeros(0, 3, dtype=torch.int16),
             "j_f4": torch.randint(0, 255, (2, 3), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
    path = tmp_path / "mixed.safetensors"
    st_torch.save_file(state, str(path))
    for file in (path, FIXTURES / "dtypes.safetensors"):
        with safe_open(str(file), "pt") as ref:
            want = {k: ref.get_tensor(k) for k in ref.keys()}
        with hbmio.open(file, framework="pt", device=device) as f, f.prefetch() as loader:
            got = dict(loader)
        assert sorted(got) == sorted(want)
        storages = {t.untyped_storage().data_ptr() for t in got.values()}
        assert len(storages) == 1, f"{file.name}: {len(storages)} allocations for one batch"
        for k, t in want.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
            assert got[k].is_contiguous() and got[k].data_ptr() % t.element_size() == 0, k
            assert raw(got[k]) == raw(t), k


def test_row_plans_of_f4_read_whole_bytes_or_are_refused(tmp_path):
    """F4 holds two values a byte: rows of a 2-D F4 tensor are whole bytes and read as such; rows of
    a 1-D one that would split a byte are refused, never read as a wrong range."""
    g = torch.Generator().manual_seed(5)
    two_d = torch.randint(0, 255, (6, 4), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
    one_d = torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    st_torch.save_file({"m": two_d, "v": one_d, "z": torch.randn(3)}, str(path))
    with hbmio.open(path, framework="pt") as f:
        with f.prefetch({"m": slice(1, 4), "v": slice(2, 8), "z": None}) as loader:
            got = dict(loader)
        assert got["m"].view(torch.uint8).tolist() == two_d[1:4].view(torch.uint8).tolist()
        assert got["v"].view(torch.uint8).tolist() == one_d[1:4].view(torch.uint8).tolist()  # F4 values 2..7: bytes 1..3
        with pytest.raises(ValueError, match="whole bytes"):
            f.prefetch({"v": slice(1, 4)})


def _header(path):
    data = pathlib.Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    return {k: v for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}


@pytest.fixture
def sharded(tmp_path, monkeypatch):
    """A checkpoint of two shards written by the reference and a Hugging Face index naming them;
    the second shard's names sort before the first's, so file order is not name order."""
    monkeypatch.setattr("hbmio._prefetch._BATCH", 16 << 10)
    torch.manual_seed(2)
    shards = {"model-00001-of-00002.safetensors": {f"z.layer{i}.w": torch.randn(40 + i, 65) for i in range(5)},
              "model-00002-of-00002.safetensors": {"a.embed": torch.randn(33, 17).to(torch.bfloat16),
                                                  "a.bias": torch.arange(9, dtype=torch.int32), "a.scalar": torch.tensor(1.5)}}
    weight_map, total = {}, 0
    for file, state in shards.items():
        st_torch.save_file(state, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in state})
        total += sum(t.numel() * t.element_size() for t in state.values())
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return tmp_path, index, list(shards)


def _reference_per_file(folder, files):
    """{name: tensor} of every shard, each file loaded on its own through the reference's safe_open,
    and the names in file order (shard by shard)."""
    want, order = {}, []
    for file in files:
        with safe_open(str(folder / file), "pt") as ref:
            order += list(ref.offset_keys())
            want.update({k: ref.get_tensor(k) for k in ref.keys()})
    return want, order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["index", "directory"])
def test_prefetch_and_get_tensor_meta_over_a_sharded_index(sharded, device, which):
    """hbmio.open of an index (or its directory) prefetches the tensors of every shard, each equal
    byte for byte to the reference's load of its own file; names() is file order across the
    shards; a plan may take rows of tensors in both shards; get_tensor_meta gives each tensor's
    header entry, data_offsets within its own shard (as the reference's safe_open of that shard)."""
    folder, index, files = sharded
    want, order = _reference_per_file(folder, files)
    path = index if which == "index" else folder
    with hbmio.open(path, framework="pt", device=device) as f:
        with f.prefetch() as loader:
            assert loader.names() == order == f.offset_keys()
            assert len(loader) == len(want)
            last = loader.take(order[-1])  # from the second shard, before anything else
            got = dict(loader)
        got[order[-1]] = last
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert got[name].device.type == torch.device(device).type, name
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert raw(got[name]) == raw(t), name
        plan = {"z.layer1.w": slice(3, 17), "a.embed": slice(-5, None), "a.bias": None, "z.layer4.w": slice(0, 1)}
        with f.prefetch(plan) as loader:
            parts = {name: loader.take(name) for name in plan}
        for name, key in plan.items():
            ref = want[name] if key is None else want[name][key]
            assert parts[name].shape == ref.shape and raw(parts[name]) == raw(ref), name
        headers = {}
        for file in files:
            headers.update(_header(folder / file))
        for name in order:
            meta = f.get_tensor_meta(name)
            entry = headers[name]
            assert (meta.dtype, meta.shape, meta.data_offsets) == (entry["dtype"], entry["shape"], tuple(entry["data_offsets"])), name
        # The second shard's first tensor starts its own data section, not where the first shard's ends.
        first_of_second = _reference_per_file(folder, files[1:])[1][0]
        assert f.get_tensor_meta(first_of_second).data_offsets[0] == 0
        assert f.get_tensor_meta(order[-1]).data_offsets[1] > 0
        with pytest.raises(KeyError):
            f.get_tensor_meta("no.such.tensor")


def test_use_in_transformers_handles_route_prefetch(sharded):
    """The handle hbmio.use_in_transformers() gives transformers for each shard is hbmio.open's
    (a mapped CPU handle, as transformers 5 asks for it): its prefetch() and get_tensor_meta are
    hbmio's and give the reference's tensors and header entries."""
    transformers = pytest.importorskip("transformers", reason="hbmio.use_in_transformers needs transformers")
    import transformers.modeling_utils  # noqa: F401 - the call site of safe_open
    from hbmio import integrations
    from hbmio._prefetch import PrefetchLoader, TensorMeta
    folder, _, files = sharded
    with hbmio.use_in_transformers():
        opener = transformers.modeling_utils.safe_open
        assert opener is integrations._safe_open
        for file in files:
            want, order = _reference_per_file(folder, [file])
            handle = opener(str(folder / file), framework="pt", device="cpu", backend="mmap")
            try:
                assert isinstance(handle, hbmio.SafeOpen) and handle._mmap
                loader = handle.prefetch()
                assert isinstance(loader, PrefetchLoader) and loader.names() == order
                with loader:
                    got = dict(loader)
                assert sorted(got) == sorted(want)
                for name, t in want.items():
                    assert got[name].dtype == t.dtype and raw(got[name]) == raw(t), name
                name = next(n for n in order if want[n].dim() and want[n].shape[0] >= 4)
                rows = handle.prefetch({name: slice(1, 4)})
                assert raw(rows.take(name)) == raw(want[name][1:4])
                rows.close()
                header = _header(folder / file)
                for name in order:
                    meta = handle.get_tensor_meta(name)
                    assert isinstance(meta, TensorMeta)
                    assert (meta.dtype, meta.shape, meta.data_offsets) == (
                        header[name]["dtype"], header[name]["shape"], tuple(header[name]["data_offsets"])), name
            finally:
                handle.__exit__(None, None, None)  # as transformers closes it: never entered
    assert transformers.modeling_utils.safe_open is safe_open  # restored after the block


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_plan_reads_only_the_planned_bytes(tmp_path, device):
    """What the engines moved for a plan of the first eighth of each tensor's rows is exactly those
    rows' bytes (the handle's report: its reads summed, and per file the same), not the tensors'."""
    torch.manual_seed(1)
    state = {f"t{i:03d}": torch.randn(64, 96) for i in range(40)}
    path = str(tmp_path / "rows.safetensors")
    st_torch.save_file(state, path)
    with hbmio.open(path, framework="pt", device=device) as f:
        plan = {k: slice(0, 8) for k in f.keys()}
        with f.prefetch(plan) as loader:
            got = dict(loader)
        report = f.report()
    planned = sum(state[k][:8].numel() * 4 for k in state)
    assert report["bytes"] == planned, (report["bytes"], planned)
    assert sum(p["bytes"] for p in report["paths"]) == planned, report["paths"]
    assert all(raw(got[k]) == raw(state[k][:8]) for k in state)
