"""DHelix's schedule without pipelining (PP = 1): one stage, one chunk, SI blocks.

    F(1); SI[F(2)+B(1)]; SI[F(3)+B(2)]; ...; SI[F(m)+B(m-1)]; B(m)

It is the W-shaped schedule's token rule (`w_schedule.token_passes`) with p = 1 on the
linear one-stage path: token t carries forward(t) when t < m and backward(t-1) when t >= 1.
Tokens 0 (warmup: the first forward alone) and m (cooldown: the last backward alone) hold
one pass; every token in between is an SI block, the forward of micro-batch t paired with
the backward of micro-batch t-1. It has the shape of Megatron's own
`combined_1f1b_schedule_for_no_pipelining` (megatron.core.pipeline_parallel.combined_1f1b):
the same order of micro-batches, so the data iterator, the losses and every parameter's
gradient accumulation follow Megatron's no-pipelining schedule.

One stage means no SEND/RECV; `validate` and `simulate` take it like any other schedule.
"""

from __future__ import annotations

from dhelix.schedules.actions import Pass, PipelinePath, Schedule
from dhelix.schedules.emit import Task, check_microbatches, emit_schedule
from dhelix.schedules.w_schedule import phase_of, token_passes


def build_si_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """The one-stage SI schedule for m = `num_microbatches` (`num_stages` must be 1: the
    builder signature of `build_w_schedule`, so both fit `ScheduleEngine`)."""
    if num_stages != 1:
        raise ValueError(f"the SI schedule runs without pipelining (1 stage), got "
                         f"{num_stages}; use build_w_schedule for PP > 1")
    check_microbatches(num_microbatches)
    tasks = []
    for token in range(num_microbatches + 1):
        fwd, bwd = token_passes(token, 1, num_microbatches)
        tasks.append(Task(forward=Pass(fwd, 0) if fwd is not None else None,
                          backward=Pass(bwd, 0) if bwd is not None else None,
                          phase=phase_of(fwd, bwd)))
    return emit_schedule("si", PipelinePath.linear(1), num_microbatches, [tasks])
