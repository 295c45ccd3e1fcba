"""safetensors' low-level functions, which safetensors.torch and safetensors.numpy re-export:
serialize / serialize_file (tensors given as TensorSpec: a dtype, a shape and a raw address with
its length) and deserialize (bytes -> [(name, {"dtype", "shape", "data"})]).

The specs become arrays over the caller's memory (no copy), NumPy's where NumPy has the dtype,
else torch's (bfloat16, float8, float4), and go through hbmio's own writers: serialize is
hbmio.torch.save's format code, serialize_file hbmio's crash-safe save without checksums. The
bytes are the reference's for the same specs (python/tests/test_conformance.py).
"""
from __future__ import annotations

import ctypes as _ctypes

# The dtype names TensorSpec takes (torch's names, as the reference's constructor takes them) ->
# the safetensors code it records.
_CODES = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32", "uint32": "U32",
    "int64": "I64", "uint64": "U64", "float16": "F16", "float32": "F32", "float64": "F64", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4", "complex64": "C64",
}
_NAMES = {code: name for name, code in _CODES.items()}
_BITS = {"BOOL": 8, "I8": 8, "U8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64, "F16": 16,
         "F32": 32, "F64": 64, "BF16": 16, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8, "F8_E5M2FNUZ": 8,
         "F8_E8M0": 8, "F4": 4, "C64": 64}


def _refusal(message):
    import errno
    from . import _hbmio
    return _hbmio._dtype_error(errno.EINVAL, message)


class TensorSpec:
    """One tensor for serialize / serialize_file, as safetensors.TensorSpec: dtype (a torch-style
    name such as "float32"; .dtype is then the safetensors code, "F32"), shape, and the address and
    length in bytes of its C-contiguous data, which the caller keeps alive through the call. For
    float4_e2m1fn_x2 the shape may be torch's (pairs): the last dimension is doubled, so .shape is
    always the file's."""

    __slots__ = ("dtype", "shape", "data_ptr", "data_len")

    def __init__(self, *, dtype, shape, data_ptr, data_len):
        code = _CODES.get(dtype)
        if code is None:
            raise _refusal(f'Unknown dtype "{dtype}". Supported dtypes: {", ".join(_CODES)}')
        shape = [int(n) for n in shape]
        if code == "F4" and shape:
            shape[-1] *= 2
        self.dtype, self.shape, self.data_ptr, self.data_len = code, shape, int(data_ptr), int(data_len)

    def __repr__(self):
        return (f"TensorSpec(dtype={self.dtype!r}, shape={self.shape}, data_ptr={self.data_ptr}, "
                f"data_len={self.data_len})")


def _arrays(tensor_dict) -> dict:
    """{name: array over the spec's memory}: NumPy's where NumPy has the dtype, else torch's."""
    import numpy as np
    from ._lazy import _NUMPY_DTYPES
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"argument 'tensor_dict': '{type(tensor_dict).__name__}' object is not a dict of TensorSpec")
    out = {}
    for name, spec in tensor_dict.items():
        if not all(hasattr(spec, a) for a in ("dtype", "shape", "data_ptr", "data_len")):
            raise TypeError(f"argument 'tensor_dict': tensor {name!r}: '{type(spec).__name__}' object is not an "
                            "instance of 'TensorSpec'")
        code, shape = str(spec.dtype), [int(n) for n in spec.shape]
        if code in _CODES:  # a torch-style name (a TensorSpec of another kind that kept it)
            code = _CODES[code]
        if code not in _BITS:
            raise _refusal(f'Unknown dtype "{spec.dtype}" (tensor {name!r})')
        count = 1
        for n in shape:
            count *= n
        if count * _BITS[code] % 8 or count * _BITS[code] // 8 != int(spec.data_len):
            # The reference's words for a length that does not match the dtype and shape.
            raise _refusal(f"Error while serializing: invalid shape, data type, or offset for tensor {name!r}: "
                           f"{code} {shape} holds {count * _BITS[code] / 8:g} bytes, not {spec.data_len}")
        data_len = int(spec.data_len)
        raw = (np.ctypeslib.as_array(_ctypes.cast(int(spec.data_ptr), _ctypes.POINTER(_ctypes.c_ubyte)), (data_len,))
               if data_len else np.empty(0, np.uint8))
        if code in _NUMPY_DTYPES:
            out[name] = raw.view(np.dtype(_NUMPY_DTYPES[code])).reshape(shape)
            continue
        try:
            import torch
        except ImportError:
            raise _refusal(f"tensor {name!r}: dtype {code} needs torch, which is not installed") from None
        from ._dtypes import torch_shape
        torch_dtype = getattr(torch, _NAMES[code], None)
        if torch_dtype is None:
            raise _refusal(f"tensor {name!r}: dtype {code} needs torch.{_NAMES[code]}, which torch "
                           f"{torch.__version__} lacks")
        data = torch.from_numpy(raw) if data_len else torch.empty(0, dtype=torch.uint8)
        out[name] = data.view(torch_dtype).reshape(torch_shape(name, code, shape, "serialize"))
    return out


def serialize(tensor_dict, metadata=None) -> bytes:
    """The bytes of a safetensors file of {name: TensorSpec}, as safetensors.serialize makes them."""
    from . import _check_metadata, _hbmio
    return _hbmio._serialize(_arrays(tensor_dict), _check_metadata(metadata))


def serialize_file(tensor_dict, filename, metadata=None) -> None:
    """Writes {name: TensorSpec} to `filename` as safetensors.serialize_file writes it (the same
    bytes), crash-safe as hbmio.save_file, without checksums."""
    from . import save_file
    save_file(_arrays(tensor_dict), filename, metadata, checksums=False)


def deserialize(data) -> list:
    """[(name, {"dtype": "F32", "shape": [...], "data": bytearray})] of safetensors bytes, as
    safetensors.deserialize returns them, after the checks every load makes."""
    from . import _hbmio
    entries, _ = _hbmio._deserialize(data)
    view = memoryview(data).cast("B")
    return [(name, {"dtype": dtype, "shape": list(shape), "data": bytearray(view[offset:offset + nbytes])})
            for name, dtype, shape, offset, nbytes in entries]
