"""The W-shaped schedule as data: Figure 8's structure, SI pairing, phases, every m."""

import json

import pytest

from dhelix.schedules.actions import BACKWARD, FORWARD, PipelinePath, Schedule
from dhelix.schedules.one_f_one_b import build_1f1b_schedule
from dhelix.schedules.sequential import build_sequential_schedule
from dhelix.schedules.validate import validate
from dhelix.schedules.w_schedule import ALPHA, BETA, build_w_schedule, strand


def compute_actions(schedule, rank):
    return [a for a in schedule.ranks[rank] if a.is_compute]


def test_figure_8_p4_m12():
    """Paper Figure 8: alpha 1-4 warm up, SI blocks [beta5; alpha1] ... [alpha12; beta8]
    in the steady phase, alpha 9-12 backwards cool down."""
    w = build_w_schedule(4, 12)
    validate(w)
    for rank in range(4):
        comp = compute_actions(w, rank)
        assert len(comp) == 2 * 16  # m + p tokens, a down and an up hop each
        warm = [a for a in comp if a.phase == "warmup"]
        steady = [a for a in comp if a.phase == "steady"]
        cool = [a for a in comp if a.phase == "cooldown"]
        assert {a.forward.microbatch for a in warm} == {0, 1, 2, 3}
        assert all(a.kind == "F" for a in warm) and all(a.kind == "B" for a in cool)
        assert {a.backward.microbatch for a in cool} == {8, 9, 10, 11}
        assert all(a.kind == "SI" for a in steady) and len(steady) == 2 * 8
        for a in steady:
            # forward of micro-batch i pairs with backward of i-p, of the other strand
            assert a.forward.microbatch - a.backward.microbatch == 4
            assert strand(a.forward.microbatch, 4) != strand(a.backward.microbatch, 4)
            # same stage; chunk c forward with the mirrored chunk 1-c backward
            assert a.forward.hop == a.backward.hop
            assert (w.path.chunk(FORWARD, a.forward.hop)
                    == 1 - w.path.chunk(BACKWARD, a.backward.hop))
    first_si = next(a for a in compute_actions(w, 0) if a.kind == "SI")
    assert (strand(first_si.forward.microbatch, 4), first_si.forward.microbatch + 1) == (BETA, 5)
    assert (strand(first_si.backward.microbatch, 4),
            first_si.backward.microbatch + 1) == (ALPHA, 1)


def test_si_tensors_travel_together_and_turn_is_local():
    w = build_w_schedule(3, 7)
    last = 2
    for rank, actions in enumerate(w.ranks):
        for action in actions:
            if action.kind in ("SEND", "RECV"):
                assert abs(action.peer - rank) == 1
                kinds = sorted(t.direction for t in action.tensors)
                # one activation and/or one gradient per transfer, never two of a kind
                assert kinds in (["F"], ["B"], ["B", "F"])
                assert not (rank == last and action.peer == last)
    steady_sends = [a for a in w.ranks[0] if a.kind == "SEND" and a.phase == "steady"]
    assert steady_sends and all(len(a.tensors) == 2 for a in steady_sends)
    # the last stage never talks to itself: its turn (hop p-1 -> p) is local
    hops_sent_by_last = {t.hop for a in w.ranks[last] if a.kind == "SEND" for t in a.tensors}
    assert last not in hops_sent_by_last


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_every_m_is_valid(p):
    """m < p, m = p, p < m < 2p, m not a multiple of p: all supported."""
    for m in range(1, 3 * p + 2):
        w = build_w_schedule(p, m)
        validate(w)
        n_si = sum(a.kind == "SI" for acts in w.ranks for a in acts)
        assert n_si == 2 * p * max(0, m - p)


def test_bad_sizes_are_rejected():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="micro-batches"):
            build_w_schedule(2, bad)
        with pytest.raises(ValueError, match="stages"):
            build_w_schedule(bad, 4)


def test_deterministic_and_json_round_trip():
    a, b = build_w_schedule(4, 9), build_w_schedule(4, 9)
    assert a == b
    again = Schedule.from_dict(json.loads(json.dumps(a.to_dict())))
    assert again == a


def test_1f1b_and_sequential_are_valid_and_shaped():
    o = build_1f1b_schedule(4, 6)
    validate(o)
    # stage s warms up with p-1-s forwards, as Megatron's 1F1B
    for rank in range(4):
        warm = [a for a in compute_actions(o, rank) if a.phase == "warmup"]
        assert len(warm) == 3 - rank
    seq = build_sequential_schedule(PipelinePath.folded(3), 2)
    validate(seq)
    assert all(a.kind in ("F", "B", "SEND", "RECV") for acts in seq.ranks for a in acts)


def test_live_activations():
    """W keeps p micro-batches' activations alive on every stage (1F1B's first stage, its
    maximum over ranks), plus up to half a stage pass inside an SI block; 1F1B keeps p-s."""
    from dhelix.schedules.activations import peak_live_activations

    for p, m in ((2, 8), (4, 12), (8, 32)):
        w = peak_live_activations(build_w_schedule(p, m))
        assert w.low == (float(p),) * p
        assert w.high == (p + 0.5,) * p
        o = peak_live_activations(build_1f1b_schedule(p, m))
        assert o.low == o.high == tuple(float(p - s) for s in range(p))
        assert max(w.low) == max(o.high)
