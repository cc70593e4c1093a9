"""The simulator against the paper's bubble formulas, and its deadlock detection."""

import dataclasses

import pytest

from dhelix.schedules.bubbles import (
    bubble_ratio_1f1b,
    bubble_ratio_dhelix,
    max_physical_si_speedup,
)
from dhelix.schedules.one_f_one_b import build_1f1b_schedule
from dhelix.schedules.simulate import Costs, DeadlockError, simulate
from dhelix.schedules.validate import validate
from dhelix.schedules.w_schedule import build_w_schedule

COSTS = [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0), (1.0, 3.0)]  # (forward, backward) per stage
EXACT = 1e-9


@pytest.mark.parametrize("f,b", COSTS)
def test_1f1b_matches_formula(f, b):
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, p, p + 1, 2 * p + 1, 12, 64):
            sim = simulate(build_1f1b_schedule(p, m), Costs(f, b))
            assert sim.bubble_ratio == pytest.approx(bubble_ratio_1f1b(p, m), abs=EXACT)
            assert sim.makespan == pytest.approx((m + p - 1) * (f + b), abs=EXACT)


@pytest.mark.parametrize("f,b", COSTS)
def test_w_schedule_matches_dhelix_formula(f, b):
    """Exact for every m > p and every physically possible s in [1, (f+b)/max(f,b)]."""
    top = max_physical_si_speedup(f, b)
    for s in sorted({1.0, 1.2, 1.3, 1.4, top}):
        if s > top:
            continue
        for p in (1, 2, 3, 4, 8):
            for m in (p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 12, 64):
                if m <= p:
                    continue
                sim = simulate(build_w_schedule(p, m), Costs(f, b, s))
                want = bubble_ratio_dhelix(p, m, s)
                assert sim.bubble_ratio == pytest.approx(want, abs=EXACT), (f, b, s, p, m)


def test_w_schedule_beyond_physical_speedup_is_worse_than_formula():
    """An SI block shorter than its longer pass (s > (f+b)/max(f,b)) cannot be fed fast
    enough: the real bubble exceeds the formula."""
    f, b = 1.0, 2.0
    s = max_physical_si_speedup(f, b) + 0.5
    for p, m in ((2, 6), (4, 12), (8, 50)):
        sim = simulate(build_w_schedule(p, m), Costs(f, b, s))
        assert sim.bubble_ratio > bubble_ratio_dhelix(p, m, s) + 1e-3


def test_w_schedule_with_few_microbatches():
    """m <= p: no SI block, s is irrelevant; the schedule still beats or ties 1F1B, and one
    micro-batch is fully sequential."""
    for p in (2, 3, 4, 8):
        for m in range(1, p + 1):
            w = build_w_schedule(p, m)
            ratios = {simulate(w, Costs(1.0, 2.0, s)).bubble_ratio for s in (1.0, 1.4)}
            assert len(ratios) == 1
            ratio = ratios.pop()
            assert ratio <= bubble_ratio_1f1b(p, m) + EXACT
            if m == 1:
                assert ratio == pytest.approx((p - 1) / p, abs=EXACT)


def test_dhelix_below_1f1b_with_si_speedup():
    for p, m in ((2, 8), (4, 12), (8, 32)):
        c = Costs(1.0, 2.0, 1.3)
        w = simulate(build_w_schedule(p, m), c)
        o = simulate(build_1f1b_schedule(p, m), c)
        assert w.bubble_ratio < o.bubble_ratio
        assert w.makespan < o.makespan


def test_p2p_latency_counts_each_hop():
    """One micro-batch crosses 2(p-1) stage boundaries in 1F1B and 4(p-1) on the folded
    path (the W's two down-up trips)."""
    d = 0.25
    for p in (2, 3, 5):
        base_o = simulate(build_1f1b_schedule(p, 1), Costs()).makespan
        base_w = simulate(build_w_schedule(p, 1), Costs()).makespan
        lat_o = simulate(build_1f1b_schedule(p, 1), Costs(p2p_latency=d)).makespan
        lat_w = simulate(build_w_schedule(p, 1), Costs(p2p_latency=d)).makespan
        assert lat_o - base_o == pytest.approx(2 * (p - 1) * d)
        assert lat_w - base_w == pytest.approx(4 * (p - 1) * d)


def test_intervals_are_consistent():
    w = build_w_schedule(3, 7)
    sim = simulate(w, Costs(1.0, 2.0, 1.3, 0.1))
    for rank in range(3):
        mine = sorted((iv for iv in sim.intervals if iv.rank == rank), key=lambda iv: iv.index)
        assert [iv.index for iv in mine] == list(range(len(w.ranks[rank])))
        for a, b in zip(mine, mine[1:]):
            assert a.end <= b.start + EXACT
        busy = sum(iv.end - iv.start for iv in mine if iv.action.is_compute)
        assert busy == pytest.approx(sim.busy[rank])
    assert sim.makespan == pytest.approx(max(sim.finish))


def test_deadlocking_list_passes_validation_and_is_caught():
    """Stage 0 waits for a gradient before sending the activation stage 1 needs to make it:
    every tensor is produced, sent and received (the validator accepts it), but the order
    deadlocks."""
    o = build_1f1b_schedule(2, 2)
    acts = list(o.ranks[0])
    send = next(i for i, a in enumerate(acts) if a.kind == "SEND")
    recv = next(i for i, a in enumerate(acts) if a.kind == "RECV")
    assert send < recv
    acts.insert(send, acts.pop(recv))
    ranks = list(o.ranks)
    ranks[0] = tuple(acts)
    broken = dataclasses.replace(o, ranks=tuple(ranks))
    validate(broken)
    with pytest.raises(DeadlockError) as info:
        simulate(broken, Costs())
    message = str(info.value)
    assert "rank 0: blocked" in message and "rank 1: blocked" in message


def test_bad_costs():
    for kwargs in ({"forward": 0}, {"backward": -1}, {"si_speedup": 0}, {"p2p_latency": -1}):
        with pytest.raises(ValueError):
            Costs(**kwargs)
