"""The same call through the reference (safetensors) and through hbmio's stand-ins: the same
result, or the same exception type with the words code matches on."""
import pytest

import hbmio
import hbmio.torch

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

SAVE_REFUSALS = {
    "not a dict": ("notadict", "Expected a dict of [str, torch.Tensor]"),
    "a list": ([torch.zeros(2)], "Expected a dict of [str, torch.Tensor]"),
    "meta tensor": ({"a": torch.empty(3, device="meta")}, "Cannot copy out of meta tensor"),
    "strided": ({"a": torch.zeros(4, 4)[:, ::2]}, "non contiguous tensor: `a`"),
    "sparse": ({"a": torch.zeros(3, 3).to_sparse()}, "sparse tensors"),
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
        assert "notafile" in str(ref.value) and "notafile" in str(ours.value)
        assert "No such file or directory" in str(ours.value)
