"""Megatron's own MoE layer through the plugin on CPU gloo ranks (stock Megatron: `--dhelix`
refuses MoE in one line, tests/test_megatron_lm_refusals.py), in one 4-rank launch:

- EP=2 (DP=4): 4 experts, top-2 routing, the all-to-all token dispatcher
  (`all_to_all_single` with split sizes known only after routing), the load-balancing loss;
- TP=2 x EP=2 with sequence parallelism, a mixed dense/MoE stack (`--moe-layer-freq`),
  shared experts and a separate expert FFN size: the dispatcher's uneven all-gather and
  reduce-scatter over the TP group.

Needs the CPU shims' `Tensor.new_*` device mapping, MoE split sizes and uneven gathers
(`megatron_patches/cpu_shims.py`, checked here against their expected values)."""

import math

import pytest

from dhelix.harness import run_on_ranks
from tests.moe_ranks import stock_moe_steps

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


@pytest.fixture(scope="module")
def report():
    return run_on_ranks(stock_moe_steps, 4, CASES, 3, timeout_s=400,
                        env={"OMP_NUM_THREADS": "1"})


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
