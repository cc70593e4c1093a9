"""Region charges: Megatron's unfused core attention charged as a whole from the profile.

Megatron's `DotProductAttention` (the local spec's core attention) issues baddbmm, scale,
mask fill, softmax (fp32 when `attention_softmax_in_fp32`), dropout and bmm, and their
backward: on a GPU most of its time is memory traffic over the s x s scores, which the
element-wise bandwidth of norms and SwiGLU does not describe. The profile times that
attention as one operator (`attention.fwd/bwd(...)`, fitted as `KernelTimeModel.attention`
"unfused"), so `attention_regions` charges each core-attention forward and backward that
operator's time for its shape to the innermost active `GpuEmulationMode` and absorbs the
kernels inside (`GpuEmulationMode.enter_region`); with no mode active the hooks do nothing:

- forward: from the module's forward pre-hook to its forward hook;
- backward: from its full backward pre-hook (the output's gradient is ready) to its full
  backward hook (the query's, key's and value's gradients are computed). On CPU autograd
  runs the core attention's backward nodes in one stretch: nothing else in the layer can
  run before the gradients of its inputs exist.

The hooks fire wherever the module is called: Megatron's own SelfAttention and dhelix's
attention operator (`megatron_patches.layer_regions.attention_core`) alike. A fused core
attention (`megatron_patches.sdpa_attention.SDPAttention`) gets no region: its SDPA kernel is
charged at the fused rate by `aten_costs.kernel_ms`. The profile's attention entry also
covers the QKV split and RoPE (`dhelix.ops.kernels.AttentionForward`), which run outside the
core attention and stay charged per kernel: the fit takes their traced bytes off the
profile's attention time (`kernel_model.fit_kernel_model(traced_bytes=...)`), so the region
and the kernels around it add up to the profile's entry.

The hooks stay registered while the context is open, across modes: a forward run under one
mode and its backward under another (the profile trace) charge each its own mode.

Also here: `fused_rms_norms`, RMSNorms with weights in their input's dtype run as CUDA's
fused kernels (charged once each way, and allocating and saving what those kernels do),
and `routing_regions`, MoE routers routing for real under the emulation.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from dhelix.gpu_emulation.kernel_model import CostKey, nominal_bytes
from dhelix.gpu_emulation.mode import GpuEmulationMode

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def active_mode() -> GpuEmulationMode | None:
    """The innermost `GpuEmulationMode` on this thread's dispatch-mode stack (torch's
    `_get_current_dispatch_mode_stack`), or None."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, GpuEmulationMode):
            return mode
    return None


def core_attention_kernel(mode: GpuEmulationMode, module) -> str:
    """The attention rate `module`'s core attention is charged at: "unfused" (the profile's
    own, fp32 softmax) when its config has `attention_softmax_in_fp32`, else
    "unfused.bf16-softmax" when the mode's model was fitted with a `CoreAttentionTrace`,
    else "unfused" (the region's term then says which was charged)."""
    if (not module.config.attention_softmax_in_fp32
            and ("unfused.bf16-softmax", "fwd") in mode.model.attention):
        return "unfused.bf16-softmax"
    return "unfused"


def core_attention_ms(mode: GpuEmulationMode, module, s: int, b: int, phase: str) -> float:
    """Modelled ms of one unfused core attention of `module` (a `DotProductAttention`: its
    heads per rank, head size, mask type and softmax dtype) over `s` tokens x `b` sequences
    in `phase` ("fwd" / "bwd"), at the profile's attention rate (`core_attention_kernel`)."""
    return mode.model.attention_ms(
        s, b, module.num_attention_heads_per_partition, module.hidden_size_per_attention_head,
        causal=module.attn_mask_type in _CAUSAL, phase=phase,
        kernel=core_attention_kernel(mode, module))


def _enter(module, s: int, b: int, phase: str) -> None:
    mode = active_mode()
    if mode is not None:
        mode.enter_region(f"attention.{core_attention_kernel(mode, module)}.{phase}",
                          core_attention_ms(mode, module, s, b, phase))


def _exit() -> None:
    mode = active_mode()
    if mode is not None and mode.in_region:
        mode.exit_region()


