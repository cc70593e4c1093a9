"""Peak live tensor memory of a piece of code, on CPU as on GPU.

CPU builds have no allocator statistics (`torch.cuda.max_memory_allocated` has no CPU
twin) and the resident set size mixes in the Python heap and freed-but-cached pages. This
module measures what the GPU number means - bytes of tensor storage alive at the same time -
from the allocation events torch's profiler records with `profile_memory=True`: every
c10 allocation and free made while the profiler runs, each stamped with the allocator's
running total. The peak of that total during the call, minus its value before the first
event, is the peak of tensor bytes allocated by the call and alive at once.

What it counts: every tensor storage the code allocates (activations, gradients, buffers,
temporaries inside kernels). What it does not count: storage that existed before the call
(parameters, inputs the caller made) - frees of such storage are not subtracted either, so
the reading never goes below what the call itself allocated - and memory outside torch's
allocator (gloo's internal buffers, Python objects).
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch


def peak_allocated_bytes(fn: Callable[[], object]) -> Tuple[object, int]:
    """Run `fn()` under the profiler; return (its result, peak live bytes it allocated).

    On CUDA the reading is `torch.cuda.max_memory_allocated` relative to the bytes allocated
    before the call (the CUDA allocator's own statistic); on CPU it comes from profiler
    memory events as described in the module docstring.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, int(torch.cuda.max_memory_allocated() - before)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        stack.extend(node.children)
    if not events:
        return result, 0
    events.sort(key=lambda e: e[0])
    _, first_size, first_total = events[0]
    baseline = first_total - first_size
    peak = max(total for _, _, total in events)
    return result, int(max(0, peak - baseline))
