"""hbmio.use_in_transformers(): transformers' from_pretrained reads safetensors checkpoints
(one file, and sharded) through hbmio.open, and gets exactly what it gets from safetensors.

A small Llama made from a config (no download) is saved once as one file and once in several
shards; each is loaded with stock from_pretrained and with hbmio, and the weights must agree bit
for bit. Every load through hbmio is checked to have opened each checkpoint file with hbmio.open,
so the test cannot pass by loading through safetensors unnoticed."""
import importlib
import inspect
import os
import subprocess
import sys

# Before transformers (and huggingface_hub, which reads it once) is imported: nothing here may
# reach the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

torch = pytest.importorskip("torch", reason="these tests load models with PyTorch")
transformers = pytest.importorskip("transformers", reason="hbmio.use_in_transformers needs transformers")
safetensors = pytest.importorskip("safetensors")

import hbmio  # noqa: E402
from hbmio import integrations  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _save(model, path, **kwargs):
    # transformers 4.x needs safe_serialization=True for safetensors; 5.x writes only those and
    # no longer has the argument.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(path, **kwargs)


def _dtype_kwargs(dtype):
    # transformers 5 names it dtype (torch_dtype is deprecated there); 4.x torch_dtype.
    if dtype is None:
        return {}
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"single": dir, "sharded": dir} holding one random model, and its state dict."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    root = tmp_path_factory.mktemp("llama")
    dirs = {"single": root / "single", "sharded": root / "sharded"}
    _save(model, dirs["single"])
    _save(model, dirs["sharded"], max_shard_size="100KB")
    assert sorted(p.name for p in dirs["single"].glob("*.safetensors")) == ["model.safetensors"]
    shards = sorted(dirs["sharded"].glob("*.safetensors"))
    assert len(shards) >= 3, f"expected several shards, got {[p.name for p in shards]}"
    assert (dirs["sharded"] / "model.safetensors.index.json").exists()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return dirs, reference


@pytest.fixture
def opened(monkeypatch):
    """Records (path, framework, device) of every hbmio.open call, then lets it through."""
    calls = []
    real = hbmio.open

    def recording_open(path, *args, **kwargs):
        calls.append((os.fspath(path), args, kwargs))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hbmio, "open", recording_open)
    return calls


@pytest.fixture(autouse=True)
def stock_afterwards():
    """Every test leaves transformers as it found it, even when it fails half-way."""
    yield
    integrations._disable()
    assert transformers.modeling_utils.safe_open is safetensors.safe_open


def _load(path, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_identical(got, want):
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name].cpu(), want[name].cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Bytes, not values: equal NaNs and signed zeros count, and nothing is compared "close".
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), name


def _files(path):
    return sorted(str(p) for p in path.glob("*.safetensors"))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_from_pretrained_same_bits(checkpoints, opened, layout, dtype):
    dirs, reference = checkpoints
    path = dirs[layout]
    stock = _load(path, **_dtype_kwargs(dtype))
    assert opened == [], "stock from_pretrained went through hbmio"
    with hbmio.use_in_transformers():
        through_hbmio = _load(path, **_dtype_kwargs(dtype))
    # Every file of the checkpoint opened through hbmio.open (transformers 4.x opens some twice).
    assert sorted({p for p, _, _ in opened}) == _files(path)
    # On the CPU the handle maps the file, as safetensors' own does there (see test_lazy's mmap tests).
    assert all(kw == {"framework": "pt", "device": "cpu", "mmap": True} for _, _, kw in opened), opened
    _assert_identical(through_hbmio, stock)
    if dtype is None:  # both are also the weights that were saved
        _assert_identical(stock, reference)
    else:
        assert all(t.dtype == dtype for t in through_hbmio.values() if t.is_floating_point())


def test_plain_call_enables_for_the_process(checkpoints, opened):
    dirs, reference = checkpoints
    use = hbmio.use_in_transformers()  # the one documented line
    _assert_identical(_load(dirs["sharded"]), reference)
    assert sorted({p for p, _, _ in opened}) == _files(dirs["sharded"])
    use.restore()
    assert transformers.modeling_utils.safe_open is safetensors.safe_open


