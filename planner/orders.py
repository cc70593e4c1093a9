"""Candidate operator sequences: bounded, deduplicated topological orders of one DAG.

The freedom is in the `movable` operators (wgrad GEMMs, MoE routers): every other operator
keeps its program order. A candidate places each movable operator into a *slot* of the fixed
sequence (slot s = after the s-th fixed operator) at most `wgrad_move` slots away from its
program slot; movable operators sharing a slot keep their program relative order. Candidates
that break a dependency are dropped, so every candidate is a topological order.

Candidates are produced closest-first: by total movement (sum over movable operators of
|slot - program slot|), ties broken deterministically, starting with the program order itself,
and the list stops at `max_orders`.
"""

from __future__ import annotations

from typing import Iterator

from dhelix.dag import OpDAG, topological_sort, topological_violation


def _slot_ranges(dag: OpDAG, base: list[str], wgrad_move: int):
    """Fixed ops (program order), movable ops (program order), each movable op's program
    slot and the slot range its dependencies on fixed ops and `wgrad_move` allow."""
    ops = dag.by_id()
    fixed = [i for i in base if not ops[i].movable]
    movable = [i for i in base if ops[i].movable]
    fixed_index = {op_id: k for k, op_id in enumerate(fixed)}
    base_slot, ranges = movable_slots(dag, base), {}
    for m in movable:
        lo = max(0, base_slot[m] - wgrad_move)
        hi = min(len(fixed), base_slot[m] + wgrad_move)
        for dep in ops[m].deps:  # must come after every fixed op it reads
            if dep in fixed_index:
                lo = max(lo, fixed_index[dep] + 1)
        for other in fixed:  # must come before every fixed op that reads it
            if m in ops[other].deps:
                hi = min(hi, fixed_index[other])
        ranges[m] = (lo, hi)
    return fixed, movable, base_slot, ranges


def _offset_vectors(movable, base_slot, ranges, total) -> Iterator[tuple[int, ...]]:
    """Every slot assignment with sum |slot - program slot| == total, inside the ranges, in a
    fixed order (smaller moves and earlier ops first)."""

    def rec(k: int, left: int):
        if k == len(movable):
            if left == 0:
                yield ()
            return
        m = movable[k]
        lo, hi = ranges[m]
        for step in range(0, left + 1):
            for delta in ((0,) if step == 0 else (-step, step)):
                slot = base_slot[m] + delta
                if lo <= slot <= hi:
                    for rest in rec(k + 1, left - step):
                        yield (slot,) + rest

    yield from rec(0, total)


def _assemble(fixed, movable, slots) -> tuple[str, ...]:
    by_slot: dict[int, list[str]] = {}
    for m, s in zip(movable, slots):
        by_slot.setdefault(s, []).append(m)
    order: list[str] = list(by_slot.get(0, []))
    for k, op_id in enumerate(fixed, start=1):
        order.append(op_id)
        order.extend(by_slot.get(k, []))
    return tuple(order)


def candidate_orders(dag: OpDAG, max_orders: int = 64, wgrad_move: int = 3) -> list[tuple]:
    """Up to `max_orders` distinct topological orders of `dag`, the program order first, then
    by increasing total movement of the movable ops (each moved by at most `wgrad_move`
    slots). Guarantees: every order is a permutation of the DAG's ops that respects every
    dependency; no order appears twice; the result is deterministic."""
    if max_orders < 1:
        raise ValueError(f"max_orders must be >= 1, got {max_orders}")
    if wgrad_move < 0:
        raise ValueError(f"wgrad_move must be >= 0, got {wgrad_move}")
    base = topological_sort(dag)
    fixed, movable, base_slot, ranges = _slot_ranges(dag, base, wgrad_move)
    result: list[tuple] = [tuple(base)]
    seen = {tuple(base)}
    # The ranges already honour dependencies on fixed ops; only movable->movable dependencies
    # can still fail, so the scan is bounded generously but finitely.
    budget = 200 * max_orders
    max_total = sum(max(base_slot[m] - ranges[m][0], ranges[m][1] - base_slot[m])
                    for m in movable)
    for total in range(1, max_total + 1):
        for slots in _offset_vectors(movable, base_slot, ranges, total):
            if len(result) >= max_orders or budget <= 0:
                return result
            budget -= 1
            order = _assemble(fixed, movable, slots)
            if order in seen or topological_violation(dag, order):
                continue
            seen.add(order)
            result.append(order)
    return result


def movable_slots(dag: OpDAG, order) -> dict:
    """Slot of every movable op in `order`: how many non-movable ops precede it."""
    ops, fixed_seen, slots = dag.by_id(), 0, {}
    for op_id in order:
        if ops[op_id].movable:
            slots[op_id] = fixed_seen
        else:
            fixed_seen += 1
    return slots


def movement(dag: OpDAG, order) -> int:
    """Total slot movement of the movable ops of `order` relative to the program order (the
    quantity candidates are sorted by)."""
    base, now = movable_slots(dag, topological_sort(dag)), movable_slots(dag, order)
    return sum(abs(base[m] - now[m]) for m in base)
