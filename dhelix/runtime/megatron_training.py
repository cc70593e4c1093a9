"""The DHelix schedules as the forward/backward function of `megatron.training`'s `train()`
and `evaluate()` (handed to them by `megatron_patches.training_hooks`).

- PP = 1: the SI schedule of `dhelix.runtime.pp1_schedule` as it is (it has Megatron's
  signature and falls back to Megatron's no-pipelining schedule for forward-only steps).
- PP > 1, the folded model: training runs the W-shaped schedule (the executor of
  `dhelix.schedules` with the operator pass engine `FoldedOperatorPasses`); evaluation runs
  each micro-batch's forward along the folded route without gradients. Batches come from
  the pretrain script's own `forward_step_func`, called once per micro-batch on every stage
  in micro-batch order as Megatron's schedules call it, and seen through
  `folded_data_view` (stage 0 embeds and computes the loss, so to the forward step it is a
  whole model; the other stages read no data). The loss goes through Megatron's
  `forward_step_calc_loss` (the script's loss function, token-count normalisation,
  division by the number of micro-batches) and `config.grad_scale_func`, as in Megatron's
  schedules; gradients are finalised by `config.finalize_model_grads_func`.

The folded model computes the loss on the first stage; Megatron's training loop reduces and
logs the losses of the last pipeline stage, so the per-micro-batch loss dicts are handed from
the first stage to the others (`relay_losses_to_last_stage`) and returned on the last stage
only, as Megatron's schedules return them.

Megatron's `forward-compute`/`backward-compute` timers are not run inside the DHelix
schedules (their forward and backward passes interleave); the step's other timers are.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config

from dhelix.devices import compute_device
from dhelix.runtime.folded_passes import FoldedOperatorPasses
from dhelix.runtime.forward_step_capture import capture_forward_step
from dhelix.schedules.runner import forward_backward_schedule
from dhelix.schedules.w_schedule import build_w_schedule
from megatron_patches.gpt_parts import unwrap_gpt


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


def relay_losses_to_last_stage(losses: list) -> list:
    """The first pipeline stage's per-micro-batch loss dicts, returned on the last stage
    ([] elsewhere), as Megatron's pipeline schedules return them. Collective over the
    pipeline group."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return losses
    first = parallel_state.get_pipeline_model_parallel_rank() == 0
    payload = [[{k: v.detach().cpu() for k, v in d.items()} for d in losses] if first else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    if parallel_state.get_pipeline_model_parallel_rank() != dist.get_world_size(group) - 1:
        return []
    device = compute_device()
    return [{k: v.to(device) for k, v in d.items()} for d in payload[0]]


@contextlib.contextmanager
def _without_timers(config):
    timers, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = timers


class FoldedMegatronSchedule:
    """Megatron's forward_backward_func for the folded model (module docstring). `setup` is
    the `dhelix.runtime.setup.DHelixSetup` built for this model; `args` Megatron's args."""

    def __init__(self, setup, args):
        self.passes = FoldedOperatorPasses(setup.parts, setup.runner)
        self.args = args
        self._schedules: dict = {}

    def _next_step(self, forward_step_func, data_iterator, model) -> dict:
        first = parallel_state.get_pipeline_model_parallel_rank() == 0
        with folded_data_view(self.args):
            step = capture_forward_step(forward_step_func, data_iterator, model,
                                        require_labels=first)
        return {"tokens": step.input_ids, "position_ids": step.position_ids,
                "labels": step.labels, "loss_func": step.loss_func}

    @staticmethod
    def _megatron_loss(model, config, num_microbatches, batch, output):
        store: list = []
        loss, _ = mcore_schedules.forward_step_calc_loss(
            model, output, batch["loss_func"], config, None, False, num_microbatches, store,
            cp_group_size=1, is_last_stage=True)
        return loss, store[-1]

    def _pipeline_shape(self, config, seq_length, micro_batch_size):
        seq = seq_length
        if config.sequence_parallel:
            seq //= parallel_state.get_tensor_model_parallel_world_size()
        return (seq, micro_batch_size, config.hidden_size)

    def _train(self, forward_step_func, data_iterator, chunk, config, num_microbatches,
               seq_length, micro_batch_size) -> list:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        key = (pp, num_microbatches)
        if key not in self._schedules:
            self._schedules[key] = build_w_schedule(pp, num_microbatches)
        return forward_backward_schedule(
            self._schedules[key], model=[chunk], data_iterator=None,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, config=config, passes=self.passes,
            next_batch=partial(self._next_step, forward_step_func, data_iterator, chunk),
            batch_loss=partial(self._megatron_loss, chunk, config, num_microbatches))

    def _evaluate(self, forward_step_func, data_iterator, chunk, config, num_microbatches,
                  seq_length, micro_batch_size) -> list:
        """Each micro-batch's forward along the folded route, no gradients; returns the loss
        dicts on stage 0."""
        module = unwrap_gpt(chunk)
        route = module.layout.forward_route()
        stage = module.stage
        group = parallel_state.get_pipeline_model_parallel_group()
        shape = self._pipeline_shape(config, seq_length, micro_batch_size)
        dtype = config.pipeline_dtype or config.params_dtype
        device = compute_device()
        losses = []
        with torch.no_grad():
            for _ in range(num_microbatches):
                batch = self._next_step(forward_step_func, data_iterator, chunk)
                x = None
                for hop, (hop_stage, hop_chunk) in enumerate(route):
                    if hop_stage != stage:
                        continue
                    if hop > 0 and route[hop - 1][0] != stage:
                        x = torch.empty(shape, dtype=dtype, device=device)
                        dist.recv(x, src=dist.get_global_rank(group, route[hop - 1][0]))
                    out = chunk(batch["tokens"], batch["position_ids"], None, decoder_input=x,
                                labels=batch["labels"], chunk=hop_chunk)
                    if hop == len(route) - 1:
                        losses.append(self._megatron_loss(chunk, config, num_microbatches,
                                                          batch, out)[1])
                    elif route[hop + 1][0] != stage:
                        dist.send(out.contiguous(),
                                  dst=dist.get_global_rank(group, route[hop + 1][0]))
                    else:
                        x = out
        return losses

    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length=None, micro_batch_size=None, forward_only=False,
                         collect_non_loss_data=False, **_unused):
        """Megatron's forward_backward_func signature (the extra keyword arguments of
        `train_step`/`evaluate` are accepted and not needed)."""
        if collect_non_loss_data:
            raise ValueError("--dhelix with PP > 1 does not collect non-loss data")
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise ValueError("--dhelix runs one model chunk per rank")
        if isinstance(data_iterator, list):
            data_iterator = data_iterator[0]
        config = get_model_config(chunks[0])
        run = self._evaluate if forward_only else self._train
        with _without_timers(config):
            losses = run(forward_step_func, data_iterator, chunks[0], config, num_microbatches,
                         seq_length, micro_batch_size)
        return relay_losses_to_last_stage(losses)


def megatron_forward_backward(setup, args):
    """The function `train()` and `evaluate()` get for this `--dhelix` run: the PP=1 DHelix
    schedule, or `FoldedMegatronSchedule` for the folded model."""
    if args.pipeline_model_parallel_size == 1:
        pp1 = setup.forward_backward_func

        def forward_backward(**kwargs):
            config = get_model_config(kwargs["model"][0] if isinstance(kwargs["model"], list)
                                      else kwargs["model"])
            if kwargs.get("forward_only"):
                return pp1(**kwargs)
            with _without_timers(config):
                return pp1(**kwargs)

        return forward_backward
    return FoldedMegatronSchedule(setup, args).forward_backward
