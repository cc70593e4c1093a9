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
    code = bench_gpu.main(["--quick", "--reps", "1", "--warmup", "1", "--json", str(out),
                           "--trace", str(tmp_path / "traces")])
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
        # warm-up, measured and traced step, the rows in lockstep
        assert len(row["losses"]) == 3 and all(5 < x < 9 for x in row["losses"])
        assert row["label"] in printed
        # the traced step's trace is written; on CPU it holds no device activity
        trace = tmp_path / "traces" / f"{row['row']}.trace.json.gz"
        assert trace.stat().st_size > 0
        assert row["kernels"]["kernels"] == 0 and row["kernels"]["busy_ms"] == 0
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


def test_kernel_summary_of_a_trace():
    """Busy time is the union of device intervals on every stream; kernel time their sum;
    host synchronisation counted from the CUDA runtime calls; CPU operators ignored."""
    from dhelix.bench.gpu_kernels import summarise_trace

    def event(cat, name, ts, dur, tid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0,
                "tid": tid}

    trace = {"traceEvents": [
        event("kernel", "gemm", 0, 100), event("kernel", "gemm", 50, 100, tid=8),  # overlap
        event("gpu_memcpy", "Memcpy DtoD", 300, 20), event("kernel", "softmax", 400, 100),
        event("cuda_runtime", "cudaStreamSynchronize", 150, 250),
        event("cuda_runtime", "cudaLaunchKernel", 0, 5), event("cpu_op", "aten::mm", 0, 500),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 900}]}
    summary = summarise_trace(trace)
    assert summary.kernels == 3 and summary.kernel_ms == pytest.approx(0.3)
    assert summary.copy_ms == pytest.approx(0.02)
    assert summary.busy_ms == pytest.approx(0.27)  # 0-150, 300-320, 400-500
    assert summary.span_ms == pytest.approx(0.5) and summary.idle_ms == pytest.approx(0.23)
    assert summary.streams == 2
    assert (summary.host_syncs, summary.host_sync_ms) == (1, pytest.approx(0.25))
    assert summary.top == (("gemm", 2, pytest.approx(0.2)), ("softmax", 1, pytest.approx(0.1)))
    assert summarise_trace({"traceEvents": []}).busy_ms == 0
