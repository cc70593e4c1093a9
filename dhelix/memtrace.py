"""Peak live tensor memory of a piece of code, on CPU as on GPU.

CPU builds have no allocator statistics (`torch.cuda.max_memory_allocated` has no CPU
twin) and the resident set size mixes in the Python heap and freed-but-cached pages. This
module measures what the GPU number means - bytes of tensor storage alive at the same time -
from the allocation events torch's profiler records with `profile_memory=True`: every c10
allocation and free made while the profiler runs, with its pointer, size, time and thread.
Replaying them in time order gives the live bytes at every moment; the maximum is the peak.

Two readings:
- `peak_bytes`: every allocation the call makes, on any thread;
- `compute_peak_bytes`: only storage allocated by the calling thread (the thread running
  the model code). On CPU this leaves out gloo's internal staging buffers, which its worker
  threads allocate and free at times that vary from run to run (NCCL has no such buffers);
  it is the stable number to compare two code paths with.

Not counted: storage that existed before the call (parameters, inputs the caller made, and
persistent buffers such as Megatron's global memory buffer once allocated) - frees of such
storage are ignored, so the reading never goes below what the call itself allocated - and
memory outside torch's allocator (Python objects).

Over-counted on CPU: the profiler records a free only on a thread it follows (the calling
thread), so storage whose last reference dies on another thread (a C++ thread completing a
collective, a helper thread) stays counted until a later allocation reuses its address (the
retiring rule below): a reading is high by up to the tensors freed that way (gloo's own
collectives release theirs on gloo's threads; docs/benchmark.md, "Caveats").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch

_MARK = "dhelix.memtrace.call"


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int
    compute_peak_bytes: int


def _replay(events, keep_tid=None) -> int:
    """Peak of live bytes over `events` (time, size, ptr, tid), sizes < 0 being frees.

    Events of different threads can be stamped slightly out of order. The allocator never
    hands out a pointer that is still live, so an allocation at a live pointer proves the
    earlier block was freed already: it is retired then, and its free event, when it
    arrives later, is ignored.
    """
    return max((current for _, current in _live_trace(events, keep_tid)), default=0)


def _live_trace(events, keep_tid=None):
    """(time, live bytes after it) for each of `events` (time, size, ptr, tid) in order,
    counting allocations of thread `keep_tid` only (every thread's when None); live bytes
    start at 0. The retiring rule of `_replay`'s docstring applies."""
    live: dict = {}
    stale: dict = {}
    current = 0
    for when, size, ptr, tid in events:
        if size > 0:
            if ptr in live:
                current -= live.pop(ptr)
                stale[ptr] = stale.get(ptr, 0) + 1
            if keep_tid is None or tid == keep_tid:
                live[ptr] = size
                current += size
        elif stale.get(ptr):
            stale[ptr] -= 1
        else:
            current -= live.pop(ptr, 0)
        yield when, current


def measure_peak(fn: Callable[[], object]) -> Tuple[object, MemoryReading]:
    """Run `fn()` under the profiler; return (its result, MemoryReading).

    On CUDA both readings are `torch.cuda.max_memory_allocated` relative to the bytes
    allocated before the call (the CUDA allocator's own statistic).
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        peak = int(torch.cuda.max_memory_allocated() - before)
        return result, MemoryReading(peak, peak)
    result = []
    events, caller_tid, _ = _profiled([lambda: result.append(fn())])
    return result[0], MemoryReading(_replay(events), _replay(events, keep_tid=caller_tid))


def _profiled(steps):
    """Run the callables `steps` under the profiler, each in its own marked range. Returns
    (allocation events (time, size, ptr, tid) in time order, the calling thread's id, each
    step's (start_ns, end_ns))."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_MARK):
            for number, fn in enumerate(steps):
                with record_function(f"{_MARK}.{number}"):
                    fn()
    events, caller_tid, bounds = [], None, {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr, node.start_tid))
        elif node.name == _MARK:
            caller_tid = node.start_tid
        elif node.name.startswith(_MARK + "."):
            bounds[int(node.name.rsplit(".", 1)[1])] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    if caller_tid is None or sorted(bounds) != list(range(len(steps))):
        raise RuntimeError("profiler recorded no marker for the measured call")
    events.sort(key=lambda e: e[0])
    return events, caller_tid, [bounds[k] for k in range(len(steps))]


def _replay_steps(events, keep_tid, bounds) -> list[tuple[int, int]]:
    """Per step (start_ns, end_ns) of `bounds`, in time order: (live bytes at its end, most
    live bytes during it), relative to the live bytes before the first step, counting only
    thread `keep_tid`'s allocations (as `_replay`)."""
    out = []
    step, peak, base = 0, None, None
    before = 0  # live bytes before the event at hand
    for when, current in [*_live_trace(events, keep_tid), (float("inf"), None)]:
        while step < len(bounds) and when >= bounds[step][1]:
            if base is None:
                base = before
            out.append((before - base, (before if peak is None else peak) - base))
            step, peak = step + 1, None
        if step < len(bounds) and when >= bounds[step][0]:
            if base is None:
                base = before
            peak = before if peak is None else peak
        if current is None:
            break
        before = current
        if peak is not None:
            peak = max(peak, current)
    return out


def measure_steps(steps) -> list[tuple[int, int]]:
    """Run the callables `steps` one after another; per step, (live bytes of tensor storage
    when it ended, the most live bytes while it ran), both relative to the live bytes before
    the first step. On CUDA from the allocator's statistics; on CPU from the profiler's
    allocation events of the calling thread (`compute_peak_bytes`'s reading: storage that
    existed before the call is not seen, so its frees are not either)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = []
        for fn in steps:
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            out.append((torch.cuda.memory_allocated() - base,
                        torch.cuda.max_memory_allocated() - base))
        return out
    events, caller_tid, bounds = _profiled(steps)
    return _replay_steps(events, caller_tid, bounds)
