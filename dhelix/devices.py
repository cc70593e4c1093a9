"""Which device a rank's tensors live on: the one rule the runtime, the schedules, the
trainer, the profiler and the benchmarks follow when they create a tensor next to a model
(a tensor made without a device lands on the CPU, which a CUDA model's ops then refuse)."""

from __future__ import annotations

import torch


def compute_device() -> torch.device:
    """This rank's compute device: the current CUDA device when CUDA is available (the one
    Megatron's `initialize_megatron` or `dhelix.parallel.init_process_group_from_env`
    selected), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model) -> torch.device:
    """The device of `model`'s parameters (a module, or Megatron's list of model chunks);
    `compute_device()` for a model without parameters."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    return compute_device()


def gpu_emulated() -> bool:
    """True while a dispatch mode that stands a CPU in for a GPU is active on this thread
    (`dhelix.gpu_emulation.mode.GpuEmulationMode`, which says so by its class attribute
    `emulates_gpu`): code that picks a kernel by device type
    (`megatron_patches.sdpa_attention`) then picks the one a GPU would run."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(getattr(mode, "emulates_gpu", False)
               for mode in _get_current_dispatch_mode_stack())
