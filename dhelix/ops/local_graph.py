"""Small autograd graphs for the non-GEMM operators, and the parameter-gradient sink.

Operators whose math is not a GEMM (norms, the attention core with RoPE, the activation,
bias-dropout-add) run Megatron's own module code in their forward operator while recording
a *local* autograd graph that starts at the operator's inputs and ends at its outputs. Their
backward operator runs exactly that graph backward. The graph saves what Megatron's autograd
graph saves for the same code (the operator's inputs are entered through a node that saves
nothing, and only gradient *edges* are kept, never the output tensors), so activation
memory matches Megatron's.

Parameter gradients always reach the parameters through their autograd accumulator node,
inside the autograd engine, as in Megatron's own backward: a local graph's in the one engine
call that runs the graph backward (which also yields the input gradients), a GEMM's through
`deliver_param_grads` (which computes them inside the engine, as a Megatron backward
function does). `param.grad` accumulates as autograd would (taking the gradient
tensor itself when it was None, so no copy), and every hook registered on the accumulator -
Megatron DDP's backward post-hook, which adds `param.grad` into `param.main_grad`, clears
`param.grad` and (with overlap_grad_reduce) marks the parameter ready for its bucket's grad
sync - fires exactly as in Megatron's own backward.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, get_gradient_edge


class _Entry(torch.autograd.Function):
    """Identity that starts a local graph: saves nothing, so entering a tensor does not
    keep it alive. Its backward writes the gradient of the entered tensor into the graph's
    `sink` under `key` (None when no gradient reached it) and passes nothing on: the local
    graph ends here."""

    @staticmethod
    def forward(ctx, tensor, anchor, sink, key):  # noqa: ARG004 - anchor only makes the output require grad
        ctx.sink, ctx.key = sink, key
        ctx.set_materialize_grads(False)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink[ctx.key] = grad
        return None, None, None, None


_ANCHORS: dict = {}
_ANCHOR_LOCK = threading.Lock()


def _anchor(device: torch.device) -> torch.Tensor:
    """A scalar leaf on `device` that requires grad; it never receives a gradient (the entry
    node returns None for it). One per thread and device, so concurrent executors never
    share autograd state."""
    key = (threading.get_ident(), device)
    anchor = _ANCHORS.get(key)
    if anchor is None:
        with _ANCHOR_LOCK:
            anchor = _ANCHORS.get(key)
            if anchor is None:
                anchor = _ANCHORS[key] = torch.zeros((), device=device, requires_grad=True)
    return anchor


def enter(tensor: torch.Tensor, sink: dict, key: str) -> torch.Tensor:
    """`tensor` entered into the autograd graph that code run on the result records, as a
    leaf whose storage the graph does not keep: the result is a view of `tensor` (same
    device, dtype and storage) through a node that saves nothing, and when a backward
    reaches that node it writes the gradient into `sink[key]` (None when no gradient
    reached it) and stops there. Unlike `tensor.detach().requires_grad_()` (whose `.grad`
    needs the leaf itself kept), the caller may drop `tensor` and the result as soon as the
    forward is done: the storage then lives only as long as something in the graph saved
    it, as in Megatron's own graph."""
    return _Entry.apply(tensor, _anchor(tensor.device), sink, key)


def _run_engine(roots: tuple, grads: tuple, inputs: tuple) -> None:
    """One autograd engine call from `roots` (gradient edges or tensors) with `grads`,
    accumulating into the leaves `inputs` (every node on a path to them runs, hooks
    included). What `torch.autograd.backward(roots, grads, inputs=inputs)` does, without its
    Python-side re-checking of the gradients (megatron-core's `custom_backward` calls the
    engine the same way): callers pass gradients whose shapes the operator programs checked
    when they were produced."""
    Variable._execution_engine.run_backward(roots, grads, False, False, inputs, True, True)


