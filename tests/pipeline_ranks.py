"""Rank bodies for the `--dhelix` with PP > 1 tests (spawned by dhelix.harness; module-level so
they pickle by name). One launch runs every case of a world size: each process pays ~4 s of
imports."""

from __future__ import annotations

import torch.distributed as dist

from dhelix.parallel import destroy_parallel_state, init_process_group_from_env
from dhelix.parity import gather_full_tensors, max_abs_diff
from tests.foundation_ranks import (
    build_trainer,
    compare_steps,
    engine_record,
    eval_loss,
    observed_step,
    tiny_args,
)


class PairCounter:
    """Wraps a `LayerRunner.run_paired` to count the layer pairs co-executed on this rank."""

    def __init__(self, runner):
        self.pairs = 0
        self._run_paired = runner.run_paired
        runner.run_paired = self

    def __call__(self, fwd_layers, *args, **kwargs):
        self.pairs += len(fwd_layers)
        return self._run_paired(fwd_layers, *args, **kwargs)


def dhelix_pipeline_parity(ctx, cases: dict, steps: int = 3) -> dict:
    """For each case {name: {"tp", "pp", "sp", "pairer", "extra"}}: stock Megatron (TP x PP,
    Megatron's own 1F1B schedule) and `--dhelix` (folded model, W-shaped schedule,
    operator-level SI blocks) are each built from the same --seed (no checkpoint passes
    weights between them) and train `steps` SGD steps on the same data. `init_param_diff`
    compares every initial parameter by checkpoint key; per-step rows compare the loss,
    every gradient and every updated parameter.

    Returns {name: {"init_param_diff", "init_param_key", "rows", "pairs" (co-executed layer
    pairs per rank), "m", "p"}}."""
    job = init_process_group_from_env()
    report = {}
    for name, spec in cases.items():
        base = ["--optimizer", "sgd", "--lr", "0.05", *spec.get("extra", ())]
        layout = dict(tp=spec["tp"], pp=spec["pp"], sp=spec.get("sp", False))
        ref = build_trainer(tiny_args(**layout, extra=base), job)
        ref_init = gather_full_tensors(ref.model, "param")
        ref_steps = [observed_step(ref, with_grads=True) for _ in range(steps)]
        dargs = tiny_args(**layout, extra=base + ["--dhelix", "--dhelix-pairer",
                                                  spec.get("pairer", "dp")])
        trainer = build_trainer(dargs, job)
        init_diff, init_key = max_abs_diff(ref_init, gather_full_tensors(trainer.model, "param"))
        counter = PairCounter(trainer.dhelix.runner)
        got = [observed_step(trainer, with_grads=True) for _ in range(steps)]
        trained = engine_record(trainer)
        eval_diff = abs(eval_loss(ref) - eval_loss(trainer))
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, counter.pairs)
        report[name] = {"init_param_diff": init_diff, "init_param_key": init_key,
                        "rows": compare_steps(ref_steps, got), "pairs": pairs,
                        "m": dargs.num_microbatches, "p": dargs.pipeline_model_parallel_size,
                        "executed": {"train": trained, "eval": engine_record(trainer)},
                        "eval_loss_diff": eval_diff}
    destroy_parallel_state()
    dist.barrier()
    return report

