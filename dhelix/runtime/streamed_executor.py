"""The streamed executor: runs an SI block's layer pairs as one static operator sequence
(`planner.streamed.StreamedSchedule.sequence`), both strands layer after layer, with no block
barriers.

Each entry names a strand ('fwd' or 'bwd'), a layer pair and an operator. The executor runs
the entries in exactly that order on the calling thread (CPU) / current stream (GPU): a
computation first waits for the collectives it reads (`LayerExecution.wait_inputs`: the
thread blocks on CPU, the stream waits on GPU), a collective is issued and returns a handle.
Both strands' collectives go to one lane per channel (strand slot 0 of
`dhelix.runtime.lanes`): the sequence is the same on every rank, so the lane's process group
sees the same collectives in the same order everywhere, and one group (one NCCL
communicator: one stream) runs them one after another, in sequence order - the FIFO lane the
planner's simulation assumes.

A strand moves to its next layer when the sequence reaches that layer's first operator: the
finished layer's execution is ended (`StrandChain.close`, which hands its output on) and the
next one begun with it (`StrandChain.open`). A strand's last layer is ended as soon as the
sequence has run its last operator and nothing of it is in flight (`on_strand_end` is told,
so a pipeline stage can send that output while the other strand still runs); the chains end
whatever is left after the sequence. Guarantees: every layer's operators run in the strand
order the sequence gives (checked by the executions: an operator before its dependencies,
one run twice or one never run is an error); tensors belong to their `LayerExecution`s,
which free each value after its last reader; nothing is left in flight when
`run_streamed` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dhelix.runtime.timeline import span_or_nothing

SHARED_LANE_SLOT = 0


@dataclass
class StrandChain:
    """One strand of a streamed SI block: `open(pair)` begins (and returns) the execution of
    layer pair `pair`, `close(execution)` ends it and keeps its output for the next `open`.
    Pairs are opened in order 0, 1, ... ."""

    open: Callable
    close: Callable
    execution: object = None
    pair: int = -1
    _closed: bool = field(default=False, repr=False)

    def at(self, pair: int):
        """The execution of `pair`, ending the current one and beginning the next first
        when the sequence has moved on."""
        if pair != self.pair:
            if pair != self.pair + 1:
                raise RuntimeError(f"streamed sequence jumps from layer pair {self.pair} to "
                                   f"{pair}")
            if self.execution is not None:
                self.close(self.execution)
            self.execution = self.open(pair)
            self.execution.strand_slot = SHARED_LANE_SLOT
            self.pair = pair
        return self.execution

    def finish(self) -> None:
        """End the last layer's execution (once; later calls do nothing)."""
        if self.execution is not None and not self._closed:
            self.close(self.execution)
            self._closed = True


def _last_entries(sequence: Sequence) -> dict:
    """strand -> index of its last entry in `sequence`."""
    return {step.strand: index for index, step in enumerate(sequence)}


def run_streamed(sequence: Sequence, chains: dict, timeline=None,
                 before_step: Callable[[int], None] | None = None,
                 on_strand_end: Callable[[str], None] | None = None) -> None:
    """Run `sequence` (`planner.streamed.StreamedStep`s) on `chains` ('fwd' and 'bwd' ->
    `StrandChain`), ending each chain's last layer as soon as the sequence has run the
    strand's last entry and the execution has nothing in flight (`ran_all`; checked after
    every entry from then on) and calling `on_strand_end(strand)` then, on the calling
    thread; the chains not ended by then are ended after the sequence, without the call.
    `timeline` (a `dhelix.runtime.timeline.Timeline`) records what the compute thread did;
    None records nothing. `before_step(k)` (optional) is called before entry k runs, on
    every rank at the same entry, in the caller's autograd mode (it may build a graph: the
    embedding)."""
    caller_grad = torch.is_grad_enabled()
    last = _last_entries(sequence)
    ending: list = []  # strands whose last entry has run, not ended yet
    with torch.no_grad():  # what every operator runs under (LayerExecution.run), set once
        for index, step in enumerate(sequence):
            if before_step is not None:
                with torch.set_grad_enabled(caller_grad):
                    before_step(index)
            execution = chains[step.strand].at(step.pair)
            program = execution.programs.program(execution.phase)
            if program[step.op].kind == "comm":
                with span_or_nothing(timeline, "issue", step.op):
                    execution.run(step.op)
            else:
                if timeline is not None and not execution.op_ready(step.op):
                    with timeline.span("wait", step.op):
                        execution.wait_inputs(step.op)
                with span_or_nothing(timeline, "compute", step.op):
                    execution.run(step.op)
            if on_strand_end is None:
                continue
            if index == last[step.strand]:
                ending.append(step.strand)
            for strand in list(ending):
                if chains[strand].execution.ran_all():
                    ending.remove(strand)
                    chains[strand].finish()
                    on_strand_end(strand)
    for chain in chains.values():
        chain.finish()

