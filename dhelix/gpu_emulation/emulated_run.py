"""Running a benchmark's steps as if on GPUs: the settings one job shares and the context
each model-running call enters.

`GpuEmulation` is what every rank of an emulated-GPU benchmark gets (JSON-able, in the
launch's spec): the profile file, its layer's trace (`profile_fit.trace_profile_layer`,
taken once by the launcher), the time scale S and the overlap slowdown. `emulated_call(
chunks, model, config)` opens, for one call (a training step, a forward/backward), the
regions of every model chunk (`regions.attention_regions`, `regions.fused_norm_regions`) and
a fresh `GpuEmulationMode`, and yields the mode (its `report()` is that call's modelled
kernel time). The link the collectives cross must be slowed by the same S
(`emulated_link_rate`) so computation and communication keep the GPU cluster's ratio.
TIMING ONLY: every compute kernel is faked (`mode` module docstring).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from dhelix.gpu_emulation.kernel_model import KernelTimeModel
from dhelix.gpu_emulation.mode import H100_OVERLAP_SLOWDOWN, EmulationConfig, GpuEmulationMode


@dataclass(frozen=True)
class GpuEmulation:
    """`profile`: path of the `dhelix profile --comp-only` file the kernel times come from;
    `trace`: `profile_fit.trace_profile_layer`'s result for it; `time_scale` S (> 0);
    `overlap_slowdown` (the mode's)."""

    profile: str
    trace: dict
    time_scale: float
    overlap_slowdown: float = H100_OVERLAP_SLOWDOWN

    def __post_init__(self):
        EmulationConfig(time_scale=self.time_scale, overlap_slowdown=self.overlap_slowdown)

    def config(self) -> EmulationConfig:
        return EmulationConfig(time_scale=self.time_scale,
                               overlap_slowdown=self.overlap_slowdown)

    def kernel_model(self) -> KernelTimeModel:
        """The fitted model (`profile_fit.fit_emulation_model`; pure, milliseconds)."""
        from dhelix.gpu_emulation.profile_fit import fit_emulation_model
        from profiler.profile_file import load_profile

        return fit_emulation_model(load_profile(self.profile), self.trace)


def emulated_link_rate(bits_per_s: int, time_scale: float) -> int:
    """The emulated link's rate for a GPU cluster link of `bits_per_s` at time scale S:
    every kernel takes S x its time, so the link carries 1/S of the rate."""
    if not time_scale > 0:
        raise ValueError(f"error: time_scale must be > 0, got {time_scale}")
    return max(1, round(bits_per_s / time_scale))


@contextmanager
def emulated_call(chunks, model: KernelTimeModel, config: EmulationConfig):
    """Open the core-attention and fused-norm regions of every module in `chunks` (a model
    chunk or a list of them) and a new `GpuEmulationMode(model, config)`; yields the mode.
    Leaving drains the emulated stream (the host waits for the last kernel)."""
    from dhelix.gpu_emulation.regions import attention_regions, fused_norm_regions

    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    mode = GpuEmulationMode(model, config)
    with ExitStack() as stack:
        for chunk in chunks:
            stack.enter_context(attention_regions(chunk))
            stack.enter_context(fused_norm_regions(chunk))
        with mode:
            yield mode
