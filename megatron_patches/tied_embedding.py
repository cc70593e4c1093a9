"""The tied word-embedding weight's two gradients, summed as stock Megatron sums them.

With tied embeddings (Megatron's default) one weight is the input embedding and the output
layer. The DHelix schedules back-propagate the loss tail (loss, output layer, final norm) as
soon as the loss exists and the embedding at the end of the micro-batch's backward, in two
separate autograd passes, so the weight's accumulator (where Megatron DDP's hook adds
`param.grad` into the fp32 `param.main_grad`) would fire once per side. Stock Megatron sums
the two sides differently, depending on where its layout keeps them:

- PP = 1 (`JOIN_PER_MICROBATCH`): both uses are in one autograd graph, so autograd adds the
  two gradients in the parameter's dtype (bf16 under `--bf16`) and the accumulator fires
  once per micro-batch with that sum. In fp32 adding the two halves separately to main_grad
  differs from it by fp32 rounding only; in bf16 by the bf16 rounding of their sum (measured
  6.1e-5 on the word-embedding gradient, TP2, CPU).
- PP > 1 (`APART_PER_STEP`, the folded model, both ends on stage 0): stock keeps the
  embedding on the first stage and a copy of the weight on the last stage, each with its
  own fp32 main_grad accumulated over the micro-batches from zero; `finalize_model_grads`
  then all-reduces them over the embedding group (first + last). The folded stage adds the
  output side's gradients into their own fp32 sum and adds that sum to main_grad once
  after the step's last pass, before `finalize_model_grads`: the same additions in the same
  order with data parallelism 1. With DP > 1 stock reduces each side over DP before adding
  the sides, the folded stage adds them first: the two differ by fp32 rounding of the
  reductions.

How: a tensor hook on the weight (it runs before the accumulator) takes the output side's
gradient while the loss tail is back-propagated and hands the accumulator zeros instead
(Megatron DDP adds them to main_grad: no change); the held gradient joins the embedding side
(PP = 1) or main_grad at the end of the step (PP > 1). Tensors are on the weight's device;
this object owns the held gradients until they are delivered.
"""

from __future__ import annotations

import contextlib
import enum

import torch


class TiedSum(enum.Enum):
    """How stock Megatron's layout sums the two sides (module docstring)."""

    JOIN_PER_MICROBATCH = "pp1"
    APART_PER_STEP = "pipelined"


class TiedEmbeddingGradient:
    """Holds the output-layer side of the tied weight `weight`'s gradient and delivers it as
    `mode` says. Use `loss_tail()` around every back-propagation of a loss through the output
    layer, `embedding()` around every back-propagation into the embedding (PP = 1), and
    `finish_step()` after the step's last pass (PP > 1)."""

    def __init__(self, weight: torch.nn.Parameter, mode: TiedSum):
        self.weight = weight
        self.mode = mode
        self._held: torch.Tensor | None = None  # PP=1: one micro-batch's, weight dtype
        self._apart: torch.Tensor | None = None  # PP>1: the step's sum, fp32

    def _take(self, grad: torch.Tensor) -> torch.Tensor:
        if self.mode is TiedSum.JOIN_PER_MICROBATCH:
            if self._held is not None:
                raise RuntimeError("tied embedding: a second loss-tail gradient arrived before "
                                   "the first joined the embedding's")
            self._held = grad
        else:
            if self._apart is None:
                main = getattr(self.weight, "main_grad", None)
                dtype = main.dtype if main is not None else torch.float32
                self._apart = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
            self._apart.add_(grad)
        return torch.zeros_like(grad)

    @contextlib.contextmanager
    def loss_tail(self):
        """While the loss tail is back-propagated: the weight's gradient from the output
        layer is held here (the accumulator gets zeros)."""
        handle = self.weight.register_hook(self._take)
        try:
            yield
        finally:
            handle.remove()

    def _join(self, grad: torch.Tensor) -> torch.Tensor:
        held, self._held = self._held, None
        return grad if held is None else held + grad

    @contextlib.contextmanager
    def embedding(self):
        """While the embedding is back-propagated (PP = 1): the held gradient joins the
        embedding side's before the accumulator, as autograd sums them in stock's single
        backward."""
        if self.mode is not TiedSum.JOIN_PER_MICROBATCH:
            yield
            return
        handle = self.weight.register_hook(self._join)
        try:
            yield
        finally:
            handle.remove()
        if self._held is not None:
            self._held = None
            raise RuntimeError("tied embedding: the embedding's backward did not reach the "
                               "shared weight, its output-layer gradient was not delivered")

    def finish_step(self) -> None:
        """After the step's last pass, before `finalize_model_grads` (PP > 1): add the
        output side's fp32 sum to the weight's main_grad (or grad), as stock's embedding
        all-reduce adds the last stage's to the first's."""
        apart, self._apart = self._apart, None
        if apart is None:
            return
        main = getattr(self.weight, "main_grad", None)
        if main is not None:
            main.add_(apart)
        elif self.weight.grad is None:
            self.weight.grad = apart.to(self.weight.dtype)
        else:
            self.weight.grad.add_(apart)


def tied_embedding_gradient(model, whole_model: bool) -> TiedEmbeddingGradient | None:
    """The tied weight's gradient keeper for a GPTModel chunk `model` holding both the
    embedding and the output layer (PP = 1 when `whole_model`, else a folded stage 0), or
    None when its embeddings are untied or it lacks one of the ends."""
    if not (model.pre_process and model.post_process
            and model.share_embeddings_and_output_weights):
        return None
    weight = model.shared_embedding_or_output_weight()
    if not weight.requires_grad:
        return None
    mode = TiedSum.JOIN_PER_MICROBATCH if whole_model else TiedSum.APART_PER_STEP
    return TiedEmbeddingGradient(weight, mode)
