"""PARITY inside Megatron-LM's real training loop: `scripts/pretrain_gpt.py` through
`megatron.training.pretrain` (under the plugin, `dhelix.megatron_lm`) with and without
`--dhelix`, same seed and mock data, on 4 real gloo ranks. Every step: the global loss, every
gradient after the schedule and every parameter before the step (so the initial weights and
each update) are compared, layout-independently (`dhelix.parity`). Layouts: TP2 + SP (x DP2,
PP=1: the SI schedule), TP2 x PP2 (folded model, W schedule), TP2 x DP2 with the distributed
optimizer and Adam, and a Llama-style layer (RMSNorm, RoPE, SwiGLU, GQA, no bias, untied
output layer) with TP2 x PP2 + SP. Run with -s to see the measured differences.

The same launch watches the --dhelix runs for tensors the plugin creates without a device
(`tests.device_watch`): each would be a CPU tensor next to a CUDA model. On CUDA (marked
`gpu`, skipped without it) the 4 ranks share the visible GPU(s) over gloo (the plugin's
machine adaptations) for TP2 + SP and TP2 x PP2."""

import pytest
import torch

from dhelix.harness import run_on_ranks
from tests.megatron_lm_ranks import parity_body, parity_env

# device -> (|loss diff| (losses ~7), max |grad diff| (accumulation order differs), max
# |param diff| (Adam lr 3e-4 after a few steps)); on CUDA, kernels may reorder reductions
TOLERANCES = {"cpu": (2e-6, 1e-7, 1e-6), "cuda": (1e-5, 1e-5, 1e-5)}
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
CUDA_CASES = ("tp2_sp_dp2", "tp2_pp2")


def _run(device: str, names) -> dict:
    result = run_on_ranks(parity_body, 4, {n: CASES[n] for n in names}, STEPS,
                          timeout_s=600, env=parity_env(device))[0]
    for name, case in result.items():
        for i, row in enumerate(case["rows"]):
            print(f"{device} {name} step {i + 1}: loss {row['loss']:.6f} diff "
                  f"{row['loss_diff']:.1e}, grad diff {row['grad_diff']:.1e} "
                  f"({row['grad_key']}), param diff before the step {row['param_diff']:.1e} "
                  f"({row['param_key']}); co-executed layer pairs per rank {case['pairs']}")
    return result


@pytest.fixture(scope="module")
def report():
    return _run("cpu", CASES)


@pytest.fixture(scope="module")
def cuda_report():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return _run("cuda", CUDA_CASES)


def _check(case, device: str) -> None:
    loss_tol, grad_tol, param_tol = TOLERANCES[device]
    assert case["devices"] == {device}  # every rank's model, in both runs
    assert case["steps"] == (STEPS, STEPS)
    # Same seed, same weights: identical initial parameters, not merely close.
    assert case["rows"][0]["param_diff"] == 0.0, case["rows"][0]["param_key"]
    for row in case["rows"]:
        assert row["loss_diff"] <= loss_tol
        assert row["grad_diff"] <= grad_tol, row["grad_key"]
        assert row["param_diff"] <= param_tol, row["param_key"]
    assert min(case["pairs"]) > 0  # the DHelix SI path really ran on every rank


@pytest.mark.parametrize("name", sorted(CASES))
def test_dhelix_matches_megatron_in_pretrain(report, name):
    _check(report[name], "cpu")


@pytest.mark.parametrize("name", sorted(CASES))
def test_dhelix_creates_no_tensor_off_the_model_device(report, name):
    """No `torch.zeros(...)`-style call without a device from dhelix/ or megatron_patches/
    in the --dhelix run (PP=1 SI schedule and PP=2 W schedule, every rank)."""
    assert report[name]["host_tensors"] == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_CASES)
def test_dhelix_matches_megatron_on_cuda_ranks_sharing_a_gpu(cuda_report, name):
    _check(cuda_report[name], "cuda")
