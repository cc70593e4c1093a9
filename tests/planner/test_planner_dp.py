"""The block model and the joint segmentation/pairing DP against brute force."""

import math
import random

import numpy as np
import pytest
from tests.planner.planner_reference import exhaustive_best, random_dag, random_profile

from dhelix.dag import OpDAG, OpNode, shared_channels, topological_violation
from planner.blocks import Block, Pairing, layer_seam, pairing_violation
from planner.cosched import block_cost_table, op_masks, simulate_block, strand_alone_ms, \
    unhidden_alone_ms
from planner.costs import build_cost_model
from planner.dp import dp_search
from planner.orders import candidate_orders
from planner.synthetic import layer_dags, layer_profile
from profiler.profile_file import Profile, pair_key


def _case(seed, n_max=4, m_max=4):
    rng = random.Random(seed)
    fwd = random_dag(rng, "fwd", rng.randint(1, n_max))
    bwd = random_dag(rng, "bwd", rng.randint(1, m_max))
    profile = random_profile(rng, fwd, bwd) if rng.random() < 0.8 else None
    return fwd, bwd, build_cost_model(fwd, bwd, profile)


def _one_op(direction, op_id, channel, key):
    kind = "comp" if channel == "compute" else "comm"
    return OpDAG(direction, [OpNode(op_id, kind, channel, (), key, False, "x")])


def _profile(solo, pairs):
    return Profile("hw", solo, {pair_key(*k.split("|")): v for k, v in pairs.items()},
                   {"repeats": 1, "warmup": 0, "ranks": 1, "created": "t"})


def test_simulated_pair_reproduces_the_measured_pair_time():
    fwd = _one_op("fwd", "g", "compute", "gemm")
    bwd = _one_op("bwd", "c", "intra", "ag")
    costs = build_cost_model(fwd, bwd, _profile({"gemm": 3.0, "ag": 1.0}, {"gemm|ag": 3.4}))
    sim = simulate_block(["g"], ["c"], costs)
    assert sim.ms == pytest.approx(3.4)
    assert sim.corun == {("g", "c")}
    # and the DP picks the paired block because 3.4 < 3 + 1
    result = dp_search(fwd, bwd, costs)
    assert result.planned_ms == pytest.approx(3.4)
    assert len(result.pairing.blocks) == 1


def test_same_channel_communication_is_never_paired_even_if_profitable():
    fwd = _one_op("fwd", "a", "intra", "ag")
    bwd = _one_op("bwd", "b", "intra", "rs")
    # a (bogus) profile claiming perfect overlap must not tempt the DP
    costs = build_cost_model(fwd, bwd, _profile({"ag": 1.0, "rs": 1.0}, {"ag|rs": 1.0}))
    result = dp_search(fwd, bwd, costs)
    assert result.planned_ms == pytest.approx(2.0)
    assert all(not block.paired for block in result.pairing.blocks)
    # intra with cross-node is allowed and used
    bwd_x = _one_op("bwd", "b", "inter", "rs")
    costs = build_cost_model(fwd, bwd_x, _profile({"ag": 1.0, "rs": 1.0}, {"ag|rs": 1.2}))
    assert dp_search(fwd, bwd_x, costs).planned_ms == pytest.approx(1.2)


def test_vectorised_block_table_equals_the_reference_simulation():
    for seed in range(40):
        fwd, bwd, costs = _case(seed, 6, 7)
        ops_f, ops_b = fwd.by_id(), bwd.by_id()
        f_order = candidate_orders(fwd, 4, 2)[-1]
        b_order = candidate_orders(bwd, 4, 2)[-1]
        table = block_cost_table(f_order, b_order, costs, op_masks(f_order, ops_f),
                                 op_masks(b_order, ops_b))
        n, m = len(f_order), len(b_order)
        for i in range(n + 1):
            for j in range(m + 1):
                for a in range(i + 1):
                    for b in range(j + 1):
                        seg_f, seg_b = f_order[a:i], b_order[b:j]
                        illegal = shared_channels([ops_f[o] for o in seg_f],
                                                  [ops_b[o] for o in seg_b])
                        if (a, b) == (i, j) or illegal:
                            assert table[i, j, a, b] == math.inf
                        else:
                            expected = simulate_block(seg_f, seg_b, costs).ms
                            assert table[i, j, a, b] == pytest.approx(expected, rel=1e-9), \
                                (seed, seg_f, seg_b)


