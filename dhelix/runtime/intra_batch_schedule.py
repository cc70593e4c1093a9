"""The Domino-style intra-batch split (a benchmark baseline, `--dhelix-pairer domino`).

Megatron's no-pipelining order, F(1) B(1) F(2) B(2) ... F(m) B(m), with every transformer
layer run as two half-micro-batches: the layer input is split in two along the batch
dimension, each half gets its own `LayerExecution` of the same layer (bound for half the
micro-batch size), and the two halves' forward (then backward) operators are co-executed
through the shared strand executor (`run_blocks`) with Domino's staggered pairing
(`planner.baselines.staggered_pairing`): half B runs one unit behind half A, so each
collective of one half is in flight while the other half computes. No planning.

Everything else is the DHelix PP=1 schedule's machinery (`DHelixSchedule`): the same
forward_step capture, megatron-core's own embedding, final norm, output layer and loss on
the full micro-batch, Megatron's loss scaling, `no_sync` for every backward but the last,
`finalize_model_grads`. Training semantics equal Megatron's schedule up to fp32 rounding
(a weight gradient is summed over the two halves separately, then added).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dhelix.devices import model_device
from dhelix.runtime.pp1_schedule import DHelixSchedule
from dhelix.runtime.strand_executor import Block, run_blocks

BATCH_DIM = 1  # layer activations are [sequence, batch, hidden]


def split_halves(tensor: torch.Tensor) -> tuple:
    """The two batch halves of a [s, b, h] tensor, each contiguous (a copy)."""
    return tuple(t.contiguous() for t in tensor.chunk(2, dim=BATCH_DIM))


@dataclass
class IntraBatchSplitSchedule(DHelixSchedule):
    """`runner.bound_layers` are bound for half the micro-batch size; `runner.blocks` pairs
    the two halves' forward programs and `bwd_blocks` their backward programs (first half =
    `Block.fwd`)."""

    bwd_blocks: tuple = ()

    def __post_init__(self):
        self.bwd_blocks = tuple(Block(tuple(b.fwd), tuple(b.bwd)) for b in self.bwd_blocks)

    def _forward_alone(self, mb, model, config, ctx) -> int:
        halves = split_halves(mb.pre.decoder_input.detach())
        for layer in range(len(self.runner.bound_layers)):
            pair = [self.runner.new_execution(layer) for _ in halves]
            for execution, x in zip(pair, halves):
                execution.begin_forward(x, None, mb.pre.rotary_pos_emb)
            mb.executions.append(pair)
            run_blocks(pair[0], pair[1], self.runner.blocks, barrier=self.runner.block_barriers,
                       timeline=self.runner.timeline)
            halves = [execution.end_forward() for execution in pair]
        y = torch.cat(halves, dim=BATCH_DIM)
        return self._finish_forward(mb, y, model, config, ctx)

    def _backward_alone(self, mb, model, config) -> None:
        grads = split_halves(self._start_backward(mb, config))
        for pair in reversed(mb.executions):
            for execution, grad in zip(pair, grads):
                execution.begin_backward(grad)
            run_blocks(pair[0], pair[1], self.bwd_blocks, barrier=self.runner.block_barriers,
                       timeline=self.runner.timeline)
            grads = [execution.end_backward() for execution in pair]
        self._finish_backward(mb, torch.cat(grads, dim=BATCH_DIM))

    def _run_microbatches(self, forward_step_func, data_iterator, model, config, ctx):
        """F(i) then B(i) for each micro-batch, as Megatron's no-pipelining schedule."""
        no_sync = config.no_sync_func or contextlib.nullcontext
        total_tokens = torch.zeros([], dtype=torch.int, device=model_device(model))
        for index in range(ctx.num_microbatches):
            last = index == ctx.num_microbatches - 1
            with contextlib.nullcontext() if last else no_sync():
                mb = self._begin_microbatch(forward_step_func, data_iterator, model)
                total_tokens += self._forward_alone(mb, model, config, ctx)
                self._backward_alone(mb, model, config)
        return total_tokens
