"""The exposure of a layer-pair plan's pipeline transfers (`planner.pipeline_transfers`) on
the synthetic layer: where each strand ends and starts, read off the plan's timeline."""

import pytest

from planner.build import make_plan
from planner.costs import build_cost_model
from planner.pipeline_transfers import si_block_ms, transfer_exposure
from planner.synthetic import layer_dags, layer_profile


@pytest.fixture(scope="module")
def layer():
    fwd, bwd = layer_dags(dp_grad_comm=True)
    return fwd, bwd, build_cost_model(fwd, bwd, layer_profile(fwd, bwd))


def test_sequential_pairing_ends_the_backward_first_and_starts_with_it(layer):
    """The whole backward, then the whole forward: the gradient leaves a forward's time
    before the end, and the peer runs the backward alone for its whole time first."""
    fwd, bwd, costs = layer
    plan = make_plan(fwd, bwd, costs, "sequential")
    forward_ms = sum(costs.solo_f.values())
    backward_ms = sum(costs.solo_b.values())
    none = transfer_exposure(plan, 0.0)
    assert none.first_strand == "bwd" and none.exposed_ms == 0.0
    assert none.tail_ms == pytest.approx(forward_ms) and none.head_ms == pytest.approx(
        backward_ms)
    short = transfer_exposure(plan, forward_ms / 2)  # hidden by both
    assert short.exposed_ms == 0.0
    long = transfer_exposure(plan, backward_ms + 1.0)  # outlasts the tail and the head
    assert long.exposed_ms == pytest.approx(2 * (backward_ms + 1.0) - forward_ms - backward_ms)
    assert si_block_ms(plan, 3, backward_ms + 1.0) == pytest.approx(
        3 * plan.planned_ms + long.exposed_ms)


def test_a_plan_ending_both_strands_together_exposes_both_transfers(layer):
    """The dp plan pairs the strands to its last block: the first strand's output leaves
    shortly before the end, the peer's first block needs both inputs."""
    fwd, bwd, costs = layer
    plan = make_plan(fwd, bwd, costs, "dp", 8, 2)
    transfer = 1000.0 * plan.planned_ms  # longer than anything in the plan
    exposure = transfer_exposure(plan, transfer)
    assert exposure.tail_ms < plan.planned_ms and exposure.head_ms < plan.planned_ms
    assert exposure.exposed_ms == pytest.approx(2 * transfer - exposure.tail_ms
                                                - exposure.head_ms)
    # a transfer as long as the forward: the sequential pairing hides it both ways, the dp
    # plan (its strands end 0.35 ms apart, its first block is the other strand's) does not
    forward_ms = sum(costs.solo_f.values())
    sequential = make_plan(fwd, bwd, costs, "sequential")
    assert transfer_exposure(sequential, forward_ms).exposed_ms == pytest.approx(0.0, abs=1e-9)
    assert transfer_exposure(plan, forward_ms).exposed_ms > forward_ms


def test_a_negative_transfer_is_refused(layer):
    fwd, bwd, costs = layer
    with pytest.raises(ValueError, match=">= 0 ms"):
        transfer_exposure(make_plan(fwd, bwd, costs, "sequential"), -1.0)
