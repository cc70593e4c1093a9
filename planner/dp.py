"""Joint segmentation and pairing by dynamic programming.

For one forward order F (n ops) and one backward order B (m ops), let T(i, j) be the shortest
time to run F[:i] and B[:j] as a sequence of blocks. The last block pairs F[a:i] with B[b:j]
for some a <= i, b <= j (not both equal), so

    T(0, 0) = 0,   T(i, j) = min over (a, b) of T(a, b) + P(F[a:i], B[b:j]),

with P the block model of `planner.cosched` (inf for illegal blocks). This is the paper's
recurrence T(i,j) = min(T(i-1,j) + P(i,-), T(i,j-1) + P(-,j), T(i-1,j-1) + P(i,j)) with the
segment boundaries searched jointly instead of fixed beforehand: a "segment" here is any run
of consecutive ops. It is exact for the model: every sequence of blocks is a path from (0, 0)
to (n, m), and the last block of an optimal path leaves an optimal prefix, because a block's
time depends only on its own two segments (blocks are separated by barriers).

The two solo blocks (all of F, then all of B, or the other way round) form a legal plan, so
T(n, m) never exceeds the sequential time.

With a memory bound (`planner.memory.MemoryBound`), every block whose worst case
(`planner.memory.block_peak_table`: the most it can hold above the layer pair's start over
any interleaving of its segments) exceeds the budget is masked out. The path "all of B, then
all of F" of the program orders fits the budget by its definition, so the bounded search
still has a plan, and its time still never exceeds the sequential time; an order pair with
no path inside the budget is skipped, and so is an order in which a value's last reader is
not the one of program order (`planner.memory.frees_as_measured`).

The search runs this DP for every pair of candidate orders (`planner.orders`) and keeps the
fastest plan; on ties, the one with the least movement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dhelix.dag import OpDAG
from planner.blocks import Block, Pairing, merge_solo_runs
from planner.cosched import block_cost_table, op_masks
from planner.costs import CostModel
from planner.memory import MemoryBound, block_peak_table, frees_as_measured
from planner.orders import candidate_orders

_TIE = 1e-9  # relative margin a later candidate must beat the best by


@dataclass(frozen=True)
class SearchResult:
    """Best pairing found, its predicted time, and what the search covered."""

    pairing: Pairing
    planned_ms: float
    fwd_orders: int
    bwd_orders: int
    seconds: float


def pair_orders(table: np.ndarray, fwd_order, bwd_order) -> tuple[float, list[Block]]:
    """Run the DP over a block cost table `table[i, j, a, b]` (see `block_cost_table`).
    Returns the optimal makespan and the blocks of one optimal plan, in execution order."""
    n, m = len(fwd_order), len(bwd_order)
    best = np.full((n + 1, m + 1), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((n + 1, m + 1, 2), dtype=np.int64)
    for i in range(n + 1):
        for j in range(m + 1):
            if i == 0 and j == 0:
                continue
            cand = best[: i + 1, : j + 1] + table[i, j, : i + 1, : j + 1]
            flat = int(cand.argmin())
            best[i, j] = cand.flat[flat]
            back[i, j] = divmod(flat, j + 1)
    blocks = []
    i, j = n, m
    while i or j:
        a, b = back[i, j]
        blocks.append(Block(tuple(fwd_order[a:i]), tuple(bwd_order[b:j])))
        i, j = int(a), int(b)
    blocks.reverse()
    return float(best[n, m]), blocks


def dp_search(fwd: OpDAG, bwd: OpDAG, costs: CostModel, max_orders: int = 64,
              wgrad_move: int = 3, memory: MemoryBound | None = None) -> SearchResult:
    """The best legal pairing over every pair of candidate orders (at most `max_orders` per
    direction, movable ops moved at most `wgrad_move` slots) and every segmentation, using
    only blocks within `memory`'s budget when given (module docstring).
    Guarantees: the pairing satisfies `planner.blocks.check_pairing`; its predicted time is
    the DP optimum and never exceeds the sequential time; with `memory`, every block's
    worst case is within the budget."""
    started = time.perf_counter()
    fwd_orders = candidate_orders(fwd, max_orders, wgrad_move)
    bwd_orders = candidate_orders(bwd, max_orders, wgrad_move)
    if memory is not None:  # orders whose frees happen where they were measured
        fwd_orders = [o for o in fwd_orders if frees_as_measured(fwd, o)]
        bwd_orders = [o for o in bwd_orders if frees_as_measured(bwd, o)]
    ops_f, ops_b = fwd.by_id(), bwd.by_id()
    best_ms, best = np.inf, None
    for f_order in fwd_orders:
        f_masks = op_masks(f_order, ops_f)
        for b_order in bwd_orders:
            table = block_cost_table(f_order, b_order, costs, f_masks, op_masks(b_order, ops_b))
            if memory is not None:
                peak = block_peak_table(f_order, b_order, memory.fwd, memory.bwd,
                                        memory.input_bytes)
                table[peak > memory.budget_bytes] = np.inf
            ms, blocks = pair_orders(table, f_order, b_order)
            if not np.isfinite(ms):
                continue  # no path within the memory budget for these orders
            if best is None or ms < best_ms * (1 - _TIE):
                best_ms, best = ms, Pairing(f_order, b_order, merge_solo_runs(blocks))
    if best is None:
        raise ValueError("no plan within the memory budget: the program orders' sequential "
                         "plan should always fit it (internal error)")
    return SearchResult(best, best_ms, len(fwd_orders), len(bwd_orders),
                        time.perf_counter() - started)