def test_dp_equals_exhaustive_search_on_random_small_problems():
    checked = 0
    for seed in range(120):
        fwd, bwd, costs = _case(1000 + seed)
        f_orders = candidate_orders(fwd, 3, 2)
        b_orders = candidate_orders(bwd, 3, 2)
        result = dp_search(fwd, bwd, costs, max_orders=3, wgrad_move=2)
        best = exhaustive_best(fwd, bwd, costs, f_orders, b_orders)
        assert result.planned_ms == pytest.approx(best, rel=1e-9, abs=1e-12), seed
        # the pairing it returns really takes that long and is legal
        total = sum(simulate_block(b.fwd, b.bwd, costs).ms for b in result.pairing.blocks)
        assert total == pytest.approx(result.planned_ms, rel=1e-9)
        assert pairing_violation(fwd, bwd, result.pairing) is None
        checked += len(f_orders) * len(b_orders)
    assert checked > 120  # some cases really had several candidate orders


def test_dp_never_exceeds_sequential_and_emits_only_legal_topological_plans():
    for seed in range(200):
        fwd, bwd, costs = _case(5000 + seed, 7, 8)
        result = dp_search(fwd, bwd, costs, max_orders=8, wgrad_move=3)
        assert result.planned_ms <= costs.sequential_ms() * (1 + 1e-12)
        pairing = result.pairing
        assert topological_violation(fwd, pairing.fwd_order) is None
        assert topological_violation(bwd, pairing.bwd_order) is None
        assert pairing_violation(fwd, bwd, pairing) is None
        ops_f, ops_b = fwd.by_id(), bwd.by_id()
        for block in pairing.blocks:
            assert not shared_channels([ops_f[o] for o in block.fwd],
                                       [ops_b[o] for o in block.bwd])


def test_pairing_violation_detects_each_broken_rule():
    fwd = OpDAG("fwd", [OpNode("f0", "comm", "intra", (), "k0"),
                        OpNode("f1", "comp", "compute", ("f0",), "k1")])
    bwd = OpDAG("bwd", [OpNode("b0", "comm", "intra", (), "k2")])
    ok = Pairing(("f0", "f1"), ("b0",), [Block(("f0",), ()), Block(("f1",), ("b0",))])
    assert pairing_violation(fwd, bwd, ok) is None
    same_channel = Pairing(("f0", "f1"), ("b0",), [Block(("f0",), ("b0",)), Block(("f1",), ())])
    assert "same channel" in pairing_violation(fwd, bwd, same_channel)
    not_topo = Pairing(("f1", "f0"), ("b0",), [Block(("f1", "f0"), ()), Block((), ("b0",))])
    assert "before its dependency" in pairing_violation(fwd, bwd, not_topo)
    bad_cut = Pairing(("f0", "f1"), ("b0",), [Block(("f0",), ()), Block((), ("b0",))])
    assert "concatenate" in pairing_violation(fwd, bwd, bad_cut)


def test_full_layer_search_finds_a_real_speedup():
    fwd, bwd = layer_dags()
    costs = build_cost_model(fwd, bwd, layer_profile(fwd, bwd))
    result = dp_search(fwd, bwd, costs, max_orders=16, wgrad_move=3)
    assert (len(fwd.ops), len(bwd.ops)) == (14, 18)
    assert result.bwd_orders == 16
    assert costs.sequential_ms() / result.planned_ms > 1.1
    assert pairing_violation(fwd, bwd, result.pairing) is None
    assert np.isfinite(result.planned_ms)


