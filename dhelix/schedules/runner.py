"""One global batch's forward and backward on this rank's Megatron model, driven by a
schedule (`dhelix.schedules.executor`), with Megatron's own gradient finalisation.

The folded path runs a `FoldedGPTModel` (any folded schedule: sequential, W-shaped); the
linear path runs a stock GPTModel chunk (e.g. the 1F1B action lists, to compare the executor
with Megatron's own 1F1B). Batches are dhelix's GPT micro-batch dicts (`dhelix.data`) and
the loss is `dhelix.training.loss_func`, exactly as in `dhelix.training.forward_step`.

Gradients accumulate while DDP's `no_sync` is active and are then finalised by
`config.finalize_model_grads_func` (Megatron's `finalize_model_grads`: DP all-reduce, SP
norm all-reduce, embedding groups), as Megatron's schedules do. DDP with
`overlap_grad_reduce` is not supported (checked).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from dhelix.schedules.actions import Schedule
from dhelix.schedules.executor import AutogradPasses, StageExecutor
from dhelix.training import forward_step as gpt_forward_step
from dhelix.training import loss_func as gpt_loss_func
from megatron_patches.folded_model import FoldedGPTModel
from megatron_patches.gpt_parts import unwrap_gpt


class ScheduleMismatch(ValueError):
    """The schedule does not fit the model, the pipeline or the batch."""


def chunk_forward(model) -> Callable:
    """forward_chunk(batch, chunk, input) for the executor, for a (DDP- and
    Float16Module-wrapped) folded or stock GPT model chunk."""
    module = unwrap_gpt(model)
    if isinstance(module, FoldedGPTModel):
        def run(batch, chunk, inp):
            return model(batch["tokens"], batch["position_ids"], None, decoder_input=inp,
                         labels=batch["labels"], chunk=chunk)
        return run

    def run_stock(batch, chunk, inp):
        if chunk != 0:
            raise ScheduleMismatch("a stock GPTModel chunk has one layer chunk per stage")
        module.set_input_tensor(inp)
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return run_stock


def _check_fit(schedule: Schedule, module, num_microbatches: int) -> None:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if schedule.num_stages != pp:
        raise ScheduleMismatch(f"schedule has {schedule.num_stages} stages, the pipeline "
                               f"has {pp} (--pipeline-model-parallel-size)")
    if schedule.num_microbatches != num_microbatches:
        raise ScheduleMismatch(f"schedule has {schedule.num_microbatches} micro-batches, the "
                               f"global batch has {num_microbatches}")
    folded = isinstance(module, FoldedGPTModel)
    if folded != (schedule.path.name == "folded"):
        raise ScheduleMismatch(f"a {schedule.path.name}-path schedule cannot run a "
                               f"{type(module).__name__}")


def forward_backward_schedule(schedule: Schedule, *, model, data_iterator,
                              num_microbatches: int, seq_length: int, micro_batch_size: int,
                              config, passes=None,
                              loss_func: Callable = gpt_loss_func, next_batch=None,
                              batch_loss: Callable | None = None) -> list:
    """Run `schedule` on this rank's single model chunk (`model` or `[model]`) and finalise
    the gradients. `passes` is the pass engine (default: `AutogradPasses` over the chunk).
    Batches are `next(data_iterator)` (dhelix's GPT batch dicts) and the loss
    `loss_func(batch["loss_mask"], output)` scaled by the executor, unless `next_batch()`
    and `batch_loss(batch, output) -> (scaled loss, info)` are given (Megatron's forward
    step and loss scaling: `dhelix.runtime.megatron_training`). Returns the per-micro-batch
    loss dicts on the rank that computes the loss (first stage for folded, last for linear),
    [] elsewhere. A pass engine with a `finish_step()` method has it called after the
    last pass, before the gradients are finalised. Collective over all ranks."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ScheduleMismatch("one model chunk per rank (no virtual pipeline stages)")
    (chunk,) = chunks
    module = unwrap_gpt(chunk)
    _check_fit(schedule, module, num_microbatches)
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        raise ScheduleMismatch("schedule execution needs DDP without overlap_grad_reduce")
    seq = seq_length
    if config.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    executor = StageExecutor(
        schedule, parallel_state.get_pipeline_model_parallel_rank(),
        passes=passes if passes is not None else AutogradPasses(chunk_forward(chunk)),
        loss_func=batch_loss or (lambda batch, out: loss_func(batch["loss_mask"], out)),
        loss_is_scaled=batch_loss is not None,
        next_batch=next_batch or (lambda: next(data_iterator)),
        tensor_shape=(seq, micro_batch_size, config.hidden_size),
        dtype=config.pipeline_dtype or config.params_dtype,
        device=device,
        peer_rank=lambda stage: dist.get_global_rank(pp_group, stage),
        grad_scale_func=config.grad_scale_func,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
    no_sync = config.no_sync_func or nullcontext
    with no_sync():
        losses = executor.run()
    finish_step = getattr(executor.passes, "finish_step", None)
    if finish_step is not None:
        finish_step()
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([chunk])
    return losses


def make_forward_backward_func(build_schedule: Callable[[int, int], Schedule],
                               passes=None) -> Callable:
    """A function with Megatron's `forward_backward_func` signature (what
    `dhelix.training.Trainer.forward_backward_func` holds) that runs
    `build_schedule(pp, num_microbatches)` through the executor, with the pass engine
    `passes` (default: `AutogradPasses` over the model chunk).

    The executor handles batches itself, exactly like `dhelix.training.forward_step`; any
    other `forward_step_func` is refused rather than silently ignored.
    """
    cache: dict = {}

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, forward_only=False, **_unused):
        if forward_step_func is not gpt_forward_step:
            raise ScheduleMismatch("schedule execution supports dhelix.training.forward_step "
                                   "batches only")
        if forward_only:
            raise ScheduleMismatch("schedule execution is for training (forward_only=False)")
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        key = (pp, num_microbatches)
        if key not in cache:
            cache[key] = build_schedule(pp, num_microbatches)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        return forward_backward_schedule(
            cache[key], model=chunks, data_iterator=data_iterator,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, config=get_model_config(chunks[0]),
            passes=passes)

    return forward_backward
