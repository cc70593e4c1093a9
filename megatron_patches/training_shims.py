"""CPU/gloo shims for `megatron.training` (megatron-core 0.19 tested): what
`megatron.training.pretrain` needs beyond the megatron-core shims of
`megatron_patches.cpu_shims` to initialise, train, log and checkpoint on a CPU-only torch.

Applied only when CUDA is unavailable (`apply_training_cpu_shims` is a no-op otherwise) and
at most once per process. Each shim names the call it replaces and why:

1. `megatron.training.training.initialize_megatron` is called by `pretrain()` without
   `allow_no_cuda`, and then asserts `torch.cuda.is_available()`: it is called with
   `allow_no_cuda=True`.
2. `torch.cuda.device_count()` is 0 on CPU, and `initialize._initialize_distributed` then
   skips `mpu.initialize_model_parallel` and `_set_random_seed` skips
   `model_parallel_cuda_manual_seed` (no TP/PP groups, no RNG tracker): it returns 1, the
   CPU standing in for device 0 as `torch.cuda.current_device()` already does.
3. Arguments: gloo instead of nccl, the CUDA kernel fusions off and the local layer spec
   without Transformer Engine are decided, with the adaptations a GPU without Transformer
   Engine or Apex needs, by `megatron_patches.machine_arguments` (called by the argument
   hook of `megatron_patches.training_hooks` right after parsing).
4. Memory reporting (`training_log`'s `torch.cuda.memory_stats`, `memory_reserved`,
   `max_memory_reserved`, `mem_get_info`) reads zeros: there is no device memory.
5. `megatron.training.utils.get_device_arch_version` (imported by name into `arguments`)
   reads `torch.cuda.get_device_properties`, which fails without a GPU; `validate_args`
   uses it to demand `CUDA_DEVICE_MAX_CONNECTIONS=1` (a CUDA kernel-scheduling setting) with
   TP > 1 before Blackwell. On CPU it reports 10, an architecture without that demand.
6. Checkpoints store `torch.cuda.get_rng_state()` and loads call `torch.cuda.set_rng_state`
   (`checkpointing.get_rng_state` / `load_checkpoint`), which fail without a GPU: the state
   is an empty byte tensor and setting it does nothing (the CPU generator, which draws
   everything on CPU, is saved as `torch_rng_state` beside it).

The local layer spec's norm is not a CPU matter (a GPU without Transformer Engine or Apex
gets the same `WrappedTorchNorm`): `megatron_patches.norms.install_sequence_parallel_torch_norm`
replaces it on every machine.
"""

from __future__ import annotations

import functools
import threading

import torch

_LOCK = threading.Lock()


def _allow_no_cuda(initialize_megatron):
    @functools.wraps(initialize_megatron)
    def wrapper(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    wrapper.__dhelix_original__ = initialize_megatron  # read by `apply_training_cpu_shims`
    return wrapper


def _empty_memory_stats(device=None) -> dict:
    return {}


def _patch_memory_reporting() -> None:
    cuda = torch.cuda
    cuda.device_count = lambda: 1
    cuda.memory_stats = _empty_memory_stats
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_reserved = lambda device=None: 0
    cuda.mem_get_info = lambda device=None: (0, 0)


def _cpu_arch_version() -> int:
    return 10


def _patch_device_queries() -> None:
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    arguments.get_device_arch_version = _cpu_arch_version
    common_utils.get_device_arch_version = _cpu_arch_version
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8,
                                                                  device="cpu")
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None


def apply_training_cpu_shims() -> bool:
    """Install the megatron-core CPU shims and the `megatron.training` ones above when CUDA is
    unavailable; True when they are (now) active, False on a CUDA machine (nothing changed).
    Must run before `megatron.training.pretrain` is called."""
    from megatron_patches.cpu_shims import apply_cpu_shims

    if not apply_cpu_shims():
        return False
    with _LOCK:
        from megatron.training import training

        # installed when the last shim is (read off the patch, as `cpu_shims_active` does)
        if hasattr(training.initialize_megatron, "__dhelix_original__"):
            return True
        _patch_memory_reporting()
        _patch_device_queries()
        training.initialize_megatron = _allow_no_cuda(training.initialize_megatron)
        return True
