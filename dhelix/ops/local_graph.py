"""Small autograd graphs for the non-GEMM operators, and the parameter-gradient sink.

Operators whose math is not a GEMM (norms, the attention core with RoPE, the activation,
bias-dropout-add) run Megatron's own module code in their forward operator while recording
a *local* autograd graph that starts at the operator's inputs and ends at its outputs. Their
backward operator runs exactly that graph backward. The graph saves what Megatron's autograd
graph saves for the same code (the operator's inputs are entered through a node that saves
nothing, and only gradient *edges* are kept, never the output tensors), so activation
memory matches Megatron's.

Parameter gradients always reach the parameters through their autograd accumulator node
(`accumulate_param_grads`): `param.grad` accumulates as autograd would, and every hook
registered on the accumulator - Megatron DDP's backward post-hook, which adds `param.grad`
into `param.main_grad`, clears `param.grad` and (with overlap_grad_reduce) marks the
parameter ready for its bucket's grad sync - fires exactly as in Megatron's own backward.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class _Entry(torch.autograd.Function):
    """Identity that starts a local graph: saves nothing, so entering a tensor does not
    keep it alive; its gradient edge is where the input gradient is read."""

    @staticmethod
    def forward(ctx, tensor, anchor):  # noqa: ARG004 - anchor only makes the output require grad
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_ANCHORS: dict = {}
_ANCHOR_LOCK = threading.Lock()


def _anchor() -> torch.Tensor:
    """A scalar leaf that requires grad; it never receives a gradient (the entry node returns
    None for it). One per thread, so concurrent executors never share autograd state."""
    key = threading.get_ident()
    with _ANCHOR_LOCK:
        anchor = _ANCHORS.get(key)
        if anchor is None:
            anchor = _ANCHORS[key] = torch.zeros((), requires_grad=True)
    return anchor


class LocalGraph:
    """The recorded autograd graph of one operator, owned by the execution state from the
    forward operator that traced it until the backward operator that consumes it.

    Holds only gradient edges and the parameter list; the tensors the graph needs are held by
    the autograd nodes themselves and are freed by `backward` (or `release`).
    """

    __slots__ = ("name", "_input_edges", "_output_edges", "_params", "_used")

    def __init__(self, name: str, input_edges: Mapping[str, GradientEdge],
                 output_edges: Sequence[GradientEdge], params: Sequence[torch.nn.Parameter]):
        self.name = name
        self._input_edges = dict(input_edges)
        self._output_edges = list(output_edges)
        self._params = list(params)
        self._used = False

    @classmethod
    def trace(cls, name: str, fn: Callable, grad_inputs: Mapping[str, torch.Tensor],
              params: Sequence[torch.nn.Parameter], **constant_inputs):
        """Run `fn(**entered_inputs, **constant_inputs)` with grad enabled.

        `grad_inputs` are tensors whose gradients the backward operator returns;
        `constant_inputs` get none (masks, rotary tables). `fn` returns a tensor or a tuple
        of tensors. Returns `(outputs, graph)`: the outputs detached (plain tensors for the
        next operators, sharing storage with the graph's outputs) and the LocalGraph.
        Parameters used by `fn` must be listed in `params` to receive gradients.
        """
        with torch.enable_grad():
            anchor = _anchor()
            entered = {key: _Entry.apply(t, anchor) for key, t in grad_inputs.items()}
            result = fn(**entered, **constant_inputs)
            outputs = result if isinstance(result, tuple) else (result,)
            for out in outputs:
                if not out.requires_grad:
                    raise RuntimeError(f"{name}: an output of the traced operator does not "
                                       "depend on its inputs or parameters")
            graph = cls(
                name,
                {key: get_gradient_edge(t) for key, t in entered.items()},
                [get_gradient_edge(out) for out in outputs],
                [p for p in params if p is not None and p.requires_grad],
            )
        return tuple(out.detach() for out in outputs), graph

    def backward(self, grad_outputs: Sequence[torch.Tensor]) -> dict:
        """Run the graph backward once. Returns {input name: gradient} and sends the
        parameter gradients through `accumulate_param_grads`. Frees the graph."""
        if self._used:
            raise RuntimeError(f"local graph {self.name} was already run backward")
        self._used = True
        names = list(self._input_edges)
        targets = [self._input_edges[n] for n in names] + self._params
        grads = torch.autograd.grad(self._output_edges, targets, list(grad_outputs),
                                    allow_unused=True)
        input_grads = dict(zip(names, grads[:len(names)]))
        accumulate_param_grads(self._params, grads[len(names):])
        self.release()
        return input_grads

    def release(self) -> None:
        """Drop the edges (the autograd nodes, and the tensors they saved, go with them)."""
        self._input_edges.clear()
        self._output_edges.clear()
        self._params = []


def accumulate_param_grads(params: Sequence[torch.nn.Parameter],
                           grads: Sequence[Optional[torch.Tensor]]) -> None:
    """Deliver `grads[i]` to `params[i]` through the parameter's autograd accumulator.

    Equivalent to the gradient arriving during `loss.backward()`: it is added to
    `param.grad` (stealing the tensor when param.grad is None), and the accumulator's hooks
    run, so under Megatron DDP the gradient ends in `param.main_grad` with `param.grad`
    cleared, and grad-sync bookkeeping happens. `None` gradients are skipped. The caller
    gives up ownership of the gradient tensors.
    """
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    if not pairs:
        return
    torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
