#!/usr/bin/env python
"""Megatron-style GPT pretraining on megatron-core (run under torchrun).

    torchrun --nproc-per-node 4 scripts/dhelix_trainer.py --preset tiny \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Megatron's argument names (see `dhelix.arguments`); GPTModel with the local spec on CPU
(Transformer Engine spec where TE is present), Megatron DDP, Megatron's optimizer and
Megatron's own forward/backward schedule. Logs loss, step time, tokens/s and peak memory.

Bad arguments are reported as one line naming the argument and the fix, with exit code 2,
before any process group is created (rank 0 prints it; torchrun then adds its own failure
report and exits 1). When `$DHELIX_ERROR_FILE` is set the ranks write the line there
instead (`dhelix.rank_errors.report_error`). `dhelix train` no longer runs this trainer: it
launches the Megatron-LM plugin (`dhelix.megatron_lm`).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dhelix.arguments import ArgumentError, parse_args  # noqa: E402
from dhelix.rank_errors import ERROR_EXIT_CODE, report_error  # noqa: E402


def _quiet_known_warnings() -> None:
    # Deprecation chatter from megatron-core/torch internals that users cannot act on.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")


def _print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def train(args) -> int:
    """Join the job, run `_train`, leave the job. A collective that times out because ranks
    stopped answering ends with one line naming them (exit code 1)."""
    import logging

    from dhelix.parallel import destroy_parallel_state, init_process_group_from_env
    from dhelix.stall import StallGuard

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    timeout_s = 60 * args.distributed_timeout_minutes
    job = init_process_group_from_env(args.distributed_backend, timeout_s=timeout_s)
    import torch.distributed as dist

    guard = StallGuard.for_job(job)
    try:
        return _train(args, job)
    except Exception as exc:
        if guard is None or guard.explain(exc, report=_print_error) is None:
            raise
        return 1
    finally:
        destroy_parallel_state()
        dist.destroy_process_group()


def _train(args, job) -> int:
    from dhelix.checkpointing import (
        CheckpointError,
        iteration_dir,
        load_checkpoint,
        remove_incomplete_saves,
        save_checkpoint,
    )
    from dhelix.divergence import nonfinite_error
    from dhelix.file_formats import FormatError
    from dhelix.folding import uses_folded_model
    from dhelix.parallel import ParallelSizes, init_megatron_parallel_state
    from dhelix.runtime.setup import DHelixSetupError
    from dhelix.training import Trainer, format_step, step_record
    import torch.distributed as dist

    rank = dist.get_rank()
    init_megatron_parallel_state(
        ParallelSizes(args.tensor_model_parallel_size, args.pipeline_model_parallel_size),
        args.seed, job, folded=uses_folded_model(args),
    )
    try:
        trainer = Trainer.build(args, job)
    except (DHelixSetupError, FormatError) as exc:
        report_error(str(exc))
        return ERROR_EXIT_CODE
    last_checkpoint = None  # the newest good checkpoint of this run (loaded or saved)
    if args.load:
        try:
            load_checkpoint(trainer, args.load, load_optimizer=not args.no_load_optim,
                            load_rng=not args.no_load_rng, iteration=args.ckpt_step)
        except CheckpointError as exc:
            report_error(str(exc))
            return ERROR_EXIT_CODE
        last_checkpoint = iteration_dir(args.load, trainer.iteration)
        if rank == 0:
            print(f"loaded checkpoint from {args.load} at iteration {trainer.iteration}")
    if args.save and rank == 0:
        for stale in remove_incomplete_saves(args.save):
            print(f"removed {stale}: a save that did not finish (an earlier run was stopped "
                  "during it)", flush=True)
    if rank == 0:
        print(f"training: world {dist.get_world_size()} = TP {args.tensor_model_parallel_size}"
              f" x PP {args.pipeline_model_parallel_size} x DP {args.data_parallel_size}, "
              f"SP {'on' if args.sequence_parallel else 'off'}, "
              f"{args.num_microbatches} micro-batches of {args.micro_batch_size}", flush=True)
        if trainer.dhelix is not None:
            print(f"dhelix: {trainer.dhelix.describe()}", flush=True)
    log_file = open(args.log_json, "a") if (args.log_json and rank == 0) else None
    try:
        while trainer.iteration < args.train_iters:
            result = trainer.train_step()
            if rank == 0 and (result.iteration % args.log_interval == 0
                              or result.iteration == args.train_iters):
                line = format_step(result, args.train_iters)
                if trainer.dhelix is not None and trainer.dhelix.predicted_speedup:
                    line += f" | dhelix plan predicts {trainer.dhelix.predicted_speedup:.3f}x"
                if trainer.dhelix is not None and trainer.dhelix.timing_only:
                    line += " | TIMING ONLY, WRONG NUMERICS"
                print(line, flush=True)
                if log_file:
                    log_file.write(step_record(result) + "\n")
                    log_file.flush()
            error = (nonfinite_error(result.iteration, result.loss, result.grad_norm,
                                     last_checkpoint)
                     if args.check_for_nan_in_loss_and_grad else None)
            if error:  # the same on every rank: loss and grad norm are global
                report_error(error)
                return 1
            if args.save and args.save_interval and result.iteration % args.save_interval == 0:
                last_checkpoint = save_checkpoint(trainer, args.save)
        if args.save and (not args.save_interval or trainer.iteration % args.save_interval):
            path = save_checkpoint(trainer, args.save)
            if rank == 0:
                print(f"saved checkpoint to {path}")
    finally:
        if log_file:
            log_file.close()
    return 0


def main(argv=None) -> int:
    _quiet_known_warnings()
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        report_error(str(exc))
        return ERROR_EXIT_CODE
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
