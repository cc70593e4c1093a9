"""`--dhelix` with megatron-core's MoE layers and pipeline parallelism (the folded model, the
W-shaped schedule, MoE layers as operators) keeps Megatron's training semantics: on 4 gloo
ranks, PP=2 x DP=2 with EP=2 inside the data-parallel ranks of each stage (TP=1; one rank
per emulated node, so the all-to-alls cross nodes), 4 experts top-2, the alltoall
dispatcher and the auxiliary load-balancing loss, a mixed dense/MoE stack
(`--moe-layer-freq [1,1,0,1]`: folded, stage 0 holds MoE layers 1 and 4, stage 1 MoE layer
2 and dense layer 3, so stage 1 pairs MoE with dense layers) gives, step after step, the
losses, the load-balancing loss of every layer and every gradient of Megatron's own 1F1B
schedule from the same seed and data, and every router call routes the same tokens to the
same experts on both sides. Before each `--dhelix` step Megatron's process-wide aux-loss
gradient scale (`MoEAuxLossAutoScaler`) is set to a wrong value, so a stage that does not
set it as Megatron's schedules do (stage 1 never computes the loss) fails the gradient
check. One launch (tests/moe_ranks.py `moe_parity`, shared with tests/test_dhelix_moe.py),
through the plugin's step harness."""

import pytest

from dhelix.harness import run_on_ranks
from tests.engine_checks import assert_ran_on_the_engine
from tests.moe_ranks import moe_parity
from tests.plugin_parity_ranks import ParityCase
from tests.test_dhelix_moe import MOE, assert_mixed_stack_parity

pytestmark = pytest.mark.slow  # multi-process

# m = 16 / (2 x DP 2) = 4 micro-batches = 2p: the W has SI blocks on both stages
PP2 = tuple(w if w != "12" else "16" for w in MOE) + ("--pipeline-model-parallel-size", "2")
CASES = {"ep2_pp2_mixed_dp": ParityCase(PP2, ("--dhelix",))}
STEPS = 2
MICROBATCHES = 4


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    launch = run_on_ranks(moe_parity, 4, CASES, STEPS, str(tmp_path_factory.mktemp("moe_pp")),
                          timeout_s=400, env={"OMP_NUM_THREADS": "1",
                                              "DHELIX_RANKS_PER_NODE": "1"})
    report = [dict(rank["ep2_pp2_mixed_dp"], rank=r) for r, rank in enumerate(launch)]
    for entry in report[:1]:  # every rank compares the same full tensors
        for step, (row, ref, got) in enumerate(zip(entry["rows"], entry["aux_ref"],
                                                   entry["aux"])):
            aux = max(abs(a - b) for a, b in zip(ref, got))
            print(f"step {step + 1}: loss {row['loss']:.6f} diff {row['loss_diff']:.1e}, "
                  f"grad diff {row['grad_diff']:.1e} ({row['grad_key']}), param diff "
                  f"{row['param_diff']:.1e}, load-balancing losses {ref} diff {aux:.1e}")
    return report


def _stage(entry) -> int:
    return entry["executed"]["train"][entry["rank"]]["stage"]


def test_losses_aux_losses_and_gradients_equal_megatron_1f1b(report):
    # every gradient of both stages; load-balancing losses per layer over the pipeline
    for entry in report:
        assert_mixed_stack_parity(entry, STEPS)


def test_router_decisions_are_identical(report):
    for entry in report:
        assert entry["routing_equal"]
        assert entry["moe_layers"] == [1, 2, 4]
        # 3 MoE layers x 4 micro-batches x 2 steps, each call 64 x 2 tokens, top-2
        assert entry["router_calls"] == 3 * MICROBATCHES * STEPS
        assert entry["routed_pairs"] == 3 * MICROBATCHES * STEPS * 128 * 2


def test_moe_layers_ran_as_operators_in_the_w_schedule(report):
    assert sorted(_stage(entry) for entry in report) == [0, 0, 1, 1]
    for entry in report:
        assert_ran_on_the_engine(entry["executed"], "w", "OperatorPasses", path="folded")
        assert all(rank["si_blocks"] > 0 for rank in entry["executed"]["train"])
        assert "dispatch.a2a" in entry["moe_fwd_ops"] and "router" in entry["moe_fwd_ops"]
        assert "combine.a2a_grad" in entry["moe_bwd_ops"]
        # the EP group (2 ranks of one stage) spans two emulated nodes: inter-node lanes
        assert entry["lanes"] == [("ep", "inter")]
        # stage 0 holds two MoE layers (one plan); stage 1 an MoE and a dense layer, which
        # meet as MoE fwd x dense bwd and dense fwd x MoE bwd: a plan for each pair
        assert entry["pair_plans"] == (0 if _stage(entry) == 0 else 2), entry["describe"]
