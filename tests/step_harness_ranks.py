"""Rank body for tests/test_step_harness.py (module-level so `dhelix.harness` can pickle it)."""

from __future__ import annotations

import os

from tests.megatron_lm_ranks import SCRIPT, TINY


def four_runs_alive(ctx, layouts: dict, steps: int) -> dict:
    """Build every run of `layouts` (name -> extra Megatron arguments) with
    `megatron_patches.step_harness.build_run`, all alive at once, then step them in turn
    `steps` times. Per run and step: the full parameters before the step (rank 0, layout-
    independent, `dhelix.parity`), the loss report of this rank, and the run's DHelix plan
    description. Closes every run at the end (`close_all_runs`, which destroys their
    process groups) while this body still holds them, and records under "threads" this
    process's thread count before the runs, with all alive, and after (gloo keeps threads
    per live group: closing the runs must let their groups go)."""
    from dhelix.parity import gather_full_tensors
    from megatron_patches.step_harness import build_run, close_all_runs

    threads = {"start": _thread_count()}
    runs = {name: build_run(SCRIPT, TINY + ["--train-iters", "100", *extra])
            for name, extra in layouts.items()}
    threads["alive"] = _thread_count()
    record = {name: {"params": [], "loss": [], "layout": run.layout,
                     "dhelix": run.dhelix.describe() if run.dhelix else None}
              for name, run in runs.items()}
    for _ in range(steps):
        for name, run in runs.items():
            with run.active():
                params = gather_full_tensors(run.model, "param")
            outcome = run.train_step()
            record[name]["params"].append(params if ctx.rank == 0 else None)
            record[name]["loss"].append({k: v.view(-1)[0].item()
                                         for k, v in outcome.loss_dict.items()})
            record[name]["iteration"] = run.iteration
    close_all_runs()
    threads["closed"] = _thread_count()
    threads["models_dropped"] = all(run.model is None for run in runs.values())
    return {"runs": record, "threads": threads}


def _thread_count() -> int:
    """This process's threads (Linux: /proc), native ones (gloo's) included."""
    return len(os.listdir(f"/proc/{os.getpid()}/task"))
