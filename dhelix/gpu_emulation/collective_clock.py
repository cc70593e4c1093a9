"""When the collectives in flight under the GPU emulation will stop slowing kernels.

On a GPU a kernel is slowed by a collective only while the two run at the same time. The
emulation charges a kernel when the host issues it, usually well before the stream reaches
it (the host runs ahead), so whether a collective in flight *now* still runs when the
kernel starts, and for how much of it, is a forecast: the collective's stream start plus how
long collectives of its kind took before. `CollectiveDurations` keeps that (the shortest
duration observed per kind: operator, process group, bytes), `InFlightCollective` one
collective's record, and `slowed_kernel_s` the kernel's duration with only its overlapped
part slowed.

Guarantees: a collective of a kind never observed counts as lasting until the kernel ends
(the whole kernel is slowed, as without a forecast); an observation is taken when the
host first sees the collective completed (at a later charge), so it is at least its real
duration, and the shortest one is kept (a forecast, not a measurement: a collective that
runs longer than the shortest of its kind slows kernels only until its forecast end, so
its jitter is not charged). No tensor is held: a record keeps the Work handle
(which the caller's Work already holds) and plain numbers. Host-side only, any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class CollectiveKind(NamedTuple):
    """The key collectives share a duration under: operator name, process group (hashable,
    None when unknown) and the bytes of its tensors."""

    op: str
    group: object
    nbytes: int


@dataclass
class InFlightCollective:
    """One collective issued under the mode: its Work (or stream-ordered handle), the
    stream time (perf_counter seconds) it starts at, and its kind."""

    work: object
    stream_start: float
    kind: CollectiveKind


class CollectiveDurations:
    """The shortest observed duration (s) of each collective kind, kept across the
    emulated calls of a process (one object per process, handed to every mode)."""

    def __init__(self):
        self._shortest: dict = {}

    def observe(self, record: InFlightCollective, seen_done_at: float) -> None:
        """`record` was seen completed at `seen_done_at` (perf_counter s)."""
        duration = max(0.0, seen_done_at - record.stream_start)
        best = self._shortest.get(record.kind)
        if best is None or duration < best:
            self._shortest[record.kind] = duration

    def expected_end(self, record: InFlightCollective) -> float | None:
        """When `record` should complete (perf_counter s), None for a kind never observed."""
        duration = self._shortest.get(record.kind)
        return None if duration is None else record.stream_start + duration


def slowed_kernel_s(base_s: float, start: float, busy_until: float | None,
                    slowdown: float) -> float:
    """How long a kernel of `base_s` seconds alone lasts when it starts at `start` and
    collectives run beside it until `busy_until` (None: until it ends): it progresses at
    1 / (1 + slowdown) while they run and at full speed after."""
    slowed_total = base_s * (1.0 + slowdown)
    if busy_until is None:
        return slowed_total
    overlap = min(max(0.0, busy_until - start), slowed_total)
    return overlap + (base_s - overlap / (1.0 + slowdown))
