"""PARITY inside Megatron-LM's real training loop: `scripts/pretrain_gpt.py` through
`megatron.training.pretrain` (under the plugin, `dhelix.megatron_lm`) with and without
`--dhelix`, same seed and mock data, on 4 real gloo ranks. Every step: the global loss, every
gradient after the schedule and every parameter before the step (so the initial weights and
each update) are compared, layout-independently (`dhelix.parity`). Layouts: TP2 + SP (x DP2,
PP=1: the SI schedule), TP2 x PP2 (folded model, W schedule; on CUDA, its CPU twin being
tests/folding/test_folded_parity.py's TP2 x PP2 + SP), TP2 x DP2 with the distributed
optimizer and Adam, and a Llama-style layer (RMSNorm, RoPE, SwiGLU, GQA, no bias, untied
output layer) with TP2 x PP2 + SP, and the Llama layer with SDPA core attention
(`--dhelix-attention sdpa` in both runs) at TP2 + SP x DP2. Run with -s to see the measured
differences.

bf16 (`--bf16`: Megatron's Float16Module, bf16 parameters and activations, fp32 main grads
and main params), in the same launch:

- TP2, PP=1 (`bf16_tp2`): bit-identical to stock, every step (losses, every gradient,
  every parameter), and so are its evaluation losses (`evaluate()` runs the one-stage
  forward-only list on dhelix's schedule engine, not Megatron's schedule). The tied word-embedding weight's two gradients are summed in bf16
  before DDP's accumulation, as autograd sums them in stock's single backward
  (`megatron_patches.tied_embedding`); added to main_grad separately they differed by
  6.1e-5 after one step and the losses by up to 1.5e-5 after two.
- TP2 x PP2 without grad clipping (`bf16_tp2_pp2_noclip`, `--clip-grad 0`): bit-identical,
  every step, and so are its evaluation losses (Megatron's `evaluate()` runs the folded
  model through `FoldedFloat16Module.forward`). The folded stage sums the tied weight's output-layer gradients apart in fp32
  and adds them after the step, as stock's embedding all-reduce adds the last stage's.
- TP2 x PP2 with Megatron's default clipping (`bf16_tp2_pp2`): the first step is
  bit-identical (losses, gradients); the parameters after it are not, by a different but
  legitimate reduction order: the global grad norm sums each rank's squared local norm,
  and a folded stage holds other layers than a stock stage (stage 0: layers 0 and 3, not
  0 and 1), so the norm, and with it the clip factor, differs in the last fp32 bits. Adam's
  update is insensitive to that scale to first order, so the fp32 main parameters differ by
  about an fp32 rounding; the bf16 copies the model computes with then differ where a main
  parameter sits at a bf16 rounding boundary, by one bf16 ulp (2^-8 of the value: measured
  1.2e-7 after step 1, 1.2e-4 after step 2 on parameters ~0.02). Those flips move the next
  losses by O(ulp x gradient): measured 0 at step 2 and 2.0e-5 at step 3.
  `BF16_CLIPPED_LOSS` = 1e-4 bounds the first three steps with 5x margin; gradients after
  step 1 follow from the flipped parameters and are not compared. Without clipping the
  same run is exact (the case above), which shows the norm is the only difference.

The same launch watches the --dhelix runs for tensors the plugin creates without a device
(`tests.device_watch`): each would be a CPU tensor next to a CUDA model. On CUDA (marked
`gpu`; skipped with fewer than 4 GPUs) the 4 ranks run one per GPU (rank r on cuda:r, over
NCCL) for TP2 + SP, TP2 x PP2 and the bf16 cases. Fewer GPUs cannot host them: the plugin
refuses more ranks on a node than GPUs (`megatron_patches.machine_arguments`: NCCL refuses
two ranks on one GPU, and gloo cannot all-reduce Megatron's CUDA gradients)."""

import pytest
import torch

from tests.megatron_lm_ranks import RANKS, assert_parity, launch_parity, parity_env

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

