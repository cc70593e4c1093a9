"""Rank bodies for the folding tests (spawned by dhelix.harness; module-level so they pickle
by name). One launch runs every layout, because each process pays ~4 s of imports."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.checkpointing import load_checkpoint, save_checkpoint
from dhelix.parallel import (
    ParallelSizes,
    destroy_parallel_state,
    init_megatron_parallel_state,
    init_process_group_from_env,
)
from dhelix.parity import gather_full_tensors, max_abs_diff
from dhelix.schedules.actions import PipelinePath
from dhelix.schedules.one_f_one_b import build_1f1b_schedule
from dhelix.schedules.executor import AutogradPasses
from dhelix.schedules.runner import chunk_forward, make_forward_backward_func
from dhelix.schedules.sequential import build_sequential_schedule
from dhelix.schedules.w_schedule import build_w_schedule
from dhelix.training import Trainer, reduce_loss_to_all_ranks
from megatron_patches.folded_model import FoldedModelError, build_folded_model_chunks
from tests.foundation_ranks import tiny_args

FOLDED_SCHEDULES = {
    "sequential": lambda p, m: build_sequential_schedule(PipelinePath.folded(p), m),
    "w": build_w_schedule,
}


def _trainer(args, job, folded: bool) -> Trainer:
    init_megatron_parallel_state(
        ParallelSizes(args.tensor_model_parallel_size, args.pipeline_model_parallel_size),
        args.seed, job, folded=folded)
    if folded:
        return Trainer.build(args, job, model_builder=build_folded_model_chunks)
    return Trainer.build(args, job)


def _stock_embedding_group_rejected(args, job) -> list:
    """Build the folded model under Megatron's default embedding group (first and last
    stage): [(stage, raised FoldedModelError)] of every rank."""
    init_megatron_parallel_state(
        ParallelSizes(args.tensor_model_parallel_size, args.pipeline_model_parallel_size),
        args.seed, job)
    try:
        build_folded_model_chunks(args)
        raised = False
    except FoldedModelError:
        raised = True
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (parallel_state.get_pipeline_model_parallel_rank(), raised))
    return everyone


class CountingSI(AutogradPasses):
    """Autograd passes that count the SI blocks they run (forward, then backward)."""

    def __init__(self, model):
        super().__init__(chunk_forward(model))
        self.blocks = 0

    def si(self, forward, backward):
        self.blocks += 1
        return super().si(forward, backward)


def _fresh_step(trainer: Trainer, loss_on_first_stage: bool) -> tuple[float, dict]:
    """One forward/backward from the first sample: (loss, full grads by checkpoint key)."""
    trainer.reset_data_iterator()
    losses = trainer.forward_backward()
    loss = reduce_loss_to_all_ranks(losses, loss_on_first_stage=loss_on_first_stage)
    return loss, gather_full_tensors(trainer.model, "grad")


def folded_parity(ctx, workdir: str, cases: dict) -> dict:
    """For each case `{name: {"tp", "pp", "sp", "extra", "back": (tp, pp)}}`:

    - stock GPTModel (TP x PP) saves its initial weights and runs Megatron's 1F1B: the
      reference loss and gradients; the same model runs the 1F1B action lists through the
      executor;
    - the folded model (same TP x PP) loads the stock checkpoint (params compared), then
      runs the sequential folded schedule and the W-shaped schedule (SI blocks executed
      forward-then-backward), each compared with the reference;
    - the folded model takes an SGD step and saves; a stock model with the `back` TP x PP
      loads that checkpoint (params compared with the folded model's);
    - building the folded model under Megatron's default embedding group (first and last
      stage) is refused on the stages in that group.

    Returns {name: {measure: value}} on every rank.
    """
    job = init_process_group_from_env()
    report = {}
    for name, case in cases.items():
        root = Path(workdir) / name
        row = {}
        args = tiny_args(tp=case["tp"], pp=case["pp"], sp=case.get("sp", False),
                         extra=case.get("extra", ()))
        pp = args.pipeline_model_parallel_size
        stock = _trainer(args, job, folded=False)
        save_checkpoint(stock, root / "stock_init")
        init_params = gather_full_tensors(stock.model, "param")
        ref_loss, ref_grads = _fresh_step(stock, loss_on_first_stage=False)
        row["loss_ref"] = ref_loss
        stock.forward_backward_func = make_forward_backward_func(build_1f1b_schedule)
        loss, grads = _fresh_step(stock, loss_on_first_stage=False)
        row["exec_1f1b_loss_diff"] = abs(loss - ref_loss)
        row["exec_1f1b_grad_diff"], _ = max_abs_diff(ref_grads, grads)

        folded = _trainer(args, job, folded=True)
        load_checkpoint(folded, root / "stock_init", load_optimizer=False)
        row["load_stock_param_diff"], _ = max_abs_diff(
            init_params, gather_full_tensors(folded.model, "param"))
        for sched_name, builder in FOLDED_SCHEDULES.items():
            counter = CountingSI(folded.model[0])
            folded.forward_backward_func = make_forward_backward_func(builder, passes=counter)
            loss, grads = _fresh_step(folded, loss_on_first_stage=True)
            row[f"{sched_name}_si_blocks"] = counter.blocks
            row[f"{sched_name}_loss_diff"] = abs(loss - ref_loss)
            row[f"{sched_name}_grad_diff"], row[f"{sched_name}_grad_key"] = max_abs_diff(
                ref_grads, grads)
        folded.optimizer.step()
        folded.iteration += 1
        stepped = gather_full_tensors(folded.model, "param")
        row["step_changed_params"], _ = max_abs_diff(init_params, stepped)
        save_checkpoint(folded, root / "folded_step")

        back_tp, back_pp = case["back"]
        back = _trainer(tiny_args(tp=back_tp, pp=back_pp, extra=case.get("extra", ())),
                        job, folded=False)
        load_checkpoint(back, root / "folded_step", load_optimizer=False)
        row["folded_to_stock_param_diff"], _ = max_abs_diff(
            stepped, gather_full_tensors(back.model, "param"))
        row["stock_embedding_group"] = _stock_embedding_group_rejected(args, job)
        row["microbatches"] = args.num_microbatches
        row["pp"] = pp
        report[name] = row
    destroy_parallel_state()
    dist.barrier()
    return report
