"""Rank bodies for the `--dhelix` with PP > 1 tests (spawned by dhelix.harness; module-level so
they pickle by name). One launch runs every case of a world size: each process pays ~4 s of
imports."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dhelix.checkpointing import load_checkpoint, save_checkpoint
from dhelix.parallel import destroy_parallel_state, init_process_group_from_env
from tests.foundation_ranks import build_trainer, compare_steps, observed_step, tiny_args


class PairCounter:
    """Wraps a `LayerRunner.run_paired` to count the layer pairs co-executed on this rank."""

    def __init__(self, runner):
        self.pairs = 0
        self._run_paired = runner.run_paired
        runner.run_paired = self

    def __call__(self, fwd_layers, *args, **kwargs):
        self.pairs += len(fwd_layers)
        return self._run_paired(fwd_layers, *args, **kwargs)


def dhelix_pipeline_parity(ctx, workdir: str, cases: dict, steps: int = 3) -> dict:
    """For each case {name: {"tp", "pp", "sp", "pairer", "extra"}}: stock Megatron (TP x PP,
    Megatron's own 1F1B schedule) saves its initial weights and trains `steps` SGD steps;
    `--dhelix` (folded model, W-shaped schedule, operator-level SI blocks) loads those
    weights and trains the same steps on the same data. Per-step rows compare the loss,
    every gradient and every updated parameter by checkpoint key.

    Returns {name: {"rows", "pairs" (co-executed layer pairs per rank), "m", "p"}}."""
    init_process_group_from_env()
    report = {}
    for name, spec in cases.items():
        base = ["--optimizer", "sgd", "--lr", "0.05", *spec.get("extra", ())]
        layout = dict(tp=spec["tp"], pp=spec["pp"], sp=spec.get("sp", False))
        ref = build_trainer(tiny_args(**layout, extra=base))
        init = Path(workdir) / name / "init"
        save_checkpoint(ref, init)
        ref_steps = [observed_step(ref, with_grads=True) for _ in range(steps)]
        dargs = tiny_args(**layout, extra=base + ["--dhelix", "--dhelix-pairer",
                                                  spec.get("pairer", "dp")])
        trainer = build_trainer(dargs)
        load_checkpoint(trainer, init, load_optimizer=False)
        counter = PairCounter(trainer.dhelix.runner)
        got = [observed_step(trainer, with_grads=True) for _ in range(steps)]
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, counter.pairs)
        report[name] = {"rows": compare_steps(ref_steps, got), "pairs": pairs,
                        "m": dargs.num_microbatches, "p": dargs.pipeline_model_parallel_size}
    destroy_parallel_state()
    dist.barrier()
    return report

