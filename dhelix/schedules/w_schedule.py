"""DHelix's W-shaped pipeline schedule over the folded model (paper section 4.1, Figure 8).

Construction. Pair the forward of micro-batch i with the backward of micro-batch i-p: token
t (t = 0 .. m+p-1) carries forward(t) when t < m and backward(t-p) when t >= p. On the folded
path, forward hop h and backward hop h of two micro-batches sit on the same stage (chunk c of
one with the mirrored chunk 1-c of the other) and take the same route, so a token's two
passes run as one SI block per hop and their activation and gradient travel together. Each
stage s runs its tokens in the 1F1B pattern: min(p-1-s, m+p) "down" hops (hop s, chunk 0
forward / chunk 1 backward), then down and "up" hops (hop 2p-1-s) alternating, then the
remaining up hops. The last stage turns each token around locally (hop p-1 then hop p).

Phases (Figure 8): tokens 0..p-1 carry only forwards (warmup: the alpha strand fills the
pipeline), tokens p..m-1 are SI blocks (steady: beta forwards fused with alpha backwards,
the strands swapping roles every p micro-batches), tokens m..m+p-1 carry only backwards
(cooldown). Micro-batches are labelled alpha in even groups of p and beta in odd ones.

Why lag p: on stage 0, token t's down hop comes right after the up hop of token t-p, which
computed micro-batch (t-p)'s loss; a smaller lag would ask for a backward before its loss.

Every m >= 1 is supported. When m < p the tokens m..p-1 are empty (neither pass exists) and
are left out; when m is not a multiple of p the last strand group is simply shorter. With
m <= p there is no SI block at all (warmup then cooldown). The schedule is deterministic.
"""

from __future__ import annotations

from dhelix.schedules.actions import Pass, PipelinePath, Schedule
from dhelix.schedules.emit import Task, check_microbatches, emit_schedule
from dhelix.schedules.one_f_one_b import DOWN, one_f_one_b_order

ALPHA, BETA = "α", "β"


def strand(microbatch: int, num_stages: int) -> str:
    """α for micro-batches in even groups of p (0-based), β for odd groups."""
    return ALPHA if (microbatch // num_stages) % 2 == 0 else BETA


def token_passes(token: int, num_stages: int, num_microbatches: int):
    """(forward micro-batch or None, backward micro-batch or None) of `token`."""
    fwd = token if token < num_microbatches else None
    bwd = token - num_stages if 0 <= token - num_stages < num_microbatches else None
    return fwd, bwd


def phase_of(fwd, bwd) -> str:
    """warmup (forward only), steady (an SI block) or cooldown (backward only)."""
    if fwd is not None and bwd is not None:
        return "steady"
    return "warmup" if bwd is None else "cooldown"


def build_w_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """The W-shaped schedule for p = `num_stages` folded stages and m micro-batches."""
    check_microbatches(num_microbatches)
    path = PipelinePath.folded(num_stages)
    p, m = num_stages, num_microbatches
    stage_tasks = []
    for s in range(p):
        tasks = []
        for leg, token, _ in one_f_one_b_order(p - 1 - s, m + p):
            fwd, bwd = token_passes(token, p, m)
            if fwd is None and bwd is None:
                continue
            hop = s if leg == DOWN else 2 * p - 1 - s
            tasks.append(Task(
                forward=Pass(fwd, hop) if fwd is not None else None,
                backward=Pass(bwd, hop) if bwd is not None else None,
                phase=phase_of(fwd, bwd),
            ))
        stage_tasks.append(tasks)
    return emit_schedule("w", path, m, stage_tasks)
