"""Rank body of the profiler's multi-process test (spawned by dhelix.harness; module-level
so it can be pickled by name). One launch: a full profile, an interrupted and resumed one,
then the plugin: `--dhelix --dhelix-profile` runs of the same model (planned from the
profile, stepped against stock Megatron) and of another model (refused)."""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

import torch.distributed as dist

from profiler.cli import add_options, profile_job, report
from profiler.session import load_partial, partial_path
from tests.megatron_lm_ranks import SCRIPT, TINY

# Megatron's arguments, as for pretraining (tests.megatron_lm_ranks.TINY: the tiny preset's
# sizes, dropout 0, mock data)
MEGATRON = [*TINY, "--tensor-model-parallel-size", "2"]
# another model: the profile's model fingerprint differs (FFN size)
OTHER_MODEL = ["--ffn-hidden-size", "256"]


def _job(options: list, output: Path):
    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["-o", str(output), "--no-progress", *options])
    return args, profile_job(args, MEGATRON)


def _observed_steps(run, steps: int) -> list:
    """Per `train_step` of `run`: the full parameters before it, the full gradients after
    its schedule (`dhelix.parity`, layout-independent) and its loss report."""
    from dhelix.parity import gather_full_tensors

    observed = []
    for _ in range(steps):
        with run.active():
            params = gather_full_tensors(run.model, "param")
        outcome = run.train_step()
        with run.active():
            grads = gather_full_tensors(run.model, "grad")
        observed.append({"params": params, "grads": grads,
                         "loss": float(outcome.loss_dict["lm loss"].view(-1)[0])})
    return observed


def train_from_profile(ctx, profile: str, steps: int) -> dict:
    """The plugin with `--dhelix --dhelix-profile PROFILE` (the step harness: the run
    `pretrain()` sets up): for the profiled model, its plan source and, step by step, its
    parity with stock Megatron from the same seed; for another model, the one-line refusal
    (rank 0's stderr) and its exit code."""
    from megatron_patches.step_harness import build_run, close_all_runs
    from tests.megatron_lm_ranks import compare_runs

    argv = MEGATRON + ["--train-iters", "100"]
    stock = build_run(SCRIPT, argv)
    dhelix = build_run(SCRIPT, argv + ["--dhelix", "--dhelix-profile", profile])
    out = {"plan_source": dhelix.dhelix.plan_source,
           "num_microbatches": dhelix.args.global_batch_size // (
               dhelix.args.micro_batch_size * dhelix.args.data_parallel_size),
           **compare_runs(_observed_steps(stock, steps), _observed_steps(dhelix, steps))}
    close_all_runs()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            build_run(SCRIPT, argv + OTHER_MODEL + ["--dhelix", "--dhelix-profile", profile])
    except SystemExit as exc:
        out["other_model_exit"] = exc.code
    else:
        out["other_model_exit"] = None
    finally:
        close_all_runs()
    out["other_model_error"] = stderr.getvalue().strip().splitlines()
    return out


def profile_resume_and_train(ctx, workdir: str, options: list, stop_after: int,
                             steps: int) -> dict:
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

    out["plugin"] = train_from_profile(ctx, str(full), steps)
    return out
