"""Baseline pairers for comparison benchmarks; both use the program order of each DAG and
produce the same `Pairing` structure as the DP search.

- sequential: no pairing. The whole forward layer, then the whole backward layer.
- round_robin: Wavelet-style interleaving without search. The k-th forward operator is paired
  with the k-th backward operator, one operator per strand per block, until the shorter strand
  runs out; the rest of the longer one runs alone. A pair that would co-run two communication
  operators on the same channel is illegal, so it is split into two solo blocks (forward
  first); merged solo runs follow `planner.blocks.merge_solo_runs`.
"""

from __future__ import annotations

from dhelix.dag import OpDAG, topological_sort
from planner.blocks import Block, Pairing, merge_solo_runs, shared_channels


def sequential_pairing(fwd: OpDAG, bwd: OpDAG) -> Pairing:
    """Forward layer then backward layer, no co-execution."""
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    blocks = [Block(f_order, ()), Block((), b_order)]
    return Pairing(f_order, b_order, blocks)


def round_robin_pairing(fwd: OpDAG, bwd: OpDAG) -> Pairing:
    """One forward op with one backward op per block, in program order (see module doc)."""
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    ops_f, ops_b = fwd.by_id(), bwd.by_id()
    blocks = []
    for k in range(max(len(f_order), len(b_order))):
        f = f_order[k:k + 1]
        b = b_order[k:k + 1]
        if f and b and shared_channels([ops_f[f[0]]], [ops_b[b[0]]]):
            blocks += [Block(f, ()), Block((), b)]
        else:
            blocks.append(Block(f, b))
    return Pairing(f_order, b_order, merge_solo_runs(blocks))
