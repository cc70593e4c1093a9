"""The folded model against stock Megatron on real gloo ranks, every run
`scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` (step harness; the folded
model is `--dhelix` with PP > 1), in the 4-rank launch of tests/plugin_pipeline_ranks.py
(`four_rank_report`, shared with the layout and pipeline matrices):

- a Megatron checkpoint saved by stock Megatron loads (`--load`, `--finetune`) into the
  folded model with identical weights, and one saved by the folded model (after an SGD
  step) loads back into stock Megatron with another TP x PP;
- the folded model run with the sequential folded schedule and with the W-shaped schedule
  (SI blocks executed forward-then-backward) gives Megatron 1F1B's loss and every gradient
  (compared by checkpoint key) to fp32 rounding;
- the executor running the 1F1B action lists on the stock model reproduces Megatron's own
  1F1B bit for bit.

Layouts: TP2 x PP2 with SP (m = 4 = 2p), TP1 x PP4 (m = 6: not a multiple of p, < 2p),
TP1 x PP2 x DP2 (m = 3) with untied embeddings, RoPE and SwiGLU. Run with -s to see the
measured differences.
"""

import pytest

from tests.plugin_pipeline_ranks import SGD, four_rank_report

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

CASES = {
    "tp2pp2_sp_m4": dict(tp=2, pp=2, sp=True, back=(1, 1),
                         extra=["--num-layers", "8", *SGD]),
    "tp1pp4_m6": dict(tp=1, pp=4, back=(2, 1),
                      extra=["--num-layers", "8", "--global-batch-size", "12", *SGD]),
    "tp1pp2dp2_m3_untied_rope_swiglu": dict(
        tp=1, pp=2, back=(1, 2),
        extra=["--num-layers", "4", "--global-batch-size", "12", *SGD,
               "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
               "--swiglu"]),
}
FP32_LOSS = 2e-6   # |loss diff|, losses ~7
FP32_GRAD = 5e-8   # max |grad diff|; tied-embedding sums are added in another order


@pytest.fixture(scope="module")
def report():
    rows = four_rank_report()["folded"]
    for name, row in rows.items():
        print(f"{name} (p={row['pp']}, m={row['microbatches']}): loss {row['loss_ref']:.6f}; "
              f"sequential loss/grad diff {row['sequential_loss_diff']:.1e}/"
              f"{row['sequential_grad_diff']:.1e}; W {row['w_loss_diff']:.1e}/"
              f"{row['w_grad_diff']:.1e}; executor 1F1B {row['exec_1f1b_loss_diff']:.1e}/"
              f"{row['exec_1f1b_grad_diff']:.1e}; stock->folded params "
              f"{row['load_stock_param_diff']:.1e}, folded->stock params "
              f"{row['folded_to_stock_param_diff']:.1e}")
    return rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoints_load_both_ways(report, case):
    row = report[case]
    assert row["load_stock_param_diff"] == 0.0
    assert row["step_changed_params"] > 1e-4  # the round trip carries new values
    assert row["folded_to_stock_param_diff"] == 0.0


@pytest.mark.parametrize("schedule", ["sequential", "w"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_folded_matches_megatron_1f1b(report, case, schedule):
    row = report[case]
    assert row[f"{schedule}_loss_diff"] < FP32_LOSS, row
    assert row[f"{schedule}_grad_diff"] < FP32_GRAD, row


@pytest.mark.parametrize("case", sorted(CASES))
def test_w_ran_si_blocks(report, case):
    """Stage 0 (rank 0) runs 2(m-p) SI blocks in the W schedule, none sequentially."""
    row = report[case]
    assert row["w_si_blocks"] == 2 * (row["microbatches"] - row["pp"]) > 0
    assert row["sequential_si_blocks"] == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_embedding_group_is_refused(report, case):
    row = report[case]
    for stage, raised in row["stock_embedding_group"]:
        assert raised == (stage in (0, row["pp"] - 1)), row["stock_embedding_group"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_executor_reproduces_megatron_1f1b_exactly(report, case):
    row = report[case]
    assert row["exec_1f1b_loss_diff"] == 0.0
    assert row["exec_1f1b_grad_diff"] == 0.0
