"""What the strand executor's compute thread did, span by span: for explaining measured step
times (how much of a step was computation, how much waited on communication).

A `Timeline` is an explicit recorder handed to the `LayerRunner` (None = no recording, the
default). The strand executor records, on the calling (compute) thread:
- `compute`: a computation operator running (its inputs were ready);
- `issue`: a collective being issued (asynchronous: the call returns with a handle);
- `wait`: blocked on a pending collective some operator needs (neither strand could
  proceed);
- `barrier`: the end-of-block wait for both strands' collectives.
`wait` + `barrier` is the communication the interleaving left exposed on this rank. On GPU
the spans are host-side launch times, not kernel times; use them on CPU.

Besides the spans, `run_blocks` marks where each block of a layer pair's plan ended
(`blocks`: block index, start, end), read on `block_clock`: `time.perf_counter` by default
(the compute thread), or a clock that says when the work issued so far ends where it runs
(under the GPU emulation, the emulated stream: `GpuEmulationMode.stream_time`), since a
host that runs ahead of its device passes a block's end before the block has run.
"""

from __future__ import annotations

import bisect
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

KINDS = ("compute", "issue", "wait", "barrier")


@dataclass
class Timeline:
    """Spans (kind, name, start_s, end_s) in `time.perf_counter` seconds, and the blocks of
    the layer pairs run (index in the pair's plan, start_s, end_s) on `block_clock`."""

    spans: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    block_clock: Callable[[], float] = time.perf_counter
    _block_start: float | None = field(default=None, init=False, repr=False)

    def layer_pair_started(self) -> None:
        """A layer pair's blocks start now (`run_blocks`): the next block's start."""
        self._block_start = self.block_clock()

    def block_ended(self, index: int) -> None:
        """Block `index` of a layer pair's plan ended now: it ran from the previous block's
        end (or the pair's start) to now."""
        now = self.block_clock()
        start = now if self._block_start is None else self._block_start
        self.blocks.append((index, start, now))
        self._block_start = now

    def block_ms(self) -> dict:
        """Median ms of each block index over the layer pairs recorded, {index: (ms,
        pairs)}, in index order."""
        by_index: dict = {}
        for index, start, end in self.blocks:
            by_index.setdefault(index, []).append((end - start) * 1e3)
        return {index: (statistics.median(ms), len(ms)) for index, ms in sorted(by_index.items())}

    @contextmanager
    def span(self, kind: str, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((kind, name, start, time.perf_counter()))

    def totals(self) -> dict:
        """Seconds per kind, and `recorded` (the sum)."""
        out = {kind: 0.0 for kind in KINDS}
        for kind, _, start, end in self.spans:
            out[kind] += end - start
        out["recorded"] = sum(out[kind] for kind in KINDS)
        return out

    def held_longest(self, count: int = 4) -> list:
        """Where the compute thread was held longest: the `count` (kind, operator) of the
        kinds other than `compute` (issuing a collective, waiting on one, a block's barrier)
        with the most seconds summed over their spans, as [kind, name, seconds, spans],
        longest first (ties in first-recorded order)."""
        return _ranked(((kind, name), end - start) for kind, name, start, end in self.spans
                       if kind != "compute")[:count]

    def idle_by_span(self, gaps: list, count: int = 4) -> list:
        """Where the device sat idle, by what the compute thread was doing when it ended:
        each gap (start_s, end_s) on `time.perf_counter`, e.g. the emulated stream's
        (`GpuEmulationMode.idle_gaps`), goes to the span in which it ended (the host issued
        the kernel that ended it there: a `compute` span names the operator the device
        waited for, such as one reading a collective's output), or, ending outside every
        span, to ("outside", "the layers"): embedding, loss, gradient finalisation, Python.
        The `count` largest as [kind, name, seconds, gaps], longest first (ties in
        first-recorded order)."""
        spans = sorted(self.spans, key=lambda s: s[2])
        starts = [s[2] for s in spans]

        def owner(end: float) -> tuple:
            i = bisect.bisect_right(starts, end) - 1
            inside = i >= 0 and end <= spans[i][3]
            return (spans[i][0], spans[i][1]) if inside else ("outside", "the layers")
        return _ranked((owner(end), end - start) for start, end in gaps)[:count]

    def chrome_trace(self, pid: int = 0) -> dict:
        """The spans as a Chrome/Perfetto trace (one row per kind), microseconds from the
        first span."""
        origin = min((s[2] for s in self.spans), default=0.0)
        events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"name": kind}} for tid, kind in enumerate(KINDS)]
        for kind, name, start, end in self.spans:
            events.append({"name": name, "cat": kind, "ph": "X", "pid": pid,
                           "tid": KINDS.index(kind), "ts": (start - origin) * 1e6,
                           "dur": (end - start) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _ranked(items) -> list:
    """[kind, name, seconds summed, items] per (kind, name) of `items` ((kind, name),
    seconds), longest first (ties in first-seen order)."""
    totals: dict = {}
    for key, seconds in items:
        total, n = totals.get(key, (0.0, 0))
        totals[key] = (total + seconds, n + 1)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])
    return [[kind, name, seconds, n] for (kind, name), (seconds, n) in ranked]


def span_or_nothing(timeline: "Timeline | None", kind: str, name: str):
    """`timeline.span(kind, name)`, or a context that records nothing when `timeline` is
    None (the executors' default)."""
    return nullcontext() if timeline is None else timeline.span(kind, name)
