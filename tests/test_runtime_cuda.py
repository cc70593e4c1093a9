"""The DHelix runtime on CUDA (NCCL, the compute stream plus NCCL's communication
streams): parity with Megatron's schedule on one GPU, and with TP=2 when two GPUs exist.
Skipped without CUDA (CI has none)."""

import pytest
import torch

from dhelix.harness import run_on_ranks
from tests.foundation_ranks import dhelix_parity

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check(report):
    for entry in report.values():
        for row in entry["rows"]:
            # GPU GEMMs may reorder reductions between the two paths: fp32 tolerance.
            assert row["loss_diff"] < 1e-5, row
            assert row["grad_diff"] < 1e-5, row


@pytest.mark.slow
@needs_cuda
def test_dhelix_parity_one_gpu():
    _check(run_on_ranks(dhelix_parity, 1, {"tp1_dp": dict(tp=1, pairer="dp")},
                        timeout_s=600)[0])


@pytest.mark.slow
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dhelix_parity_tp2_lanes_on_nccl():
    _check(run_on_ranks(dhelix_parity, 2, {"tp2_sp_dp": dict(tp=2, sp=True, pairer="dp")},
                        timeout_s=600)[0])
