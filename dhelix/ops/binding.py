"""Binding of operator programs to a live megatron-core TransformerLayer.

`LayerBinding` checks that a layer is one the programs implement (GPT/Llama layer of
the local spec: torch norms, ColumnParallelLinear/RowParallelLinear, DotProductAttention or
`--dhelix-attention sdpa`'s SDPAttention; a dense MLP, or megatron-core's MoELayer with the
alltoall dispatcher, `megatron_patches.moe_regions.check_supported_moe_layer`) and resolves the module paths named by operators
to that layer's own modules. Nothing is
copied: the kernels use the layer's parameter objects, so checkpoints and the optimizer see
the same tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dhelix.ops.describe import LayerDescription, UnsupportedLayerError
from dhelix.topology import NodeTopology
from megatron_patches.layer_regions import uses_transformer_engine
from megatron_patches.moe_regions import check_supported_moe_layer, is_moe_layer

TE_UNSUPPORTED = (
    "the Transformer Engine layer spec is not supported by dhelix operator programs yet "
    "(its fused LayerNorm+linear and TE attention hide the GEMM/communication boundaries the "
    "programs need); build the model with megatron-core's local spec "
    "(--transformer-impl local)"
)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UnsupportedLayerError(message)


def check_supported_layer(layer) -> None:
    """Raise UnsupportedLayerError unless `layer` is a local-spec TransformerLayer whose MLP
    the programs implement (dense, or a supported MoELayer)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_patches.sdpa_attention import SDPAttention

    _require(isinstance(layer, TransformerLayer),
             f"expected a megatron-core TransformerLayer, got {type(layer).__name__}")
    for module in layer.modules():
        if uses_transformer_engine(module):
            raise UnsupportedLayerError(f"{TE_UNSUPPORTED} (found {type(module).__name__})")
    moe = is_moe_layer(layer)
    if moe:
        problems = check_supported_moe_layer(layer)
        _require(not problems, "MoE layer not supported by the operator programs: "
                 + "; ".join(problems))
    attn = layer.self_attention
    _require(isinstance(attn, SelfAttention),
             f"self_attention must be SelfAttention, got {type(attn).__name__}")
    _require(isinstance(attn.linear_qkv, ColumnParallelLinear),
             f"linear_qkv must be ColumnParallelLinear, got {type(attn.linear_qkv).__name__}")
    _require(isinstance(attn.linear_proj, RowParallelLinear),
             f"linear_proj must be RowParallelLinear, got {type(attn.linear_proj).__name__}")
    _require(isinstance(attn.core_attention, (DotProductAttention, SDPAttention)),
             f"core_attention must be DotProductAttention or SDPAttention, got "
             f"{type(attn.core_attention).__name__}")
    _require(isinstance(layer.cross_attention, IdentityOp)
             and isinstance(layer.pre_cross_attn_layernorm, IdentityOp),
             "cross-attention layers are not supported")
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        _require(not isinstance(getattr(layer, name), IdentityOp),
                 f"{name} is an IdentityOp (a norm fused into the next linear, as in the "
                 "Transformer Engine spec); the programs need the norm as its own module")
    for name, linear in (("linear_qkv", attn.linear_qkv), ("linear_proj", attn.linear_proj)):
        _require(linear.sequence_parallel == layer.config.sequence_parallel,
                 f"{name}.sequence_parallel differs from the layer config")
    _require(not attn.linear_qkv.skip_bias_add and not attn.linear_qkv.gather_output,
             "linear_qkv must add its own bias and keep its output sharded")
    _require(attn.linear_proj.skip_bias_add and attn.linear_proj.input_is_parallel
             and not attn.linear_proj.explicit_expert_comm,
             "linear_proj must skip its bias add and take a parallel input")
    if moe:
        return
    mlp = layer.mlp
    _require(isinstance(mlp, MLP), f"mlp must be a dense MLP, got {type(mlp).__name__}")
    _require(isinstance(mlp.linear_fc1, ColumnParallelLinear)
             and isinstance(mlp.linear_fc2, RowParallelLinear),
             "MLP linears must be ColumnParallelLinear (fc1) and RowParallelLinear (fc2)")
    # The layouts the GEMM kernels reproduce (Megatron builds exactly these).
    _require(mlp.linear_fc1.skip_bias_add and not mlp.linear_fc1.gather_output,
             "linear_fc1 must skip its bias add and keep its output sharded")
    _require(mlp.linear_fc2.skip_bias_add and mlp.linear_fc2.input_is_parallel
             and not mlp.linear_fc2.explicit_expert_comm,
             "linear_fc2 must skip its bias add and take a parallel input")
    for name, linear in (("linear_fc1", mlp.linear_fc1), ("linear_fc2", mlp.linear_fc2)):
        _require(linear.sequence_parallel == layer.config.sequence_parallel,
                 f"{name}.sequence_parallel differs from the layer config")


