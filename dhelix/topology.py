"""Which ranks share a node, and therefore which channel a process group's traffic uses.

DHelix runs communication on two channels besides compute: `intra` (NVLink or shared memory
inside one node) and `inter` (the network between nodes). A collective uses `inter` as soon
as its group spans two nodes. Ranks are placed on nodes in blocks, as torchrun does: rank r
lives on node `r // ranks_per_node`.

`ranks_per_node` comes from, in order: an explicit argument, the `DHELIX_RANKS_PER_NODE`
environment variable (to emulate a multi-node cluster on one machine), torchrun's
`LOCAL_WORLD_SIZE`, and otherwise "every rank on one node".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

RANKS_PER_NODE_ENV = "DHELIX_RANKS_PER_NODE"


def _positive_int(value, source: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not an integer number of ranks per node")
    if number < 1:
        raise ValueError(f"{source}={value!r} must be >= 1")
    return number


@dataclass(frozen=True)
class NodeTopology:
    """Block placement of ranks on nodes. `ranks_per_node=None` means a single node."""

    ranks_per_node: Optional[int] = None

    def __post_init__(self):
        if self.ranks_per_node is not None:
            _positive_int(self.ranks_per_node, "ranks_per_node")

    @classmethod
    def detect(cls, ranks_per_node: Optional[int] = None) -> "NodeTopology":
        """The topology from the argument, else $DHELIX_RANKS_PER_NODE, else
        $LOCAL_WORLD_SIZE, else one node."""
        if ranks_per_node is not None:
            return cls(_positive_int(ranks_per_node, "ranks_per_node"))
        for name in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE"):
            value = os.environ.get(name)
            if value:
                return cls(_positive_int(value, name))
        return cls(None)

    def node_of(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def channel_for_group(self, ranks: Iterable[int]) -> str:
        """'inter' if the group's ranks sit on more than one node, else 'intra'."""
        return "inter" if self.spans_nodes(ranks) else "intra"

    def describe(self) -> str:
        if self.ranks_per_node is None:
            return "one node"
        return f"{self.ranks_per_node} ranks per node"


def tensor_parallel_ranks(tp_size: int, rank: int = 0) -> list[int]:
    """Ranks of the tensor-parallel group holding `rank` under Megatron's default rank order
    (TP varies fastest: groups are the aligned blocks [k*tp, (k+1)*tp))."""
    start = (rank // tp_size) * tp_size
    return list(range(start, start + tp_size))


def expert_parallel_ranks(ep_size: int, rank: int = 0) -> list[int]:
    """Ranks of the expert-parallel group holding `rank` under Megatron's default expert
    rank order with expert tensor parallelism 1 (the expert grid etp-ep-edp-pp: EP varies
    fastest, so groups are the aligned blocks [k*ep, (k+1)*ep))."""
    start = (rank // ep_size) * ep_size
    return list(range(start, start + ep_size))