def test_context_manager_restores_originals(checkpoints, opened):
    sites = []
    for name in integrations._CALL_SITES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a module this version lacks
            continue
        if "safe_open" in vars(module):  # one that calls safe_open in this version
            sites.append(module)
    assert transformers.modeling_utils in sites
    before = {m: m.safe_open for m in sites}
    assert all(f is safetensors.safe_open for f in before.values())
    with hbmio.use_in_transformers() as use:
        assert all(m.safe_open is integrations._safe_open for m in sites)
        with hbmio.use_in_transformers():  # nested: the inner exit keeps the outer one on
            pass
        assert transformers.modeling_utils.safe_open is integrations._safe_open
    assert {m: m.safe_open for m in sites} == before
    use.restore()  # after the block: nothing left to undo
    assert {m: m.safe_open for m in sites} == before
    # Restored for real: a load goes through safetensors again.
    _load(checkpoints[0]["single"])
    assert opened == []


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with hbmio.use_in_transformers():
            raise RuntimeError("boom")
    assert transformers.modeling_utils.safe_open is safetensors.safe_open


def test_idempotent():
    first = hbmio.use_in_transformers()
    second = hbmio.use_in_transformers()  # already on: patches nothing twice
    assert transformers.modeling_utils.safe_open is integrations._safe_open
    second.restore()  # did not turn it on, so does not turn it off
    assert transformers.modeling_utils.safe_open is integrations._safe_open
    first.restore()
    assert transformers.modeling_utils.safe_open is safetensors.safe_open


def test_handle_matches_safe_open(checkpoints, opened):
    """The handle transformers gets, method by method, against safetensors' own."""
    dirs, _ = checkpoints
    shard = _files(dirs["sharded"])[0]
    with hbmio.use_in_transformers():
        ours = transformers.modeling_utils.safe_open(shard, framework="pt", device="cpu", backend="mmap")
    assert opened and opened[-1][0] == shard  # backend= (safetensors' own) did not keep it from hbmio
    assert opened[-1][2].get("mmap") is True  # CPU tensors are views of a mapping, not copies
    theirs = safetensors.safe_open(shard, framework="pt", device="cpu")
    assert ours.keys() == theirs.keys()
    assert ours.offset_keys() == theirs.offset_keys()
    assert ours.metadata() == theirs.metadata()
    for name in theirs.keys():
        a, b = ours.get_slice(name), theirs.get_slice(name)
        assert a.get_shape() == b.get_shape() and a.get_dtype() == b.get_dtype()
        keys = [Ellipsis, slice(None)]
        if len(b.get_shape()) == 2:
            keys += [(slice(1, 3), slice(None, None, 2)), (0, Ellipsis), (slice(None), -1)]
        for key in keys:
            _assert_identical({name: a[key]}, {name: b[key]})
        _assert_identical({name: ours.get_tensor(name)}, {name: theirs.get_tensor(name)})
    _assert_identical(ours.get_tensors(), theirs.get_tensors())
    with pytest.raises(KeyError):
        ours.get_tensor("no.such.tensor")
    ours.__exit__(None, None, None)  # as transformers closes it: never entered


def test_device_arguments():
    to = integrations._hbmio_device
    assert to("cpu") == "cpu" and to(torch.device("cpu")) == "cpu"
    assert to(0) == "cuda:0" and to(3) == "cuda:3"  # an int is a CUDA index, as in safetensors
    assert to("cuda") == "cuda" and to("cuda:1") == "cuda:1" and to(torch.device("cuda", 2)) == "cuda:2"
    for other in ("mps", "xpu:0", "meta", "cuda:x", torch.device("mps"), True, -1):
        assert to(other) is None, other  # left to safetensors