class LayerBinding:
    """A checked TransformerLayer plus what the kernels need from it.

    `module(path)` returns the layer's own submodule at a dotted path, `own_params(path,
    exclude)` its parameters outside some children; `tp_group` is the layer's
    tensor-parallel process group. The binding holds a reference to the layer and caches of
    the layer's own submodules and parameter lists (looked up once: a bound layer's module
    tree and parameter objects do not change), nothing else (no tensors of its own).
    """

    def __init__(self, layer):
        check_supported_layer(layer)
        self.layer = layer
        self.config = layer.config
        self.tp_group = layer.pg_collection.tp
        self._modules: dict[str, torch.nn.Module] = {}
        self._params: dict[tuple, tuple] = {}

    @property
    def attention(self) -> str:
        """The layer's core attention as `--dhelix-attention` names it."""
        from megatron_patches.sdpa_attention import SDPAttention

        core = self.layer.self_attention.core_attention
        return "sdpa" if isinstance(core, SDPAttention) else "megatron"

    def module(self, path: str) -> torch.nn.Module:
        found = self._modules.get(path)
        if found is None:
            found = self.layer.get_submodule(path) if path else self.layer
            self._modules[path] = found
        return found

    def own_params(self, path: str, exclude: tuple = ()) -> tuple:
        """The parameters of the submodule at `path` (in `parameters()` order) that do not
        belong to its child modules named in `exclude`."""
        key = (path, exclude)
        found = self._params.get(key)
        if found is None:
            module = self.module(path)
            skip = {id(p) for name in exclude for p in getattr(module, name).parameters()}
            found = self._params[key] = tuple(p for p in module.parameters()
                                              if id(p) not in skip)
        return found

    def group(self, role: str):
        """The layer's process group for `role`: 'tp', or 'ep' (an MoE layer's
        expert-parallel group)."""
        if role == "tp":
            return self.tp_group
        if role == "ep" and is_moe_layer(self.layer):
            return self.layer.mlp.ep_group
        raise KeyError(f"unknown process-group role {role!r}")

    def describe(self, seq_length: int, micro_batch_size: int, *, rope: bool,
                 topology: Optional[NodeTopology] = None) -> LayerDescription:
        """The layer's description for this rank (its real TP group ranks), checked against
        the actual parameter shapes."""
        ranks = dist.get_process_group_ranks(self.tp_group) if dist.is_initialized() else [0]
        moe = is_moe_layer(self.layer)
        ep_ranks = None
        if moe:
            group = self.group("ep")
            ep_ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else [0]
        desc = LayerDescription.from_config(
            self.config, seq_length, micro_batch_size, rope=rope, tp_ranks=ranks,
            topology=topology, attention=self.attention, moe=moe, ep_ranks=ep_ranks,
        )
        self._check_shapes(desc)
        return desc

    def _check_shapes(self, desc: LayerDescription) -> None:
        expected = {
            "self_attention.linear_qkv": (desc.qkv_out_per_rank, desc.hidden_size),
            "self_attention.linear_proj": (desc.hidden_size, desc.proj_in_per_rank),
        }
        moe = desc.moe
        if moe is None:
            expected["mlp.linear_fc1"] = (desc.fc1_out_per_rank, desc.hidden_size)
            expected["mlp.linear_fc2"] = (desc.hidden_size, desc.ffn_per_rank)
        else:
            expected["mlp.router"] = (moe.num_experts, desc.hidden_size)
            fc1 = moe.ffn_hidden_size * (2 if desc.gated_linear_unit else 1)
            for i in range(moe.num_local_experts):
                expected[f"mlp.experts.local_experts.{i}.linear_fc1"] = (fc1, desc.hidden_size)
                expected[f"mlp.experts.local_experts.{i}.linear_fc2"] = (desc.hidden_size,
                                                                        moe.ffn_hidden_size)
        for path, shape in expected.items():
            actual = tuple(self.module(path).weight.shape)
            if actual != shape:
                raise UnsupportedLayerError(
                    f"{path}.weight has shape {actual}, but the layer description expects "
                    f"{shape} ({desc.summary()})"
                )
