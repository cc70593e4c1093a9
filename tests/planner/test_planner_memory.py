"""The memory bound of the DP (`planner.memory`): the block bound against every interleaving
of a block's operators, the mask on a DAG whose fastest plan exceeds the budget, and the
bounded search's guarantees on random cases."""

import itertools
import random

import numpy as np
import pytest
from tests.planner.planner_reference import random_dag, random_profile

from dhelix.dag import OpDAG, OpNode, topological_sort
from planner.baselines import sequential_pairing
from planner.blocks import Block, Pairing, pairing_violation
from planner.costs import build_cost_model
from planner.dp import dp_search
from planner.memory import (
    OpMemory,
    block_peak_table,
    early_input_block,
    frees_as_measured,
    layer_activation_bytes,
    live_and_peak,
    make_bound,
    pairing_peak,
    seam_peak,
)
from profiler.profile_file import Profile, pair_key

MIB = 2 ** 20


def _random_memory(rng, dag: OpDAG) -> OpMemory:
    delta = {op.id: rng.randint(-4, 6) * MIB for op in dag.ops}
    transient = {o: max(d, 0) + rng.randint(0, 3) * MIB for o, d in delta.items()}
    return OpMemory(delta, transient)


def _interleaving_peak(f_ops, b_ops, f_start, b_start, mem_f, mem_b):
    """Most live bytes over every interleaving of two op sequences run one op at a time,
    from live bytes f_start + b_start (reference for `block_peak_table`)."""
    worst = -np.inf
    for slots in itertools.combinations(range(len(f_ops) + len(b_ops)), len(f_ops)):
        live = {"f": f_start, "b": b_start}
        fi, bi = iter(f_ops), iter(b_ops)
        worst = max(worst, live["f"] + live["b"])
        for k in range(len(f_ops) + len(b_ops)):
            strand, op, mem = (("f", next(fi), mem_f) if k in slots else
                               ("b", next(bi), mem_b))
            during = live[strand] + max(mem.transient[op], 0, mem.delta[op])
            worst = max(worst, during + live["b" if strand == "f" else "f"])
            live[strand] += mem.delta[op]
    return worst


@pytest.mark.parametrize("seed", range(6))
def test_block_bound_is_the_worst_interleaving(seed):
    rng = random.Random(seed)
    fwd, bwd = random_dag(rng, "fwd", 4), random_dag(rng, "bwd", 3)
    mem_f, mem_b = _random_memory(rng, fwd), _random_memory(rng, bwd)
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    table = block_peak_table(f_order, b_order, mem_f, mem_b)
    live_f, _ = live_and_peak(f_order, mem_f)
    live_b, _ = live_and_peak(b_order, mem_b)
    for a, i in itertools.combinations_with_replacement(range(5), 2):
        for b, j in itertools.combinations_with_replacement(range(4), 2):
            if (a, b) == (i, j):
                continue
            expected = _interleaving_peak(f_order[a:i], b_order[b:j], live_f[a], live_b[b],
                                          mem_f, mem_b)
            assert table[i, j, a, b] == pytest.approx(expected), (a, i, b, j)


def _chain(direction, specs):
    """A chain DAG: (id, channel, cost key) per op, each depending on the previous."""
    ops, prev = [], ()
    for op_id, channel, key in specs:
        kind = "comp" if channel == "compute" else "comm"
        ops.append(OpNode(op_id, kind, channel, prev, key, False, "gemm" if kind == "comp"
                          else "all_gather"))
        prev = (op_id,)
    return OpDAG(direction, ops)


@pytest.fixture
def overlapping_layer():
    """Forward: a GEMM saving 8 MiB, then its gather. Backward: a cross-node collective,
    then a GEMM freeing 8 MiB (2 MiB of temporaries). Pairing each computation with the
    other strand's collective hides both collectives (8.4 ms against 12 ms), but its first
    block runs the forward's GEMM before the backward's frees."""
    fwd = _chain("fwd", [("fa", "compute", "gf"), ("fc", "intra", "agf")])
    bwd = _chain("bwd", [("bc", "inter", "rsb"), ("bb", "compute", "gb")])
    profile = Profile("hw", {"gf": 4.0, "agf": 2.0, "rsb": 2.0, "gb": 4.0},
                      {pair_key("gf", "rsb"): 4.2, pair_key("agf", "gb"): 4.2,
                       pair_key("gf", "gb"): 8.0, pair_key("agf", "rsb"): 2.5},
                      {"repeats": 1, "warmup": 0, "ranks": 1, "created": "t"})
    mem_f = OpMemory({"fa": 8 * MIB, "fc": 0}, {"fa": 8 * MIB, "fc": 0})
    mem_b = OpMemory({"bc": 0, "bb": -8 * MIB}, {"bc": 0, "bb": 2 * MIB})
    return fwd, bwd, build_cost_model(fwd, bwd, profile), mem_f, mem_b


