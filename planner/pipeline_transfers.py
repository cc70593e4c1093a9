"""What a layer-pair plan costs the W schedule's pipeline transfers, and the choice it
informs (`dhelix.runtime.setup`: the dp plan or the sequential pairing on a folded stage).

On the W schedule two stages exchange, between SI blocks, the activation of the block's
forward and the input gradient of its backward (docs/folding_and_w_schedule.md, "Pipeline
transfers"). The executor sends each as soon as its strand is done (the peer has posted
its receive a RECV ahead, so the bytes move then) and the receiving block starts on the
strand whose input has landed, so a plan hides a transfer of `transfer_ms` where its
strands end apart and start apart:

- the strand that ends first (its output leaves `tail` ms before the block ends) has its
  transfer exposed by max(0, transfer - tail);
- the peer's block (the same plan) runs that strand alone for `head` ms before the other
  strand's first operator, whose input left at the block's end: exposed by
  max(0, transfer - head).

Per SI block, exposure = max(0, transfer - tail) + max(0, transfer - head): the sequential
pairing (the whole backward, then the whole forward) has tail = the forward's time and head
= the backward's; a plan whose last block co-executes both strands has tail ~0 and, if its
first block pairs them too, head 0. The block model (`planner.cosched`) gives the times;
queueing of the two transfers on one link is not modelled. A streamed SI block
(`planner.streamed`) is charged by the same formula (`exposed_ms`), from its simulated
strands' starts and ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan import Plan


@dataclass(frozen=True)
class TransferExposure:
    """A plan's strand ends and the exposure they leave per SI block (ms)."""

    first_strand: str  # "fwd" or "bwd": the strand whose output leaves first
    tail_ms: float     # from that strand's end to the pair's end
    head_ms: float     # how long the pair starts with that strand alone
    exposed_ms: float


def exposed_ms(transfer_ms: float, tail_ms: float, head_ms: float) -> float:
    """What an SI block's two transfers of `transfer_ms` leave exposed, given the first
    strand's `tail_ms` and `head_ms` (module docstring)."""
    if transfer_ms < 0:
        raise ValueError(f"a transfer time is >= 0 ms, got {transfer_ms}")
    return max(0.0, transfer_ms - tail_ms) + max(0.0, transfer_ms - head_ms)


def transfer_exposure(plan: Plan, transfer_ms: float) -> TransferExposure:
    """The exposure of `plan`'s pipeline transfers of `transfer_ms` each (module docstring)."""
    if transfer_ms < 0:
        raise ValueError(f"a transfer time is >= 0 ms, got {transfer_ms}")
    ends = {"fwd": 0.0, "bwd": 0.0}
    for span in plan.timeline:
        ends[span["strand"]] = max(ends[span["strand"]], span["end_ms"])
    first = min(ends, key=lambda strand: (ends[strand], strand))
    tail = plan.planned_ms - ends[first]
    head = 0.0
    for block in plan.blocks:
        if block.bwd if first == "fwd" else block.fwd:  # the other strand starts here
            break
        head += block.predicted_ms
    return TransferExposure(first, tail, head, exposed_ms(transfer_ms, tail, head))


def strands_exposure(total_ms: float, starts: dict, ends: dict,
                     transfer_ms: float) -> TransferExposure:
    """The exposure of an SI block whose strands ("fwd", "bwd") start at `starts` and end
    at `ends` (ms from the block's start, the block `total_ms` long; e.g. a streamed
    sequence's simulation): the strand that ends first leaves `tail` before the end, and
    runs alone for `head` from its start until the other strand's first operator (0 where
    the other starts first)."""
    first = min(ends, key=lambda strand: (ends[strand], strand))
    other = "bwd" if first == "fwd" else "fwd"
    tail = total_ms - ends[first]
    head = max(0.0, starts[other] - starts[first])
    return TransferExposure(first, tail, head, exposed_ms(transfer_ms, tail, head))


def si_block_ms(plan: Plan, pairs: int, transfer_ms: float) -> float:
    """An SI block of `pairs` layer pairs under `plan` with its transfers' exposure."""
    return pairs * plan.planned_ms + transfer_exposure(plan, transfer_ms).exposed_ms
