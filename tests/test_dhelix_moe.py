"""`--dhelix` with megatron-core's MoE layers keeps Megatron's training semantics: on 2 gloo
ranks, one per (emulated) node (EP=2 across the nodes, DP=2, TP=1; 4 experts, top-2, the alltoall dispatcher, the auxiliary
load-balancing loss; also with a shared expert) a mixed dense/MoE stack (`--moe-layer-freq [1,1,0,1]`: the SI schedule
pairs MoE with MoE, MoE with dense and dense with MoE layers) gives, step after step, the
losses, the load-balancing loss of every layer and every gradient of Megatron's own
no-pipelining schedule from the same seed and data, and every router call routes the same
tokens to the same experts on both sides (routing maps recorded on Megatron's routers).
An all-MoE stack is profiled by `dhelix profile` in the same launch and trained from a plan
made from that profile, with the same checks. One launch (tests/moe_ranks.py
`moe_parity`), through the plugin's step harness."""

import re

import pytest

from tests.engine_checks import assert_ran_on_the_engine
from tests.moe_ranks import PROFILE, assert_moe_parity, launch_moe_parity
from tests.plugin_parity_ranks import ParityCase

pytestmark = pytest.mark.slow  # multi-process

FP32_LOSS = 1e-6
FP32_GRAD = 2e-7
FP32_PARAM = 2e-7
FP32_EVAL = 1e-6

MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
       "alltoall", "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type",
       "aux_loss", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "192",
       "--moe-layer-freq", "[1,1,0,1]", "--global-batch-size", "12")
# every layer MoE: profiled by `dhelix profile` in the same launch, planned from the profile
ALL_MOE = tuple(w if w != "[1,1,0,1]" else "1" for w in MOE)
# SwiGLU experts without biases (no FC2-bias term: one probability gradient), RMSNorm,
# SDPA core attention in the MoE model's block spec (stock and --dhelix alike), planned by
# the Wavelet-style round robin
LLAMA = ("--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
         "--dhelix-attention", "sdpa")
# a shared expert beside the routed ones (Megatron's shared experts have no biases)
SHARED = ("--disable-bias-linear", "--moe-shared-expert-intermediate-size", "96")
CASES = {"ep2_mixed_dp": ParityCase(MOE, ("--dhelix",)),
         "ep2_mixed_shared_expert": ParityCase(MOE + SHARED, ("--dhelix",)),
         "ep2_mixed_llama_round_robin": ParityCase(MOE + LLAMA, ("--dhelix", "--dhelix-pairer",
                                                                 "round_robin")),
         # without biases: the combine's gradient split by local expert, profiled too
         "ep2_all_moe_profiled": ParityCase(ALL_MOE + ("--disable-bias-linear",),
                                            ("--dhelix", "--dhelix-profile", PROFILE)),
         # streamed SI blocks: both strands' all-to-alls on one expert-parallel lane
         # (unbounded: with the bound the analytic costs put the streamed sequence within
         # ~10% of the block plan, on either side as the measured memory moves, and setup
         # runs whichever is predicted faster: the second case)
         "ep2_all_moe_streamed": ParityCase(ALL_MOE, ("--dhelix", "--dhelix-streamed",
                                                      "--dhelix-no-memory-bound")),
         "ep2_all_moe_streamed_bounded": ParityCase(ALL_MOE, ("--dhelix", "--dhelix-streamed"))}
STEPS = 2


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return launch_moe_parity(2, CASES, STEPS, str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module", params=["ep2_mixed_dp", "ep2_mixed_llama_round_robin",
                                        "ep2_mixed_shared_expert"])
def report(launch, request):
    return [dict(rank[request.param], case=request.param) for rank in launch]


@pytest.fixture(scope="module")
def profiled(launch):
    return [rank["ep2_all_moe_profiled"] for rank in launch]


def test_losses_aux_losses_and_gradients_equal_megatron(report):
    for entry in report:
        # layers 1, 2 and 4 are MoE: each recorded a loss; the dense layer 3 none
        assert_moe_parity(entry, STEPS, [True, True, False, True],
                          dict(loss=FP32_LOSS, grad=FP32_GRAD, param=FP32_PARAM, eval=FP32_EVAL))
        # and, with a shared expert, its two weights in every MoE layer
        keys = entry["grad_keys"]
        shared = sum(".shared_experts.linear_fc" in k and k.endswith(".weight") for k in keys)
        assert shared == (6 if "shared" in entry["case"] else 0), keys


def test_router_decisions_are_identical(report):
    for entry in report:
        assert entry["routing_equal"]
        assert entry["moe_layers"] == [1, 2, 4]
        # 3 MoE layers x 3 micro-batches x 2 steps, each call 64 x 2 tokens, top-2
        assert entry["router_calls"] == 3 * 3 * STEPS
        assert entry["routed_pairs"] == 3 * 3 * STEPS * 128 * 2