def test_mask_rejects_the_faster_plan_that_exceeds_the_budget(overlapping_layer):
    fwd, bwd, costs, mem_f, mem_b = overlapping_layer
    free = dp_search(fwd, bwd, costs)
    assert free.planned_ms == pytest.approx(8.4)
    bound = make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, 0)
    assert bound.reference_bytes == 2 * MIB  # the backward GEMM's temporaries
    # the forward's 8 MiB held while the backward's GEMM needs its 2 MiB of temporaries
    assert pairing_peak(free.pairing, mem_f, mem_b) == 10 * MIB > bound.budget_bytes
    bounded = dp_search(fwd, bwd, costs, memory=bound)
    assert pairing_violation(fwd, bwd, bounded.pairing) is None
    assert pairing_peak(bounded.pairing, mem_f, mem_b) <= bound.budget_bytes
    assert bounded.planned_ms == pytest.approx(costs.sequential_ms())  # nothing fits
    assert bounded.pairing.blocks[0].bwd and not bounded.pairing.blocks[0].fwd
    # a margin of 8 MiB admits it again
    wide = make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, 8 * MIB)
    relaxed = dp_search(fwd, bwd, costs, memory=wide)
    assert relaxed.planned_ms == pytest.approx(8.4)
    assert pairing_peak(relaxed.pairing, mem_f, mem_b) <= wide.budget_bytes


