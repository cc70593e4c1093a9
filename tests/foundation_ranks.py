"""Rank bodies for the foundation tests (spawned by dhelix.harness; module-level so they
can be pickled by name). Each body batches several checks into one launch, because every
process pays ~4 s of imports on a 2-core machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.arguments import parse_args
from dhelix.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from dhelix.folding import uses_folded_model
from dhelix.parallel import (
    Job,
    ParallelSizes,
    destroy_parallel_state,
    init_megatron_parallel_state,
    init_process_group_from_env,
)
from dhelix.parity import gather_full_tensors
from dhelix.training import Trainer, forward_step, reduce_loss_to_all_ranks
from tests.plugin_parity_ranks import compare_steps


def tiny_args(tp=1, pp=1, sp=False, distopt=False, extra=()):
    argv = ["--preset", "tiny", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp)]
    if sp:
        argv.append("--sequence-parallel")
    if distopt:
        argv.append("--use-distributed-optimizer")
    return parse_args(argv + list(extra))


def build_trainer(args, job: Job) -> Trainer:
    """Parallel state and trainer for `args` (the folded model for --dhelix with PP > 1)."""
    init_megatron_parallel_state(
        ParallelSizes(args.tensor_model_parallel_size, args.pipeline_model_parallel_size),
        args.seed, job, folded=uses_folded_model(args),
    )
    return Trainer.build(args, job)


def observed_step(trainer: Trainer, with_grads: bool) -> dict:
    """One iteration with full (layout-independent) grads before and params after the
    optimizer step."""
    losses = trainer.forward_backward()
    grads = gather_full_tensors(trainer.model, "grad") if with_grads else None
    trainer.optimizer_step()
    return {
        "loss": reduce_loss_to_all_ranks(losses, trainer.loss_on_first_stage),
        "grads": grads,
        "params": gather_full_tensors(trainer.model, "param"),
    }


def eval_loss(trainer: Trainer) -> float:
    """The mean loss of one forward-only global batch (what Megatron's `evaluate()` asks of
    the forward/backward function), from the trainer's next samples."""
    losses = trainer.forward_backward_func(
        forward_step_func=forward_step, data_iterator=trainer.data_iterator(),
        model=trainer.model, num_microbatches=trainer.args.num_microbatches,
        seq_length=trainer.args.seq_length, micro_batch_size=trainer.args.micro_batch_size,
        forward_only=True)
    return reduce_loss_to_all_ranks(losses, trainer.loss_on_first_stage)


def engine_record(trainer: Trainer) -> list[dict]:
    """Every rank's record of what the `--dhelix` trainer's last forward/backward call ran
    (`ScheduleEngine.last_step`, counted by the executor while it ran), with the engine's
    type, the pass engine and the length of that rank's listed actions."""
    engine = trainer.dhelix.engine
    step = engine.last_step
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    schedule = engine.schedule(pp, trainer.args.num_microbatches, step.forward_only)
    mine = {**dataclasses.asdict(step), "engine": type(engine).__name__,
            "listed": len(schedule.ranks[step.stage]),
            "si_blocks": sum(a.kind == "SI" for a in schedule.ranks[step.stage])}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def untag_sequence_parallel_norms(trainer: Trainer) -> int:
    """Negative control for the SP LayerNorm trap: drop the `sequence_parallel` tag from
    the norm parameters, as a naively built torch norm would. Returns how many."""
    count = 0
    for chunk in trainer.model:
        for param in chunk.module.parameters():
            if getattr(param, "sequence_parallel", False):
                del param.sequence_parallel
                count += 1
    if count == 0:
        raise AssertionError("no sequence_parallel-tagged parameters to untag")
    return count


def layout_parity_and_resume(ctx, workdir: str, groups: dict, steps: int = 3) -> dict:
    """For each group `{name: {"extra_args": [...], "distopt": bool, "layouts": {name: spec}}}`:
    a reference TP1xPP1 (DP = world) run with the group's options, then each layout
    from the same initial weights and data, and resume checks (`spec["resume"]`) from a
    checkpoint the reference saved after 2 steps. With `group["try_optimizer_load"]` the
    reference then loads that checkpoint with its optimizer state, recorded under
    `<group>_optimizer_load`: "loaded" or the CheckpointError's message.

    Returns (on every rank) {layout_name: [per-step comparison rows]}.
    """
    job = init_process_group_from_env()
    report = {}
    for group_name, group in groups.items():
        workdir_group = Path(workdir) / group_name
        extra = group.get("extra_args", ())
        ref = build_trainer(tiny_args(distopt=group.get("distopt", False), extra=extra), job)
        save_checkpoint(ref, workdir_group / "init")
        ref_steps = []
        for k in range(steps):
            ref_steps.append(observed_step(ref, with_grads=not group.get("distopt", False)))
            if k == 1:
                save_checkpoint(ref, workdir_group / "resume")
        if group.get("try_optimizer_load"):
            try:
                load_checkpoint(ref, workdir_group / "resume")
                report[f"{group_name}_optimizer_load"] = "loaded"
            except CheckpointError as exc:
                report[f"{group_name}_optimizer_load"] = str(exc)
        for name, spec in group["layouts"].items():
            args = tiny_args(tp=spec["tp"], pp=spec["pp"], sp=spec.get("sp", False),
                             distopt=spec.get("distopt", False), extra=extra)
            trainer = build_trainer(args, job)
            if spec.get("untag_sp_norms"):
                untag_sequence_parallel_norms(trainer)
            if spec.get("resume"):
                load_checkpoint(trainer, workdir_group / "resume")
                expected = ref_steps[trainer.iteration:]
            else:
                load_checkpoint(trainer, workdir_group / "init", load_optimizer=False)
                expected = ref_steps
            # With the distributed optimizer each DP rank holds only its reduce-scattered
            # grad shard, so such runs are compared through losses and updated params.
            with_grads = not args.use_distributed_optimizer
            got = [observed_step(trainer, with_grads) for _ in expected]
            report[name] = compare_steps(expected, got)
    destroy_parallel_state()
    dist.barrier()
    return report
