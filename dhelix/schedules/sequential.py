"""The sequential reference schedule: one micro-batch at a time, its whole forward route then
its whole backward route, so only one stage computes at any moment.

On the folded path a micro-batch goes stage 0 chunk 0 -> ... -> stage p-1 chunk 0 ->
stage p-1 chunk 1 -> ... -> stage 0 chunk 1 (loss) and back. It is the plain reference the
W-shaped schedule must match numerically (same passes, same per-parameter accumulation order
of micro-batches), and it is trivially free of deadlocks.
"""

from __future__ import annotations

from dhelix.schedules.actions import BACKWARD, FORWARD, Pass, PipelinePath, Schedule
from dhelix.schedules.emit import Task, check_microbatches, emit_schedule


def build_sequential_schedule(path: PipelinePath, num_microbatches: int) -> Schedule:
    """Micro-batches 0..m-1 one after another over `path` (folded or linear)."""
    check_microbatches(num_microbatches)
    stage_tasks: list[list[Task]] = [[] for _ in range(path.num_stages)]
    for mb in range(num_microbatches):
        for hop in range(path.num_hops):
            stage_tasks[path.stage(FORWARD, hop)].append(Task(forward=Pass(mb, hop)))
        for hop in range(path.num_hops):
            stage_tasks[path.stage(BACKWARD, hop)].append(Task(backward=Pass(mb, hop)))
    return emit_schedule("sequential", path, num_microbatches, stage_tasks)
