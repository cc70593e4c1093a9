"""Torch-native LayerNorm/RMSNorm that is correct under sequence parallelism.

Replaces: `megatron.core.transformer.torch_norm.WrappedTorchNorm`, which asserts
`not config.sequence_parallel`. Simply building it with SP off is a trap: with SP on, each
TP rank sees a different slice of the sequence, so the norm's weight/bias gradients are
partial sums that Megatron all-reduces over the TP group only for parameters tagged
`sequence_parallel=True` (`finalize_model_grads`). Untagged, training runs but the norm
gradients are wrong (~4e-3 off on the tiny preset). This class builds the same torch module
and tags its parameters when SP is on; `tests/test_norms_sequence_parallel.py` keeps the
trap covered.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """Factory with WrappedTorchNorm's signature; returns a torch.nn.LayerNorm/RMSNorm."""

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
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

