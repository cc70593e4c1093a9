"""`--dhelix` without pipelining keeps Megatron's training semantics: with plans from every
pairer (sequential, Wavelet-style round robin, the DP), TP=2 and TP=4, SP on and off, and a
Llama-style layer, losses and every gradient equal Megatron's no-pipelining schedule from
the same weights and data, step after step. One launch per world size."""

import pytest

from dhelix.harness import run_on_ranks
from tests.foundation_ranks import dhelix_parity

FP32_LOSS = 1e-6
FP32_GRAD = 2e-7
FP32_PARAM = 2e-7   # SGD lr 0.05: param diffs are lr x grad diffs

LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--num-query-groups", "2", "--disable-bias-linear")

CASES_TP2 = {
    "tp2_sequential": dict(tp=2, pairer="sequential"),
    "tp2_round_robin": dict(tp=2, pairer="round_robin"),
    "tp2_dp": dict(tp=2, pairer="dp"),
    "tp2_sp_dp": dict(tp=2, sp=True, pairer="dp"),
    "tp2_sp_llama_dp": dict(tp=2, sp=True, pairer="dp", extra=LLAMA),
}
CASES_TP4 = {
    "tp4_sp_dp": dict(tp=4, sp=True, pairer="dp"),
    "tp4_round_robin": dict(tp=4, pairer="round_robin"),
}


def _launch(world, cases):
    report = run_on_ranks(dhelix_parity, world, cases, timeout_s=480,
                          env={"OMP_NUM_THREADS": "1"})[0]
    for name, entry in report.items():
        for i, row in enumerate(entry["rows"]):
            print(f"{name} ({entry['blocks']} blocks, m={entry['num_microbatches']}) step {i}: "
                  f"loss diff {row['loss_diff']:.2e} grad diff {row['grad_diff']:.2e} "
                  f"param diff {row['param_diff']:.2e}")
    return report


@pytest.fixture(scope="module")
def tp2():
    return _launch(2, CASES_TP2)


@pytest.fixture(scope="module")
def tp4():
    return _launch(4, CASES_TP4)


def _check(entry):
    assert entry["num_microbatches"] >= 2  # there were SI blocks to run
    assert len(entry["rows"]) == 2
    for row in entry["rows"]:
        assert row["loss_diff"] < FP32_LOSS, row
        assert row["grad_diff"] < FP32_GRAD, row
        assert row["param_diff"] < FP32_PARAM, row


@pytest.mark.parametrize("name", sorted(CASES_TP2))
def test_dhelix_matches_megatron_tp2(tp2, name):
    _check(tp2[name])


@pytest.mark.parametrize("name", sorted(CASES_TP4))
def test_dhelix_matches_megatron_tp4(tp4, name):
    _check(tp4[name])


def test_plans_differ_between_pairers(tp2):
    """The pairers really produced different plans (so parity covers several)."""
    blocks = {tp2[n]["blocks"] for n in ("tp2_sequential", "tp2_round_robin", "tp2_dp")}
    assert len(blocks) == 3
