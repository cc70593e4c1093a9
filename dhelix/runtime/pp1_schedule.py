"""The DHelix forward/backward function without pipelining (PP=1).

Micro-batches flow as F(1); [F(2)+B(1)]; ...; [F(m)+B(m-1)]; B(m). Each bracket is an SI
block: the forward of micro-batch beta=i+1 and the backward of alpha=i go through the
layers together, forward layer l of beta paired with backward layer L-1-l of alpha (the
pairing of the folded model; with PP=1 both sit on this rank), each pair executed block by
block as the plan says (`strand_executor.run_blocks`). F(1) and B(m) run alone, in the
plan's orders.

Semantics are Megatron's `forward_backward_no_pipelining`: the same `forward_step_func`
is called once per micro-batch in the same order (so the data iterator is consumed
identically); the embedding, final norm, output layer and loss are megatron-core's own code
(`megatron_patches.gpt_parts`); loss scaling and token counting go through Megatron's
`forward_step_calc_loss` and `backward_step`; every backward but the last runs inside
`config.no_sync_func`; `config.finalize_model_grads_func` runs at the end. Gradient
accumulation into `main_grad` happens in the same micro-batch order (B(1) before B(2) ...).

Requirement on `forward_step_func`: it must call the model as Megatron's pretrain_gpt does
and return its output unchanged together with the loss function
(`dhelix.runtime.forward_step_capture`). Anything else is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from megatron.core.pipeline_parallel import schedules as mcore_schedules
from megatron.core.utils import get_model_config

from dhelix.devices import model_device
from dhelix.runtime.forward_step_capture import CapturedStep, capture_forward_step
from dhelix.runtime.layer_runner import LayerRunner
from megatron_patches.gpt_parts import GPTParts


@dataclass
class _MicroBatch:
    """One micro-batch in flight. Owns its layer executions (each frees its activations
    after their last reader) and the autograd graphs of its embedding and loss."""

    call: CapturedStep
    pre: object
    executions: list = field(default_factory=list)
    hidden: torch.Tensor = None       # leaf: input of the final norm (requires grad)
    output_tensor: torch.Tensor = None  # scaled loss from forward_step_calc_loss


@dataclass
class DHelixSchedule:
    """Everything the PP=1 schedule needs, built once at start-up (see `runtime.setup`):
    Megatron's model split at the layers (`parts`) and the operator-level layer runner
    (bound layers, lanes, plan)."""

    parts: GPTParts
    runner: LayerRunner

    def _begin_microbatch(self, forward_step_func, data_iterator, model) -> _MicroBatch:
        call = capture_forward_step(forward_step_func, data_iterator, model)
        pre = self.parts.pre(call.input_ids, call.position_ids)
        return _MicroBatch(call=call, pre=pre)

    def _finish_forward(self, mb: _MicroBatch, y: torch.Tensor, model, config, ctx) -> int:
        mb.hidden = y.detach().requires_grad_(True)
        output = self.parts.post(mb.hidden, mb.call.input_ids, mb.call.position_ids,
                                 mb.call.labels, mb.pre)
        mb.output_tensor, num_tokens = mcore_schedules.forward_step_calc_loss(
            model, output, mb.call.loss_func, config, None, False, ctx.num_microbatches,
            ctx.forward_data_store, cp_group_size=1, is_last_stage=True)
        return num_tokens

    def _start_backward(self, mb: _MicroBatch, config) -> torch.Tensor:
        """Loss backward through the output layer and final norm (Megatron's backward_step,
        with grad scaling); returns the gradient of the last layer's output."""
        grad = mcore_schedules.backward_step(mb.hidden, mb.output_tensor, None, config)
        mb.hidden = mb.output_tensor = None
        return grad

    @staticmethod
    def _finish_backward(mb: _MicroBatch, grad_input: torch.Tensor) -> None:
        torch.autograd.backward(mb.pre.decoder_input, grad_tensors=grad_input)
        mb.pre = None
        mb.executions.clear()

    # -------------------------------------------------------------- phases
    def _forward_alone(self, mb, model, config, ctx) -> int:
        layers = range(len(self.runner.bound_layers))
        y, mb.executions = self.runner.forward_alone(layers, mb.pre.decoder_input.detach(),
                                                     mb.pre.rotary_pos_emb)
        return self._finish_forward(mb, y, model, config, ctx)

    def _backward_alone(self, mb, model, config) -> None:
        grad = self._start_backward(mb, config)
        grad = self.runner.backward_alone(list(reversed(mb.executions)), grad)
        self._finish_backward(mb, grad)

    def _si_block(self, beta, alpha, model, config, ctx) -> int:
        """Forward of `beta` paired layer by layer with the backward of `alpha`: forward
        layer l with backward layer L-1-l."""
        grad = self._start_backward(alpha, config)
        layers = range(len(self.runner.bound_layers))
        y, beta.executions, grad = self.runner.run_paired(
            layers, beta.pre.decoder_input.detach(), beta.pre.rotary_pos_emb,
            list(reversed(alpha.executions)), grad)
        self._finish_backward(alpha, grad)
        return self._finish_forward(beta, y, model, config, ctx)

    def _run_microbatches(self, forward_step_func, data_iterator, model, config, ctx):
        """Every micro-batch's forward and backward (SI blocks between the first forward and
        the last backward); every backward but the last under `no_sync`. Returns the token
        count."""
        no_sync = config.no_sync_func or contextlib.nullcontext
        total_tokens = torch.zeros([], dtype=torch.int, device=model_device(model))
        with no_sync():
            alpha = self._begin_microbatch(forward_step_func, data_iterator, model)
            total_tokens += self._forward_alone(alpha, model, config, ctx)
            for _ in range(ctx.num_microbatches - 1):
                beta = self._begin_microbatch(forward_step_func, data_iterator, model)
                total_tokens += self._si_block(beta, alpha, model, config, ctx)
                alpha = beta
        self._backward_alone(alpha, model, config)
        return total_tokens

    # ---------------------------------------------------------- entry point
    def forward_backward(self, *, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length=None, micro_batch_size=None, decoder_seq_length=None,
                         forward_only=False, collect_non_loss_data=False,
                         first_val_step=None, **kwargs):
        """Megatron's forward_backward_func signature. Forward-only and non-loss data
        collection fall back to Megatron's own no-pipelining schedule."""
        if forward_only or collect_non_loss_data:
            return mcore_schedules.forward_backward_no_pipelining(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                first_val_step=first_val_step, **kwargs)
        if isinstance(model, list):
            if len(model) != 1:
                raise ValueError("the PP=1 DHelix schedule does not support model chunking")
            model = model[0]
        if isinstance(data_iterator, list):
            data_iterator = data_iterator[0]
        config = get_model_config(model)
        ctx = _StepContext(num_microbatches=num_microbatches)
        total_tokens = self._run_microbatches(forward_step_func, data_iterator, model, config,
                                              ctx)
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                [model], total_tokens if config.calculate_per_token_loss else None)
        return ctx.forward_data_store


@dataclass
class _StepContext:
    num_microbatches: int
    forward_data_store: list = field(default_factory=list)
