"""Run parts of a megatron-core TransformerLayer's own forward code between its GEMMs.

The operator programs do the linear layers (GEMMs and their tensor-parallel collectives)
themselves, and reuse Megatron's code for everything between them, so every variant the
module supports (RoPE flavours, GQA layout, qk-layernorm, softmax variants, GLU clamps,
fused bias-activation kernels, ...) behaves exactly as in Megatron:

- `attention_core(self_attention, mixed_qkv, ...)` runs `SelfAttention.forward` with
  `linear_qkv` and `linear_proj` bypassed: the QKV GEMM output goes in, the core-attention
  output (the input of the output projection) comes out. Inside: the QKV split, RoPE, and
  `core_attention`.
- `mlp_activation(mlp, take_fc1_output)` runs `MLP.forward` with `linear_fc1`/`linear_fc2`
  bypassed: FC1's GEMM output goes in, the activation output (FC2's input) comes out, with
  FC1's bias added exactly where Megatron adds it (`skip_bias_add=True`).
  `expert_activation` does the same for an MoE expert (probabilities applied), and
  `expert_fc2_bias` is the expert's tail after FC2 (its bias scaled by the probabilities).

A bypass stands in for a linear module for the duration of one call and returns what that
module would have returned had its GEMM produced the given tensor: `(tensor, bias if the
module skips its bias add else None)`. The original module is restored before returning,
also on error. Each linear module gets one bypass, built at its first call and reused
(`bypass_of`): it holds the module's bias parameter (the module's own), and between calls
no tensor and no callable.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


class _LinearBypass(torch.nn.Module):
    """Stands in for a ColumnParallelLinear/RowParallelLinear whose GEMM already ran.

    Returns its input as the GEMM output, or - while `take` is set - the tensor `take()`
    hands over, ignoring the input: then the caller's frames never hold the GEMM output, and
    it is freed as soon as Megatron's code stops using it, exactly as the real linear's
    output would be.
    """

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        # Plain attributes (object.__setattr__): the bypass must not register the
        # original's parameters as its own.
        object.__setattr__(self, "_bias", original.bias if original.skip_bias_add else None)
        object.__setattr__(self, "_take", None)

    def forward(self, gemm_output, *args, **kwargs):  # noqa: ARG002 - linear signature
        if self._take is not None:
            gemm_output = self._take()
        return gemm_output, self._bias


def bypass_of(original: torch.nn.Module) -> _LinearBypass:
    """The linear module `original`'s bypass, built once (kept in the module's `__dict__`,
    outside its submodules and parameters, so it changes nothing torch or Megatron sees)."""
    bypass = original.__dict__.get("_dhelix_bypass")
    if bypass is None:
        bypass = _LinearBypass(original)
        object.__setattr__(original, "_dhelix_bypass", bypass)
    return bypass


@contextlib.contextmanager
def _bypassed(module: torch.nn.Module, **takes) -> Iterator[None]:
    """Replace the named linear submodules by their bypasses (`name=None` or
    `name=take`)."""
    originals = {name: getattr(module, name) for name in takes}
    try:
        for name, original in originals.items():
            bypass = bypass_of(original)
            object.__setattr__(bypass, "_take", takes[name])
            setattr(module, name, bypass)
        yield
    finally:
        for name, original in originals.items():
            object.__setattr__(bypass_of(original), "_take", None)
            setattr(module, name, original)


def attention_core(self_attention, mixed_qkv, attention_mask=None, rotary_pos_emb=None):
    """Megatron's SelfAttention forward from the QKV GEMM output (bias included) to the
    core-attention output `[s, b, heads_per_rank * kv_channels]`."""
    with _bypassed(self_attention, linear_qkv=None, linear_proj=None):
        output, _ = self_attention(mixed_qkv, attention_mask=attention_mask,
                                   rotary_pos_emb=rotary_pos_emb)
    return output


def mlp_activation(mlp, take_fc1_output: Callable[[], torch.Tensor]):
    """Megatron's MLP forward from FC1's GEMM output (bias not yet added) to the activation
    output `[s, b, ffn_hidden_size / tp]`. `take_fc1_output()` hands the FC1 output over
    (the caller keeps no reference), so it is freed right after the bias add, as in
    Megatron; `MLP.forward` itself receives None for its input. Also an MoE layer's
    `SharedExpertMLP` (without its gate), whose forward returns the output alone."""
    with _bypassed(mlp, linear_fc1=take_fc1_output, linear_fc2=None):
        result = mlp(None)
    return result[0] if isinstance(result, tuple) else result


def expert_activation(mlp, take_fc1_output: Callable[[], torch.Tensor],
                      per_token_scale: torch.Tensor):
    """An MoE expert's `MLP.forward` from its FC1 GEMM output to the FC2 input: FC1's bias,
    the (gated) activation and the routing probabilities (`per_token_scale`) applied, as
    Megatron applies them. FC2's bias is not added here (Megatron adds it after FC2,
    scaled by the probabilities: `expert_fc2_bias`)."""
    fc2 = bypass_of(mlp.linear_fc2)
    bias = fc2._bias
    object.__setattr__(fc2, "_bias", None)  # MLP.forward must not add FC2's bias here
    try:
        with _bypassed(mlp, linear_fc1=take_fc1_output, linear_fc2=None):
            output, _ = mlp(None, per_token_scale)
    finally:
        object.__setattr__(fc2, "_bias", bias)
    return output


def expert_fc2_bias(mlp, fc2_output: torch.Tensor, per_token_scale: torch.Tensor):
    """The end of an MoE expert's `MLP.forward` after FC2: its skipped bias, scaled by the
    routing probabilities, added to the FC2 output (`output += bias * scale`; out of place,
    the same sums); the FC2 output itself without a bias."""
    bias = mlp.linear_fc2.bias if mlp.linear_fc2.skip_bias_add else None
    if bias is None:
        return fc2_output
    return fc2_output + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)


def run_forward_pre_hooks(module: torch.nn.Module, args: tuple) -> None:
    """Fire `module`'s forward pre-hooks as calling it would (Megatron DDP registers them
    with overlap_param_gather to wait for the parameter all-gather). Hooks that replace the
    module's inputs are not supported and raise."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, {})
        else:
            result = hook(module, args)
        if result is not None:
            raise RuntimeError(
                f"forward pre-hook {hook} of {type(module).__name__} replaces the module's "
                "inputs, which dhelix operator programs do not support"
            )


def uses_transformer_engine(module: torch.nn.Module) -> bool:
    """True when `module` comes from Transformer Engine (megatron.core.extensions.*)."""
    return "transformer_engine" in type(module).__module__ or type(module).__name__.startswith("TE")
