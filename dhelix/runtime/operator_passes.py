"""The DHelix pass engine, for every layout: each chunk pass runs its layers operator by
operator, and an SI block co-executes the forward of one micro-batch with the backward of
another, layer pair by layer pair, as the plan says.

It plugs into `dhelix.schedules.executor.StageExecutor` (which owns the action list, the
point-to-point transfers, the loss and its scaling, `no_sync`). Without pipelining the
rank holds the whole model as one chunk (`si_schedule`: forward layer l of one micro-batch
meets backward layer L-1-l of the other). On a folded stage (PP > 1, `w_schedule`),
forward hop h runs chunk c and backward hop h runs the mirrored chunk 1-c of the same
stage, so the i-th layer of the forward chunk (global layer l) meets the i-th layer of the
backward chunk in backward order (global layer L-1-l): the pairing of the paper's section 4.

Autograd is used only where Megatron's own code runs outside the layers: the embedding on
the first chunk of the rank that embeds (its output's graph is kept until that
micro-batch's last backward hop back-propagates into it), and the final norm, output layer
and loss on the loss chunk, run on a detached leaf of the last layer's output. When the
loss part is back-propagated is `loss_at_forward`:
- False (one stage): at the micro-batch's backward, as Megatron's schedules do, so every
  parameter of the rank gets its last gradient of the step in the last backward action
  (the executor's `no_sync` rule is then exact, also with `overlap_grad_reduce`). One
  micro-batch's logits are alive at a time: an SI block back-propagates its backward's
  loss before its forward computes the next.
- True (the folded pipeline): as soon as the loss exists (`keep_loss`). The W schedule
  keeps p micro-batches in flight on stage 0, and holding p sets of logits would cost far
  more than the one leaf gradient kept instead.
Either way the order in which micro-batches add into the output layer's gradient is the
loss order. Layer activations are owned by their layer executions (`dhelix.ops.runner`),
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
    `hidden`: the leaf the loss part starts from (loss hop only, until back-propagated);
    `hidden_grad`: its gradient once the loss was back-propagated (`loss_at_forward`)."""

    executions: list
    embedding: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    hidden_grad: torch.Tensor | None = None


class OperatorPasses:
    """Pass engine over this rank's model chunk(s). `runner.bound_layers` lists the rank's
    layers chunk by chunk (`parts.layers` order); `chunk_layers[c]` are the runner's
    indices of chunk c's layers in forward order. Batches are the captured micro-batch
    dicts (`tokens`, `position_ids`, `labels`) of `dhelix.schedules.runner`."""

    def __init__(self, parts: GPTParts, runner: LayerRunner, loss_at_forward: bool):
        self.parts = parts
        self.runner = runner
        self.loss_at_forward = loss_at_forward
        self.chunk_layers = []
        start = 0
        for chunk in range(parts.num_chunks):
            count = len(parts.chunk_layers(chunk))
            self.chunk_layers.append(range(start, start + count))
            start += count
        self.loss_chunk = parts.num_chunks - 1 if parts.model.post_process else None

    # ------------------------------------------------------- layers (overridable)
    def layers_forward(self, layers: range, x: torch.Tensor, rotary_pos_emb):
        """(output, executions) of `layers` run alone on the layer input `x`."""
        return self.runner.forward_alone(layers, x, rotary_pos_emb)

    def layers_backward(self, executions: list, grad: torch.Tensor) -> torch.Tensor:
        """The input gradient of a chunk's layer executions (forward order) run backward."""
        return self.runner.backward_alone(list(reversed(executions)), grad)

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
        y, executions = self.layers_forward(self.chunk_layers[work.chunk], x, rotary)
        return self._forward_tail(work, y, rotary, embedding, executions)

    # ----------------------------------------------------------------- backward
    def keep_loss(self, state: ChunkPassState, loss: torch.Tensor):
        """With `loss_at_forward`: back-propagate the (scaled) loss now, through the loss,
        output layer and final norm, into the leaf, keep only the leaf's gradient and
        return None. Otherwise return the loss (back-propagated at the backward)."""
        if not self.loss_at_forward:
            return loss
        with self.parts.tied_loss_tail():
            torch.autograd.backward(loss)
        state.hidden_grad, state.hidden = state.hidden.grad, None
        return None

    def _backward_head(self, work: BackwardWork) -> torch.Tensor:
        """The gradient of the chunk's last layer output (from the loss on the loss hop)."""
        state = work.state
        if work.loss is not None:
            with self.parts.tied_loss_tail():
                torch.autograd.backward(work.loss)
            state.hidden_grad, state.hidden = state.hidden.grad, None
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
        grad = self.layers_backward(work.state.executions, grad)
        return self._backward_tail(work, grad)

    def finish_step(self) -> None:
        """After the step's last pass, before the gradients are finalised: the tied
        embedding's output-layer gradients join main_grad (`GPTParts.finish_step`)."""
        self.parts.finish_step()

    # ---------------------------------------------------------------- SI block
    def si(self, forward: ForwardWork, backward: BackwardWork):
        """The SI block: the backward's loss part first, then the layer pairs co-executed,
        then the forward's loss part and the backward's embedding part."""
        grad = self._backward_head(backward)
        x, rotary, embedding = self._forward_head(forward)
        y, executions, grad = self.runner.run_paired(
            self.chunk_layers[forward.chunk], x, rotary,
            list(reversed(backward.state.executions)), grad)
        result = self._forward_tail(forward, y, rotary, embedding, executions)
        return result, self._backward_tail(backward, grad)
