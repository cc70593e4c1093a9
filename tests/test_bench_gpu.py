"""`scripts/bench_gpu.py` on CPU with the tiny model (wall-clock timing): the four rows are
built and run in one process, every row's loss equals its reference at every step, and the
table names the device and the timing. Plus the loss check's refusals (pure function)."""

from __future__ import annotations

import json

import pytest

from scripts import bench_gpu


@pytest.mark.slow  # four trainers, a few steps each
def test_quick_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench_gpu.main(["--quick", "--reps", "1", "--warmup", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert code == 0, printed
    assert summary["loss_check"] == [] and "Loss check" in printed and "PASS" in printed
    assert summary["timing"] == "wall clock" and summary["device"].startswith("CPU")
    assert [r["row"] for r in summary["rows"]] == ["stock", "stock_sdpa", "dhelix_sequential",
                                                   "dhelix_dp"]
    assert [r["attention"] for r in summary["rows"]] == ["megatron", "sdpa", "sdpa", "sdpa"]
    for row in summary["rows"]:
        low, median, high = row["step_s_min_median_max"]
        assert 0 < low <= median <= high
        assert row["tflops_per_gpu"] > 0 and row["peak_bytes"] is None  # no CUDA here
        assert len(row["losses"]) == 2 and all(5 < x < 9 for x in row["losses"])
        assert row["label"] in printed
    assert summary["flops_per_step"] > 0


def test_loss_check_reports_differences():
    rows = bench_gpu.rows_for("sdpa")
    same = {r.name: [7.0, 6.9] for r in rows}
    assert bench_gpu.check_losses(rows, same, bf16=False) == []
    off = dict(same, dhelix_dp=[7.0, 6.9 + 1e-4])
    (problem,) = bench_gpu.check_losses(rows, off, bf16=False)
    assert problem.startswith("dhelix_dp vs stock_sdpa, step 2")
    cross = dict(same, stock_sdpa=[7.0 + 1e-3, 6.9], dhelix_sequential=[7.0 + 1e-3, 6.9],
                 dhelix_dp=[7.0 + 1e-3, 6.9])
    (problem,) = bench_gpu.check_losses(rows, cross, bf16=False)
    assert problem.startswith("stock_sdpa vs stock, step 1")
    assert bench_gpu.check_losses(rows, cross, bf16=True) == []
