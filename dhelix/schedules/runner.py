"""The schedule engine: Megatron's `forward_backward_func` for every layout, running this
rank's action list (`dhelix.schedules.executor.StageExecutor`) on its Megatron model chunk
with Megatron's own forward-step contract, loss and gradient finalisation.

One engine serves every `--dhelix` layout and the executor's tests:
- PP = 1: the one-stage SI schedule (`si_schedule`) with the operator pass engine
  (`dhelix.runtime.operator_passes`); the Domino-style split is the no-pipelining order
  (`sequential.build_no_pipelining_schedule`) with its own pass engine
  (`dhelix.runtime.intra_batch_passes`); the Wavelet-style row is the SI schedule with a
  round-robin plan;
- PP > 1, the folded model: the W-shaped schedule with the same operator pass engine;
- any schedule with `AutogradPasses` over the chunk module (the folded sequential and W
  schedules, the 1F1B lists on a stock model: `tests/folding`).
Evaluation (`forward_only=True`) runs the forward-only list of the same path
(`sequential.build_forward_only_schedule`) on the same executor, the chunk module's own
forward under `torch.no_grad()`.

Batches: the script's `forward_step_func(data_iterator, model)` is called once per
micro-batch, in micro-batch order, on every stage, as Megatron's schedules call it; what it
hands the model (tokens, positions, labels) and its loss function are captured
(`dhelix.runtime.forward_step_capture`; Megatron-LM's pretrain_gpt fits). For the folded
model with `data_args` (Megatron's args) it runs under `folded_data_view` (stage 0 embeds
and computes the loss). The loss goes through Megatron's `forward_step_calc_loss` (the
script's loss function, token-count normalisation, division by the number of
micro-batches, the loss dicts Megatron's training loop reduces) and
`config.grad_scale_func`; `no_sync` follows the executor's one rule;
`config.finalize_model_grads_func` runs after the list (with the token count under
`calculate_per_token_loss`). Megatron's `forward-compute`/`backward-compute` timers are not
run (forward and backward passes interleave); the step's other timers are.

Every tensor the engine creates (the token count, receive buffers) lives on the model's
device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config

from dhelix.runtime.forward_step_capture import CausalMaskCheck, capture_forward_step
from dhelix.schedules.actions import FORWARD, Schedule
from dhelix.schedules.executor import AutogradPasses, StageExecutor
from dhelix.schedules.sequential import build_forward_only_schedule
from megatron_patches.folded_model import FoldedGPTModel
from megatron_patches.folded_stage_io import folded_data_view, relay_losses_to_last_stage
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


def model_device(module) -> torch.device:
    """The device of the model's parameters (CPU for a model without any)."""
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@dataclass(frozen=True)
class ExecutedStep:
    """What the engine's last call ran on this rank, as the executor observed it:
    `actions_run` is counted while the actions execute."""

    schedule_kind: str
    path: str
    stage: int
    forward_only: bool
    actions_run: int
    pass_engine: str


class MegatronLoss:
    """The executor's loss step: Megatron's `forward_step_calc_loss` with the forward step's
    own loss function (captured in `batch["loss_func"]`); returns (scaled loss, loss dict)
    and counts tokens in `total_tokens` (on `device`)."""

    def __init__(self, model, config, num_microbatches: int, device: torch.device):
        self.model = model
        self.config = config
        self.num_microbatches = num_microbatches
        self.cp = parallel_state.get_context_parallel_world_size()
        self.total_tokens = torch.zeros([], dtype=torch.int, device=device)

    def __call__(self, batch: dict, output):
        store: list = []
        loss, num_tokens = mcore_schedules.forward_step_calc_loss(
            self.model, output, batch["loss_func"], self.config, None, False,
            self.num_microbatches, store, cp_group_size=self.cp, is_last_stage=True)
        self.total_tokens += num_tokens
        return loss, store[-1]


