"""Catch the class of bug "a tensor made on the CPU next to a CUDA model" on a CPU machine.

On the CPU every tensor is on the CPU, so a factory call that forgets its device (torch's
default then puts the tensor on the CPU) trains correctly here and fails only on a GPU
(`Expected all tensors to be on the same device`). `HostTensorWatch` records, while it is
active in this thread, every tensor factory call whose caller is the project's runtime or
Megatron patches (a frame in `dhelix/` or `megatron_patches/`) and that names no device;
the `*_like` and `Tensor.new_*` factories take their source's device and are not counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
WATCHED = tuple(str(ROOT / d) + "/" for d in ("dhelix", "megatron_patches"))
# the CPU shims' factory wrappers (megatron_patches/cpu_shims.py) pass Megatron's calls on
PASS_THROUGH = (str(Path(torch.__file__).parent) + "/", str(ROOT / "megatron_patches" /
                                                            "cpu_shims.py"))
FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange",
                       "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm",
                       "empty_strided", "scalar_tensor"})


def _caller(frame) -> str | None:
    """`path:line` of the first frame outside torch and the CPU shims, when it is in a
    watched directory."""
    while frame is not None and frame.f_code.co_filename.startswith(PASS_THROUGH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(WATCHED):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"


class HostTensorWatch(TorchFunctionMode):
    """Records `{"path:line torch.NAME"}` for device-less factory calls from watched frames
    (in `found`), for as long as the mode is active in this thread."""

    def __init__(self):
        super().__init__()
        self.found: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in FACTORIES and kwargs.get("device") is None
                and not (name == "as_tensor" and args and isinstance(args[0], torch.Tensor))):
            where = _caller(sys._getframe(1))
            if where is not None:
                self.found.add(f"{where} torch.{name}")
        return func(*args, **kwargs)
