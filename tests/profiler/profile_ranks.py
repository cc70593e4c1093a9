"""Rank body of the profiler's multi-process test (spawned by dhelix.harness; module-level
so it can be pickled by name). One launch: a full profile, an interrupted and resumed one,
and DHelix training from the profile against Megatron."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch.distributed as dist

from profiler.cli import add_options, profile_job, report
from profiler.session import load_partial, partial_path
from tests.plugin_parity_ranks import ParityCase, pp1_parity

MEGATRON = ["--preset", "tiny", "--tensor-model-parallel-size", "2"]


def _job(options: list, output: Path):
    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["-o", str(output), "--no-progress", *options])
    return args, profile_job(args, MEGATRON)


def profile_resume_and_train(ctx, workdir: str, options: list, stop_after: int) -> dict:
    out = {}
    full = Path(workdir) / "full" / "profile.json"
    started = time.monotonic()
    args, result = _job(options, full)
    out["full_wall_s"] = time.monotonic() - started
    out["full_complete"] = result.complete
    out["full_pairs"] = dict(result.pairs)
    out["skipped_same_channel"] = result.skipped_same_channel
    if ctx.rank == 0:
        report(args, result)

    resumed = Path(workdir) / "resumed" / "profile.json"
    _, first = _job([*options, "--stop-after", str(stop_after)], resumed)
    out["first_complete"] = first.complete
    out["first_measured"] = first.measured_pairs
    dist.barrier()
    out["partial_pairs"] = dict(load_partial(partial_path(resumed)).pairs)
    _, second = _job(options, resumed)
    out["second_complete"] = second.complete
    out["second_resumed"] = second.resumed_pairs
    out["second_measured"] = second.measured_pairs
    out["second_pairs"] = dict(second.pairs)
    out["partial_left"] = partial_path(resumed).exists()

    out["parity"] = pp1_parity(ctx, {"tp2_from_profile": ParityCase(
        ("--tensor-model-parallel-size", "2"),
        ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-profile", str(full)))})
    return out
