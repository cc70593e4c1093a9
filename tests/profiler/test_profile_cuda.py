"""The profiler on CUDA: CUDA-event timing, the single-GPU computation-only profile in
bf16, and (with two GPUs) operators and pairs on NCCL lanes with the host-side gloo group
for barriers and the slowest-rank reduction. Skipped without CUDA (CI has none)."""

import json
import subprocess
import sys

import pytest
import torch

from dhelix.harness import run_on_ranks

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the llama8b preset (expanded to Megatron arguments) at smaller sizes; dropout 0
SMALL_LLAMA = ["--preset", "llama8b", "--hidden-dropout", "0", "--attention-dropout", "0",
               "--hidden-size", "1024", "--ffn-hidden-size", "3584",
               "--num-attention-heads", "8", "--num-query-groups", "2", "--seq-length", "1024"]


@needs_cuda
def test_cuda_event_timer_measures_the_region():
    from profiler.timing import Timer

    timer = Timer(cuda=True)
    a = torch.randn(2048, 2048, device="cuda")
    timer.time(lambda: a @ a)
    for _ in range(4):
        timer.time(lambda: [a @ a for _ in range(8)])
    one, *eight = timer.collect()
    assert one > 0 and all(ms > 2 * one for ms in eight[1:])
    assert timer.collect() == []


@needs_cuda
def test_cuda_event_timer_marks_the_compute_stream():
    """The mark is an event on the current stream: work issued on a side stream after it
    (what a collective on its lane is) lengthens the region, not the mark."""
    from profiler.timing import Timer

    timer = Timer(cuda=True)
    a = torch.randn(2048, 2048, device="cuda")
    side = torch.cuda.Stream()

    def region():
        a @ a
        timer.mark()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(16):
                a @ a
        torch.cuda.current_stream().wait_stream(side)

    for _ in range(3):
        timer.time(region)
    (_, _), *rest = timer.collect_marked()
    assert all(0 < mark and total > 4 * mark for total, mark in rest), rest


@pytest.mark.slow
@needs_cuda
def test_comp_only_bf16_profile_one_gpu(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "dhelix", "profile", *SMALL_LLAMA, "--bf16",
                          "--comp-only", "--repeats", "3", "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["hardware"]["backend"] == "nccl"
    assert document["hardware"]["device"] == torch.cuda.get_device_name(0)
    assert all(key.endswith("/bfloat16") for key in document["solo"])
    assert document["pairs"] and "comp-comp" in run.stdout


def _tp2_profile(ctx, output):
    import argparse

    from profiler.cli import add_options, profile_job
    from tests.megatron_lm_ranks import TINY

    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["-o", output, "--no-progress", "--repeats", "2",
                              "--max-pairs", "30"])
    result = profile_job(args, [*TINY, "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"])
    return {"complete": result.complete, "pairs": dict(result.pairs),
            "classes": sorted({v["class"] for v in result.ops.values()})}


@pytest.mark.slow
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_profile_on_nccl_lanes(tmp_path):
    from tests.megatron_lm_ranks import parity_env

    # Megatron's validate_args demands CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (before
    # Blackwell); the lanes then warn that pairs cannot overlap: this test checks coverage
    results = run_on_ranks(_tp2_profile, 2, str(tmp_path / "tp2.json"), timeout_s=600,
                           env=parity_env("cuda"))
    assert results[0]["complete"] and results[0]["pairs"] == results[1]["pairs"]
    assert {"all_gather", "reduce_scatter"} <= set(results[0]["classes"])
    assert any("all_gather" in name for name in results[0]["pairs"])
