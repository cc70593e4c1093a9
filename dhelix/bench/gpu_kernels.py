"""What the GPU and the host did during one traced step, read off a torch.profiler Chrome
trace (`profile.export_chrome_trace`): how many kernels ran, their summed time, the time the
GPU was busy (the union of kernel and copy intervals, so kernels that overlap on two
streams count once), the span from the first to the last, the largest kernels by total
time, and the host's synchronising CUDA runtime calls. Comparing two rows of
`scripts/bench_gpu.py` with it says whether a slower step ran more or slower kernels (busy
time differs) or left the GPU idle (busy time equal, span longer: launch gaps or host
synchronisation).

Pure functions of the trace's JSON: no torch, no device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# Chrome-trace categories of device activity, as torch's profiler (Kineto) writes them
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime calls that block the host until the device (or a stream/event) catches up
SYNCHRONISING_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize",
                       "cudaEventSynchronize")


@dataclass(frozen=True)
class KernelSummary:
    """One traced step's device activity. Times in milliseconds."""

    kernels: int  # kernel launches (copies and memsets not counted)
    kernel_ms: float  # summed kernel durations (two overlapping kernels count twice)
    copy_ms: float  # summed memcpy and memset durations
    busy_ms: float  # union of every kernel, copy and memset interval
    span_ms: float  # first device activity's start to the last one's end
    streams: int  # device streams with any activity
    host_syncs: int  # synchronising CUDA runtime calls on the host
    host_sync_ms: float  # their summed duration
    top: tuple  # ((kernel name, launches, ms), ...) by ms, largest first

    @property
    def idle_ms(self) -> float:
        """Time inside the span with no device activity at all."""
        return self.span_ms - self.busy_ms


def _union_us(intervals: list) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarise_trace(trace: dict, top: int = 8) -> KernelSummary:
    """The `KernelSummary` of a Chrome trace dict (`{"traceEvents": [...]}`; complete events,
    `ph` "X", with `ts`/`dur` in microseconds). A trace without device activity (a CPU run)
    gives zeros."""
    per_kernel = defaultdict(lambda: [0, 0.0])
    intervals, streams = [], set()
    kernels = 0
    kernel_us = copy_us = sync_us = 0.0
    syncs = 0
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        category, name = event.get("cat", ""), event.get("name", "")
        start, dur = float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        if category in DEVICE_CATEGORIES:
            intervals.append((start, start + dur))
            streams.add((event.get("pid"), event.get("tid")))
            if category == "kernel":
                kernels += 1
                kernel_us += dur
                per_kernel[name][0] += 1
                per_kernel[name][1] += dur
            else:
                copy_us += dur
        elif category == "cuda_runtime" and name in SYNCHRONISING_CALLS:
            syncs += 1
            sync_us += dur
    span_us = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1][1])[:top]
    return KernelSummary(
        kernels=kernels, kernel_ms=kernel_us / 1e3, copy_ms=copy_us / 1e3,
        busy_ms=_union_us(intervals) / 1e3, span_ms=span_us / 1e3, streams=len(streams),
        host_syncs=syncs, host_sync_ms=sync_us / 1e3,
        top=tuple((name, count, us / 1e3) for name, (count, us) in ranked))
