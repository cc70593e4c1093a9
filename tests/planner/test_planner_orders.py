"""Candidate orders: topological, deduplicated, bounded, and exactly the documented set."""

import random

import pytest
from tests.planner.planner_reference import all_topological_orders, random_dag

from dhelix.dag import OpDAG, OpNode, topological_sort, topological_violation
from planner.orders import candidate_orders, movable_slots, movement
from planner.synthetic import layer_dags


def _in_documented_set(dag, order, k):
    """The definition in planner.orders, checked directly on one permutation."""
    ops, base = dag.by_id(), topological_sort(dag)
    fixed = [o for o in base if not ops[o].movable]
    if [o for o in order if not ops[o].movable] != fixed:
        return False
    base_slots, slots = movable_slots(dag, base), movable_slots(dag, order)
    if any(abs(slots[m] - base_slots[m]) > k for m in slots):
        return False
    rank = {o: i for i, o in enumerate(base)}
    movables = [o for o in order if ops[o].movable]
    for a, b in zip(movables, movables[1:]):  # same slot -> program order
        if slots[a] == slots[b] and rank[a] > rank[b]:
            return False
    return True


def test_candidates_are_exactly_the_documented_set_on_random_dags():
    rng = random.Random(7)
    for _ in range(150):
        dag = random_dag(rng, "bwd", rng.randint(1, 7), p_dep=0.3, p_movable=0.5)
        k = rng.randint(0, 3)
        got = candidate_orders(dag, max_orders=10_000, wgrad_move=k)
        expected = {p for p in all_topological_orders(dag) if _in_documented_set(dag, p, k)}
        assert len(got) == len(set(got)), "duplicates"
        assert set(got) == expected
        assert got[0] == tuple(topological_sort(dag))


def test_candidates_are_bounded_sorted_by_movement_and_topological():
    _, bwd = layer_dags()
    for k in (0, 1, 3, 6):
        orders = candidate_orders(bwd, max_orders=50, wgrad_move=k)
        assert len(orders) <= 50
        moves = [movement(bwd, o) for o in orders]
        assert moves == sorted(moves)
        assert all(topological_violation(bwd, o) is None for o in orders)
        for order in orders:
            base, now = movable_slots(bwd, orders[0]), movable_slots(bwd, order)
            assert all(abs(now[m] - base[m]) <= k for m in now)
    assert len(candidate_orders(bwd, 50, 0)) == 1
    assert len(candidate_orders(bwd, 50, 3)) == 50
    assert candidate_orders(bwd, 50, 3) == candidate_orders(bwd, 50, 3)  # deterministic


def test_wgrad_moves_only_forward_past_its_consumers_limits():
    # w reads a and must precede c; it may sit in slot 1 or 2 only
    dag = OpDAG("bwd", [OpNode("a", "comp", "compute", (), "a"),
                        OpNode("w", "comp", "compute", ("a",), "w", movable=True),
                        OpNode("b", "comp", "compute", ("a",), "b"),
                        OpNode("c", "comp", "compute", ("b", "w"), "c"),
                        OpNode("d", "comp", "compute", ("c",), "d")])
    assert candidate_orders(dag, 100, 5) == [("a", "w", "b", "c", "d"),
                                             ("a", "b", "w", "c", "d")]


def test_bad_arguments_are_rejected():
    _, bwd = layer_dags()
    with pytest.raises(ValueError, match="max_orders"):
        candidate_orders(bwd, 0, 1)
    with pytest.raises(ValueError, match="wgrad_move"):
        candidate_orders(bwd, 5, -1)
