"""`--dhelix` with megatron-core's MoE layers and pipeline parallelism (the folded model, the
W-shaped schedule, MoE layers as operators) keeps Megatron's training semantics: on 4 gloo
ranks, PP=2 x DP=2 with EP=2 inside the data-parallel ranks of each stage (TP=1; one rank
per emulated node, so the all-to-alls cross nodes), 4 experts top-2, the alltoall
dispatcher and the auxiliary load-balancing loss, two stacks give, step after step, the
losses, the load-balancing loss of every layer and every gradient of Megatron's own 1F1B
schedule from the same seed and data, and every router call routes the same tokens to the
same experts on both sides:
- `--moe-layer-freq [1,1,0,1]` (GeLU with biases, DP plans): folded, stage 0 holds MoE
  layers 1 and 4, stage 1 MoE layer 2 and dense layer 3, so stage 1 pairs MoE with dense
  layers (a plan per layer pair);
- `[0,1,1,0]` (SwiGLU, RMSNorm, no biases, a shared expert beside the routed ones;
  round-robin plans): stage 0 holds only dense layers, stage 1 only MoE layers (the stage
  without MoE layers still joins the expert-parallel lanes' creation).
Before each `--dhelix` step Megatron's process-wide aux-loss gradient scale
(`MoEAuxLossAutoScaler`) is set to a wrong value, so a stage that does not set it as
Megatron's schedules do (stage 1 never computes the loss) fails the gradient check
(measured: grads 0.97 off without it). One launch (tests/moe_ranks.py `moe_parity`,
shared with tests/test_dhelix_moe.py), through the plugin's step harness."""

import pytest

from tests.engine_checks import assert_ran_on_the_engine
from tests.moe_ranks import assert_moe_parity, launch_moe_parity
from tests.plugin_parity_ranks import ParityCase
from tests.test_dhelix_moe import FP32_EVAL, FP32_GRAD, FP32_LOSS, FP32_PARAM, LLAMA, MOE, SHARED

pytestmark = pytest.mark.slow  # multi-process

# m = 16 / (2 x DP 2) = 4 micro-batches = 2p: the W has SI blocks on both stages
PP2 = tuple(w if w != "12" else "16" for w in MOE) + ("--pipeline-model-parallel-size", "2")
PATTERNS = {"ep2_pp2_mixed_dp": (1, 1, 0, 1), "ep2_pp2_llama_round_robin": (0, 1, 1, 0)}
CASES = {
    "ep2_pp2_mixed_dp": ParityCase(PP2, ("--dhelix",)),
    "ep2_pp2_llama_round_robin": ParityCase(
        tuple(w if w != "[1,1,0,1]" else "[0,1,1,0]" for w in PP2) + LLAMA + SHARED,
        ("--dhelix", "--dhelix-pairer", "round_robin")),
}
STEPS = 2
MICROBATCHES = 4


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return launch_moe_parity(4, CASES, STEPS, str(tmp_path_factory.mktemp("moe_pp")))


@pytest.fixture(scope="module", params=sorted(CASES))
def report(launch, request):
    report = [dict(rank[request.param], rank=r, case=request.param)
              for r, rank in enumerate(launch)]
    entry = report[0]  # every rank compares the same full tensors
    for step, (row, ref, got) in enumerate(zip(entry["rows"], entry["aux_ref"], entry["aux"])):
        aux = max(abs(a - b) for a, b in zip(ref, got))
        print(f"{request.param} step {step + 1}: loss {row['loss']:.6f} diff "
              f"{row['loss_diff']:.1e}, grad diff {row['grad_diff']:.1e} ({row['grad_key']}), "
              f"param diff {row['param_diff']:.1e}, load-balancing losses "
              f"{[round(v, 4) for v in ref]} diff {aux:.1e}")
    return report


def _stage(entry) -> int:
    return entry["executed"]["train"][entry["rank"]]["stage"]


def _moe_layers(entry) -> list:
    return [layer + 1 for layer, kind in enumerate(PATTERNS[entry["case"]]) if kind]


def test_losses_aux_losses_and_gradients_equal_megatron_1f1b(report):
    # every gradient of both stages; load-balancing losses per layer over the pipeline
    for entry in report:
        assert_moe_parity(entry, STEPS, [bool(kind) for kind in PATTERNS[entry["case"]]],
                          dict(loss=FP32_LOSS, grad=FP32_GRAD, param=FP32_PARAM, eval=FP32_EVAL))


def test_router_decisions_are_identical(report):
    for entry in report:
        layers = _moe_layers(entry)
        assert entry["routing_equal"]
        assert entry["moe_layers"] == layers
        # per MoE layer: 4 micro-batches x 2 steps, each call 64 x 2 tokens, top-2
        assert entry["router_calls"] == len(layers) * MICROBATCHES * STEPS
        assert entry["routed_pairs"] == len(layers) * MICROBATCHES * STEPS * 128 * 2


def test_moe_layers_ran_as_operators_in_the_w_schedule(report):
    assert sorted(_stage(entry) for entry in report) == [0, 0, 1, 1]
    for entry in report:
        assert_ran_on_the_engine(entry["executed"], "w", "OperatorPasses", path="folded")
        assert all(rank["si_blocks"] > 0 for rank in entry["executed"]["train"])
        # the EP group (2 ranks of one stage) spans two emulated nodes: inter-node lanes,
        # on every rank (also on a stage without MoE layers: lanes are made by all ranks)
        assert entry["lanes"] == [("ep", "inter")]
        stage_pattern = [PATTERNS[entry["case"]][g] for g in
                         ((0, 3) if _stage(entry) == 0 else (1, 2))]
        if any(stage_pattern):
            assert "dispatch.a2a" in entry["moe_fwd_ops"] and "router" in entry["moe_fwd_ops"]
            shared = entry["case"] == "ep2_pp2_llama_round_robin"
            # without expert biases the combine's gradient travels expert by expert
            assert set(entry["moe_bwd_ops"]) >= ({"combine.a2a_grad.0", "combine.a2a_grad.1"}
                                                 if shared else {"combine.a2a_grad"})
            assert ("shared.fc1" in entry["moe_fwd_ops"]) == shared
        else:
            assert entry["moe_fwd_ops"] == []
        # a stage of an MoE and a dense layer meets MoE fwd x dense bwd and dense fwd x MoE
        # bwd: a plan for each pair; a stage of identical layers has one plan
        mixed = len(set(stage_pattern)) == 2
        assert entry["pair_plans"] == (2 if mixed else 0), entry["describe"]
