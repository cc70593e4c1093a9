"""The block model: how long one block (a forward segment co-executed with a backward segment)
takes, and when each of its operators runs.

Model (fluid co-execution):
- Each strand runs its segment's operators one after another, in order (this is what keeps
  intra-strand dependencies satisfied without any cross-strand reasoning).
- At any moment each strand has at most one current operator. While both strands have one,
  the two co-run and each progresses at 1/sigma(f, b) of its solo speed, sigma = 2 - OEF
  (`planner.costs`). Computation of both strands sharing the compute lane is the case
  OEF = 0 (sigma 2: the lane is time-shared, the pair takes T_f + T_b); communication on its
  own channel lane next to computation is the case OEF ~ 0.75 (mostly hidden).
- When one strand has finished its segment, the other runs the rest of its segment solo.
- The block ends when both segments are done (the barrier); the next block starts then.

`simulate_block` is the reference implementation (one block, with a per-operator timeline).
`block_cost_table` computes the same times for every block of a pair of orders at once,
vectorised over the start positions, for the DP. Both follow the same event sequence, so they
agree to floating-point rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dhelix.dag import topological_sort
from planner.blocks import comm_mask
from planner.costs import CostModel

_DONE = 1e30  # remaining work of a strand that has finished (never the minimum)


@dataclass(frozen=True)
class OpSpan:
    """When one operator ran, relative to the start of its block."""

    strand: str  # "fwd" or "bwd"
    op: str
    start: float
    end: float


@dataclass(frozen=True)
class BlockSim:
    """Result of simulating one block: its duration, each operator's span, and the
    (fwd op, bwd op) pairs that co-ran for a positive time."""

    ms: float
    spans: tuple
    corun: frozenset = field(default_factory=frozenset)


def simulate_block(fwd_ops: Sequence[str], bwd_ops: Sequence[str], costs: CostModel) -> BlockSim:
    """Duration and timeline of one block under the fluid model (module docstring). Either
    segment may be empty; a solo segment takes the sum of its solo times."""
    solo = {"fwd": costs.solo_f, "bwd": costs.solo_b}
    seqs = {"fwd": list(fwd_ops), "bwd": list(bwd_ops)}
    pos = {"fwd": 0, "bwd": 0}
    work = {s: (solo[s][seqs[s][0]] if seqs[s] else _DONE) for s in seqs}
    begun = {s: 0.0 for s in seqs}
    spans: list[OpSpan] = []
    corun = set()
    t = 0.0
    while pos["fwd"] < len(seqs["fwd"]) or pos["bwd"] < len(seqs["bwd"]):
        both = pos["fwd"] < len(seqs["fwd"]) and pos["bwd"] < len(seqs["bwd"])
        pair = (seqs["fwd"][pos["fwd"]], seqs["bwd"][pos["bwd"]]) if both else None
        sigma = costs.sigma[pair] if both else 1.0
        step = min(work["fwd"], work["bwd"])
        t = t + step * sigma
        if both:
            corun.add(pair)
        for s in ("fwd", "bwd"):
            work[s] = work[s] - step
        for s in ("fwd", "bwd"):
            if pos[s] < len(seqs[s]) and work[s] <= 0.0:
                spans.append(OpSpan(s, seqs[s][pos[s]], begun[s], t))
                pos[s] += 1
                begun[s] = t
                work[s] = solo[s][seqs[s][pos[s]]] if pos[s] < len(seqs[s]) else _DONE
    return BlockSim(t, tuple(spans), frozenset(corun))


def _prefix(values: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(values)])


def _mask_prefix(masks: list[int]) -> np.ndarray:
    """seg[a, b] = OR of masks[a:b] (0 where b <= a)."""
    n = len(masks)
    seg = np.zeros((n + 1, n + 1), dtype=np.int64)
    for a in range(n):
        acc = 0
        for b in range(a + 1, n + 1):
            acc |= masks[b - 1]
            seg[a, b] = acc
    return seg


def block_cost_table(fwd_order: Sequence[str], bwd_order: Sequence[str], costs: CostModel,
                     fwd_masks: Sequence[int], bwd_masks: Sequence[int]) -> np.ndarray:
    """Duration of every block of the two orders: `P[i, j, a, b]` is the time of the block
    pairing fwd_order[a:i] with bwd_order[b:j] (a <= i, b <= j, not both empty), `inf` for an
    empty or illegal block (same communication channel in both segments; `*_masks` are the
    per-op channel bits of `comm_mask`). Equal, to rounding, to `simulate_block` of each block.

    How: for every start (a, b) one event sweep runs both strands from a and b to the ends of
    their orders. A block ending at (i, j) behaves exactly like that sweep until the first of
    its two segments completes (at the time tf[i] or tb[j] the sweep records), after which the
    other strand runs the rest of its segment solo; so all ends are read off one sweep."""
    n, m = len(fwd_order), len(bwd_order)
    tf_solo = np.array([costs.solo_f[o] for o in fwd_order], dtype=float)
    tb_solo = np.array([costs.solo_b[o] for o in bwd_order], dtype=float)
    pf, pb = _prefix(tf_solo), _prefix(tb_solo)
    table = np.full((n + 1, m + 1, n + 1, m + 1), np.inf)  # [a, b, i, j] while filling

    if n and m:
        work_f = np.append(tf_solo, _DONE)
        work_b = np.append(tb_solo, _DONE)
        sig = np.ones((n + 1, m + 1))
        sig[:n, :m] = [[costs.sigma[(f, b)] for b in bwd_order] for f in fwd_order]
        start_f = np.repeat(np.arange(n), m)
        start_b = np.tile(np.arange(m), n)
        count = n * m
        rows = np.arange(count)
        k, l = start_f.copy(), start_b.copy()
        wf, wb = work_f[k], work_b[l]
        t = np.zeros(count)
        # at the time the forward strand has completed i ops: time, and the backward strand's
        # completed-op count and remaining work of its current op (and vice versa)
        tf = np.full((count, n + 1), np.inf)
        b_done_at_f = np.zeros((count, n + 1), dtype=np.int64)
        b_left_at_f = np.zeros((count, n + 1))
        tb = np.full((count, m + 1), np.inf)
        f_done_at_b = np.zeros((count, m + 1), dtype=np.int64)
        f_left_at_b = np.zeros((count, m + 1))
        for _ in range(n + m):
            live = (k < n) | (l < m)
            if not live.any():
                break
            step = np.where(live, np.minimum(wf, wb), 0.0)
            t = t + step * sig[k, l]
            wf, wb = wf - step, wb - step
            fin_f = (k < n) & (wf <= 0.0)
            fin_b = (l < m) & (wb <= 0.0)
            k, l = k + fin_f, l + fin_b
            wf = np.where(fin_f, work_f[k], wf)
            wb = np.where(fin_b, work_b[l], wb)
            r = rows[fin_f]
            tf[r, k[r]] = t[r]
            b_done_at_f[r, k[r]] = l[r]
            b_left_at_f[r, k[r]] = wb[r]
            r = rows[fin_b]
            tb[r, l[r]] = t[r]
            f_done_at_b[r, l[r]] = k[r]
            f_left_at_b[r, l[r]] = wf[r]
        ends_i = np.arange(n + 1)[None, :, None]
        ends_j = np.arange(m + 1)[None, None, :]
        tfi, tbj = tf[:, :, None], tb[:, None, :]
        # rest of the backward segment [.., j) after the forward one finished (and vice versa)
        cb = b_done_at_f[:, :, None]
        rest_b = np.where(cb < ends_j,
                          b_left_at_f[:, :, None] + pb[ends_j] - pb[np.minimum(cb + 1, m)], 0.0)
        cf = f_done_at_b[:, None, :]
        rest_f = np.where(cf < ends_i,
                          f_left_at_b[:, None, :] + pf[ends_i] - pf[np.minimum(cf + 1, n)], 0.0)
        with np.errstate(invalid="ignore"):
            both = np.where(tfi <= tbj, tfi + rest_b, tbj + rest_f)
        valid = (ends_i > start_f[:, None, None]) & (ends_j > start_b[:, None, None])
        both = np.where(valid, both, np.inf)
        table[:n, :m] = both.reshape(n, m, n + 1, m + 1)

    # one strand alone: the sum of its solo times (every a < i at once, then every b < j)
    starts, ends = np.triu_indices(n + 1, k=1)
    same = np.arange(m + 1)[None, :]
    table[starts[:, None], same, ends[:, None], same] = (pf[ends] - pf[starts])[:, None]
    starts, ends = np.triu_indices(m + 1, k=1)
    same = np.arange(n + 1)[None, :]
    table[same, starts[:, None], same, ends[:, None]] = (pb[ends] - pb[starts])[:, None]

    seg_f, seg_b = _mask_prefix(list(fwd_masks)), _mask_prefix(list(bwd_masks))
    clash = (seg_f[:, None, :, None] & seg_b[None, :, None, :]) != 0
    table[clash] = np.inf
    return np.ascontiguousarray(table.transpose(2, 3, 0, 1))  # -> [i, j, a, b]


def op_masks(order: Sequence[str], ops: dict) -> list[int]:
    """Per-op channel bits (see `planner.blocks.comm_mask`) of an order."""
    return [comm_mask([ops[o]]) for o in order]


def collective_sigma(costs: CostModel, op_id: str, direction: str, other_compute) -> float:
    """Co-run slowdown of computation beside collective `op_id` (of `direction`), from its
    pairs with the other direction's computations `other_compute` (the profile measures
    pairs across the two strands only); 1.0 when there are none.

    Where the profile timed the computation itself inside those pairs
    (`CostModel.compute_sigma`): their mean weighted by the computations' solo times (the
    slowdown of that much computation as a whole; a tiny operator's entry, whose fixed
    costs of a few tenths of a ms read as sigma 1.8-3.3 on the emulated GPU, weighs what it
    computes). Otherwise from the pairs' makespans: the median of the sigma of the pairs
    whose computation takes at least as long as the collective alone, else of all of them.
    A computation shorter than the collective ends inside it, the pair's makespan is the
    collective's whatever the computation's slowdown, and its sigma reads ~1.0 (an emulated
    GPU slowing every kernel beside a collective by 25% read 1.0-1.2 from such pairs, where
    their computations' own times read 1.25-1.43). The median, not the mean: a pair of a
    tiny operator carries its noise divided by the tiny operator's time, and one such entry
    (sigma 52, an emulated profile at S = 50) made a mean several times every other entry."""
    solo = costs.solo_f if direction == "fwd" else costs.solo_b
    other_solo = costs.solo_b if direction == "fwd" else costs.solo_f
    key = (lambda o: (op_id, o)) if direction == "fwd" else (lambda o: (o, op_id))
    timed = [o for o in other_compute if key(o) in costs.compute_sigma]
    if timed:
        work = sum(other_solo[o] for o in timed)
        return sum(other_solo[o] * costs.compute_sigma[key(o)] for o in timed) / work
    measured = [o for o in other_compute if key(o) in costs.sigma]
    long_enough = [o for o in measured if other_solo[o] >= solo[op_id]]
    values = [costs.sigma[key(o)] for o in (long_enough or measured)]
    return float(np.median(values)) if values else 1.0


def strand_alone_ms(order: Sequence[str], ops: dict, costs: CostModel, direction: str,
                    other_ops: dict) -> float:
    """How long one strand's operators `order` take alone as the strand executor runs them
    (`dhelix.runtime.strand_executor.run_alone`), where the block model's solo segment
    counts the sum of the solo times: a collective is issued when the strand reaches it and
    proceeds on its channel while the strand goes on; a computation waits only for the
    collectives it reads (its DAG deps); collectives of one channel run one after another
    at their solo speed; computation progresses at 1/sigma while collectives are in flight
    (`collective_sigma`, the largest of those in flight), as in the streamed simulation
    (`planner.streamed`); the segment ends when its collectives have completed. `ops` /
    `other_ops`: op id -> OpNode of this direction / the other one. Never more than the
    sum of the solo times when every sigma is <= 2."""
    solo = costs.solo_f if direction == "fwd" else costs.solo_b
    other_compute = [o for o, node in other_ops.items() if node.kind != "comm"]
    sigma = {o: collective_sigma(costs, o, direction, other_compute)
             for o in order if ops[o].kind == "comm"}
    channels: dict = {}
    done: set = set()
    compute = None  # [op id, remaining solo work]
    t, position = 0.0, 0
    while True:
        while compute is None and position < len(order):
            op = ops[order[position]]
            if op.kind == "comm":
                channels.setdefault(op.channel, []).append([op.id, solo[op.id]])
                position += 1
                continue
            if any(ops[d].kind == "comm" and d not in done for d in op.deps if d in ops):
                break  # reads a collective still in flight
            compute = [op.id, solo[op.id]]
            position += 1
        heads = [queue[0] for queue in channels.values() if queue]
        if compute is None and not heads:
            if position < len(order):
                raise ValueError(f"{order[position]!r} waits for a collective never issued "
                                 "(order not legal)")
            return t
        slowdown = max(sigma[o] for o, _ in heads) if heads and compute is not None else 1.0
        # the next event: a collective's end (solo speed) or the computation's (1/slowdown)
        step = min([work for _, work in heads]
                   + ([compute[1] * slowdown] if compute is not None else []))
        t += step
        for item in heads:
            item[1] -= step
        if compute is not None:
            compute[1] -= step / slowdown
        for queue in channels.values():
            if queue and queue[0][1] <= 1e-12:
                done.add(queue.pop(0)[0])
        if compute is not None and compute[1] <= 1e-12:
            done.add(compute[0])
            compute = None


def unhidden_alone_ms(dag, solo: dict) -> float:
    """The least time a strand's collectives keep its computation waiting when it runs
    alone with nothing beside it (a step's first forward without pipelining): its DAG's
    longest path by the solo times, collectives included, less the sum of its
    computations' solo times, or 0. One computation runs at a time, so the strand takes at
    least the larger of the two; a layer whose collectives all stand on its one dependency
    chain (a dense TP forward; an MoE forward's dispatch and combine) keeps every one of
    them exposed. Nothing is slowed here, so it is a lower bound. `solo`: op id -> ms."""
    ops = dag.by_id()
    finish: dict = {}
    for op_id in topological_sort(dag):
        finish[op_id] = solo[op_id] + max((finish[d] for d in ops[op_id].deps if d in finish),
                                          default=0.0)
    longest = max(finish.values(), default=0.0)
    computation = sum(solo[op.id] for op in dag.ops if op.kind != "comm")
    return max(0.0, longest - computation)
