"""Baseline pairers for comparison benchmarks; both use the program order of each DAG and
produce the same `Pairing` structure as the DP search.

- sequential: no pairing. The whole backward layer, then the whole forward layer: the
  backward frees its layer's saved activations before the forward saves the next layer's,
  so the two micro-batches never hold more than Megatron's schedule does when its backward
  starts (`planner.memory`); forward first would hold one layer more.
- round_robin: Wavelet-style interleaving without search. The k-th forward operator is paired
  with the k-th backward operator, one operator per strand per block, until the shorter strand
  runs out; the rest of the longer one runs alone. A pair that would co-run two communication
  operators on the same channel is illegal, so it is split into two solo blocks (forward
  first); merged solo runs follow `planner.blocks.merge_solo_runs`.
- staggered (Domino-style, for two halves of one micro-batch going the same direction): each
  program order is cut into *units* - a maximal run of computation operators, or one
  communication operator - and the second strand runs one unit behind the first:
  block k = (unit k of the first, unit k-1 of the second). Units alternate computation and
  communication, so every communication unit of one half is paired with a computation unit
  of the other (its collective overlaps that computation, as in Domino's intra-batch split);
  an illegal pair is split as above. Here `Pairing.fwd_order` is the first strand's order
  and `bwd_order` the second's.
"""

from __future__ import annotations

from dhelix.dag import OpDAG, topological_sort
from dhelix.dag import shared_channels
from planner.blocks import Block, Pairing, merge_solo_runs


def sequential_pairing(fwd: OpDAG, bwd: OpDAG) -> Pairing:
    """Backward layer then forward layer, no co-execution (module docstring)."""
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    blocks = [Block((), b_order), Block(f_order, ())]
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


def _units(dag: OpDAG, order) -> list[tuple]:
    """`order` cut into maximal computation runs and single communication operators."""
    ops = dag.by_id()
    units: list[list[str]] = []
    for op_id in order:
        if ops[op_id].kind == "comm" or not units or ops[units[-1][-1]].kind == "comm":
            units.append([op_id])
        else:
            units[-1].append(op_id)
    return [tuple(u) for u in units]


def staggered_pairing(first: OpDAG, second: OpDAG) -> Pairing:
    """Domino-style pairing of two strands in the same direction (see module doc): the
    second strand one unit behind the first, no search. Legal for `check_pairing(first,
    second, ...)`."""
    f_order, s_order = topological_sort(first), topological_sort(second)
    ops_f, ops_s = first.by_id(), second.by_id()
    units_f, units_s = _units(first, f_order), _units(second, s_order)
    blocks = []
    for k in range(max(len(units_f), len(units_s) + 1)):
        f = units_f[k] if k < len(units_f) else ()
        s = units_s[k - 1] if 0 <= k - 1 < len(units_s) else ()
        if f and s and shared_channels([ops_f[i] for i in f], [ops_s[i] for i in s]):
            blocks += [Block(f, ()), Block((), s)]
        elif f or s:
            blocks.append(Block(f, s))
    return Pairing(f_order, s_order, merge_solo_runs(blocks))
