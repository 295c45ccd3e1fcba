"""Tensors a framework cannot hold, refused as safetensors (0.8 and 0.9) refuses them.

The reference's NumPy mode asks NumPy for the dtype named after torch's and fails where NumPy
has none: bfloat16 with TypeError("data type 'bfloat16' not understood"), the float8 kinds and
F4 with AttributeError("module 'numpy' has no attribute 'float8_e4m3fn'"); F6_E2M3 and F6_E3M2,
which neither NumPy nor torch has, with SafetensorError("Dtype not understood: F6_E2M3") in every
framework. hbmio raised TypeError for all of them, so each error here is a TypeError too (and an
AttributeError where the reference's is one): code written for either catches it.
"""
from __future__ import annotations

# safetensors dtype -> the torch dtype name the reference's NumPy mode looks up in NumPy.
_REFERENCE_NAMES = {
    "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F4": "float4_e2m1fn_x2",
}
_PACKED = ("F6_E2M3", "F6_E3M2")  # four values in three bytes: no framework has such a type

_types = {}


def _type(name, bases, doc):
    made = _types.get(name)
    if made is None:
        made = _types[name] = type(name, bases, {"__module__": "hbmio", "__doc__": doc})
    return made


def _shown(where) -> str:
    """A path as messages show it: a URL without its secrets (hbmio::shown_path)."""
    from . import _hbmio
    return _hbmio.shown_path(str(where))


def numpy_refusal(name: str, dtype: str, where: str) -> Exception:
    """The error for tensor `name` (of `where`) of safetensors dtype `dtype`, which NumPy lacks."""
    where = _shown(where)
    context = f" (tensor {name!r} of {where}: NumPy has no such dtype; load it with hbmio.torch)"
    if dtype in _PACKED:
        return packed_refusal(name, dtype, where)
    torch_name = _REFERENCE_NAMES.get(dtype)
    if torch_name == "bfloat16":
        return _type("NumpyDtypeError", (TypeError,), "A dtype NumPy lacks (TypeError, as the reference raises).")(
            f"data type 'bfloat16' not understood{context}")
    if torch_name is not None:
        return _type("NumpyAttributeError", (TypeError, AttributeError),
                     "A dtype NumPy lacks (TypeError, and AttributeError as the reference raises).")(
            f"module 'numpy' has no attribute '{torch_name}'{context}")
    return _type("NumpyDtypeError", (TypeError,), "A dtype NumPy lacks (TypeError, as the reference raises).")(
        f"data type {dtype!r} not understood{context}")


def packed_refusal(name: str, dtype: str, where: str) -> Exception:
    """hbmio.DtypeError (an hbmio.Error, a TypeError and, where safetensors is installed, a
    SafetensorError) for an F6 tensor, in the reference's words."""
    where = _shown(where)
    import errno
    from . import _hbmio
    return _hbmio._dtype_error(errno.ENOTSUP, f"Dtype not understood: {dtype} (tensor {name!r} of {where}: "
                                              "neither NumPy nor torch has this packed sub-byte type)")


def torch_shape(name: str, dtype: str, shape, where: str) -> list:
    """The torch shape of a tensor of the file's `shape`: F4's last dimension counts pairs (the
    torch dtype float4_e2m1fn_x2 holds two values a byte), as in the reference, which refuses an
    odd one (hbmio.DtypeError here, a SafetensorError there) in these words."""
    shape = list(shape)
    if dtype != "F4":
        return shape
    if not shape or shape[-1] % 2:
        where = _shown(where)
        import errno
        from . import _hbmio
        raise _hbmio._dtype_error(errno.EINVAL, f"f4_x2 dtype requires that the last dim be divisible by 2 in torch: "
                                                f"got {shape} (tensor {name!r} of {where})")
    return shape[:-1] + [shape[-1] // 2]