def set_auxiliary_loss_scales(model, config, num_microbatches: int, cp: int,
                              device: torch.device) -> None:
    """Set the gradient scales of the auxiliary losses (the MoE load-balancing loss,
    `MoEAuxLossAutoScaler`) as Megatron's schedules set them on a stage that does not
    compute the loss (`forward_step_calc_loss` with `is_last_stage=False`: the loss scale
    `/ m`, times cp), on every rank before its first backward. A folded stage other than the
    first never computes the loss, so `MegatronLoss` never sets them there; without this its
    MoE layers would back-propagate their load-balancing losses with whatever scale the
    process last set (None: 1)."""
    if getattr(config, "num_moe_experts", None) is None:
        return
    mcore_schedules.forward_step_calc_loss(
        model, torch.zeros((), device=device), None, config, None, False, num_microbatches,
        [], cp_group_size=cp, is_last_stage=False)


@contextlib.contextmanager
def _without_timers(config):
    timers, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = timers


class ScheduleEngine:
    """Megatron's forward_backward_func over `build_schedule(pp, num_microbatches)`
    (module docstring). `passes`: the training pass engine (default `AutogradPasses` over
    the chunk module). `data_args`: Megatron's args, for the folded model's data view (None:
    the forward step reads no pipeline arguments).
    `losses_to_last_stage`: return the folded model's loss dicts on the last pipeline stage,
    as Megatron's training loop expects (else on the stage that computes them).
    `transfer_groups`: the groups the pipeline's transfers travel on (`StageExecutor`,
    `dhelix.schedules.transfer_groups`; None: the default group carries everything).
    `early_direction`: the SI block output its peer sends first, whose receives alone are
    posted a whole SI block ahead, the others once the block's first strand has ended
    (`StageExecutor`; None: all a block ahead).
    `last_step` is what the last call ran (`ExecutedStep`)."""

    def __init__(self, build_schedule: Callable[[int, int], Schedule], passes=None,
                 data_args=None, losses_to_last_stage: bool = False,
                 transfer_groups=None, early_direction: str | None = None):
        self.build_schedule = build_schedule
        self.passes = passes
        self.transfer_groups = transfer_groups
        self.early_direction = early_direction
        self.data_args = data_args
        self.losses_to_last_stage = losses_to_last_stage
        self.last_step: ExecutedStep | None = None
        self._schedules: dict = {}
        self._mask_check = CausalMaskCheck()

    def for_megatron(self, args) -> "ScheduleEngine":
        """The same engine for `megatron.training`'s `train()`/`evaluate()`: `args`' data
        view, loss dicts on the last stage."""
        return ScheduleEngine(self.build_schedule, self.passes, data_args=args,
                              losses_to_last_stage=True,
                              transfer_groups=self.transfer_groups,
                              early_direction=self.early_direction)

    def schedule(self, pp: int, num_microbatches: int, forward_only: bool) -> Schedule:
        """The training schedule, or its path's forward-only schedule (built once each)."""
        key = (pp, num_microbatches, forward_only)
        if key not in self._schedules:
            if forward_only:
                path = self.schedule(pp, num_microbatches, False).path
                self._schedules[key] = build_forward_only_schedule(path, num_microbatches)
            else:
                self._schedules[key] = self.build_schedule(pp, num_microbatches)
        return self._schedules[key]

    def _next_batch(self, forward_step_func, data_iterator, model, folded: bool,
                    require_labels: bool) -> dict:
        view = (folded_data_view(self.data_args) if folded and self.data_args is not None
                else contextlib.nullcontext())
        with view:
            step = capture_forward_step(forward_step_func, data_iterator, model,
                                        self._mask_check, require_labels=require_labels)
        return {"tokens": step.input_ids, "position_ids": step.position_ids,
                "labels": step.labels, "loss_func": step.loss_func}

    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length=None, micro_batch_size=None, forward_only=False,
                         collect_non_loss_data=False, **_unused):
        """Megatron's forward_backward_func signature (the other keyword arguments of
        `train_step`/`evaluate` are accepted and not needed). Returns the per-micro-batch
        loss dicts where Megatron's schedules return them. Collective over the pipeline."""
        if collect_non_loss_data:
            raise ScheduleMismatch("--dhelix does not collect non-loss data "
                                   "(collect_non_loss_data); drop the non-loss data function")
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise ScheduleMismatch("one model chunk per rank (no virtual pipeline stages)")
        (chunk,) = chunks
        if isinstance(data_iterator, list):
            data_iterator = data_iterator[0]
        module = unwrap_gpt(chunk)
        config = get_model_config(chunk)
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        schedule = self.schedule(pp, num_microbatches, forward_only)
        _check_fit(schedule, module, num_microbatches)
        passes = AutogradPasses(chunk_forward(chunk)) if forward_only or self.passes is None \
            else self.passes
        self._check_grad_sync(chunk, schedule, passes)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        folded = schedule.path.name == "folded"
        device = model_device(module)
        loss = MegatronLoss(chunk, config, num_microbatches, device)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        executor = StageExecutor(
            schedule, stage, passes=passes, loss_func=loss, loss_is_scaled=True,
            next_batch=partial(self._next_batch, forward_step_func, data_iterator, chunk,
                               folded, schedule.path.stage(FORWARD, schedule.path.num_hops - 1)
                               == stage),
            tensor_shape=pipeline_shape(config, seq_length, micro_batch_size),
            dtype=pipeline_dtype(config), device=device,
            peer_rank=lambda s: dist.get_global_rank(pp_group, s),
            grad_scale_func=config.grad_scale_func,
            context_parallel_size=loss.cp, no_sync=config.no_sync_func,
            transfer_groups=self.transfer_groups, early_direction=self.early_direction)
        with _without_timers(config), torch.no_grad() if forward_only \
                else contextlib.nullcontext():
            if not forward_only:
                set_auxiliary_loss_scales(chunk, config, num_microbatches, loss.cp, device)
            losses = executor.run()
        self.last_step = ExecutedStep(schedule.kind, schedule.path.name, stage, forward_only,
                                      executor.actions_run, type(passes).__name__)
        finish_step = getattr(passes, "finish_step", None)
        if not forward_only and finish_step is not None:
            finish_step()  # e.g. the tied embedding's held gradients join main_grad
        if not forward_only and config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                [chunk], loss.total_tokens if config.calculate_per_token_loss else None)
        self._mask_check.verify()  # before Megatron's optimizer step reads the gradients
        if folded and self.losses_to_last_stage:
            return relay_losses_to_last_stage(losses, device)
        return losses

    @staticmethod
    def _check_grad_sync(chunk, schedule: Schedule, passes) -> None:
        """The executor's `no_sync` rule is exact with `overlap_grad_reduce` only where every
        parameter of the rank gets its last gradient in the rank's last backward action."""
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.overlap_grad_reduce or schedule.forward_only:
            return
        if schedule.path.chunks_per_stage > 1 or getattr(passes, "loss_at_forward", False):
            raise ScheduleMismatch(
                f"the {schedule.kind} schedule on the {schedule.path.name} path needs DDP "
                "without overlap_grad_reduce (this rank's parameters get their last gradient "
                "in different actions); drop --overlap-grad-reduce")


def pipeline_dtype(config) -> torch.dtype:
    """The dtype of the activations and gradients stages exchange (Megatron's rule)."""
    return config.pipeline_dtype or config.params_dtype


def pipeline_shape(config, seq_length, micro_batch_size) -> tuple:
    """The shape of the activations and gradients stages exchange ([s/tp with SP, b, h])."""
    if seq_length is None or micro_batch_size is None:
        return ()
    seq = seq_length
    if config.sequence_parallel:
        seq //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq, micro_batch_size, config.hidden_size)
