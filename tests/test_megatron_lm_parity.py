"""PARITY inside Megatron-LM's real training loop: `scripts/pretrain_gpt.py` through
`megatron.training.pretrain` (under the plugin, `dhelix.megatron_lm`) with and without
`--dhelix`, same seed and mock data, on 4 real gloo ranks. Every step: the global loss, every
gradient after the schedule and every parameter before the step (so the initial weights and
each update) are compared, layout-independently (`dhelix.parity`). Layouts: TP2 + SP (x DP2,
PP=1: the SI schedule), TP2 x PP2 (folded model, W schedule), TP2 x DP2 with the distributed
optimizer and Adam, and a Llama-style layer (RMSNorm, RoPE, SwiGLU, GQA, no bias, untied
output layer) with TP2 x PP2 + SP. Run with -s to see the measured differences."""

import pytest

from dhelix.harness import run_on_ranks
from tests.megatron_lm_ranks import parity_body

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

FP32_LOSS = 2e-6    # |loss diff|, losses ~7
FP32_GRAD = 1e-7    # max |grad diff| (accumulation order differs)
FP32_PARAM = 1e-6   # Adam lr 3e-4 after a few steps
STEPS = 3

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
CASES = {
    "tp2_sp_dp2": TP2 + ["--sequence-parallel"],
    "tp2_pp2": TP2 + PP2,
    "tp2_dp2_distopt_adam": TP2 + ["--use-distributed-optimizer", "--optimizer", "adam"],
    "llama_tp2_pp2_sp": TP2 + PP2 + ["--sequence-parallel"] + LLAMA,
}


@pytest.fixture(scope="module")
def report():
    result = run_on_ranks(parity_body, 4, CASES, STEPS, timeout_s=600,
                          env={"OMP_NUM_THREADS": "1"})[0]
    for name, case in result.items():
        for i, row in enumerate(case["rows"]):
            print(f"{name} step {i + 1}: loss {row['loss']:.6f} diff {row['loss_diff']:.1e}, "
                  f"grad diff {row['grad_diff']:.1e} ({row['grad_key']}), param diff before "
                  f"the step {row['param_diff']:.1e} ({row['param_key']}); co-executed layer "
                  f"pairs per rank {case['pairs']}")
    return result


@pytest.mark.parametrize("name", sorted(CASES))
def test_dhelix_matches_megatron_in_pretrain(report, name):
    case = report[name]
    assert case["steps"] == (STEPS, STEPS)
    # Same seed, same weights: identical initial parameters, not merely close.
    assert case["rows"][0]["param_diff"] == 0.0, case["rows"][0]["param_key"]
    for row in case["rows"]:
        assert row["loss_diff"] <= FP32_LOSS
        assert row["grad_diff"] <= FP32_GRAD, row["grad_key"]
        assert row["param_diff"] <= FP32_PARAM, row["param_key"]
    assert min(case["pairs"]) > 0  # the DHelix SI path really ran on every rank
