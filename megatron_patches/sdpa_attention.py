"""Core attention backed by `torch.nn.functional.scaled_dot_product_attention`, as a
megatron-core module for the local (torch-native) layer spec.

Megatron's local spec uses `DotProductAttention`: an unfused baddbmm, masked fp32 softmax
and bmm that materialises the `[b, heads, s, s]` score matrix. `SDPAttention` has the same
constructor and forward signature and computes the same function with torch's fused
kernels (flash / cuDNN / memory-efficient on CUDA, the math kernel on CPU), causal, with
grouped-query attention through `enable_gqa` (no repeated K/V).

`sdpa_layer_spec(spec)` returns a copy of a local-spec `TransformerLayer` spec whose
`core_attention` is `SDPAttention` (`layer_spec_for` also takes the block spec of an MoE
model, dense and MoE layers alike); stock Megatron builds it like any other spec, which makes
stock-with-SDPA the like-for-like baseline of `--dhelix --dhelix-attention sdpa`.

Mask convention (as Transformer Engine's attention with a causal mask type): the layer's
`attn_mask_type` must be causal and the causal mask is applied by the kernel
(`is_causal=True`); the `attention_mask` tensor Megatron passes along is not read. Runs with
masks that are not plain causal (`--reset-attention-mask`) are refused where the argument is
parsed (`check_attention_args`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from torch.nn.attention import SDPBackend, sdpa_kernel

from dhelix.devices import gpu_emulated
from dhelix.options import ATTENTION_CHOICES



class SDPAttentionError(ValueError):
    """A setting SDPAttention does not implement (the message names it and the way out)."""


class SDPAttention(MegatronModule):
    """Causal self-attention core `softmax(q k^T * scale) v` by torch's SDPA.

    Inputs as Megatron's `DotProductAttention`: query `[sq, b, np, hn]`, key and value
    `[sk, b, ng, hn]` (this rank's heads and query groups); output `[sq, b, np * hn]`, a new
    contiguous tensor on the inputs' device and dtype. Holds no parameters and no state.
    Attention dropout is applied inside the kernel in training mode, drawn from the
    model-parallel RNG tracker when sequence parallelism is off (as Megatron's module does).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,  # noqa: ARG002 - DotProductAttention's signature
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise SDPAttentionError("SDPA core attention does not support context parallelism; "
                                    "use --context-parallel-size 1")
        if attn_mask_type != AttnMaskType.causal:
            raise SDPAttentionError(f"SDPA core attention implements causal masks only, the "
                                    f"layer asks for {attn_mask_type.name}")
        if config.softmax_type != "vanilla":
            raise SDPAttentionError(f"SDPA core attention implements the vanilla softmax, "
                                    f"not softmax_type {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise SDPAttentionError("SDPA core attention does not implement sliding-window "
                                    "attention; drop --window-size")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads,
                                                tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # Megatron divides by layer_number under apply_query_key_layer_scaling and multiplies
        # the scores back inside its fp32 softmax: the effective scale is this one.
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """`[sq, b, np * hn]` context; `attention_mask` is not read (causal by the kernel)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise SDPAttentionError("SDPA core attention takes neither packed sequences nor "
                                    "an attention bias")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise SDPAttentionError(f"SDPA core attention implements causal masks only, got "
                                    f"{attn_mask_type.name}")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, hn] -> [b, n, s, hn] (views; the kernels accept these strides)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, dropout_p, gqa)
        else:
            context = self._sdpa(q, k, v, dropout_p, gqa)
        # [b, n, sq, hn] -> [sq, b, n * hn]
        return context.permute(2, 0, 1, 3).contiguous().view(sq, b,
                                                              self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, dropout_p: float, gqa: bool):
        """torch picks the fused kernel on CUDA; on CPU the math kernel (torch's reference
        composition, rather than its CPU flash kernel), except under dhelix's GPU emulation
        (timing only, the CPU standing in for a GPU: `dhelix.devices.gpu_emulated`), where
        torch's pick (its CPU flash kernel) is what gets charged the fused kernel's time
        and memory, as on the GPU, not the math kernel's materialised probabilities."""
        cpu = q.device.type == "cpu" and not gpu_emulated()
        with sdpa_kernel(SDPBackend.MATH) if cpu else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale,
                enable_gqa=gqa)


def _core_attention_class(core_attention):
    return core_attention.module if isinstance(core_attention, ModuleSpec) else core_attention


def sdpa_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of the local-spec layer `spec` with `SDPAttention` as core attention (the
    argument is not modified). Raises SDPAttentionError for a spec whose core attention is
    not megatron-core's `DotProductAttention` (Transformer Engine, MLA, block specs)."""
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    core = getattr(getattr(attention, "submodules", None), "core_attention", None)
    if core is None or _core_attention_class(core) is not DotProductAttention:
        found = getattr(_core_attention_class(core), "__name__", type(spec).__name__)
        raise SDPAttentionError(
            "--dhelix-attention sdpa replaces DotProductAttention of megatron-core's local "
            f"layer spec; this model's layer spec has {found} (use the local spec: "
            "--transformer-impl local, no --spec)")
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules,
                                                  core_attention=SDPAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=attention))


def layer_spec_for(spec, attention: str):
    """`spec` for `--dhelix-attention attention`: unchanged for megatron; for sdpa the SDPA
    copy of a layer spec, or of a block spec (`TransformerBlockSubmodules`, what Megatron
    builds for MoE models: every layer spec of it replaced, its final norm kept)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if attention not in ATTENTION_CHOICES:
        raise SDPAttentionError(f"--dhelix-attention {attention!r} is not one of "
                                f"{', '.join(ATTENTION_CHOICES)}")
    if attention != "sdpa":
        return spec
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(
            spec, layer_specs=[sdpa_layer_spec(layer) for layer in spec.layer_specs])
    return sdpa_layer_spec(spec)


def check_attention_args(args) -> None:
    """Raise SDPAttentionError when Megatron-style `args` ask for SDPA core attention with a
    setting it cannot honour (a mask that is not plain causal, a user layer spec)."""
    if getattr(args, "dhelix_attention", "megatron") != "sdpa":
        return
    if getattr(args, "reset_attention_mask", False):
        raise SDPAttentionError("--dhelix-attention sdpa applies a plain causal mask; drop "
                                "--reset-attention-mask (per-document masks)")
    if getattr(args, "spec", None):
        raise SDPAttentionError("--dhelix-attention sdpa swaps the core attention of the "
                                "default local layer spec; drop --spec")