def test_a_strand_alone_computes_while_its_collective_is_in_flight():
    # backward strand: collective c (4 ms), then w (3 ms, does not read c), then r (1 ms,
    # reads c); the forward strand's gemm g co-runs with c at sigma 1.5 (measured pair)
    bwd = OpDAG("bwd", [OpNode("c", "comm", "inter", (), "ar", False, "comm"),
                        OpNode("w", "comp", "compute", (), "wgrad", True, "gemm"),
                        OpNode("r", "comp", "compute", ("c",), "norm", False, "norm")])
    fwd = _one_op("fwd", "g", "compute", "gemm")
    costs = build_cost_model(fwd, bwd, _profile({"gemm": 4.0, "ar": 4.0, "wgrad": 3.0,
                                                 "norm": 1.0}, {"gemm|ar": 6.0}))
    assert costs.sigma[("g", "c")] == pytest.approx(1.5)
    # w computes at 1/1.5 beside c (c at its solo speed): 8/3 ms of w's work by c's end at
    # 4 ms, its last 1/3 ms alone, then r: 5 1/3 ms where the block model's solo segment
    # counts 4 + 3 + 1
    assert strand_alone_ms(["c", "w", "r"], bwd.by_id(), costs, "bwd",
                           fwd.by_id()) == pytest.approx(4.0 + 1.0 / 3.0 + 1.0)
    # a reader right after the collective waits for it: nothing overlaps
    assert strand_alone_ms(["c", "r", "w"], bwd.by_id(), costs, "bwd",
                           fwd.by_id()) == pytest.approx(8.0)
    # the forward alone has no collective: the sum of its solo times
    assert strand_alone_ms(["g"], fwd.by_id(), costs, "fwd", bwd.by_id()) == pytest.approx(4.0)
    # the least the collective keeps this strand waiting, whatever its order: its longest
    # path (c then r, 5 ms) less its computation (w and r, 4 ms)
    assert unhidden_alone_ms(bwd, costs.solo_b) == pytest.approx(1.0)
    assert unhidden_alone_ms(fwd, costs.solo_f) == 0.0


def test_collectives_on_the_one_chain_stay_exposed_alone():
    """`unhidden_alone_ms` of a forward whose collectives stand on its dependency chain (a
    dense TP layer, an MoE layer's dispatch and combine): all of their time; with a branch
    beside the collective (a shared expert), only what the branch does not cover."""
    def chain(*branch):
        ops = [OpNode("a", "comp", "compute", (), "gemm", False, "gemm"),
               OpNode("x", "comm", "inter", ("a",), "a2a", False, "all_to_all"),
               *branch,
               OpNode("b", "comp", "compute", ("x",), "gemm", False, "gemm"),
               OpNode("y", "comm", "inter", ("b",), "a2a", False, "all_to_all"),
               OpNode("z", "comp", "compute", ("y", *(o.id for o in branch)), "norm",
                      False, "norm")]
        return OpDAG("fwd", ops)
    solo = {"a": 4.0, "x": 5.0, "b": 4.0, "y": 5.0, "z": 1.0, "s": 3.0}
    assert unhidden_alone_ms(chain(), solo) == pytest.approx(10.0)
    shared = OpNode("s", "comp", "compute", ("a",), "gemm", False, "gemm")
    # the shared GEMM (3 ms) runs while x travels: the chain is 19 ms, the computation 12
    assert unhidden_alone_ms(chain(shared), solo) == pytest.approx(7.0)


def _collective_beside_a_chain(chain, solo, pairs):
    """Costs of a forward all-reduce "c" (cost key "ar") and a backward chain of
    computations `chain` [(op id, cost key, class)], from `solo` and `pairs` (ms)."""
    fwd = _one_op("fwd", "c", "inter", "ar")
    ops, previous = [], ()
    for op_id, key, kind in chain:
        ops.append(OpNode(op_id, "comp", "compute", previous, key, False, kind))
        previous = (op_id,)
    return build_cost_model(fwd, OpDAG("bwd", ops), _profile(solo, pairs))


