"""Megatron's own MoE layer through the plugin on CPU gloo ranks (stock Megatron: `--dhelix`
refuses MoE in one line, tests/test_megatron_lm_refusals.py): 4 experts, top-2 routing,
expert parallelism 2 with the all-to-all token dispatcher (`all_to_all_single` with split
sizes known only after routing), the load-balancing auxiliary loss. Needs the CPU shims'
`Tensor.new_*` device mapping and MoE split sizes (`megatron_patches/cpu_shims.py`)."""

import math

import pytest

from dhelix.harness import run_on_ranks
from tests.moe_ranks import stock_moe_steps

pytestmark = pytest.mark.slow  # multi-process

MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
           "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01",
           "--moe-router-load-balancing-type", "aux_loss"]


def test_stock_moe_with_expert_parallelism_trains_through_the_plugin():
    ranks = run_on_ranks(stock_moe_steps, 2, MOE_EP2, 3, timeout_s=300,
                         env={"OMP_NUM_THREADS": "1"})
    for rank in ranks:
        assert rank["ep"] == 2
        assert rank["local_experts"] == [2] * 4  # every layer: 4 experts over 2 ranks
        for step in rank["steps"]:
            assert math.isfinite(step["loss"]) and 5 < step["loss"] < 9
            assert step["grad_norm"] > 0
            # uniform routing gives 1.0 per layer (x coefficient): the aux loss ran
            assert step["load_balancing_loss"] is not None and step["load_balancing_loss"] > 0
    # data parallel over the 2 ranks (EP shares them): both see the same reduced loss
    assert [s["loss"] for s in ranks[0]["steps"]] == [s["loss"] for s in ranks[1]["steps"]]
