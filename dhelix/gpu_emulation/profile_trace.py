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

The operators run faked (timing only): nothing is computed, so the trace runs at the
profile's full shapes in seconds and a few MB.
"""

from __future__ import annotations

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
