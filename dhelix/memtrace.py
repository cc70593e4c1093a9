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
    live: dict = {}
    stale: dict = {}
    current = peak = 0
    for _, size, ptr, tid in events:
        if size > 0:
            if ptr in live:
                current -= live.pop(ptr)
                stale[ptr] = stale.get(ptr, 0) + 1
            if keep_tid is None or tid == keep_tid:
                live[ptr] = size
                current += size
                peak = max(peak, current)
        elif stale.get(ptr):
            stale[ptr] -= 1
        else:
            current -= live.pop(ptr, 0)
    return peak


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
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_MARK):
            result = fn()
    events, caller_tid = [], None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr, node.start_tid))
        elif node.name == _MARK:
            caller_tid = node.start_tid
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    if caller_tid is None:
        raise RuntimeError("profiler recorded no marker for the measured call")
    return result, MemoryReading(_replay(events), _replay(events, keep_tid=caller_tid))
