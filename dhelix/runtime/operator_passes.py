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
the first chunk of the rank that embeds (its output's graph is kept, by the output's
gradient edge, until that micro-batch's last backward hop back-propagates into it), and the
final norm, output layer and loss on the loss chunk, run on the last layer's output entered
through `dhelix.ops.local_graph.enter` (which saves nothing, as the embedding edge keeps no
tensor): those boundaries hold what Megatron's graph holds there and no more, so the
embedding output and the last layer's output are freed after their last forward reader.
When the loss part is back-propagated is `loss_at_forward`:
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
A chunk's input and the gradient of its output are handed to the layer runner in
one-element lists (`layer_runner.take_handed`): no frame here keeps them alive while the
chunk's layers run.
With `defer_embedding_reduce`, where the model allows it exactly, the embedding's TP
all-reduce is left in flight (`megatron_patches.deferred_reduce`): the layer input is then a
`dhelix.arriving.Finishing`, held pending like a received tensor. An SI block
back-propagates its backward's loss first (Megatron's blocking all-reduce of the output
layer's input gradient included), then embeds its forward's micro-batch at the block the
layer runner's `early_input_block` names (the earliest whose rest, up to the first block
with forward operators, holds the output within the memory bound), so its backward strand
computes while the embedding's all-reduce travels. The sequential pairing (the
benchmark's reference rows) keeps it blocking, as Megatron does.
Point-to-point: a received input or output gradient may come as a `dhelix.arriving.Arriving`
(`accepts_arriving`): the layer execution holds it pending and its first reader waits, so an
SI block starts on whichever strand's input has landed. An SI block reports its forward
output and its input gradient to the executor's `produced` as soon as each strand is done,
so the executor can send it while the other strand still computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dhelix.arriving import Arriving, Producing, buffer_of
from dhelix.ops.local_graph import enter
from dhelix.runtime.layer_runner import LayerRunner, take_handed
from dhelix.schedules.actions import BACKWARD, FORWARD
from dhelix.schedules.executor import BackwardWork, ForwardWork
from megatron_patches.gpt_parts import GPTParts, PreOutput


@dataclass
class ChunkPassState:
    """What the forward of one (micro-batch, chunk) leaves for its backward.

    `executions`: the chunk's layer executions in forward order (they own the activations);
    `embedding`: the gradient edge of the embedding output, which keeps its autograd graph
    but not the output (embedding hop only);
    `hidden_sink`: where the loss part's backward leaves the gradient of the last layer's
    output (loss hop only, `dhelix.ops.local_graph.enter`), under "hidden";
    `hidden_grad`: that gradient once the loss was back-propagated (`loss_at_forward`)."""

    executions: list
    embedding: GradientEdge | None = None
    hidden_sink: dict | None = None
    hidden_grad: torch.Tensor | None = None


