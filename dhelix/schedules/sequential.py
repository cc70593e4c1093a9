"""The sequential reference schedule: one micro-batch at a time, its whole forward route then
its whole backward route, so only one stage computes at any moment.

On the folded path a micro-batch goes stage 0 chunk 0 -> ... -> stage p-1 chunk 0 ->
stage p-1 chunk 1 -> ... -> stage 0 chunk 1 (loss) and back. It is the plain reference the
W-shaped schedule must match numerically (same passes, same per-parameter accumulation order
of micro-batches), and it is trivially free of deadlocks. On the one-stage linear path it is
Megatron's no-pipelining order F(1) B(1) F(2) B(2) ... (the Domino-style pairing's schedule).

`build_forward_only_schedule` is its forward half: evaluation, every micro-batch's forward
route in micro-batch order and no backward (what Megatron's schedules run with
`forward_only=True`).
"""

from __future__ import annotations

from dhelix.schedules.actions import BACKWARD, FORWARD, Pass, PipelinePath, Schedule
from dhelix.schedules.emit import Task, check_microbatches, emit_schedule


def _route_tasks(path: PipelinePath, num_microbatches: int, directions: tuple) -> list:
    check_microbatches(num_microbatches)
    stage_tasks: list[list[Task]] = [[] for _ in range(path.num_stages)]
    for mb in range(num_microbatches):
        if FORWARD in directions:
            for hop in range(path.num_hops):
                stage_tasks[path.stage(FORWARD, hop)].append(Task(forward=Pass(mb, hop)))
        if BACKWARD in directions:
            for hop in range(path.num_hops):
                stage_tasks[path.stage(BACKWARD, hop)].append(Task(backward=Pass(mb, hop)))
    return stage_tasks


def build_sequential_schedule(path: PipelinePath, num_microbatches: int) -> Schedule:
    """Micro-batches 0..m-1 one after another over `path` (folded or linear)."""
    return emit_schedule("sequential", path, num_microbatches,
                         _route_tasks(path, num_microbatches, (FORWARD, BACKWARD)))


def build_forward_only_schedule(path: PipelinePath, num_microbatches: int) -> Schedule:
    """Micro-batches 0..m-1 one after another along `path`'s forward route, no backward."""
    return emit_schedule("forward", path, num_microbatches,
                         _route_tasks(path, num_microbatches, (FORWARD,)), forward_only=True)


def build_no_pipelining_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Megatron's no-pipelining order F(1) B(1) ... F(m) B(m) on the one-stage path
    (`num_stages` must be 1: the builder signature `ScheduleEngine` takes)."""
    if num_stages != 1:
        raise ValueError(f"the no-pipelining schedule has 1 stage, got {num_stages}")
    return build_sequential_schedule(PipelinePath.linear(1), num_microbatches)
