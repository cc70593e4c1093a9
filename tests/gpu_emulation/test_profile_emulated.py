"""`dhelix profile --gpu-emulation GPU_PROFILE --time-scale S` on 2 gloo ranks (the tiny
model, TP=2): every GEMM entry of the profile takes its kernel model's time x S (this CPU
computes a tiny GEMM in well under a millisecond, the emulated GPU's is the model's time,
at least `min_kernel_ms`, x S), the profile's meta and partial-file identity name the
emulation; and the option refusals (fast). Slow: one 1-rank trace launch and one 2-rank
profile launch, ~40 s."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.gpu_emulation.test_emulated_bench import H100_PROFILE

SCALE = 2500.0  # a tiny GEMM is charged min_kernel_ms (0.004 ms): 10 ms a kernel


def _args(argv: list):
    from profiler.cli import add_options

    parser = argparse.ArgumentParser()
    add_options(parser)
    return parser.parse_args(argv)


def test_gpu_emulation_options_are_refused_when_incomplete(tmp_path):
    from dhelix.argument_error import ArgumentError
    from profiler.cli import gpu_emulation

    assert gpu_emulation(_args(["-o", "p.json"])) is None
    with pytest.raises(ArgumentError, match="go with --gpu-emulation"):
        gpu_emulation(_args(["-o", "p.json", "--time-scale", "10"]))
    with pytest.raises(ArgumentError, match="needs --time-scale S > 0"):
        gpu_emulation(_args(["-o", "p.json", "--gpu-emulation", str(tmp_path)]))
    with pytest.raises(ArgumentError, match="no such file"):
        gpu_emulation(_args(["-o", "p.json", "--gpu-emulation", str(tmp_path / "none.json"),
                             "--time-scale", "10"]))


def _profile_rank(ctx, output: str, trace: str) -> dict:
    from profiler.cli import profile_job
    from tests.profiler.profile_ranks import MEGATRON

    args = _args(["-o", output, "--no-progress", "--warmup", "0", "--repeats", "1",
                  "--max-pairs", "2", "--no-heatmap", "--gpu-emulation", str(H100_PROFILE),
                  "--time-scale", str(SCALE), "--gpu-emulation-trace", trace])
    result = profile_job(args, MEGATRON)
    return {"complete": result.complete, "solo": result.solo}


@pytest.mark.slow  # a 1-rank trace launch and a 2-rank profile launch, ~40 s
@pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")
def test_profile_on_the_emulated_gpu(tmp_path):
    from dhelix.gpu_emulation.emulated_run import GpuEmulation, trace_profile
    from dhelix.gpu_emulation.kernel_model import parse_cost_key
    from dhelix.harness import run_on_ranks
    from profiler.profile_file import load_profile

    trace = trace_profile(str(H100_PROFILE))
    trace_path = tmp_path / "trace.json"
    trace_path.write_text(json.dumps(trace))
    output = tmp_path / "emulated.json"
    results = run_on_ranks(_profile_rank, 2, str(output), str(trace_path), timeout_s=300,
                           env={"OMP_NUM_THREADS": "1"})
    assert all(r["complete"] for r in results)
    profile = load_profile(output)
    assert profile.meta["gpu_emulation"]["time_scale"] == SCALE
    assert profile.meta["gpu_emulation"]["profile"] == str(H100_PROFILE.resolve())
    model = GpuEmulation(profile=str(H100_PROFILE), trace=trace, time_scale=SCALE).kernel_model()
    gemms = {key: ms for key, ms in profile.solo.items()
             if (parsed := parse_cost_key(key)) is not None and parsed.op == "linear"}
    assert len(gemms) >= 4
    single = 0
    for key, ms in gemms.items():
        parsed = parse_cost_key(key)
        d = parsed.dims
        kernel = model.gemm_ms(d["m"], d["n"], d["k"], phase=parsed.phase) * SCALE
        assert kernel >= 9.9  # the model's time x S: far above this CPU's tiny GEMM
        assert ms >= kernel, (key, ms, kernel)
        if parsed.phase != "wgrad" and not d.get("bias"):
            # one GEMM kernel (no bias add, no accumulation into .grad) x S + host work
            assert ms <= kernel + 8.0, (key, ms, kernel)
            single += 1
    assert single >= 4
    # a collective issues no kernel: it runs for real (loopback), never slept
    reduces = [ms for key, ms in profile.solo.items() if key.startswith("all_reduce")]
    assert reduces and max(reduces) < 5.0


def test_fingerprint_names_the_emulated_gpu_so_real_runs_refuse_its_profiles(monkeypatch):
    from dhelix.gpu_emulation.options import EMULATION_ENV, mark_process
    from profiler.fingerprint import hardware_differences, hardware_fingerprint

    monkeypatch.delenv(EMULATION_ENV, raising=False)
    real = hardware_fingerprint(1, backend="gloo")
    monkeypatch.setenv(EMULATION_ENV, "")  # restored by monkeypatch after mark_process
    mark_process("/any/where/h100_layer.json", 30.0)
    emulated = hardware_fingerprint(1, backend="gloo")
    assert emulated["device"] == f"emulated GPU (h100_layer.json x S=30) on {real['device']}"
    assert hardware_differences(emulated, real) and hardware_differences(real, emulated)
    mark_process("/any/where/h100_layer.json", 50.0)  # another time scale is another device
    assert hardware_differences(emulated, hardware_fingerprint(1, backend="gloo"))