def test_a_bounded_plan_records_its_block_peaks_and_readings(overlapping_layer, tmp_path):
    """`make_plan` with a bound records each block's peak by the bound's model (the largest
    is the plan's), the bound and the per-operator readings; the file keeps them and
    `dhelix plan show` prints the peaks beside the blocks."""
    from planner.build import make_plan
    from planner.plan import load_plan, save_plan
    from planner.render import plan_table

    fwd, bwd, costs, mem_f, mem_b = overlapping_layer
    # no margin: the backward, then the forward (two blocks)
    bound = make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, 0)
    plan = make_plan(fwd, bwd, costs, memory=bound)
    record = load_plan(save_plan(plan, tmp_path / "plan.json")).search["memory"]
    pairing = Pairing(plan.fwd_order, plan.bwd_order,
                      [Block(b.fwd, b.bwd) for b in plan.blocks])
    assert len(record["block_peak_mib"]) == len(plan.blocks) > 1
    assert max(record["block_peak_mib"]) == record["plan_peak_mib"] == pytest.approx(
        pairing_peak(pairing, mem_f, mem_b) / MIB)
    assert record["budget_mib"] == pytest.approx(bound.budget_bytes / MIB)
    assert record["ops"]["fwd"]["fa"] == [8.0, 8.0] and record["ops"]["bwd"]["bb"] == [-8.0, 2.0]
    table = plan_table(load_plan(tmp_path / "plan.json"))
    assert "peak MiB" in table and f"planned peak {record['plan_peak_mib']:.1f} MiB" in table
    rows = [line for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [float(line.split()[-1]) for line in rows] == pytest.approx(
        record["block_peak_mib"], abs=0.05)
    assert "peak" not in plan_table(make_plan(fwd, bwd, costs))  # unbounded: no column


def test_what_the_step_holds_outside_the_pairs_widens_the_budget(overlapping_layer):
    """A layer pair may reach the step's peak outside the layer pairs (the loss part's, on
    top of the same layers' activations) with no new peak: `outside_bytes` replaces the
    sequential reference where larger, the margin still comes on top."""
    fwd, bwd, costs, mem_f, mem_b = overlapping_layer
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    below = make_bound(f_order, b_order, mem_f, mem_b, 0, outside_bytes=1 * MIB)
    assert below.budget_bytes == below.reference_bytes == 2 * MIB  # the larger of the two
    assert dp_search(fwd, bwd, costs, memory=below).planned_ms == pytest.approx(
        costs.sequential_ms())
    outside = make_bound(f_order, b_order, mem_f, mem_b, 1 * MIB, outside_bytes=9 * MIB)
    assert outside.budget_bytes == 10 * MIB
    assert outside.summary()["outside_mib"] == 9.0
    planned = dp_search(fwd, bwd, costs, memory=outside)
    assert planned.planned_ms == pytest.approx(8.4)
    assert pairing_peak(planned.pairing, mem_f, mem_b) <= outside.budget_bytes
    with pytest.raises(ValueError, match="outside peak"):
        make_bound(f_order, b_order, mem_f, mem_b, 0, outside_bytes=-1)


def test_what_a_pair_holds_at_its_start_comes_off_the_outside_allowance(overlapping_layer):
    """The forward's input and the backward's gradient are live when a layer pair starts,
    on top of the layers' activations, where Megatron's loss part holds neither: they come
    off `outside_bytes`, never below the sequential reference, and the plan then stays
    within the narrower budget."""
    fwd, bwd, costs, mem_f, mem_b = overlapping_layer
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    bound = make_bound(f_order, b_order, mem_f, mem_b, 0, outside_bytes=12 * MIB,
                       pair_start_bytes=4 * MIB)
    assert bound.budget_bytes == 8 * MIB
    assert bound.summary()["pair_start_mib"] == 4.0
    planned = dp_search(fwd, bwd, costs, memory=bound)
    assert pairing_peak(planned.pairing, mem_f, mem_b) <= 8 * MIB < 10 * MIB
    assert planned.planned_ms == pytest.approx(costs.sequential_ms())  # 10 MiB plan excluded
    floor = make_bound(f_order, b_order, mem_f, mem_b, 0, outside_bytes=3 * MIB,
                       pair_start_bytes=4 * MIB)
    assert floor.budget_bytes == floor.reference_bytes == 2 * MIB
    with pytest.raises(ValueError, match="pair start"):
        make_bound(f_order, b_order, mem_f, mem_b, 0, pair_start_bytes=-1)


def test_sequential_pairing_runs_the_backward_first_and_meets_the_reference(overlapping_layer):
    fwd, bwd, _, mem_f, mem_b = overlapping_layer
    pairing = sequential_pairing(fwd, bwd)
    assert [bool(b.fwd) for b in pairing.blocks] == [False, True]
    bound = make_bound(pairing.fwd_order, pairing.bwd_order, mem_f, mem_b, 0)
    assert pairing_peak(pairing, mem_f, mem_b) == bound.reference_bytes


def test_seam_peak_counts_the_next_forward_on_top_of_the_tail(overlapping_layer):
    _, _, _, mem_f, mem_b = overlapping_layer
    # the pair's forward done (+8), the next forward's GEMM (+8) run before the backward's
    # last op, whose 2 MiB of temporaries come on top: 18 at worst
    assert seam_peak(("fa", "fc"), ("bc", "bb"), 1, 1, mem_f, mem_b) == 18 * MIB


@pytest.mark.parametrize("seed", range(20))
def test_bounded_search_keeps_the_guarantees(seed):
    rng = random.Random(seed)
    fwd, bwd = random_dag(rng, "fwd", rng.randint(2, 5)), random_dag(rng, "bwd", rng.randint(2, 5))
    costs = build_cost_model(fwd, bwd, random_profile(rng, fwd, bwd))
    mem_f, mem_b = _random_memory(rng, fwd), _random_memory(rng, bwd)
    free = dp_search(fwd, bwd, costs, 8, 2)
    for margin in (0, 2 * MIB):
        bound = make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, margin)
        result = dp_search(fwd, bwd, costs, 8, 2, memory=bound)
        assert pairing_violation(fwd, bwd, result.pairing) is None
        assert pairing_peak(result.pairing, mem_f, mem_b) <= bound.budget_bytes
        assert free.planned_ms - 1e-9 <= result.planned_ms <= costs.sequential_ms() + 1e-9


def test_orders_that_move_a_free_are_recognised():
    # b2 and b3 both read b1's output; program order frees it at b3
    bwd = OpDAG("bwd", [OpNode("b1", "comp", "compute", (), "k1", False, "gemm"),
                        OpNode("b2", "comp", "compute", ("b1",), "k2", True, "gemm"),
                        OpNode("b3", "comp", "compute", ("b1",), "k3", False, "gemm")])
    assert frees_as_measured(bwd, ["b1", "b2", "b3"])
    assert not frees_as_measured(bwd, ["b1", "b3", "b2"])  # b2 moved after the last reader


