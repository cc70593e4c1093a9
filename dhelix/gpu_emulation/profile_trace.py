"""The bytes each profiled operator really moves, as the emulation will charge them.

A profile times whole operators (`dhelix.ops.kernels`: a norm, the SwiGLU activation, a
bias-dropout-add, each forward and backward); under `GpuEmulationMode` the same Megatron
code reaches the dispatcher as several aten kernels (on CPU torch's RMSNorm is pow, mean,
rsqrt, mul and casts; the activation is a chunk, silu and mul), each charged its tensors'
bytes at the fitted bandwidth. For the emulated step to give back the profile's time, the
bandwidth must be fitted at those bytes, not at the operator's nominal bytes:
`trace_operator_bytes` runs every operator of a bound layer's forward and backward programs
(in program order, exactly as the profiler's solo pass does, `profiler.timing.solo_pass`)
each under its own `GpuEmulationMode` and returns the bytes of its memory-bound kernels
(`TermTotal.nbytes`), per cost key and operator instance; `kernel_model.fit_kernel_model(
profile, traced_bytes=...)` fits at them.

`trace_core_attention` runs Megatron's core attention alone, without its region, and
returns what the kernel model needs to charge it with another softmax dtype than the
profile's (`kernel_model.CoreAttentionTrace`).

The operators run faked (timing only): nothing is computed, so the trace runs at the
profile's full shapes in seconds and a few MB.
"""

from __future__ import annotations

import torch

from dhelix.devices import model_device
from dhelix.gpu_emulation.kernel_model import KernelTimeModel
from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
from dhelix.gpu_emulation.regions import attention_regions

# kernels are charged, never waited for (the trace needs their bytes, not their time)
_NO_WAIT = EmulationConfig(time_scale=1e-9)


def _memory_bytes(mode: GpuEmulationMode) -> float:
    return sum(t.nbytes for term, t in mode.report().by_term.items()
               if term.startswith("memory."))


def trace_operator_bytes(bound, x, dy, rotary, model: KernelTimeModel) -> dict:
    """{cost key: (bytes of each instance, in program order)} for every computation
    operator of `bound`'s (a `dhelix.ops.runner.BoundLayer`) forward and backward programs,
    run once with layer input `x`, output gradient `dy` and RoPE table `rotary` (tensors on
    the layer's device; none is read: every operator runs under the mode). The core
    attention runs as a region (`regions.attention_regions`): an attention operator's bytes
    are those of its kernels outside it (QKV split, RoPE). The layer's collectives, if any,
    run for real: call it on every rank of the layer's groups."""
    with attention_regions(bound.layer):
        return _trace(bound, x, dy, rotary, model)


def _trace(bound, x, dy, rotary, model: KernelTimeModel) -> dict:
    traced: dict = {}
    execution = bound.new_execution()
    programs = bound.programs

    def run(op):
        with GpuEmulationMode(model, _NO_WAIT) as mode:
            execution.run(op.id)
            execution.wait_pending()
        if op.kind == "comp":
            traced.setdefault(op.cost_key, []).append(_memory_bytes(mode))

    with GpuEmulationMode(model, _NO_WAIT):
        execution.begin_forward(x, None, rotary)
    for op in programs.forward.ops:
        run(op)
    with GpuEmulationMode(model, _NO_WAIT):
        execution.end_forward()
        execution.begin_backward(dy)
    for op in programs.backward.ops:
        run(op)
    with GpuEmulationMode(model, _NO_WAIT):
        execution.end_backward()
    return {key: tuple(values) for key, values in traced.items()}


def trace_core_attention(core, s: int, b: int, model: KernelTimeModel) -> dict:
    """{"fwd" / "bwd": (modelled ms of its batched GEMMs, bytes of its memory-bound
    kernels)} of one forward and one backward of `core` (a megatron-core
    `DotProductAttention`, causal) over `s` tokens x `b` sequences, each under its own
    `GpuEmulationMode` with no region, on CPU (inputs and gradients are never read)."""
    from megatron.core.transformer.enums import AttnMaskType

    heads, groups = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    d, dtype = core.hidden_size_per_attention_head, core.config.params_dtype
    device = model_device(core)
    q = torch.empty(s, b, heads, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.empty(s, b, groups, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    with GpuEmulationMode(model, _NO_WAIT) as forward:
        out = core(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    with GpuEmulationMode(model, _NO_WAIT) as backward:
        out.backward(torch.empty_like(out))
    traced = {}
    for phase, mode in (("fwd", forward), ("bwd", backward)):
        terms = mode.report().by_term
        traced[phase] = (terms["gemm.batched"].modelled_ms if "gemm.batched" in terms else 0.0,
                         _memory_bytes(mode))
    return traced
