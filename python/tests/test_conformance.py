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
