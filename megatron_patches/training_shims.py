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
3. Arguments (`cpu_arguments`, called by the argument hook of
   `megatron_patches.training_hooks` right after parsing): `--distributed-backend` defaults
   to nccl, which needs GPUs: it becomes gloo. The fused-kernel options Megatron turns on by
   default need CUDA kernels (Apex, Transformer Engine or torch's CUDA fusions) and are
   turned off, which selects Megatron's unfused torch code for the same math:
   `--no-persist-layer-norm` set (torch's norm asserts persistence is off), `gradient_accumulation_fusion`
   (`fused_weight_gradient_mlp_cuda`), `bias_gelu_fusion`, `bias_swiglu_fusion`,
   `bias_dropout_fusion`, `masked_softmax_fusion`, `apply_rope_fusion`. Without Transformer
   Engine, Megatron's default `--transformer-impl transformer_engine` becomes `local`
   (megatron-core's torch-native layer spec).
4. Memory reporting (`training_log`'s `torch.cuda.memory_stats`, `memory_reserved`,
   `max_memory_reserved`, `mem_get_info`) reads zeros: there is no device memory.
5. The local layer spec's norm (`WrappedTorchNorm`, chosen by
   `megatron.core.models.backends.LocalSpecProvider` and by `TransformerBlock` when neither
   Transformer Engine nor Apex is installed) refuses `--sequence-parallel`; it is replaced by
   `megatron_patches.norms.SequenceParallelTorchNorm`, the same torch module with its
   parameters tagged for the sequence-parallel gradient all-reduce (see that module for why
   building it with SP off and untagged trains silently wrong).
6. `megatron.training.utils.get_device_arch_version` (imported by name into `arguments`)
   reads `torch.cuda.get_device_properties`, which fails without a GPU; `validate_args`
   uses it to demand `CUDA_DEVICE_MAX_CONNECTIONS=1` (a CUDA kernel-scheduling setting) with
   TP > 1 before Blackwell. On CPU it reports 10, an architecture without that demand.
7. Checkpoints store `torch.cuda.get_rng_state()` and loads call `torch.cuda.set_rng_state`
   (`checkpointing.get_rng_state` / `load_checkpoint`), which fail without a GPU: the state
   is an empty byte tensor and setting it does nothing (the CPU generator, which draws
   everything on CPU, is saved as `torch_rng_state` beside it).
"""

from __future__ import annotations

import functools
import threading

import torch

_LOCK = threading.Lock()


_CUDA_FUSIONS = ("gradient_accumulation_fusion", "bias_gelu_fusion",
                 "bias_swiglu_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                 "apply_rope_fusion")


def cpu_arguments(args) -> None:
    """On a CPU-only machine, adapt Megatron's parsed arguments in place (item 3 above):
    gloo instead of nccl, CUDA kernel fusions off, the local layer spec without Transformer
    Engine. Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        return
    if args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"
    args.no_persist_layer_norm = True
    if args.transformer_impl == "transformer_engine":
        from megatron_patches.compat import has_transformer_engine

        if not has_transformer_engine():
            args.transformer_impl = "local"
    for name in _CUDA_FUSIONS:
        if getattr(args, name, False):
            setattr(args, name, False)


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
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None


def _patch_local_norm() -> None:
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_patches.norms import SequenceParallelTorchNorm

    for module, name in ((backends, "WrappedTorchNorm"), (backends, "LNImpl"),
                         (gpt_layer_specs, "LNImpl"), (transformer_block, "LayerNormImpl")):
        if getattr(module, name, None) is WrappedTorchNorm:
            setattr(module, name, SequenceParallelTorchNorm)


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
        _patch_local_norm()
        training.initialize_megatron = _allow_no_cuda(training.initialize_megatron)
        return True
