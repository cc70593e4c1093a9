"""The Domino-style intra-batch split (a benchmark baseline, `--dhelix-pairer domino`) as a
pairing on the DHelix engine: the executor runs Megatron's no-pipelining order
F(1) B(1) F(2) B(2) ... F(m) B(m) (`sequential.build_sequential_schedule` on the one-stage
path), and this pass engine runs every transformer layer as two half-micro-batches: the
layer input is split in two along the batch dimension, each half gets its own
`LayerExecution` of the same layer (bound for half the micro-batch size), and the two
halves' forward (then backward) operators are co-executed through the shared strand
executor (`run_blocks`) with Domino's staggered pairing (`planner.baselines.staggered_pairing`):
half B runs one unit behind half A, so each collective of one half is in flight while the
other half computes. No planning.

Everything else is `OperatorPasses`' (one stage, loss back-propagated at the backward):
megatron-core's own embedding, final norm, output layer and loss on the full micro-batch;
the executor's loss scaling, `no_sync` rule and the engine's `finalize_model_grads`.
Training semantics equal Megatron's schedule up to fp32 rounding (a weight gradient is
summed over the two halves separately, then added). It has no SI blocks (`si` refuses).
"""

from __future__ import annotations

import torch

from dhelix.runtime.layer_runner import LayerRunner, take_handed
from dhelix.runtime.operator_passes import OperatorPasses
from dhelix.runtime.strand_executor import Block, run_blocks
from megatron_patches.gpt_parts import GPTParts

BATCH_DIM = 1  # layer activations are [sequence, batch, hidden]


def split_halves(tensor: torch.Tensor) -> tuple:
    """The two batch halves of a [s, b, h] tensor, each contiguous (a copy)."""
    return tuple(t.contiguous() for t in tensor.chunk(2, dim=BATCH_DIM))


class IntraBatchPasses(OperatorPasses):
    """`runner.bound_layers` are bound for half the micro-batch size; `runner.blocks` pairs
    the two halves' forward programs and `bwd_blocks` their backward programs (first half =
    `Block.fwd`). A chunk's executions are (first half, second half) pairs, layer by
    layer."""

    def __init__(self, parts: GPTParts, runner: LayerRunner, bwd_blocks):
        super().__init__(parts, runner, loss_at_forward=False)
        self.bwd_blocks = tuple(Block(tuple(b.fwd), tuple(b.bwd)) for b in bwd_blocks)

    def layers_forward(self, layers: range, inputs: list, rotary_pos_emb):
        halves = split_halves(take_handed(inputs))
        executions = []
        for layer in layers:
            pair = [self.runner.new_execution(layer) for _ in halves]
            for execution, half in zip(pair, halves):
                execution.begin_forward(half, None, rotary_pos_emb)
            halves = half = None  # the executions own them
            executions.append(pair)
            run_blocks(pair[0], pair[1], self.runner.blocks, barrier=self.runner.block_barriers,
                       timeline=self.runner.timeline)
            halves = [execution.end_forward() for execution in pair]
        return torch.cat(halves, dim=BATCH_DIM), executions

    def layers_backward(self, executions: list, grads: list) -> torch.Tensor:
        grads = split_halves(take_handed(grads))
        for pair in reversed(executions):
            for execution, half in zip(pair, grads):
                execution.begin_backward(half)
            grads = half = None  # the executions own them
            run_blocks(pair[0], pair[1], self.bwd_blocks, barrier=self.runner.block_barriers,
                       timeline=self.runner.timeline)
            grads = [execution.end_backward() for execution in pair]
        return torch.cat(grads, dim=BATCH_DIM)

    def si(self, forward, backward):
        raise ValueError("the Domino-style split pairs batch halves, not micro-batches: run "
                         "it with a schedule without SI blocks (build_sequential_schedule)")
