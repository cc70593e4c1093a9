"""The DHelix runtime on CUDA (the compute stream plus the lanes' communication streams):
parity with Megatron's schedule on one GPU, and with TP=2 when two GPUs exist. Every run is
`scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` under the plugin
(`tests/plugin_parity_ranks.py`). Skipped without CUDA (CI has none)."""

import pytest
import torch

from dhelix.harness import run_on_ranks
from tests.megatron_lm_ranks import parity_env
from tests.plugin_parity_ranks import ParityCase, pp1_parity

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DHELIX_DP = ("--dhelix", "--dhelix-pairer", "dp")


def _check(report):
    assert report
    for entry in report.values():
        assert len(entry["rows"]) == 2
        for row in entry["rows"]:
            # GPU GEMMs may reorder reductions between the two paths: fp32 tolerance.
            assert row["loss_diff"] < 1e-5, row
            assert row["grad_diff"] < 1e-5, row


@pytest.mark.slow
@needs_cuda
def test_dhelix_parity_one_gpu():
    """The block plan and the streamed sequence (each forced: which one the default runs
    depends on the start-up memory readings) on the compute stream."""
    cases = {"tp1_blocks": ParityCase((), DHELIX_DP + ("--dhelix-no-streamed",)),
             "tp1_streamed": ParityCase((), DHELIX_DP + ("--dhelix-streamed",))}
    _check(run_on_ranks(pp1_parity, 1, cases, timeout_s=600, env=parity_env("cuda"))[0])


@pytest.mark.slow
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dhelix_parity_tp2_lanes_on_nccl():
    tp2_sp = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    cases = {"tp2_sp_blocks": ParityCase(tp2_sp, DHELIX_DP + ("--dhelix-no-streamed",)),
             "tp2_sp_streamed": ParityCase(tp2_sp, DHELIX_DP + ("--dhelix-streamed",))}
    _check(run_on_ranks(pp1_parity, 2, cases, timeout_s=600, env=parity_env("cuda"))[0])