@contextmanager
def _region_hooks(model: torch.nn.Module, module_type, forward_pre, backward_pre):
    """Hooks on every `module_type` in `model`: `forward_pre(module, args, kwargs)` and
    `backward_pre(module, grad_output)` may open a region, the forward hook and the full
    backward hook close the open one (`_exit`). Removed on exit."""
    handles = []
    for module in model.modules():
        if isinstance(module, module_type):
            handles += [
                module.register_forward_pre_hook(forward_pre, with_kwargs=True),
                module.register_forward_hook(lambda *_: _exit()),
                module.register_full_backward_pre_hook(backward_pre),
                module.register_full_backward_hook(lambda *_: _exit()),
            ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def attention_regions(model: torch.nn.Module):
    """While open, every `DotProductAttention` in `model` charges its forward and backward
    as one region each (see the module docstring). Removes its hooks on exit (a backward
    whose forward ran inside the context still fires them: autograd keeps them)."""

    def forward_pre(module, args, kwargs):
        query = args[0] if args else kwargs["query"]  # [s, b, heads, d]
        _enter(module, query.shape[0], query.shape[1], "fwd")

    def backward_pre(module, grad_output):
        grad = grad_output[0]  # [s, b, heads x d]
        _enter(module, grad.shape[0], grad.shape[1], "bwd")

    with _region_hooks(model, DotProductAttention, forward_pre, backward_pre):
        yield


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def fused_norm_ms(mode: GpuEmulationMode, x: torch.Tensor, phase: str) -> float:
    """Modelled ms of one fused RMSNorm over `x` ([..., h]) in `phase`: its nominal bytes
    (`kernel_model.nominal_bytes`: input(s) read once, output written once) at the model's
    norm bandwidth."""
    h = x.shape[-1]
    key = CostKey("rms_norm", phase, {"s": x.numel() // h, "b": 1, "h": h},
                  _DTYPE_NAMES[x.dtype])
    return mode.model.memory_ms(nominal_bytes(key), "norm")


class _FusedRMSNorm(torch.autograd.Function):
    """An RMSNorm as CUDA's fused kernels run it (`torch.ops.aten._fused_rms_norm` and its
    backward), under a `GpuEmulationMode`: each direction is one kernel charged as a region
    (`fused_norm_ms`, terms "norm.fused.fwd/bwd"), and it allocates what those kernels
    allocate: forward the output and the fp32 rstd ([..., 1]), backward the input's and the
    weight's gradients; it saves the input, rstd and the weight for the backward. On CPU
    torch's RMSNorm is a decomposition (casts, pow, mean, rsqrt, muls) whose autograd saves
    fp32 copies of the input (at Llama-8B shapes 96 MiB a norm and micro-batch where the
    fused kernel keeps a 16 KiB rstd) and whose backward holds several more: memory a GPU
    run does not have. Outputs are empty (garbage, timing only) where the mode fakes the
    input (`GpuEmulationMode.fakes`), else computed for real by the same formula."""

    @staticmethod
    def forward(ctx, x, weight, dims, eps):
        mode = active_mode()  # `_rms_norm_forward` applies this only under a mode, no region
        mode.enter_region("norm.fused.fwd", fused_norm_ms(mode, x, "fwd"))
        try:
            if mode.fakes(x):
                y = torch.empty_like(x)
                rstd = torch.empty(_stats_shape(x, dims), dtype=torch.float32, device=x.device)
            else:
                xf = x.float()
                rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
                y = (xf * rstd).to(x.dtype) * weight
        finally:
            mode.exit_region()
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dims = ctx.dims
        mode = active_mode()
        charged = mode is not None and not mode.in_region  # (inside a region: its charge)
        if charged:
            mode.enter_region("norm.fused.bwd", fused_norm_ms(mode, grad, "bwd"))
        try:
            if mode is not None and mode.fakes(x, grad):
                grad_x, grad_w = torch.empty_like(x), torch.empty_like(weight)
            else:
                normed = x.float() * rstd
                grad_f = grad.float()
                batch = tuple(range(grad.dim() - len(dims)))
                grad_w = (grad_f * normed).sum(batch).to(weight.dtype)
                scaled = grad_f * weight.float()
                grad_x = (rstd * (scaled - normed * (scaled * normed).mean(dims, keepdim=True))
                          ).to(x.dtype)
        finally:
            if charged:
                mode.exit_region()
        return grad_x, grad_w, None, None


def _stats_shape(x: torch.Tensor, dims: tuple) -> tuple:
    return tuple(x.shape[:x.dim() - len(dims)]) + (1,) * len(dims)


@dataclass
class _NormPatch:
    """This process's `fused_rms_norms` contexts: how many are open, and the class's forward
    the first one replaced (torch's own: what `_rms_norm_forward` falls back to, restored
    when the last one closes)."""

    open: int = 0
    replaced: Callable | None = None


_NORM_PATCH = _NormPatch()


def _rms_norm_forward(module: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`torch.nn.RMSNorm.forward` while `fused_rms_norms` is open: `_FusedRMSNorm` under a
    `GpuEmulationMode` (outside any region) for a weight of the input's dtype, else the
    forward the patch replaced (torch's own)."""
    mode = active_mode()
    if (mode is None or mode.in_region or module.weight is None
            or module.weight.dtype != x.dtype):
        return _NORM_PATCH.replaced(module, x)
    dims = tuple(range(-len(module.normalized_shape), 0))
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return _FusedRMSNorm.apply(x, module.weight, dims, eps)


@contextmanager
def fused_rms_norms():
    """While open (re-entrant; process-wide), every `torch.nn.RMSNorm` whose weight has its
    input's dtype (Megatron-LM's `Float16Module` casts a `--bf16` model's norm weights to
    bf16), called under a `GpuEmulationMode`, runs as CUDA's fused kernels do: one kernel
    each way at the model's norm bandwidth (`fused_norm_ms`: its nominal bytes, terms
    "norm.fused.fwd/bwd") and their allocations (`_FusedRMSNorm`). Megatron's norms and
    dhelix's norm operators (which call the same modules) alike. A norm with an fp32 weight
    against a bf16 input (what the profile timed) takes torch's unfused path on CUDA too
    and runs unchanged, charged per aten kernel; so does any norm with no mode active."""
    if not _NORM_PATCH.open:
        _NORM_PATCH.replaced = torch.nn.RMSNorm.forward
        torch.nn.RMSNorm.forward = _rms_norm_forward
    _NORM_PATCH.open += 1
    try:
        yield
    finally:
        _NORM_PATCH.open -= 1
        if not _NORM_PATCH.open:
            torch.nn.RMSNorm.forward, _NORM_PATCH.replaced = _NORM_PATCH.replaced, None


@contextmanager
def routing_regions():
    """While open, every MoE router (megatron-core's `TopKRouter`, any model) called under
    a `GpuEmulationMode` routes for real: its forward runs between the mode's
    `enter_real()` and `exit_real()` (every kernel but the gating GEMM computed, all
    charged as usual) with Megatron's benchmarking option `moe_router_force_load_balancing`
    on for the call, so the logits are random (`moe_utils.apply_random_logits`: balanced
    routing in expectation) instead of the garbage a faked gating GEMM leaves. The
    dispatcher's split sizes, read on the host, then come from real token counts (index
    data runs for real, `GpuEmulationMode`). Timing only, as all of the emulation: every
    system routes this way under it. Global module hooks (a router built inside the
    context is covered too), removed on exit; with no mode active a router runs as without
    the context."""
    from megatron.core.transformer.moe.router import TopKRouter
    from torch.nn.modules.module import (register_module_forward_hook,
                                         register_module_forward_pre_hook)

    entered = []

    def forward_pre(module, args):
        mode = active_mode() if isinstance(module, TopKRouter) else None
        if mode is None:
            return
        config = module.config
        entered.append((mode, config, config.moe_router_force_load_balancing))
        config.moe_router_force_load_balancing = True
        mode.enter_real()

    def forward_post(module, args, output):
        if entered and isinstance(module, TopKRouter) and entered[-1][1] is module.config:
            mode, config, saved = entered.pop()
            config.moe_router_force_load_balancing = saved
            mode.exit_real()

    handles = [register_module_forward_pre_hook(forward_pre),
               register_module_forward_hook(forward_post, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
