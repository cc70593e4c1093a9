"""Running a benchmark's steps as if on GPUs: the settings one job shares and the context
each model-running call enters.

`GpuEmulation` is what every rank of an emulated-GPU benchmark gets (JSON-able, in the
launch's spec): the profile file, its layer's trace (`profile_fit.trace_profile_layer`,
taken once by the launcher), the time scale S and the overlap slowdown. `emulated_call(
chunks, model, config)` opens, for one call (a training step, a forward/backward), the
regions of every model chunk (`regions.attention_regions`), the fused RMSNorms
(`regions.fused_rms_norms`) and a fresh `GpuEmulationMode`, and yields the mode (its
`report()` is that call's modelled kernel time). The link the collectives cross must be
slowed by the same S (`emulated_link_rate`) so computation and communication keep the GPU
cluster's ratio.
`trace_profile(path)` takes the trace (a 1-rank process of its own); `GpuEmulation.building`
is the mode to build a model under (nothing computed, nothing touched); `EmulatedCalls`
runs one call at a time under `emulated_call` and drains the current call's stream on
demand (what a timer needs: `dhelix profile --gpu-emulation`, `profiler.timing.Timer`).
TIMING ONLY: every compute kernel is faked (`mode` module docstring).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from dhelix.cluster.host_threads import MAIN_THREAD_NAME, name_current_thread
from dhelix.gpu_emulation.collective_clock import CollectiveDurations
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

    @contextmanager
    def building(self, model: KernelTimeModel | None = None):
        """A mode that charges nothing worth waiting for (S = 1e-9, kernels of `model`,
        default `kernel_model()`), yielded: a model built under it initialises its weights,
        optimizer state and gradient buffers without computing or touching anything, so
        Llama-8B layer shapes cost virtual memory only (the weights are garbage; timing
        only). MoE routers run under it route for real (`regions.routing_regions`: the
        set-up's memory measurement runs the layer), and RMSNorms allocate as the steps'
        do (`regions.fused_rms_norms`: the memory the set-up measures for the plan's bound
        is the one the steps have)."""
        from dhelix.gpu_emulation.regions import fused_rms_norms, routing_regions

        with routing_regions(), fused_rms_norms(), GpuEmulationMode(
                model or self.kernel_model(), EmulationConfig(time_scale=1e-9)) as mode:
            yield mode


def trace_profile(profile: str, timeout_s: float = 600) -> dict:
    """`profile_fit.trace_profile_layer` of the `dhelix profile --comp-only` file at
    `profile`, in a 1-rank process of its own (it needs Megatron's parallel state at tp=1;
    ~10 s at the H100 Llama-8B profile's shape). JSON-able: `GpuEmulation.trace`."""
    from dhelix.gpu_emulation.profile_fit import trace_profile_layer
    from dhelix.harness import run_megatron_ranks

    return run_megatron_ranks(trace_profile_layer, 1, profile, timeout_s=timeout_s,
                              env={"OMP_NUM_THREADS": "1"})[0]


def emulated_link_rate(bits_per_s: int, time_scale: float) -> int:
    """The emulated link's rate for a GPU cluster link of `bits_per_s` at time scale S:
    every kernel takes S x its time, so the link carries 1/S of the rate."""
    if not time_scale > 0:
        raise ValueError(f"error: time_scale must be > 0, got {time_scale}")
    return max(1, round(bits_per_s / time_scale))


@contextmanager
def emulated_call(chunks, model: KernelTimeModel, config: EmulationConfig,
                  durations: CollectiveDurations | None = None):
    """Open the core-attention regions of every module in `chunks` (a model chunk or a
    list of them), the fused RMSNorms (`regions.fused_rms_norms`), the real MoE routing of
    any router (`regions.routing_regions`) and a new `GpuEmulationMode(model, config,
    durations)`; yields the mode. Leaving drains the emulated stream (the host waits for the
    last kernel). The calling thread is named the emulated GPU's host thread
    (`host_threads`). Pass the process's `durations` to every call so the modes forecast
    collectives from the start."""
    from dhelix.gpu_emulation.regions import attention_regions, fused_rms_norms, \
        routing_regions

    chunks = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    name_current_thread(MAIN_THREAD_NAME)  # the emulated GPU's host thread (host_threads)
    mode = GpuEmulationMode(model, config, durations)
    with ExitStack() as stack:
        for chunk in chunks:
            stack.enter_context(attention_regions(chunk))
        stack.enter_context(fused_rms_norms())
        stack.enter_context(routing_regions())
        with mode:
            yield mode


class EmulatedCalls:
    """Calls of `chunks` (a model chunk or a list of them) run one at a time under the
    emulation, each in its own `emulated_call(chunks, model, config)` (`running()`), and
    the current call's emulated stream drained on demand (`synchronize()`): what a timer of
    the emulated GPU needs, as a CUDA event ends when the stream reaches it."""

    def __init__(self, chunks, model: KernelTimeModel, config: EmulationConfig):
        self.chunks, self.model, self.config = chunks, model, config
        self.durations = CollectiveDurations()  # shared by the calls' modes
        self._mode: GpuEmulationMode | None = None

    @contextmanager
    def running(self):
        """One call under a fresh mode (its regions opened); leaving drains its stream."""
        if self._mode is not None:
            raise RuntimeError("error: EmulatedCalls.running() entered inside a running call")
        with emulated_call(self.chunks, self.model, self.config, self.durations) as mode:
            self._mode = mode
            try:
                yield mode
            finally:
                self._mode = None

    def synchronize(self) -> None:
        """Sleep until the running call's kernels charged so far have ended (no call
        running: nothing to wait for)."""
        if self._mode is not None:
            self._mode.drain()
