"""Test helpers for the planner: random small DAGs and profiles, and brute-force references
(all topological orders; all segmentations/pairings) that share nothing with the DP except
the one-block simulator `simulate_block`."""

from __future__ import annotations

import itertools
import random

from dhelix.dag import OpDAG, OpNode, shared_channels, topological_violation
from planner.blocks import Block
from planner.cosched import simulate_block
from profiler.profile_file import Profile, pair_key

CLASSES = {"comp": ["gemm", "attention", "norm"], "intra": ["all_gather", "reduce_scatter"],
           "inter": ["all_to_all", "reduce_scatter"]}


def random_dag(rng: random.Random, direction: str, n: int, p_dep: float = 0.5,
               p_movable: float = 0.4) -> OpDAG:
    """n ops with random kind/channel/class, deps only on earlier ops, some movable comps."""
    ops = []
    for k in range(n):
        channel = rng.choice(["compute", "compute", "intra", "inter"])
        kind = "comp" if channel == "compute" else "comm"
        deps = tuple(f"{direction}{d}" for d in range(k) if rng.random() < p_dep)
        op_class = rng.choice(CLASSES["comp" if kind == "comp" else channel])
        ops.append(OpNode(f"{direction}{k}", kind, channel, deps,
                          f"{direction}{k}:{op_class}", kind == "comp" and
                          rng.random() < p_movable, op_class))
    return OpDAG(direction, ops)


def random_profile(rng: random.Random, fwd: OpDAG, bwd: OpDAG, p_pair: float = 0.5) -> Profile:
    """Solo times in [0.1, 2] ms, and pair times for a random subset of cross-strand pairs
    with OEF in [-0.3, 1]."""
    solo = {op.cost_key: round(rng.uniform(0.1, 2.0), 3) for op in fwd.ops + bwd.ops}
    pairs = {}
    for a in fwd.ops:
        for b in bwd.ops:
            if rng.random() < p_pair:
                t_a, t_b = solo[a.cost_key], solo[b.cost_key]
                value = rng.uniform(-0.3, 1.0)
                pairs[pair_key(a.cost_key, b.cost_key)] = round(
                    t_a + t_b - value * min(t_a, t_b), 4)
    meta = {"repeats": 3, "warmup": 1, "ranks": 2, "created": "test"}
    return Profile(hardware="test-gpu", solo=solo, pairs=pairs, meta=meta)


def all_topological_orders(dag: OpDAG) -> list[tuple]:
    """Every permutation that respects the dependencies (tiny DAGs only)."""
    return [p for p in itertools.permutations(dag.ids) if topological_violation(dag, p) is None]


def all_block_sequences(fwd_order, bwd_order, legal):
    """Every way to cut both orders into a sequence of blocks whose every block is legal."""
    n, m = len(fwd_order), len(bwd_order)

    def rec(i, j):
        if i == n and j == m:
            yield []
            return
        for i2 in range(i, n + 1):
            for j2 in range(j, m + 1):
                if (i2, j2) == (i, j):
                    continue
                block = Block(tuple(fwd_order[i:i2]), tuple(bwd_order[j:j2]))
                if not legal(block):
                    continue
                for rest in rec(i2, j2):
                    yield [block] + rest

    yield from rec(0, 0)


def exhaustive_best(fwd: OpDAG, bwd: OpDAG, costs, fwd_orders, bwd_orders) -> float:
    """Minimum total time over every order pair and every legal block sequence, each block
    timed independently with `simulate_block`."""
    ops_f, ops_b = fwd.by_id(), bwd.by_id()

    def legal(block):
        return not shared_channels([ops_f[o] for o in block.fwd], [ops_b[o] for o in block.bwd])

    times: dict[Block, float] = {}

    def block_ms(block):
        if block not in times:
            times[block] = simulate_block(block.fwd, block.bwd, costs).ms
        return times[block]

    best = float("inf")
    for f_order in fwd_orders:
        for b_order in bwd_orders:
            for blocks in all_block_sequences(f_order, b_order, legal):
                best = min(best, sum(block_ms(b) for b in blocks))
    return best
