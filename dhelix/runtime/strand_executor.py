"""The strand executor: co-executes two operator strands block by block as a plan says -
normally one micro-batch's forward operators (strand beta) with another micro-batch's
backward operators (strand alpha).

Within a block each strand runs its segment in plan order. The executor issues every
collective at a strand's head as soon as the strand reaches it (collectives are
asynchronous: they return a handle at once), and fills the wait with the other strand's
computation: it runs the head computation of a strand whose inputs are ready and, when both
are ready, of the strand with fewer computation operators left before its next collective
(so that collective is in flight as early as possible while the other strand computes;
ties alternate), and only blocks on a pending collective when neither strand can proceed.
Measured on the emulated cluster, configuration (a): the DHelix row went from 1.048x to
1.142x over Megatron with this choice, against plain alternation, in two runs of their own
(docs/benchmark.md). A block can end with a barrier (both strands' collectives waited on,
as the planner's cost model assumes); `run_blocks` puts one after every block when asked
(the runtime's default, `LayerRunner.block_barriers`: measured faster on the emulated
cluster, since a collective left in flight shares the link with the next block's and both
arrive later), else only after a layer pair's last block (a reader waits for what it
reads).

The two strands are usually a forward and a backward (the DHelix SI block), but nothing
here depends on their directions: each strand runs the program of its execution's current
phase, so two forward (or two backward) strands - the Domino-style halves of one micro-batch
- co-execute the same way. `Block.fwd` always belongs to the first execution passed and
`Block.bwd` to the second.

Guarantees: each strand's operators run exactly in the plan's order for that strand (so a
TP group's collectives are issued in the same order on every rank, which keeps gloo/NCCL
matched), and the two strands never share state: tensors belong to their own
`LayerExecution`, which frees each value after its last reader.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from dhelix.runtime.timeline import span_or_nothing


@dataclass(frozen=True)
class Block:
    """Operator ids of one paired block: the first strand's segment (`fwd`, normally a
    forward) and the second strand's (`bwd`, normally a backward)."""

    fwd: tuple
    bwd: tuple


@functools.lru_cache(maxsize=256)
def _segment(program, ops: tuple) -> tuple:
    """(kind of each op id, computation operators left before the next collective at each
    position) of the segment `ops` of `program`; programs are immutable and shared by
    equal layers, so one entry serves every layer and micro-batch."""
    kinds = {op_id: program[op_id].kind for op_id in ops}
    to_comm = [0] * (len(ops) + 1)
    to_comm[-1] = len(ops) + 1
    for i in range(len(ops) - 1, -1, -1):
        to_comm[i] = 0 if kinds[ops[i]] == "comm" else to_comm[i + 1] + 1
    return kinds, tuple(to_comm)


class _Strand:
    def __init__(self, execution, ops: tuple, slot: int):
        self.execution = execution
        execution.strand_slot = slot  # its collectives go to this strand's lanes
        self.ops = ops
        self.next = 0
        # kinds by op id; computation operators left before the strand's next collective,
        # per position
        program = execution.programs.program(execution.phase)
        try:
            self.kinds, self.to_comm = _segment(program, ops)
        except TypeError:  # a program that cannot be a cache key (a test's plain dict)
            self.kinds, self.to_comm = _segment.__wrapped__(program, ops)

    def done(self) -> bool:
        return self.next >= len(self.ops)

    def head(self) -> str:
        return self.ops[self.next]

    def run_head(self, timeline=None) -> None:
        op_id = self.ops[self.next]
        kind = "issue" if self.kinds[op_id] == "comm" else "compute"
        if timeline is not None and kind == "compute" and not self.execution.op_ready(op_id):
            with timeline.span("wait", op_id):
                self.execution.wait_inputs(op_id)
        with span_or_nothing(timeline, kind, op_id):
            self.execution.run(op_id)
        self.next += 1

    def issue_collectives(self, timeline=None) -> None:
        while not self.done() and self.kinds[self.head()] == "comm":
            self.run_head(timeline)