# device -> (|loss diff| (losses ~7), max |grad diff| (accumulation order differs), max
# |param diff| (Adam lr 3e-4 after a few steps)); on CUDA, kernels may reorder reductions
TOLERANCES = {"cpu": (2e-6, 1e-7, 1e-6), "cuda": (1e-5, 1e-5, 1e-5)}
STEPS = 3

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
FP32_CASES = {
    "tp2_sp_dp2": TP2 + ["--sequence-parallel"],
    "tp2_dp2_distopt_adam": TP2 + ["--use-distributed-optimizer", "--optimizer", "adam"],
    "llama_tp2_pp2_sp": TP2 + PP2 + ["--sequence-parallel"] + LLAMA,
    # SDPA core attention in both runs (stock Megatron builds the SDPA spec too); GQA 2:1
    "llama_sdpa_tp2_sp_dp2": TP2 + ["--sequence-parallel", "--dhelix-attention", "sdpa"] + LLAMA,
}
BF16 = ["--bf16"]
BF16_EXACT_CASES = {
    # with evaluation after step 3: evaluate() runs the SI engine's forward-only list
    "bf16_tp2": TP2 + BF16 + ["--eval-interval", str(STEPS), "--eval-iters", "1"],
    # with evaluation after step 3 (and Megatron's final validation and test evaluations):
    # the one place the folded model runs through its Float16Module's forward
    "bf16_tp2_pp2_noclip": TP2 + PP2 + BF16 + ["--clip-grad", "0", "--eval-interval",
                                               str(STEPS), "--eval-iters", "1"],
}
BF16_CLIPPED_CASES = {"bf16_tp2_pp2": TP2 + PP2 + BF16}
BF16_CLIPPED_LOSS = 1e-4  # |loss diff| after step 1, TP2 x PP2 with clipping (docstring)
CASES = {**FP32_CASES, **BF16_EXACT_CASES, **BF16_CLIPPED_CASES}
# fp32 TP2 x PP2 on CUDA only: on CPU the Llama TP2 x PP2 + SP row above and the folded
# model's layouts (tests/folding/test_folded_parity.py) cover the plain layer's W schedule
CUDA_ONLY_CASES = {"tp2_pp2": TP2 + PP2}
CUDA_CASES = ("tp2_sp_dp2", "tp2_pp2", "bf16_tp2", "bf16_tp2_pp2_noclip", "bf16_tp2_pp2")


@pytest.fixture(scope="module")
def report():
    return launch_parity(CASES, STEPS, timeout_s=900, env=parity_env("cpu"))


@pytest.fixture(scope="module")
def cuda_report():
    if not torch.cuda.is_available() or torch.cuda.device_count() < RANKS:
        pytest.skip(f"needs {RANKS} GPUs (one per rank)")
    cases = {**CASES, **CUDA_ONLY_CASES}
    return launch_parity({n: cases[n] for n in CUDA_CASES}, STEPS, timeout_s=900,
                         env=parity_env("cuda"))


def _ran_both(case, name, device: str) -> None:
    core = ["SDPAttention"] if "sdpa" in name else ["DotProductAttention"]
    assert case["attention"] == (core, core)
    assert case["devices"] == {device}  # every rank's model, in both runs
    assert case["steps"] == (STEPS, STEPS)
    # Same seed, same weights: identical initial parameters, not merely close.
    assert case["rows"][0]["param_diff"] == 0.0, case["rows"][0]["param_key"]
    assert min(case["pairs"]) > 0  # the DHelix SI path really ran on every rank


def _fp32(case, name, device: str) -> None:
    _ran_both(case, name, device)
    assert_parity(case, STEPS, *TOLERANCES[device])


def _bf16_exact(case, name, device: str) -> None:
    _ran_both(case, name, device)
    assert case["evals"][0] == case["evals"][1]
    assert case["eval_diff"] == 0.0
    assert_parity(case, STEPS, 0.0, 0.0, 0.0)


def _bf16_clipped(case, name, device: str) -> None:
    _ran_both(case, name, device)
    first, *later = case["rows"]
    assert first["loss_diff"] == 0.0
    assert first["grad_diff"] == 0.0, first["grad_key"]
    for row in later:
        assert row["loss_diff"] <= BF16_CLIPPED_LOSS


def _check(case, name, device: str) -> None:
    if name in BF16_EXACT_CASES:
        _bf16_exact(case, name, device)
    elif name in BF16_CLIPPED_CASES:
        _bf16_clipped(case, name, device)
    else:
        _fp32(case, name, device)


@pytest.mark.parametrize("name", sorted(FP32_CASES))
def test_dhelix_matches_megatron_in_pretrain(report, name):
    _check(report[name], name, "cpu")


@pytest.mark.parametrize("name", sorted(BF16_EXACT_CASES))
def test_dhelix_bf16_is_bit_identical_to_megatron(report, name):
    _check(report[name], name, "cpu")


def test_dhelix_bf16_pipelined_evaluation_ran(report):
    assert report["bf16_tp2_pp2_noclip"]["evals"][0] >= 1


def test_dhelix_bf16_pipelined_with_clipping_within_bound(report):
    _check(report["bf16_tp2_pp2"], "bf16_tp2_pp2", "cpu")


@pytest.mark.parametrize("name", sorted(CASES))
def test_dhelix_creates_no_tensor_off_the_model_device(report, name):
    """No `torch.zeros(...)`-style call without a device from dhelix/ or megatron_patches/
    in the --dhelix run (PP=1 SI schedule and PP=2 W schedule, fp32 and bf16, every rank)."""
    assert report[name]["host_tensors"] == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_CASES)
def test_dhelix_matches_megatron_on_cuda_one_rank_per_gpu(cuda_report, name):
    """4 ranks on 4 GPUs (rank r on cuda:r, NCCL). On CUDA the bf16 cases keep their CPU
    bounds (exact, or the clipped bound): untested on a GPU so far; GPU kernels may not be
    run-to-run deterministic."""
    assert cuda_report[name]["rank_devices"] == [{f"cuda:{r}"} for r in range(RANKS)]
    _check(cuda_report[name], name, "cuda")