def test_other_calls_stay_with_safetensors(checkpoints, opened):
    shard = _files(checkpoints[0]["sharded"])[0]
    with hbmio.use_in_transformers():
        handle = transformers.modeling_utils.safe_open(shard, framework="numpy")
    assert opened == [] and not isinstance(handle, hbmio.SafeOpen)
    assert sorted(handle.keys()) == sorted(safetensors.safe_open(shard, "numpy").keys())


def test_missing_transformers_raises_on_call(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` then finds
    with pytest.raises(ImportError, match="pip install transformers"):
        hbmio.use_in_transformers()


def test_import_hbmio_does_not_import_transformers(tmp_path):
    code = "import sys, hbmio; assert 'transformers' not in sys.modules; assert callable(hbmio.use_in_transformers)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)  # the installed hbmio, not the tree's


def test_the_device_of_the_load_from_its_device_map():
    one = integrations._one_cuda_device
    assert one({"": "cuda:0"}) == "cuda:0"
    assert one({"model.embed": 0, "lm_head": "cuda:0", "model.norm": torch.device("cuda", 0)}) == "cuda:0"
    for spread in ({"a": 0, "b": 1}, {"a": "cuda:0", "b": "cpu"}, {"a": "disk"}, {"": "cpu"}, {}, "auto", None):
        assert one(spread) is None, spread

    class Config:  # what transformers 5 keeps in its load_config
        def __init__(self, device_map, device_mesh=None):
            self.device_map, self.device_mesh = device_map, device_mesh

    class Frame:
        def __init__(self, **f_locals):
            self.f_locals = f_locals

    of = integrations._device_of_the_load
    assert of(Frame(load_config=Config({"": "cuda:1"}))) == "cuda:1"
    assert of(Frame(load_config=Config({"": "cuda:1"}, device_mesh=object()))) is None, "tensor parallel: as asked"
    assert of(Frame(load_config=Config(None))) is None
    assert of(Frame()) is None and of(None) is None


@cuda
@pytest.mark.parametrize("direct_min", [0, None], ids=["direct", "small-files-mapped"])
def test_device_map_cuda(checkpoints, opened, monkeypatch, direct_min):
    pytest.importorskip("accelerate", reason="device_map needs accelerate")
    if direct_min is not None:
        monkeypatch.setattr(integrations, "_DIRECT_MIN_BYTES", direct_min)
    dirs, reference = checkpoints
    for layout in ("single", "sharded"):
        stock = _load(dirs[layout], device_map="cuda:0")
        with hbmio.use_in_transformers():
            ours = _load(dirs[layout], device_map="cuda:0")
        assert all(t.device == torch.device("cuda", 0) for t in ours.values())
        assert sorted({p for p, _, _ in opened}) == _files(dirs[layout])
        if int(transformers.__version__.split(".")[0]) >= 5:
            # 5.x asks for the CPU and moves each tensor; hbmio reads files from _DIRECT_MIN_BYTES
            # on straight into the device, and leaves smaller ones (all of these, by default)
            # mapped on the CPU, as stock does.
            expected = {"cuda:0"} if direct_min == 0 else {"cpu"}
            assert {kw.get("device") for _, _, kw in opened} == expected, opened
        opened.clear()
        _assert_identical(ours, stock)
        _assert_identical(ours, reference)


@cuda
def test_handle_on_cuda(checkpoints):
    """safe_open(..., device=...) on a GPU, however the device is written."""
    shard = _files(checkpoints[0]["sharded"])[0]
    theirs = safetensors.safe_open(shard, framework="pt", device="cpu")
    with hbmio.use_in_transformers():
        for device in (0, "cuda:0", torch.device("cuda", 0)):
            ours = transformers.modeling_utils.safe_open(shard, framework="pt", device=device)
            assert isinstance(ours, hbmio.SafeOpen)
            for name in theirs.keys():
                got = ours.get_slice(name)[...]
                assert got.device == torch.device("cuda", 0)
                _assert_identical({name: got}, {name: theirs.get_tensor(name)})
