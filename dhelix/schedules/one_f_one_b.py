"""Megatron's 1F1B pipeline schedule (non-interleaved) as action lists, for comparison with
the W-shaped schedule, and the 1F1B ordering pattern both of them use.

Stage s of p runs min(p-1-s, m) warmup forwards, then alternates one forward and one
backward, then runs the remaining backwards (Megatron's `forward_backward_pipelining_without_
interleaving`). Stage s computes hop s of the forward route and hop p-1-s of the backward
route of the linear path.
"""

from __future__ import annotations

from dhelix.schedules.actions import Pass, PipelinePath, Schedule
from dhelix.schedules.emit import Task, check_microbatches, emit_schedule

DOWN, UP = 0, 1


def one_f_one_b_order(num_warmup: int, total: int) -> list[tuple[int, int, str]]:
    """The 1F1B pattern over `total` items that each need a DOWN step then an UP step:
    `num_warmup` DOWN steps, then DOWN/UP alternating, then the remaining UP steps.

    Returns (leg, item, phase) triples with leg DOWN or UP; phase is warmup, steady or
    cooldown by position in the pattern.
    """
    warmup = max(0, min(num_warmup, total))
    order = [(DOWN, i, "warmup") for i in range(warmup)]
    steady = total - warmup
    for i in range(steady):
        order.append((DOWN, warmup + i, "steady"))
        order.append((UP, i, "steady"))
    order += [(UP, i, "cooldown") for i in range(steady, total)]
    return order


def build_1f1b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Megatron 1F1B over the linear path: any p >= 1 and m >= 1."""
    check_microbatches(num_microbatches)
    path = PipelinePath.linear(num_stages)
    p, m = num_stages, num_microbatches
    stage_tasks = []
    for s in range(p):
        tasks = []
        for leg, mb, phase in one_f_one_b_order(p - 1 - s, m):
            if leg == DOWN:
                tasks.append(Task(forward=Pass(mb, s), phase=phase))
            else:
                tasks.append(Task(backward=Pass(mb, p - 1 - s), phase=phase))
        stage_tasks.append(tasks)
    return emit_schedule("1f1b", path, m, stage_tasks)
