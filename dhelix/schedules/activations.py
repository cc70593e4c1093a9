"""How many micro-batches' activations each stage keeps alive under a schedule (pure count,
no costs): a forward chunk pass stores its activations until the backward of the same
micro-batch and chunk frees them.

Counted in stage passes (one micro-batch through all L/p layers of a stage; a folded chunk
is half of one), per rank, as the maximum over the rank's list. An SI block allocates its
forward's activations while it frees its backward's: `low` assumes the two happen together
(layer-granular co-execution, the paper's complementary memory; the peak is the larger of
before and after the block), `high` that the forward finishes before the backward frees
anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.schedules.actions import Schedule


@dataclass(frozen=True)
class LiveActivations:
    low: tuple    # per rank, in stage passes
    high: tuple


def peak_live_activations(schedule: Schedule) -> LiveActivations:
    per_pass = 1.0 / schedule.path.chunks_per_stage
    low, high = [], []
    for actions in schedule.ranks:
        live = peak_low = peak_high = 0
        for action in actions:
            if not action.is_compute:
                continue
            before = live
            if action.forward is not None:
                live += 1
            peak_high = max(peak_high, live)
            if action.backward is not None:
                live -= 1
            peak_low = max(peak_low, before, live)
        low.append(peak_low * per_pass)
        high.append(peak_high * per_pass)
    return LiveActivations(tuple(low), tuple(high))
