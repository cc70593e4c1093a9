"""When the link carried collectives under the GPU emulation, and where it sat idle.

In a link-bound step what a schedule can still gain is the time no collective is in flight.
The emulated stream's idle gaps (`GpuEmulationMode.idle_gaps`) say where the device waited;
`LinkRecord` says where the link did: every collective on a process group the mode issues
for real (on the host's thread or the stream-ordered issuer's: both pass through
`StreamOrderedIssuer.note_issued`, which notes it here) has the time it was issued and the
time its Work completed, and `link_idle` sums, over a window (one recorded step), the
stretches with none in flight, split by where in the step's sequence of collectives they
fell: before its first tenth (the unpaired first forward of an SI schedule), before its
last tenth (the unpaired last backward), between, and after the last one. "The link" is
any collective in flight on any process group: right for a node with one link (the
benchmark's 2-node configurations); point-to-point transfers (a pipeline's) are not noted.

Guarantees: host-side only, any device; nothing holds a tensor or a Work (the completion
time is set by a callback on the Work's future, from whatever thread completes it, and a
collective not completed by the window's end counts as in flight until then); spans are in
`time.perf_counter` seconds, in issue order.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class LinkSpan:
    """One collective: issued at `issued_s`, completed at `done_s` (None until it does)."""

    issued_s: float
    done_s: float | None = None


class LinkRecord:
    """Every collective noted by one `GpuEmulationMode`, in issue order (thread-safe)."""

    def __init__(self):
        self._spans: list = []
        self._lock = threading.Lock()

    def note(self, work) -> None:
        """`work` (a real Work) was issued just now; its completion is noted when its future
        completes."""
        span = LinkSpan(time.perf_counter())
        with self._lock:
            self._spans.append(span)

        def completed(_future) -> None:
            span.done_s = time.perf_counter()

        work.get_future().add_done_callback(completed)

    def spans(self) -> list:
        """A copy of the spans noted so far (`LinkSpan`s, in issue order)."""
        with self._lock:
            return list(self._spans)


@dataclass(frozen=True)
class LinkIdle:
    """A window's link time in ms: `busy` (at least one collective in flight), `idle` (none),
    and `idle` split by the collective the idle stretch preceded: one of the first tenth of
    the window's collectives (`head`), of the last tenth (`tail`), one between (`between`),
    or none (`after`: from the last completion to the window's end); `collectives` in the
    window."""

    busy: float
    idle: float
    head: float
    between: float
    tail: float
    after: float
    collectives: int


def link_idle(spans: list, start: float, end: float) -> LinkIdle:
    """`LinkIdle` of the `spans` issued in [start, end] (perf_counter s); a collective still
    in flight at `end` counts as busy until `end`."""
    chosen = sorted((s for s in spans if start <= s.issued_s <= end), key=lambda s: s.issued_s)
    count = len(chosen)
    tenth = max(1, count // 10)
    cursor, busy = start, 0.0
    idle = {"head": 0.0, "between": 0.0, "tail": 0.0}
    for index, span in enumerate(chosen):
        done = end if span.done_s is None else min(span.done_s, end)
        if span.issued_s > cursor:
            part = "head" if index < tenth else "tail" if index >= count - tenth else "between"
            idle[part] += span.issued_s - cursor
            cursor = span.issued_s
        if done > cursor:
            busy += done - cursor
            cursor = done
    after = max(0.0, end - cursor)
    return LinkIdle(busy=busy * 1e3, idle=(sum(idle.values()) + after) * 1e3,
                    head=idle["head"] * 1e3, between=idle["between"] * 1e3,
                    tail=idle["tail"] * 1e3, after=after * 1e3, collectives=count)