def run_block(fwd_execution, bwd_execution, block: Block, barrier: bool = True,
              timeline=None, on_strand_end=None) -> None:
    """Run one block: `block.fwd` on `fwd_execution` together with `block.bwd` on
    `bwd_execution`, each in the program of its current phase (normally forward and
    backward; two executions in the same direction work alike). Either side may be empty
    or None (a segment running alone). `timeline` (a `dhelix.runtime.timeline.Timeline`)
    records what the compute thread did; None records nothing. `on_strand_end(execution)`
    is called as soon as a strand has run the last operator of its segment, while the other
    strand may still have operators to run (None: not called)."""
    strands = [s for s in (_Strand(fwd_execution, tuple(block.fwd), 0) if block.fwd else None,
                           _Strand(bwd_execution, tuple(block.bwd), 1) if block.bwd else None)
               if s]
    with torch.no_grad():  # what every operator runs under (LayerExecution.run), set once
        _run_strands(strands, timeline, on_strand_end)
    if barrier:
        with span_or_nothing(timeline, "barrier", "block end"):
            for strand in strands:
                strand.execution.wait_pending()


def _run_strands(strands: list, timeline, on_strand_end=None) -> None:
    """Run the strands' operators to the end, in the order the module docstring states;
    `on_strand_end` as `run_block` says."""
    turn = 0
    ended = set()

    def report_ends():
        for s in strands:
            if s.done() and id(s) not in ended:
                ended.add(id(s))
                on_strand_end(s.execution)

    while any(not s.done() for s in strands):
        for strand in strands:
            strand.issue_collectives(timeline)
        if on_strand_end is not None:
            report_ends()
        waiting = [s for s in strands if not s.done()]
        if not waiting:
            break
        ready = [s for s in waiting if s.execution.op_ready(s.head())]
        candidates = ready or waiting
        if len(candidates) > 1:  # the strand nearest its next collective goes first
            nearest = min(s.to_comm[s.next] for s in candidates)
            candidates = [s for s in candidates if s.to_comm[s.next] == nearest]
        strand = candidates[turn % len(candidates)]
        strand.run_head(timeline)
        turn += 1
        if on_strand_end is not None and strand.done():
            report_ends()


def run_blocks(fwd_execution, bwd_execution, blocks: Sequence[Block],
               barrier: bool = False, timeline=None, on_strand_end=None,
               before_block=None, first_index: int = 0) -> None:
    """Run a layer pair's whole plan: every block in order. With `barrier` False (the
    default) a block's collectives may still be in flight when the next block starts: a
    reader waits for exactly the collective it reads, and only the end of the last block
    waits for everything (so both executions can end their programs). With `barrier` True
    every block ends by waiting for its collectives, as the planner's cost model assumes.
    `on_strand_end` is passed to every block (`run_block`); `before_block(index)`, when
    given, is called (with autograd as the caller has it) before block `index` starts.
    `timeline` also gets each block's end (`Timeline.block_ended`), numbered from
    `first_index` (where `blocks` starts in the pair's plan)."""
    if timeline is not None:
        timeline.layer_pair_started()
    for index, block in enumerate(blocks):
        if before_block is not None:
            before_block(index)
        last = index == len(blocks) - 1
        run_block(fwd_execution, bwd_execution, block, barrier=barrier or last,
                  timeline=timeline, on_strand_end=on_strand_end)
        if timeline is not None:
            timeline.block_ended(first_index + index)


def run_alone(execution, order: Sequence[str], timeline=None) -> None:
    """One strand with no partner (the first forward and the last backward of a step)."""
    if execution.phase == "fwd":
        run_block(execution, None, Block(tuple(order), ()), timeline=timeline)
    else:
        run_block(None, execution, Block((), tuple(order)), timeline=timeline)