def test_a_collectives_slowdown_is_not_carried_by_one_noisy_pair():
    """`collective_sigma`: the median over the other strand's computations, so one pair of
    a tiny operator measured far off (sigma 2 - OEF with OEF -50) does not set it."""
    from planner.cosched import collective_sigma

    costs = _collective_beside_a_chain(
        [("g1", "gemm", "gemm"), ("g2", "wgrad", "gemm"), ("t", "tiny", "x")],
        {"ar": 4.0, "gemm": 4.0, "wgrad": 4.0, "tiny": 0.1},
        {"ar|gemm": 6.0, "ar|wgrad": 6.0, "ar|tiny": 9.1})
    assert costs.sigma[("c", "t")] > 50 and costs.sigma[("c", "g1")] == pytest.approx(1.5)
    assert collective_sigma(costs, "c", "fwd", ["g1", "g2", "t"]) == pytest.approx(1.5)


def test_a_collectives_slowdown_comes_from_computations_as_long_as_it():
    """`collective_sigma` reads the pairs whose computation lasts at least the collective:
    two 1 ms norms beside a 4 ms all-reduce end inside it (the pair takes 4 ms, sigma 1.0
    whatever their slowdown); the 8 ms GEMM's pair (9 ms) shows sigma 1.25."""
    from planner.cosched import collective_sigma

    costs = _collective_beside_a_chain(
        [("g", "gemm", "gemm"), ("n1", "norm1", "norm"), ("n2", "norm2", "norm")],
        {"ar": 4.0, "gemm": 8.0, "norm1": 1.0, "norm2": 1.0},
        {"ar|gemm": 9.0, "ar|norm1": 4.0, "ar|norm2": 4.0})
    assert costs.sigma[("c", "n1")] == pytest.approx(1.0)
    assert collective_sigma(costs, "c", "fwd", ["g", "n1", "n2"]) == pytest.approx(1.25)
    # no computation as long as the collective: the median over all of them
    assert collective_sigma(costs, "c", "fwd", ["n1", "n2"]) == pytest.approx(1.0)


def test_layer_seam_of_a_plan():
    """The seam pairs the next layer pair's leading forward-only blocks with this pair's
    trailing backward-only blocks; none where a plan starts with backward operators, ends
    with forward ones, or the two sides' collectives share a channel."""
    def node(op_id, kind="comp", channel="compute"):
        return OpNode(op_id, kind=kind, channel=channel)

    ops_f = {o: node(o) for o in ("ln1", "qkv", "attn", "proj", "fc2")}
    ops_f["proj.ar"] = node("proj.ar", "comm", "inter")
    ops_b = {o: node(o) for o in ("fc2.dgrad", "qkv.wgrad", "ln1.bwd")}
    ops_b["qkv.ar_grad"] = node("qkv.ar_grad", "comm", "inter")
    plan = [Block(("ln1", "qkv"), ()), Block(("attn",), ()),
            Block(("proj", "proj.ar"), ("fc2.dgrad", "qkv.wgrad")),
            Block(("fc2",), ()), Block((), ("qkv.ar_grad",)), Block((), ("ln1.bwd",))]
    seam = layer_seam(plan, ops_f, ops_b)
    assert (seam.head, seam.tail) == (2, 2)
    assert seam.block == Block(("ln1", "qkv", "attn"), ("qkv.ar_grad", "ln1.bwd"))
    assert layer_seam(plan[2:], ops_f, ops_b) is None      # starts with a paired block
    assert layer_seam(plan[:4], ops_f, ops_b) is None      # ends with a forward block
    clash = [Block(("proj.ar",), ())] + plan[4:]            # both sides on the inter link
    assert layer_seam(clash, ops_f, ops_b) is None
