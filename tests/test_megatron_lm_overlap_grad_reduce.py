"""The engine's one `no_sync` rule under Megatron DDP's `--overlap-grad-reduce`, inside
Megatron-LM's real training loop (4 gloo ranks, TP2 x DP2, PP=1): a bucket's
data-parallel reduction starts when each of its parameters' gradients arrived outside
`no_sync`, so a wrong scope reduces a partial sum (or never issues the reduction, which
Megatron asserts). Losses, every gradient after the schedule and every parameter equal stock
Megatron's with the same option, for the SI list and the Domino-style pairing (Megatron's
no-pipelining list). SGD, so parameter differences stay lr x gradient differences (Adam
would magnify the Domino split's fp32 rounding, see below). Run with -s to see the measured
differences."""

import pytest

from tests.megatron_lm_ranks import assert_parity, launch_parity

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

FP32_LOSS = 2e-6
FP32_GRAD = 2e-7    # the Domino split sums a weight gradient over two halves, then adds
FP32_PARAM = 1e-7   # SGD lr 0.05: lr x grad diffs
STEPS = 2

OVERLAP = ["--tensor-model-parallel-size", "2", "--overlap-grad-reduce", "--optimizer", "sgd",
           "--lr", "0.05"]
CASES = {  # (the stock run of the Domino case parses --dhelix-pairer and ignores it)
    "tp2_dp2_overlap_si": OVERLAP,
    "tp2_dp2_overlap_domino": OVERLAP + ["--dhelix-pairer", "domino"],
}


@pytest.fixture(scope="module")
def report():
    return launch_parity(CASES, STEPS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlap_grad_reduce_matches_megatron(report, name):
    assert_parity(report[name], STEPS, FP32_LOSS, FP32_GRAD, FP32_PARAM)