def test_layer_activation_is_what_the_forward_leaves_live():
    order = ("a", "b", "c")
    memory = OpMemory({"a": 3 * MIB, "b": 5 * MIB, "c": -2 * MIB},
                      {"a": 4 * MIB, "b": 5 * MIB, "c": 0})
    assert layer_activation_bytes(order, memory) == 6 * MIB
    assert layer_activation_bytes(order[:1], memory) == 3 * MIB
    # a forward that frees more than it keeps leaves nothing (never a negative margin)
    assert layer_activation_bytes(("c",), memory) == 0


def test_the_early_input_waits_for_the_first_block_with_room_beside_the_backward():
    """`early_input_block`: scanning back from the first block with forward operators, the
    input goes in front of each backward-only block whose bound plus the input fits the
    budget, and stops at the first that does not (the blocks before it hold more)."""
    ops = ("b1", "b2", "b3")
    bwd = OpMemory(delta={"b1": -2 * MIB, "b2": -3 * MIB, "b3": -1 * MIB},
                   transient={"b1": 4 * MIB, "b2": 1 * MIB, "b3": 1 * MIB})
    fwd = OpMemory(delta={"f1": 2 * MIB}, transient={"f1": 2 * MIB})
    blocks = (Block(bwd=("b1",)), Block(bwd=("b2",)), Block(fwd=("f1",), bwd=("b3",)))
    pairing = Pairing(("f1",), ops, blocks)
    # the backward-only blocks' bounds: b1 4 MiB above the start, b2 -2 + 1 = -1 MiB
    table = block_peak_table(("f1",), ops, fwd, bwd)
    assert (table[0, 1, 0, 0], table[0, 2, 0, 1]) == (4 * MIB, -1 * MIB)
    assert early_input_block(pairing, fwd, bwd, 6 * MIB, 2 * MIB) == 0   # 4 + 2 fits
    assert early_input_block(pairing, fwd, bwd, 5 * MIB, 2 * MIB) == 1   # 4 + 2 does not
    assert early_input_block(pairing, fwd, bwd, 0.5 * MIB, 2 * MIB) == 2  # not even -1 + 2
    # a pairing whose first block has forward operators: nothing to start earlier
    paired_first = Pairing(("f1",), ops, (Block(fwd=("f1",), bwd=("b1",)),
                                          Block(bwd=("b2", "b3"))))
    assert early_input_block(paired_first, fwd, bwd, 100 * MIB, 0) == 0


def test_the_first_pairs_input_counts_from_the_forwards_first_operator(overlapping_layer):
    """`input_bytes` (the next micro-batch's embedding output, made in the SI block) is held
    from the forward's first operator on: the fast plan that fits a margin of 8 MiB without
    it (peak 10 MiB) holds 12 with 2 MiB of input and is rejected; the budget never drops
    below the sequential plan with its input made before its forward, as Megatron does."""
    fwd, bwd, costs, mem_f, mem_b = overlapping_layer
    f_order, b_order = topological_sort(fwd), topological_sort(bwd)
    bound = make_bound(f_order, b_order, mem_f, mem_b, 8 * MIB, input_bytes=2 * MIB)
    assert bound.reference_bytes == 2 * MIB and bound.budget_bytes == 10 * MIB
    assert bound.summary()["input_mib"] == 2.0
    table = block_peak_table(f_order, b_order, mem_f, mem_b, 2 * MIB)
    assert table[1, 0, 0, 0] == 10 * MIB  # the forward GEMM's 8 MiB and the input
    assert table[0, 1, 0, 0] == 0  # a backward-only block holds no input
    free = dp_search(fwd, bwd, costs).pairing
    assert pairing_peak(free, mem_f, mem_b) == 10 * MIB
    assert pairing_peak(free, mem_f, mem_b, 2 * MIB) == 12 * MIB > bound.budget_bytes
    planned = dp_search(fwd, bwd, costs, memory=bound)
    assert planned.planned_ms == pytest.approx(costs.sequential_ms())
    assert pairing_peak(planned.pairing, mem_f, mem_b, 2 * MIB) <= bound.budget_bytes
    # the reference is Megatron's backward start; the budget still holds the sequential
    # plan, whose forward makes its input after the backward freed 8 MiB: -8 + 12 + 8
    big = make_bound(f_order, b_order, mem_f, mem_b, 1 * MIB, input_bytes=12 * MIB)
    assert big.reference_bytes == 2 * MIB and big.budget_bytes == 12 * MIB
    assert make_bound(f_order, b_order, mem_f, mem_b, 1 * MIB,
                      input_bytes=2 * MIB).budget_bytes == 3 * MIB
    with pytest.raises(ValueError, match="input"):
        make_bound(f_order, b_order, mem_f, mem_b, 0, input_bytes=-1)
