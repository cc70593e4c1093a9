"""Megatron plumbing the folded model needs inside Megatron's training loop (used by the
schedule engine, `dhelix.schedules.runner.ScheduleEngine`):

- `folded_data_view`: batches come from the pretrain script's own `forward_step_func`,
  called once per micro-batch on every stage; with the folded model stage 0 embeds and
  computes the loss, so to the forward step it is a whole model, and the other stages read
  no data.
- `relay_losses_to_last_stage`: the folded model computes the loss on the first stage;
  Megatron's training loop reduces and logs the losses of the last pipeline stage, so the
  per-micro-batch loss dicts are handed from the first stage to the others and returned on
  the last stage only, as Megatron's schedules return them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@contextlib.contextmanager
def folded_data_view(args):
    """While a forward step runs on a folded model: stage 0 is the first and the last
    pipeline stage and the pipeline looks like one stage (`args.pipeline_model_parallel_size`
    1), so the forward step reads tokens, positions, labels and loss mask there (Megatron's
    `get_batch_on_this_tp_rank` keeps labels only on the last stage when PP > 1); every other
    stage is a middle stage and reads nothing. Everything is restored on exit."""
    first = parallel_state.get_pipeline_model_parallel_rank() == 0
    saved = (parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage,
             args.pipeline_model_parallel_size)
    parallel_state.is_pipeline_first_stage = lambda *a, **k: first
    parallel_state.is_pipeline_last_stage = lambda *a, **k: first
    args.pipeline_model_parallel_size = 1 if first else saved[2]
    try:
        yield
    finally:
        (parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage,
         args.pipeline_model_parallel_size) = saved


def relay_losses_to_last_stage(losses: list, device: torch.device) -> list:
    """The first pipeline stage's per-micro-batch loss dicts, returned on the last stage
    ([] elsewhere) on `device` (the model's), as Megatron's pipeline schedules return them.
    Collective over the pipeline group."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return losses
    first = parallel_state.get_pipeline_model_parallel_rank() == 0
    payload = [[{k: v.detach().cpu() for k, v in d.items()} for d in losses] if first else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if parallel_state.get_pipeline_model_parallel_rank() != dist.get_world_size(group) - 1:
        return []
    return [{k: v.to(device) for k, v in d.items()} for d in payload[0]]