class OperatorPasses:
    """Pass engine over this rank's model chunk(s). `runner.bound_layers` lists the rank's
    layers chunk by chunk (`parts.layers` order); `chunk_layers[c]` are the runner's
    indices of chunk c's layers in forward order. Batches are the captured micro-batch
    dicts (`tokens`, `position_ids`, `labels`) of `dhelix.schedules.runner`."""

    # received tensors may be handed over still in flight (`dhelix.arriving.Arriving`)
    accepts_arriving = True

    def __init__(self, parts: GPTParts, runner: LayerRunner, loss_at_forward: bool,
                 defer_embedding_reduce: bool = False):
        self.parts = parts
        self.runner = runner
        self.loss_at_forward = loss_at_forward
        self.defer_embedding_reduce = (defer_embedding_reduce
                                       and parts.embedding_reduce_deferrable)
        self.chunk_layers = []
        start = 0
        for chunk in range(parts.num_chunks):
            count = len(parts.chunk_layers(chunk))
            self.chunk_layers.append(range(start, start + count))
            start += count
        self.loss_chunk = parts.num_chunks - 1 if parts.model.post_process else None

    # ------------------------------------------------------- layers (overridable)
    def layers_forward(self, layers: range, inputs: list, rotary_pos_emb):
        """(output, executions) of `layers` run alone on the layer input handed over in
        `inputs` (emptied)."""
        return self.runner.forward_alone(layers, inputs, rotary_pos_emb)

    def layers_backward(self, executions: list, grads: list) -> torch.Tensor:
        """The input gradient of a chunk's layer executions (forward order) run backward
        from the output gradient handed over in `grads` (emptied)."""
        return self.runner.backward_alone(list(reversed(executions)), grads)

    # ------------------------------------------------------------------ forward
    def _forward_head(self, work: ForwardWork):
        """([layer input], RoPE table, the embedding output's gradient edge or None): the
        layer input in a one-element list, to hand to the layer runner (a `Finishing` while
        the embedding's all-reduce travels, with `defer_embedding_reduce`)."""
        batch = work.batch
        if work.inp is None:
            if self.defer_embedding_reduce:
                pre, layer_input = self.parts.pre_deferred(batch["tokens"],
                                                           batch["position_ids"])
            else:
                pre = self.parts.pre(batch["tokens"], batch["position_ids"])
                layer_input = pre.decoder_input.detach()
            edge = get_gradient_edge(pre.decoder_input)
            return [layer_input], pre.rotary_pos_emb, edge
        x = work.inp if isinstance(work.inp, Arriving) else work.inp.detach()
        pre = self.parts.pre(batch["tokens"], batch["position_ids"],
                             decoder_input=buffer_of(x))  # reads no value of it
        return [x], pre.rotary_pos_emb, None

    def _forward_tail(self, work: ForwardWork, y, rotary_pos_emb, embedding, executions):
        """(state, output): the output is the per-token loss on the loss hop, else the last
        layer's output (the activation sent to the next hop)."""
        state = ChunkPassState(executions=executions, embedding=embedding)
        if work.chunk != self.loss_chunk:
            return state, y
        state.hidden_sink = {}
        hidden = enter(y.detach(), state.hidden_sink, "hidden")
        del y
        batch = work.batch
        out = self.parts.post(hidden, batch["tokens"], batch["position_ids"],
                              batch["labels"], PreOutput(buffer_of(work.inp), rotary_pos_emb))
        return state, out

    def _forward_head_produced(self, work: ForwardWork):
        """`_forward_head` of an SI block's forward: ([layer input as a
        `dhelix.arriving.Producing`], RoPE table, a zero-argument function returning the
        embedding output's gradient edge once the input was produced). The RoPE table is
        computed now (from the layer input's shape only), the embedding when the layer
        runner starts the input (`LayerRunner.run_paired`); with `defer_embedding_reduce`
        the product is the `Finishing` its all-reduce lands in. Only for the first chunk's
        forward (its input is the embedding's)."""
        batch = work.batch
        tokens = batch["tokens"]
        config = self.parts.model.config
        rows = tokens.shape[1] // (config.tensor_model_parallel_size
                                   if config.sequence_parallel else 1)
        # a shape without storage: `_preprocess` reads only its sequence length (dim 0) for
        # the RoPE table; nothing is computed on it or kept
        shape_only = torch.empty((rows, tokens.shape[0], config.hidden_size), device="meta")
        rotary = self.parts.pre(tokens, batch["position_ids"],
                                decoder_input=shape_only).rotary_pos_emb
        edge = []

        def produce():
            inputs, _, embedding = self._forward_head(work)
            edge.append(embedding)
            return take_handed(inputs)
        return [Producing(produce)], rotary, edge.pop

    def forward(self, work: ForwardWork):
        inputs, rotary, embedding = self._forward_head(work)
        y, executions = self.layers_forward(self.chunk_layers[work.chunk], inputs, rotary)
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
        state.hidden_grad, state.hidden_sink = state.hidden_sink.pop("hidden", None), None
        return None

    def _backward_head(self, work: BackwardWork) -> list:
        """[the gradient of the chunk's last layer output] (from the loss on the loss hop),
        a one-element list to hand to the layer runner."""
        state = work.state
        if work.loss is not None:
            with self.parts.tied_loss_tail():
                torch.autograd.backward(work.loss)
            state.hidden_grad, state.hidden_sink = state.hidden_sink.pop("hidden", None), None
        if state.hidden_grad is None:
            return [work.grad]
        grad, state.hidden_grad = state.hidden_grad, None
        return [grad]

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
        grads = self._backward_head(work)
        grad = self.layers_backward(work.state.executions, grads)
        return self._backward_tail(work, grad)

    def finish_step(self) -> None:
        """After the step's last pass, before the gradients are finalised: the tied
        embedding's output-layer gradients join main_grad (`GPTParts.finish_step`)."""
        self.parts.finish_step()

    # ---------------------------------------------------------------- SI block
    def si(self, forward: ForwardWork, backward: BackwardWork, produced=None):
        """The SI block: the backward's loss part first, then the layer pairs co-executed,
        the forward's embedding computed before the first block with forward operators
        (`_forward_head_produced`: not beside the backward-only blocks before it, where
        the backward strand holds the most) or, with `defer_embedding_reduce`, before the
        earliest block whose rest holds its output within the memory bound (its all-reduce
        left in flight beside the blocks from there: `LayerRunner.early_input_block`), then
        the forward's loss part and the backward's embedding part.
        `produced(direction, tensor)` (the executor's, or None) gets the forward's output
        (not on the loss chunk) and the input gradient (not on the embedding chunk) as soon
        as its strand is done."""
        grads = self._backward_head(backward)
        # produced at the first forward block; with `defer_embedding_reduce` at the runner's
        # `early_input_block`, so the all-reduce travels beside backward-only blocks too
        # where their memory leaves room for its buffer (docs/runtime.md, "The embedding's
        # all-reduce")
        embedding_later = forward.inp is None
        head = self._forward_head_produced if embedding_later else self._forward_head
        inputs, rotary, embedding = head(forward)
        on_output = None
        if produced is not None:
            sends = {"fwd": (FORWARD, forward.chunk != self.loss_chunk),
                     "bwd": (BACKWARD, backward.state.embedding is None)}

            def on_output(direction, tensor):
                kind, sent = sends[direction]
                if sent:
                    produced(kind, tensor)
        y, executions, grad = self.runner.run_paired(
            self.chunk_layers[forward.chunk], inputs, rotary,
            list(reversed(backward.state.executions)), grads, on_output)
        if embedding_later:
            embedding = embedding()  # the input was produced: its gradient edge
        result = self._forward_tail(forward, y, rotary, embedding, executions)
        return result, self._backward_tail(backward, grad)
