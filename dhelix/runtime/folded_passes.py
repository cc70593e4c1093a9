"""The DHelix pass engine for the folded pipeline (PP > 1): each chunk pass runs its layers
operator by operator, and an SI block co-executes the forward of one micro-batch with the
backward of another, layer pair by layer pair, as the plan says.

It plugs into `dhelix.schedules.executor.StageExecutor` (which owns the action list, the
point-to-point transfers, the loss and its scaling). On a folded stage, forward hop h runs
chunk c and backward hop h runs the mirrored chunk 1-c of the same stage, so the i-th layer
of the forward chunk (global layer l) meets the i-th layer of the backward chunk in
backward order (global layer L-1-l): the pairing of the paper's section 4.

Autograd is used only where Megatron's own code runs outside the layers: the embedding on
stage 0's first chunk (its output's graph is kept until that micro-batch's last backward
hop back-propagates into it), and the final norm, output layer and loss on stage 0's second
chunk, run on a detached leaf of the last layer's output. That loss part is back-propagated
as soon as the loss exists (`keep_loss`), not when the micro-batch's backward starts: the
W schedule keeps p micro-batches in flight on stage 0, and holding p sets of logits would
cost far more than the one leaf gradient kept instead. The order in which micro-batches
add into the output layer's gradient is unchanged (loss order). Layer activations are owned by their layer executions (`dhelix.ops.runner`),
which the chunk pass state hands from the forward to the backward; nothing else keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhelix.runtime.layer_runner import LayerRunner
from dhelix.schedules.executor import BackwardWork, ForwardWork
from megatron_patches.gpt_parts import GPTParts, PreOutput


@dataclass
class ChunkPassState:
    """What the forward of one (micro-batch, chunk) leaves for its backward.

    `executions`: the chunk's layer executions in forward order (they own the activations);
    `embedding`: the embedding output with its autograd graph (embedding hop only);
    `hidden_grad`: the gradient of the last layer's output from the loss (loss hop only)."""

    executions: list
    embedding: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    hidden_grad: torch.Tensor | None = None


class FoldedOperatorPasses:
    """Pass engine over this rank's folded stage. `runner.bound_layers` lists the stage's
    layers chunk by chunk (`parts.layers` order); `chunk_layers[c]` are the runner's
    indices of chunk c's layers in forward order."""

    def __init__(self, parts: GPTParts, runner: LayerRunner):
        self.parts = parts
        self.runner = runner
        self.chunk_layers = []
        start = 0
        for chunk in range(parts.num_chunks):
            count = len(parts.chunk_layers(chunk))
            self.chunk_layers.append(range(start, start + count))
            start += count
        self.loss_chunk = parts.num_chunks - 1 if parts.model.post_process else None

    # ------------------------------------------------------------------ forward
    def _forward_head(self, work: ForwardWork):
        """(layer input, RoPE table, embedding output with graph or None)."""
        batch = work.batch
        if work.inp is None:
            pre = self.parts.pre(batch["tokens"], batch["position_ids"])
            return pre.decoder_input.detach(), pre.rotary_pos_emb, pre.decoder_input
        x = work.inp.detach()
        pre = self.parts.pre(batch["tokens"], batch["position_ids"], decoder_input=x)
        return x, pre.rotary_pos_emb, None

    def _forward_tail(self, work: ForwardWork, y, rotary_pos_emb, embedding, executions):
        """(state, output): the output is the per-token loss on the loss hop, else the last
        layer's output (the activation sent to the next hop)."""
        state = ChunkPassState(executions=executions, embedding=embedding)
        if work.chunk != self.loss_chunk:
            return state, y
        state.hidden = y.detach().requires_grad_(True)
        batch = work.batch
        out = self.parts.post(state.hidden, batch["tokens"], batch["position_ids"],
                              batch["labels"], PreOutput(work.inp, rotary_pos_emb))
        return state, out

    def forward(self, work: ForwardWork):
        x, rotary, embedding = self._forward_head(work)
        y, executions = self.runner.forward_alone(self.chunk_layers[work.chunk], x, rotary)
        return self._forward_tail(work, y, rotary, embedding, executions)

    # ----------------------------------------------------------------- backward
    def keep_loss(self, state: ChunkPassState, loss: torch.Tensor) -> None:
        """Back-propagate the (scaled) loss now, through the loss, output layer and final
        norm, into the leaf; keep only the leaf's gradient. Returns None (nothing to keep)."""
        with self.parts.tied_loss_tail():
            torch.autograd.backward(loss)
        state.hidden_grad, state.hidden = state.hidden.grad, None
        return None

    @staticmethod
    def _backward_head(work: BackwardWork) -> torch.Tensor:
        """The gradient of the chunk's last layer output (from the loss on the loss hop)."""
        state = work.state
        if state.hidden_grad is None:
            return work.grad
        grad, state.hidden_grad = state.hidden_grad, None
        return grad

    def _backward_tail(self, work: BackwardWork, grad: torch.Tensor):
        """The pass's input gradient, or None after back-propagating into the embedding."""
        state = work.state
        state.executions = []
        if state.embedding is None:
            return grad
        with self.parts.tied_embedding():
            torch.autograd.backward(state.embedding, grad_tensors=grad)
        state.embedding = None
        return None

    def backward(self, work: BackwardWork):
        grad = self._backward_head(work)
        grad = self.runner.backward_alone(list(reversed(work.state.executions)), grad)
        return self._backward_tail(work, grad)

    def finish_step(self) -> None:
        """After the step's last pass, before the gradients are finalised: the tied
        embedding's output-layer gradients join main_grad (`GPTParts.finish_step`)."""
        self.parts.finish_step()

    # ---------------------------------------------------------------- SI block
    def si(self, forward: ForwardWork, backward: BackwardWork):
        """The SI block: the backward's loss part first (stage 0), then the layer pairs
        co-executed, then the forward's loss part and the backward's embedding part."""
        grad = self._backward_head(backward)
        x, rotary, embedding = self._forward_head(forward)
        y, executions, grad = self.runner.run_paired(
            self.chunk_layers[forward.chunk], x, rotary,
            list(reversed(backward.state.executions)), grad)
        result = self._forward_tail(forward, y, rotary, embedding, executions)
        return result, self._backward_tail(backward, grad)
