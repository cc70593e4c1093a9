"""Megatron's own MoE layer through the plugin on CPU gloo ranks, in one 4-rank launch:

- EP=2 (DP=4): 4 experts, top-2 routing, the all-to-all token dispatcher
  (`all_to_all_single` with split sizes known only after routing), the load-balancing loss;
- TP=2 x EP=2 with sequence parallelism, a mixed dense/MoE stack (`--moe-layer-freq`),
  shared experts and a separate expert FFN size: the dispatcher's uneven all-gather and
  reduce-scatter over the TP group;
- `--dhelix` with TP=2 x EP=2, sequence parallelism and expert TP 1 (DP=2; the MoE layers
  as operators, tests/moe_ranks.py `moe_parity`): losses, the load-balancing loss of every
  layer and every gradient equal Megatron's own schedule from the same seed and data, and
  every router call routes the same tokens to the same experts. (EP=2 at TP=1 and the
  refusals: tests/test_dhelix_moe.py, tests/test_megatron_lm_refusals.py.)

Needs the CPU shims' `Tensor.new_*` device mapping, MoE split sizes and uneven gathers
(`megatron_patches/cpu_shims.py`, checked here against their expected values)."""

import math

import pytest

from dhelix.harness import run_on_ranks
from tests.engine_checks import assert_ran_on_the_engine
from tests.moe_ranks import assert_moe_parity, stock_moe_and_parity
from tests.plugin_parity_ranks import ParityCase

pytestmark = pytest.mark.slow  # multi-process

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
       "alltoall", "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
       "aux_loss", "--expert-model-parallel-size", "2"]
CASES = {
    "ep2": MOE,
    "tp2_ep2_sp_mixed": MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--disable-bias-linear", "--moe-layer-freq", "[1,0,1,0]",
                               "--moe-shared-expert-intermediate-size", "256",
                               "--moe-ffn-hidden-size", "192"],
}


# --dhelix parity at TP=2 x EP=2 with SP: 3 of 4 layers MoE (MoE x MoE, MoE x dense and
# dense x MoE layer pairs), DP=2, 3 micro-batches of 2 x 64 tokens per rank and step
TP_EP = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
         "alltoall", "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
         "aux_loss", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-ffn-hidden-size",
         "192", "--moe-layer-freq", "[1,1,0,1]", "--global-batch-size", "12")
PARITY = {"tp2_ep2_sp": ParityCase(TP_EP, ("--dhelix",))}
PARITY_STEPS = 2
FP32_LOSS = 1e-6
FP32_GRAD = 2e-7
FP32_PARAM = 2e-7


@pytest.fixture(scope="module")
def report():
    return run_on_ranks(stock_moe_and_parity, 4, CASES, 3, PARITY, PARITY_STEPS,
                        timeout_s=400, env={"OMP_NUM_THREADS": "1"})


def _trained(entry):
    for step in entry["steps"]:
        assert math.isfinite(step["loss"]) and 5 < step["loss"] < 9
        assert step["grad_norm"] > 0
        # about 1.0 per MoE layer under uniform routing (before the coefficient): it ran
        assert step["load_balancing_loss"] is not None and step["load_balancing_loss"] > 0


def test_expert_parallel_moe_trains_through_the_plugin(report):
    for rank in report:
        entry = rank["ep2"]
        assert (entry["tp"], entry["ep"]) == (1, 2)
        assert entry["local_experts"] == [2] * 4  # every layer: 4 experts over 2 ranks
        _trained(entry)
    # the logged loss is reduced over data parallelism: every rank reports the same
    assert len({tuple(s["loss"] for s in rank["ep2"]["steps"]) for rank in report}) == 1


def test_tensor_and_expert_parallel_moe_with_a_mixed_stack(report):
    for rank in report:
        entry = rank["tp2_ep2_sp_mixed"]
        assert (entry["tp"], entry["ep"]) == (2, 2)
        assert entry["local_experts"] == [2, 2]  # layers 1 and 3 are MoE, 2 and 4 dense
        assert entry["gather_ok"] and entry["scatter_ok"]
        _trained(entry)


def test_dhelix_tp2_ep2_sp_moe_equals_megatron(report):
    """Losses, the load-balancing loss of every layer (each rank's own value, whose tokens
    per expert Megatron all-reduces over the TP group) and every gradient, parameters after
    the step and the evaluation loss equal Megatron's own schedule."""
    for rank in report:
        assert_moe_parity(rank["tp2_ep2_sp"], PARITY_STEPS, [True, True, False, True],
                          dict(loss=FP32_LOSS, grad=FP32_GRAD, param=FP32_PARAM,
                               eval=FP32_LOSS))


def test_dhelix_tp2_ep2_sp_routes_like_megatron(report):
    for rank in report:
        entry = rank["tp2_ep2_sp"]
        assert entry["routing_equal"] and entry["moe_layers"] == [1, 2, 4]
        # 3 MoE layers x 3 micro-batches x 2 steps; each call routes this rank's sequence
        # shard (64 / TP tokens x 2 sequences), top-2
        assert entry["router_calls"] == 3 * 3 * PARITY_STEPS
        assert entry["routed_pairs"] == 3 * 3 * PARITY_STEPS * 32 * 2 * 2


def test_dhelix_tp2_ep2_sp_moe_ran_as_operators_on_lanes(report):
    for rank in report:
        entry = rank["tp2_ep2_sp"]
        assert_ran_on_the_engine(entry["executed"], "si", "OperatorPasses", path="linear")
        # the attention half all-gathers (SP); the MoE half does not: each TP rank routes
        # its sequence shard, and the router's aux-loss counts are all-reduced over TP
        fwd = entry["moe_fwd_ops"]
        assert fwd[fwd.index("ln2"):] == [
            "ln2", "router", "aux.counts.ar", "router.aux", "counts.ag", "permute",
            "dispatch.a2a", "experts.sort", "experts.fc1", "experts.act", "experts.fc2",
            "experts.unsort", "combine.a2a", "unpermute", "bda2"]
        assert "router.aux.bwd" in entry["moe_bwd_ops"]
        # both groups' collectives on lanes (one node: intra-node channels)
        assert entry["lanes"] == [("ep", "intra"), ("tp", "intra")]
        assert entry["pair_plans"] == 3, entry["describe"]