def test_moe_layers_ran_as_operators_with_their_all_to_alls_on_lanes(report):
    for entry in report:
        # the one-stage SI list with the operator pass engine: 3 micro-batches, 2 SI blocks
        assert_ran_on_the_engine(entry["executed"], "si", "OperatorPasses", path="linear")
        assert all(rank["si_blocks"] == 2 for rank in entry["executed"]["train"])
        shared = "shared" in entry["case"]
        assert entry["moe_fwd_ops"][5:] == [
            "ln2", "router", "counts.ag", "permute", "dispatch.a2a",
            *(["shared.fc1", "shared.act", "shared.fc2"] if shared else []), "experts.sort",
            "experts.fc1", "experts.act", "experts.fc2", "experts.unsort", "combine.a2a",
            "unpermute", *(["shared.add"] if shared else []), "bda2"]
        assert {"experts.fc1.wgrad.0", "experts.fc1.wgrad.1", "experts.join"} <= set(
            entry["moe_bwd_ops"])
        assert ({"shared.fc1.wgrad", "shared.fc2.dgrad"} <= set(entry["moe_bwd_ops"])) == shared
        # the probabilities' two gradients are summed only when the experts have biases
        assert ("experts.probs_sum" in entry["moe_bwd_ops"]) == entry["moe_bias"]
        assert entry["moe_bias"] == ("llama" not in entry["case"] and not shared)
        # without biases the combine's gradient travels expert by expert (2 local experts),
        # the last expert's first, with no unsort in between
        split = ["combine.a2a_grad.1", "combine.a2a_grad.0"]
        assert all((op in entry["moe_bwd_ops"]) != entry["moe_bias"] for op in split)
        assert ("combine.a2a_grad" in entry["moe_bwd_ops"]) == entry["moe_bias"]
        assert ("experts.unsort.bwd" in entry["moe_bwd_ops"]) == entry["moe_bias"]
        assert "dispatch.a2a_grad" in entry["moe_bwd_ops"]
        # one rank per node (DHELIX_RANKS_PER_NODE=1): the EP group spans two nodes, so
        # the all-to-alls use the inter-node channel, on lanes of the EP group
        assert entry["lanes"] == [("ep", "inter")]
        # MoE x MoE, MoE x dense and dense x MoE layer pairs each have their plan
        assert entry["pair_plans"] == 3, entry["describe"]


def test_an_all_moe_stack_profiled_and_planned_from_its_profile(profiled):
    """`dhelix profile` measures the MoE operators (their cost keys in the profile), and
    `--dhelix --dhelix-profile` plans from it (one plan: every layer MoE) with the same
    parity and routing."""
    for entry in profiled:
        keys = entry["profile"]["solo_keys"]
        assert entry["profile"]["complete"] and entry["profile"]["pairs"] > 0
        for name in ("router.fwd(", "router.bwd(", "permute.fwd(", "expert_linear.fwd(",
                     "expert_linear.dgrad(", "expert_linear.wgrad(", "expert_gelu.bwd(",
                     "unpermute.bwd(", "all_to_all(", "all_gather("):
            assert any(k.startswith(name) for k in keys), (name, keys)
        # the whole all-to-alls' rows and one expert's share (the combine's gradient)
        assert len({k for k in keys if k.startswith("all_to_all(")}) == 2, keys
        assert "costs from profile" in entry["plan_source"], entry["plan_source"]
        assert entry["pair_plans"] == 0  # identical layers: one plan
        assert entry["routing_equal"] and entry["moe_layers"] == [1, 2, 3, 4]
        for row in entry["rows"]:
            assert row["loss_diff"] <= FP32_LOSS and row["grad_diff"] <= FP32_GRAD, row
            assert row["param_diff"] <= FP32_PARAM, row
        for ref, got in zip(entry["aux_ref"], entry["aux"]):
            assert max(abs(a - b) for a, b in zip(ref, got)) <= FP32_LOSS, (ref, got)
        assert_ran_on_the_engine(entry["executed"], "si", "OperatorPasses", path="linear")


def test_an_all_moe_stack_streamed(launch):
    """`--dhelix-streamed` on an all-MoE stack (analytic costs): every SI block one static
    sequence, both strands' dispatch and combine all-to-alls on one lane in a fixed order;
    losses, load-balancing losses, gradients and routing equal Megatron's."""
    for entry in (rank["ep2_all_moe_streamed"] for rank in launch):
        assert "SI blocks run streamed" in entry["describe"], entry["describe"]
        assert entry["lanes"] == [("ep", "inter")]
        assert entry["routing_equal"] and entry["moe_layers"] == [1, 2, 3, 4]
        assert len(entry["rows"]) == STEPS and entry["eval_loss_diff"] <= FP32_EVAL
        for row in entry["rows"]:
            assert row["loss_diff"] <= FP32_LOSS and row["grad_diff"] <= FP32_GRAD, row
            assert row["param_diff"] <= FP32_PARAM, row
        for ref, got in zip(entry["aux_ref"], entry["aux"]):
            assert all(v > 0 for v in ref) and len(got) == 4, (ref, got)
            assert max(abs(a - b) for a, b in zip(ref, got)) <= FP32_LOSS, (ref, got)
        assert_ran_on_the_engine(entry["executed"], "si", "OperatorPasses", path="linear")


def test_streamed_runs_only_where_predicted_faster_than_the_block_plan(launch):
    """`--dhelix-streamed` with the memory bound (analytic costs, all-MoE stack): the plan
    line gives the streamed sequence's and the block plan's time a layer pair, and the SI
    blocks ran streamed exactly where the first is the smaller (the blocks, with the plan
    line saying so, otherwise); losses, gradients and routing equal Megatron's either way."""
    for entry in (rank["ep2_all_moe_streamed_bounded"] for rank in launch):
        describe = entry["describe"]
        streamed_ms = float(re.search(r"streamed SI blocks \(4 layer pairs: ([0-9.]+) ms a pair",
                                      describe).group(1))
        block_ms = float(re.search(r"against the block plan's ([0-9.]+) ms a pair",
                                   describe).group(1))
        if streamed_ms < block_ms:
            assert "SI blocks run streamed" in describe, describe
        else:
            assert "not faster, SI blocks run in blocks" in describe, describe
            assert "run streamed" not in describe, describe
        assert entry["routing_equal"] and len(entry["rows"]) == STEPS
        for row in entry["rows"]:
            assert row["loss_diff"] <= FP32_LOSS and row["grad_diff"] <= FP32_GRAD, row
