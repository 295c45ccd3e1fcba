"""Makes Hugging Face transformers read safetensors checkpoints through hbmio:

    import hbmio
    hbmio.use_in_transformers()                      # for the rest of the process, or
    with hbmio.use_in_transformers():                # only inside the block
        model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda:0")

transformers (verified with 4.57, 5.17 and 5.24) opens every .safetensors file of a checkpoint,
sharded or not, with `safe_open(file, framework="pt", device=...)`, a name bound at import time
as a global of the modules below. 5.x passes device="cpu" and backend="mmap"|"pread" and calls
keys() and get_slice(name), then get_shape()/get_dtype()/[...] on the slices from a pool of
threads, and finally handle.__exit__(None, None, None) without having entered it; 4.x passes
device_map's device ("cpu", or a CUDA index) and also calls metadata() and get_tensor(). So
replacing that global in each module is the whole integration: from_pretrained is unchanged.

One adjustment for 5.x: it opens every file on the CPU and moves each tensor to its device
afterwards, so a plain replacement would read each tensor into host memory and copy it again
(where safetensors maps the file and the copy reads the page cache once). Where the load's
device_map (its `load_config`, a local of the function calling safe_open) sends every module to
one CUDA device, hbmio reads straight into that device instead; the move is then a no-op.
Anything else (several devices, "cpu", "disk", a device mesh, no device_map) is read into host
memory as asked.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading

__all__ = ["use_in_transformers"]

# Modules of transformers that call safe_open. Those missing from a version are skipped; modules
# of transformers already imported that also bound safetensors' safe_open are patched as well, so
# a call site this list does not know about is still covered.
_CALL_SITES = (
    "transformers.modeling_utils",              # from_pretrained (_load_pretrained_model), load_state_dict
    "transformers.modeling_layers",             # multi-token-prediction heads (MtpModel)
    "transformers.integrations.accelerate",     # keys of a single file offloaded to disk
    "transformers.quantizers.quantizer_torchao",  # metadata() of torchao-quantized checkpoints
)

_lock = threading.Lock()
_patched = {}      # module -> the safe_open it had before (restored on disable)
_original = None   # safetensors.safe_open, for what hbmio does not cover


def _hbmio_device(device):
    """hbmio's text for a device safe_open was given, or None where hbmio does not load there
    (mps, xpu, meta, ...), in which case safetensors' own safe_open serves the call."""
    if isinstance(device, bool):  # an int to Python, but never meant as a CUDA index
        return None
    if isinstance(device, int):   # safetensors reads an int as a CUDA device index
        return f"cuda:{device}" if device >= 0 else None
    text = str(device)            # a str or a torch.device ("cpu", "cuda", "cuda:1")
    kind, colon, index = text.partition(":")
    if kind == "cpu" and not colon:
        return "cpu"
    if kind == "cuda" and (not colon or index.isdigit()):
        return text
    return None


def _one_cuda_device(device_map):
    """"cuda:N" when every entry of a from_pretrained device_map is that one CUDA device, else None."""
    if not isinstance(device_map, dict) or not device_map:
        return None
    devices = {_hbmio_device(d) for d in device_map.values()}
    if len(devices) != 1:
        return None
    (dev,) = devices
    if dev is None or not dev.startswith("cuda"):
        return None
    if dev == "cuda":
        import torch
        dev = f"cuda:{torch.cuda.current_device()}"
    return dev


# Files from this size on are read straight into the device a transformers 5 load asks for.
_DIRECT_MIN_BYTES = 16 << 20


def _file_size(filename):
    try:
        return os.stat(filename).st_size
    except OSError:  # hbmio.open says what is wrong with it
        return _DIRECT_MIN_BYTES


def _device_of_the_load(frame):
    """The one CUDA device the from_pretrained calling safe_open loads onto (transformers 5: the
    `load_config.device_map` of the calling function), or None."""
    load_config = frame.f_locals.get("load_config") if frame is not None else None
    if load_config is None or getattr(load_config, "device_mesh", None) is not None:
        return None
    return _one_cuda_device(getattr(load_config, "device_map", None))


def _safe_open(filename, framework, device="cpu", **kwargs):
    """safetensors.safe_open's signature; hbmio.open serves what it can, safetensors the rest."""
    # safetensors' backend= says how safetensors itself reads ("mmap" or "pread"); hbmio has its
    # own engines and picks one, so the choice does not carry over. Any other option is one hbmio
    # does not know: leave such a call to safetensors rather than drop the option.
    unknown = set(kwargs) - {"backend"}
    dev = _hbmio_device(device)
    if framework not in ("pt", "torch") or dev is None or unknown:
        return _original(filename, framework, device=device, **kwargs)
    if dev == "cpu" and "backend" in kwargs:  # transformers 5: on the CPU, to be moved afterwards
        target = _device_of_the_load(sys._getframe(1))
        # Straight into the device, except files too small to gain from it: there the engine's
        # set-up on the device (pinned buffers, streams) cost more than the CPU's copy out of the
        # mapping and transformers' move, and a model of many small shards loaded slower than
        # stock. Those stay mapped on the CPU, as stock's are.
        if target is not None and _file_size(filename) >= _DIRECT_MIN_BYTES:
            dev = target
    import hbmio  # looked up at each call, so a wrapper put on hbmio.open (tests) sees the calls
    # hbmio.open's handle is safe_open's interface, and safe to share between the threads on
    # which transformers 5 materialises the slices of one file. On the CPU, its tensors are views
    # of a mapping of the file, as safetensors' are there: a copy would only add work (and a small
    # model of many shards would load slower than stock).
    return hbmio.open(filename, framework="pt", device=dev, mmap=dev == "cpu")


def _enable() -> bool:
    """Patches every call site; True when hbmio was not in use before this call."""
    global _original
    try:
        import safetensors
        importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError("hbmio.use_in_transformers() needs transformers (and safetensors): "
                          "pip install transformers") from e
    with _lock:
        was_off = not _patched
        if _original is None:
            _original = safetensors.safe_open
        for name in _CALL_SITES:
            try:
                importlib.import_module(name)
            except ImportError:  # not in this version, or needs an optional package
                pass
        # Every imported transformers module holding safetensors' safe_open, the list above and
        # any call site added by a later version alike; a repeated call patches only what is new.
        # (vars(): transformers' lazy modules resolve missing attributes by importing.)
        for name, module in list(sys.modules.items()):
            if (name == "transformers" or name.startswith("transformers.")) and module is not None \
                    and vars(module).get("safe_open") is _original and module not in _patched:
                _patched[module] = module.safe_open
                module.safe_open = _safe_open
        return was_off


def _disable():
    with _lock:
        for module, previous in _patched.items():
            if getattr(module, "safe_open", None) is _safe_open:  # leave alone what others replaced since
                module.safe_open = previous
        _patched.clear()


class _Use:
    """What use_in_transformers() returns: a context manager whose exit (or restore()) puts back
    the state from before the call: safetensors' safe_open if hbmio was not in use yet, else
    nothing (an outer call keeps it on)."""

    def __init__(self, turned_on: bool):
        self._turned_on = turned_on

    def restore(self):
        if self._turned_on:
            self._turned_on = False
            _disable()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def use_in_transformers():
    """Makes transformers' from_pretrained (and load_state_dict) read .safetensors files through
    hbmio.open instead of safetensors.safe_open, sharded checkpoints and device_map included.
    Takes effect at once; as a context manager, undone at the end of the block. Calling it again
    is harmless. Calls hbmio does not serve (another framework than torch, a device other than
    cpu or cuda) still go to safetensors. ImportError if transformers is not installed."""
    return _Use(_enable())