class LocalGraph:
    """The recorded autograd graph of one operator, owned by the execution state from the
    forward operator that traced it until the backward operator that consumes it.

    Holds only the output gradient edges, the parameter list and the sink the entry nodes
    write the input gradients into; the tensors the graph needs are held by the autograd
    nodes themselves and are freed by `backward` (or `release`).
    """

    __slots__ = ("name", "_names", "_sink", "_output_edges", "_leaves", "_used")

    def __init__(self, name: str, names: Sequence[str], sink: dict,
                 output_edges: Sequence[GradientEdge], params: Sequence[torch.nn.Parameter],
                 anchor: torch.Tensor):
        self.name = name
        self._names = tuple(names)
        self._sink = sink
        self._output_edges = tuple(output_edges)
        # the engine runs every node on a path to these leaves: the parameters'
        # accumulators, and (through the entry nodes) the anchor's, which gets nothing
        self._leaves = (*params, anchor)
        self._used = False

    @classmethod
    def trace(cls, name: str, fn: Callable, grad_inputs: dict,
              params: Sequence[torch.nn.Parameter], **constant_inputs):
        """Run `fn(entered, **constant_inputs)` with grad enabled and record its graph.

        `grad_inputs` maps names to the tensors whose gradients the backward operator
        returns; trace *takes* them (the dict is emptied) and hands `fn` a dict of the same
        names holding the entered tensors, which `fn` should pop when it uses them - so that,
        as in Megatron's forward, an input nobody saves is freed as soon as the code stops
        using it. `constant_inputs` get no gradient (masks, rotary tables). `fn` returns a
        tensor or a tuple of tensors. Returns `(outputs, graph)`: the outputs detached
        (plain tensors for the next operators, sharing storage with the graph's outputs) and
        the LocalGraph. Parameters used by `fn` must be listed in `params` to get gradients.
        """
        with torch.enable_grad():
            devices = [t.device for t in grad_inputs.values()] or [torch.device("cpu")]
            anchor = _anchor(devices[0])
            sink: dict = {}
            names = list(grad_inputs)
            entered = {key: _Entry.apply(grad_inputs.pop(key), anchor, sink, key)
                       for key in names}
            result = fn(entered, **constant_inputs)
            entered.clear()
            outputs = result if isinstance(result, tuple) else (result,)
            del result
            for out in outputs:
                if not out.requires_grad:
                    raise RuntimeError(f"{name}: an output of the traced operator does not "
                                       "depend on its inputs or parameters")
            graph = cls(name, names, sink, [get_gradient_edge(out) for out in outputs],
                        [p for p in params if p is not None and p.requires_grad], anchor)
        return tuple(out.detach() for out in outputs), graph

    def backward(self, grad_outputs: list) -> dict:
        """Run the graph backward once, in one autograd engine call. Takes the gradient
        tensors (the list is emptied); returns {input name: gradient, None where none
        reached it}. The parameter gradients reach the parameters' accumulators inside that
        call, as in Megatron's own backward (see the module docstring). Frees the graph and
        what it saved."""
        if self._used:
            raise RuntimeError(f"local graph {self.name} was already run backward")
        self._used = True
        output_grads = tuple(grad_outputs)
        grad_outputs.clear()
        roots, self._output_edges = self._output_edges, ()
        _run_engine(roots, output_grads, self._leaves)
        del roots, output_grads
        sink = self._sink
        input_grads = {name: sink.pop(name, None) for name in self._names}
        self.release()
        return input_grads

    def release(self) -> None:
        """Drop the edges (the autograd nodes, and the tensors they saved, go with them)."""
        self._output_edges = ()
        self._leaves = ()
        self._sink.clear()


class _Deliver(torch.autograd.Function):
    """Carries parameter gradients computed inside the autograd engine to the parameters'
    accumulators, exactly as a Megatron backward function returning them would."""

    @staticmethod
    def forward(ctx, compute, mask, *params):
        ctx.compute, ctx.mask = compute, mask
        return params[0].new_empty(0)

    @staticmethod
    def backward(ctx, _unused):
        compute, ctx.compute = ctx.compute, None
        grads = compute()
        return (None, None, *[g for g, wanted in zip(grads, ctx.mask) if wanted])


def deliver_param_grads(params: Sequence[torch.nn.Parameter],
                        compute: Callable[[], list]) -> None:
    """Compute parameter gradients with `compute()` (a list, one entry per parameter, None
    to skip) inside the autograd engine and deliver each to its parameter's accumulator.

    Equivalent to the gradients arriving during Megatron's `loss.backward()`: added to
    `param.grad` (which takes the tensor itself when `param.grad` is None - `compute` must
    not keep references to what it returns), and the accumulator's hooks run: under Megatron
    DDP the gradient lands in `param.main_grad`, `param.grad` is cleared, and grad-sync
    bookkeeping happens. Gradients of parameters that do not require grad are dropped;
    `compute` runs exactly once in every case (it may have side effects).
    """
    params = list(params)
    mask = [p.requires_grad for p in params]
    if not any(mask):
        compute()
        return
    wanted = [p for p, keep in zip(params, mask) if keep]
    with torch.enable_grad():
        carrier = _Deliver.apply(compute, mask, *wanted)
    _run_engine((carrier,), (carrier.new_empty(0),), ())
