"""Rank bodies for the foundation tests (spawned by dhelix.harness; module-level so they
can be pickled by name). Each body batches several checks into one launch, because every
process pays ~4 s of imports on a 2-core machine."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.arguments import parse_args
from dhelix.folding import uses_folded_model
from dhelix.parallel import (
    Job,
    ParallelSizes,
    destroy_parallel_state,
    init_megatron_parallel_state,
    init_process_group_from_env,
)
from dhelix.parity import gather_full_tensors, max_abs_diff
from dhelix.training import Trainer, forward_step, reduce_loss_to_all_ranks
from tests.plugin_pipeline_ranks import compare_steps, gathered_engine_record


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
    return gathered_engine_record(trainer.dhelix.engine,
                                  parallel_state.get_pipeline_model_parallel_world_size(),
                                  trainer.args.num_microbatches)


def _plan_with_a_seam(trainer) -> None:
    """Give the DHelix trainer's layer runner a legal plan whose layer pairs meet at a seam
    (`planner.blocks.layer_seam`), from its own strand orders: the forward up to its first
    collective alone; the rest of the forward with the backward up to its first collective;
    the backward up to its last collective alone; the rest alone. (The analytic-cost plans of
    the tiny preset have no seam; profiled plans on the emulated cluster do.)"""
    from planner.blocks import Block, Pairing, check_pairing, layer_seam

    runner = trainer.dhelix.runner
    dags = runner.bound_layers[0].programs.dags()
    ops_f, ops_b = dags["fwd"].by_id(), dags["bwd"].by_id()
    f, b = list(runner.fwd_order), list(runner.bwd_order)
    first_f = next(i for i, o in enumerate(f) if ops_f[o].kind == "comm")
    first_b = next(i for i, o in enumerate(b) if ops_b[o].kind == "comm")
    last_b = max(i for i, o in enumerate(b) if ops_b[o].kind == "comm")
    blocks = [Block(f[:first_f], ()), Block(f[first_f:], b[:first_b]),
              Block((), b[first_b:last_b]), Block((), b[last_b:])]
    check_pairing(dags["fwd"], dags["bwd"], Pairing(f, b, blocks))
    runner.blocks = tuple(blocks)
    runner.seam = layer_seam(blocks, ops_f, ops_b)
    assert runner.seam is not None and (runner.seam.head, runner.seam.tail) == (1, 2)


def dhelix_parity(ctx, cases: dict, steps: int = 2, extra_args=()) -> dict:
    """For each case {name: {"tp", "sp", "pairer"}}: Megatron's no-pipelining schedule and
    the DHelix schedule from the same initial weights (same seed, same layout) and data;
    per-step comparison rows, plus the plan's block count."""
    job = init_process_group_from_env()
    report = {}
    for name, spec in cases.items():
        base = ["--optimizer", "sgd", "--lr", "0.05", *extra_args, *spec.get("extra", ())]
        args = tiny_args(tp=spec["tp"], sp=spec.get("sp", False), extra=base)
        ref = build_trainer(args, job)
        ref_steps = [observed_step(ref, with_grads=True) for _ in range(steps)]
        dargs = tiny_args(tp=spec["tp"], sp=spec.get("sp", False),
                          extra=base + ["--dhelix", "--dhelix-pairer", spec["pairer"],
                                        *spec.get("dhelix_extra", ())])
        trainer = build_trainer(dargs, job)
        if spec.get("seam"):
            _plan_with_a_seam(trainer)
        got = [observed_step(trainer, with_grads=True) for _ in range(steps)]
        trained = engine_record(trainer)
        eval_diff = abs(eval_loss(ref) - eval_loss(trainer))
        report[name] = {"rows": compare_steps(ref_steps, got),
                        "executed": {"train": trained, "eval": engine_record(trainer)},
                        "eval_loss_diff": eval_diff,
                        "blocks": len(trainer.dhelix.runner.blocks),
                        "plan_source": trainer.dhelix.plan_source,
                        "num_microbatches": dargs.num_microbatches,
                        "seam": trainer.dhelix.runner.seam is not None,
                        "describe": trainer.dhelix.describe()}
    destroy_parallel_state()
    dist.barrier()
    return report
