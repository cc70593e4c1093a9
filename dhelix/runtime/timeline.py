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
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

KINDS = ("compute", "issue", "wait", "barrier")


@dataclass
class Timeline:
    """Spans (kind, name, start_s, end_s) in `time.perf_counter` seconds."""

    spans: list = field(default_factory=list)

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
        held: dict = {}
        for kind, name, start, end in self.spans:
            if kind != "compute":
                seconds, spans = held.get((kind, name), (0.0, 0))
                held[(kind, name)] = (seconds + end - start, spans + 1)
        ranked = sorted(held.items(), key=lambda item: -item[1][0])[:count]
        return [[kind, name, seconds, spans] for (kind, name), (seconds, spans) in ranked]

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


def span_or_nothing(timeline: "Timeline | None", kind: str, name: str):
    """`timeline.span(kind, name)`, or a context that records nothing when `timeline` is
    None (the executors' default)."""
    return nullcontext() if timeline is None else timeline.span(kind, name)
