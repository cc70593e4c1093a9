"""Blocks and pairings, and the legality rules every pairer's output obeys.

A *block* pairs a contiguous forward segment with a contiguous backward segment (either may
be empty, not both); blocks run one after another with a barrier between them. A *pairing*
is a forward order, a backward order and the blocks that cut them.

Legality:
1. each order is a topological order of its DAG (intra-strand dependencies hold, because a
   strand executes its segment's operators one after another in order);
2. the blocks, concatenated strand by strand, are exactly the two orders;
3. no block holds communication operators of both strands on the same channel (two intra-node
   or two cross-node collectives are never co-executed; intra with cross-node is allowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dhelix.dag import OpDAG, OpNode, shared_channels, topological_violation

CHANNEL_BITS = {"intra": 1, "inter": 2}  # communication channels as bits of a mask


@dataclass(frozen=True)
class Block:
    """One barrier-delimited step: `fwd` ops of the forward strand co-executed with `bwd` ops
    of the backward strand."""

    fwd: tuple = ()
    bwd: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "fwd", tuple(self.fwd))
        object.__setattr__(self, "bwd", tuple(self.bwd))
        if not self.fwd and not self.bwd:
            raise ValueError("a block needs at least one operator")

    @property
    def paired(self) -> bool:
        return bool(self.fwd) and bool(self.bwd)


@dataclass(frozen=True)
class Pairing:
    """Orders of both strands and the blocks cutting them (output of every pairer)."""

    fwd_order: tuple
    bwd_order: tuple
    blocks: tuple

    def __post_init__(self):
        object.__setattr__(self, "fwd_order", tuple(self.fwd_order))
        object.__setattr__(self, "bwd_order", tuple(self.bwd_order))
        object.__setattr__(self, "blocks", tuple(self.blocks))


def comm_mask(ops: Iterable[OpNode]) -> int:
    """Bit set of the communication channels used by `ops` (intra=1, inter=2)."""
    mask = 0
    for op in ops:
        if op.kind == "comm":
            mask |= CHANNEL_BITS[op.channel]
    return mask


@dataclass(frozen=True)
class Seam:
    """Where two consecutive layer pairs of an SI block overlap: a plan's first `head` blocks
    hold forward operators only and its last `tail` blocks backward operators only; `block`
    co-executes the next layer pair's head (its forward segment) with this layer pair's tail
    (its backward segment) instead of running them one after the other."""

    head: int
    tail: int
    block: Block


def layer_seam(blocks, ops_f: dict, ops_b: dict) -> Seam | None:
    """The seam of a layer pair's blocks (`Seam`), or None where the first block holds
    backward operators, the last one forward operators, or the head's and the tail's
    collectives share a channel (rule 3). `ops_f` / `ops_b`: op id -> OpNode.

    Why the seam block is legal: the next pair's head reads only its forward layer's input,
    which this pair's forward produced before its tail (the tail has no forward operator),
    and this pair's tail produces the input gradient the next pair's backward starts from,
    which runs after the seam block."""
    blocks = list(blocks)
    head = next((i for i, b in enumerate(blocks) if b.bwd), len(blocks))
    tail = next((i for i, b in enumerate(reversed(blocks)) if b.fwd), len(blocks))
    if head == 0 or tail == 0 or head + tail > len(blocks):
        return None
    fwd = tuple(op for b in blocks[:head] for op in b.fwd)
    bwd = tuple(op for b in blocks[len(blocks) - tail:] for op in b.bwd)
    if shared_channels([ops_f[o] for o in fwd], [ops_b[o] for o in bwd]):
        return None
    return Seam(head, tail, Block(fwd, bwd))


def merge_solo_runs(blocks: Iterable[Block]) -> list[Block]:
    """Merge consecutive blocks that hold only forward (or only backward) operators: running
    them with or without a barrier in between takes the same time, so one block is clearer."""
    merged: list[Block] = []
    for block in blocks:
        last = merged[-1] if merged else None
        if last and not last.paired and not block.paired and (
            (last.fwd and block.fwd) or (last.bwd and block.bwd)
        ):
            merged[-1] = Block(last.fwd + block.fwd, last.bwd + block.bwd)
        else:
            merged.append(block)
    return merged


def pairing_violation(fwd: OpDAG, bwd: OpDAG, pairing: Pairing) -> str | None:
    """None if `pairing` obeys the legality rules for these DAGs, else the first problem."""
    for dag, order in ((fwd, pairing.fwd_order), (bwd, pairing.bwd_order)):
        problem = topological_violation(dag, order)
        if problem:
            return f"{dag.direction} order: {problem}"
    cut_f = tuple(op for block in pairing.blocks for op in block.fwd)
    cut_b = tuple(op for block in pairing.blocks for op in block.bwd)
    if cut_f != pairing.fwd_order:
        return "the blocks' forward segments do not concatenate to the forward order"
    if cut_b != pairing.bwd_order:
        return "the blocks' backward segments do not concatenate to the backward order"
    ops_f, ops_b = fwd.by_id(), bwd.by_id()
    for number, block in enumerate(pairing.blocks, start=1):
        shared = shared_channels([ops_f[i] for i in block.fwd], [ops_b[i] for i in block.bwd])
        if shared:
            return (f"block {number} pairs communication of both strands on the same "
                    f"channel ({', '.join(shared)})")
    return None


def check_pairing(fwd: OpDAG, bwd: OpDAG, pairing: Pairing) -> Pairing:
    """Return `pairing` unchanged, or raise ValueError naming the broken legality rule."""
    problem = pairing_violation(fwd, bwd, pairing)
    if problem:
        raise ValueError(f"illegal pairing: {problem}")
    return pairing
