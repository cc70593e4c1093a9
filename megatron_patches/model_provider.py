"""Builds megatron-core GPTModel chunks from dhelix's Megatron-style arguments.

Layer spec: Transformer Engine's where TE imports (GPU), otherwise megatron-core's local
(torch-native) spec with `SequenceParallelTorchNorm` for every norm, so sequence parallelism
trains with correct norm gradients on CPU, and with `--dhelix-attention sdpa` the SDPA core
attention (`megatron_patches.sdpa_attention`).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_patches.compat import has_transformer_engine
from megatron_patches.norms import SequenceParallelTorchNorm
from megatron_patches.sdpa_attention import SDPAttentionError, layer_spec_for


def transformer_config_from_args(args) -> TransformerConfig:
    """TransformerConfig for the model arguments of `dhelix.arguments` (Megatron names)."""
    use_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=use_cpu,
        # Fused kernels need CUDA (or TE/apex); the unfused paths are the torch reference.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # The CPU schedules must not call torch.cuda.synchronize between P2P batches.
        batch_p2p_sync=not use_cpu,
        deterministic_mode=use_cpu,
    )
    return TransformerConfig(**kwargs)


def uses_transformer_engine(args) -> bool:
    """TE's layer spec on a CUDA machine with TE installed, except with `--dhelix`: the
    operator programs run megatron-core's local (torch-native) spec, on GPU as on CPU."""
    return (has_transformer_engine() and torch.cuda.is_available()
            and not getattr(args, "dhelix", False))


def layer_spec(config: TransformerConfig, args) -> ModuleSpec:
    """The transformer-layer spec used for every layer of the model."""
    if uses_transformer_engine(args):
        if getattr(args, "dhelix_attention", "megatron") != "megatron":
            raise SDPAttentionError("--dhelix-attention sdpa replaces the local spec's core "
                                    "attention; Transformer Engine's spec has its own")
        return get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=False, normalization=args.normalization
        )
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return layer_spec_for(spec, getattr(args, "dhelix_attention", "megatron"))


def final_norm_spec(args):
    """The norm class after the last transformer layer (TE's when `uses_transformer_engine`,
    else the SP-safe torch norm)."""
    if uses_transformer_engine(args):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return SequenceParallelTorchNorm


def block_spec(config: TransformerConfig, args) -> TransformerBlockSubmodules:
    """Block spec for this pipeline stage: the layer spec for each local layer, final norm."""
    spec = layer_spec(config, args)
    num_local_layers = get_num_layers_to_build(config, vp_stage=None)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_local_layers,
                                      layer_norm=final_norm_spec(args))


def build_gpt_model(config: TransformerConfig, args, pre_process: bool, post_process: bool,
                    vp_stage=None) -> GPTModel:
    """One GPTModel chunk for this pipeline stage, on the current device (CPU on CPU)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(args):
    """Model chunks for this rank (one chunk; virtual pipelining is not supported yet)."""
    config = transformer_config_from_args(args)
    pre = parallel_state.is_pipeline_first_stage()
    post = parallel_state.is_pipeline_last_stage()
    return config, [build_gpt_model(config, args, pre_process=pre, post_process=post)]
