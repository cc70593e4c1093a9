"""Torch-native LayerNorm/RMSNorm that is correct under sequence parallelism.

Replaces: `megatron.core.transformer.torch_norm.WrappedTorchNorm`, which asserts
`not config.sequence_parallel`. Simply building it with SP off is a trap: with SP on, each
TP rank sees a different slice of the sequence, so the norm's weight/bias gradients are
partial sums that Megatron all-reduces over the TP group only for parameters tagged
`sequence_parallel=True` (`finalize_model_grads`). Untagged, training runs but the norm
gradients are wrong (~4e-3 off on the tiny preset). This class builds the same torch module
and tags its parameters when SP is on; `tests/test_norms_sequence_parallel.py` keeps the
trap covered. `install_sequence_parallel_torch_norm` puts it where megatron-core bound
`WrappedTorchNorm` (its local spec's norm whenever neither Transformer Engine nor Apex is
installed: every CPU machine, and a GPU machine without them). The norm's parameters take the config's `params_dtype`, as every other
parameter of the layer does (`tests/test_norm_dtype.py`).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """Factory with WrappedTorchNorm's signature; returns a torch.nn.LayerNorm/RMSNorm with
    parameters of `config.params_dtype` on the CPU (moved with the model)."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        build_config = config
        if config.sequence_parallel:
            # Shallow copy with SP off only to pass WrappedTorchNorm's assertion (the built
            # module keeps no reference to it). Not dataclasses.replace: that re-runs
            # __post_init__, which re-validates and can reject a config built legally.
            build_config = copy.copy(config)
            build_config.sequence_parallel = False
        norm = WrappedTorchNorm(
            build_config,
            hidden_size,
            eps=eps,
            persist_layer_norm=persist_layer_norm,
            zero_centered_gamma=zero_centered_gamma,
            normalization=normalization,
        )
        # WrappedTorchNorm builds torch's default dtype (fp32) whatever params_dtype says;
        # Megatron's Float16Module casts it later, models built without that wrapper
        # (the profiler's layer, dhelix's trainer) would run a bf16 input against an fp32
        # weight, which torch's fused RMSNorm refuses (slow fallback, a warning per call).
        norm.to(dtype=config.params_dtype)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm



def install_sequence_parallel_torch_norm() -> None:
    """Bind `SequenceParallelTorchNorm` wherever megatron-core bound `WrappedTorchNorm` as the
    local spec's norm (`models.backends`' `WrappedTorchNorm` and `LNImpl`, the GPT layer
    specs' `LNImpl`, `TransformerBlock`'s `LayerNormImpl`); a name bound to Apex's fused norm
    is left alone. Idempotent; must run before the model is built."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    for module, name in ((backends, "WrappedTorchNorm"), (backends, "LNImpl"),
                         (gpt_layer_specs, "LNImpl"), (transformer_block, "LayerNormImpl")):
        if getattr(module, name, None) is WrappedTorchNorm:
            setattr(module, name, SequenceParallelTorchNorm)
