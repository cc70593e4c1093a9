"""The MoE kernels (registered on import): router, permute, token-count exchange, the
expert-parallel all-to-alls, experts and unpermute of megatron-core's MoELayer with the
alltoall dispatcher (`dhelix.ops.moe_program`).

Computation kernels run Megatron's own code (`megatron_patches.moe_regions`) in local
autograd graphs, as the dense layer's traced regions do; their backward is the generic
`graph_bwd`. The communication kernels issue asynchronous gloo/NCCL collectives on the
layer's expert-parallel group (or the executor's lane for it) and leave their outputs
pending: `moe_token_counts` all-gathers each rank's token count per expert;
`moe_all_to_all` exchanges token rows (and their routing probabilities) with split sizes
derived from those counts, so its first run in a micro-batch (`dispatch.a2a`) waits for the
count exchange and records the split sizes (`dispatch.splits`) that the experts, the combine
and both backward all-to-alls use.
"""

from __future__ import annotations

import torch

from dhelix.ops.local_graph import LocalGraph
from dhelix.ops.registry import Kernel, register_kernel
from megatron_patches import moe_regions


def _moe(state, op):
    return state.binding.module(op.attrs["module"])


@register_kernel
class RouterForward(Kernel):
    """Megatron's router on the MLP input: outputs (probabilities with the auxiliary loss
    attached, routing map, graph). The routing map carries no gradient."""

    name, kind, op_class = "router_fwd", "comp", "router"

    def run(self, op, state):
        moe = _moe(state, op)
        routing = {}

        def region(inputs):
            probs, routing["map"] = moe_regions.route(moe, inputs.pop("x"))
            return probs

        (probs,), graph = LocalGraph.trace(op.id, region, {"x": state.take(op.inputs[0])},
                                           state.binding.own_params(f"{op.attrs['module']}.router"))
        state.put(op.outputs[0], probs)
        state.put(op.outputs[1], routing.pop("map"))
        state.put(op.outputs[2], graph)


@register_kernel
class TokenCounts(Kernel):
    """Asynchronous all-gather of this rank's token count per expert over the
    expert-parallel group (the split sizes of the all-to-alls); pending output."""

    name, kind, op_class = "moe_token_counts", "comm", "all_gather"

    def run(self, op, state):
        comm = state.collectives(op)
        local = moe_regions.local_token_counts(state.take(op.inputs[0]))
        output = local.new_empty((comm.size() * local.numel(),))
        work = comm.all_gather_into_tensor(output, local)
        state.put_pending(op.outputs[0], output, work, keepalive=(local,))


@register_kernel
class Permute(Kernel):
    """Token rows grouped by expert, and their probabilities. Inputs (MLP input,
    probabilities, routing map); outputs (rows, row probabilities, permutation rows,
    graph)."""

    name, kind, op_class = "moe_permute", "comp", "permute"

    def run(self, op, state):
        moe = _moe(state, op)
        hidden, probs, routing_map = (state.take(name) for name in op.inputs)
        rows = {}

        def region(inputs):
            tokens, permuted_probs, rows["map"] = moe_regions.permute_tokens(
                moe, inputs.pop("x"), inputs.pop("probs"), routing_map)
            return tokens, permuted_probs

        (tokens, permuted_probs), graph = LocalGraph.trace(
            op.id, region, {"x": hidden, "probs": probs}, ())
        for name, value in zip(op.outputs, (tokens, permuted_probs, rows.pop("map"), graph)):
            state.put(name, value)


@register_kernel
class MoEAllToAll(Kernel):
    """Asynchronous all-to-all of token rows over the expert-parallel group, one
    collective per input tensor (rows, and on the dispatch side their probabilities), as
    Megatron's dispatcher does. The last input is the exchanged token counts (dispatch:
    the split sizes are derived here and output last) or the split sizes themselves.
    `attrs['to_experts']`: rows travel to the experts (dispatch forward, combine backward)
    or back (combine forward, dispatch backward)."""

    name, kind, op_class = "moe_all_to_all", "comm", "all_to_all"

    def run(self, op, state):
        comm = state.collectives(op)
        *tensor_names, meta_name = op.inputs
        meta = state.take(meta_name)
        if isinstance(meta, moe_regions.DispatchSplits):
            splits, outputs = meta, op.outputs
        else:  # the counts: wait for their exchange, derive and hand on the split sizes
            splits = moe_regions.dispatch_splits(_moe_of(state), meta, comm.rank())
            *outputs, splits_name = op.outputs
            state.put(splits_name, splits)
        send, receive = splits.input_splits, splits.output_splits
        if not op.attrs["to_experts"]:
            send, receive = receive, send
        for name, out_name in zip(tensor_names, outputs):
            tensor = state.take(name).contiguous()
            output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
            work = comm.all_to_all_single(output, tensor, list(receive), list(send))
            state.put_pending(out_name, output, work, keepalive=(tensor,))


def _moe_of(state):
    return state.binding.module("mlp")


@register_kernel
class Experts(Kernel):
    """The rank's local experts on the received rows: sort by local expert, Megatron's
    experts module (SequentialMLP, probabilities applied inside), inverse sort. Inputs
    (rows, row probabilities, split sizes); outputs (expert rows, graph)."""

    name, kind, op_class = "moe_experts", "comp", "gemm"

    def run(self, op, state):
        moe = _moe_of(state)
        tokens, probs, splits = (state.take(name) for name in op.inputs)
        (output,), graph = LocalGraph.trace(
            op.id, lambda inputs: moe_regions.experts_region(
                moe, inputs.pop("x"), inputs.pop("probs"), splits),
            {"x": tokens, "probs": probs}, state.binding.own_params(op.attrs["module"]))
        state.put(op.outputs[0], output)
        state.put(op.outputs[1], graph)


@register_kernel
class Unpermute(Kernel):
    """Combined expert rows summed back into token order ([s, b, h]). Inputs (rows,
    permutation rows, routing map); outputs (MLP output, graph)."""

    name, kind, op_class = "moe_unpermute", "comp", "permute"

    def run(self, op, state):
        moe = _moe(state, op)
        rows, permutation, routing_map = (state.take(name) for name in op.inputs)
        shape = state.programs.values[op.outputs[0]].shape
        (output,), graph = LocalGraph.trace(
            op.id, lambda inputs: moe_regions.unpermute_tokens(
                moe, inputs.pop("x"), permutation, routing_map, shape),
            {"x": rows}, ())
        state.put(op.outputs[0], output)
        state.put(op.outputs[1], graph)


@register_kernel
class GradSum(Kernel):
    """The sum of two gradients of one value (a value with two readers): `a + b`, which
    equals autograd's accumulation of the same two terms bit for bit."""

    name, kind, op_class = "grad_sum", "comp", "elementwise"

    def run(self, op, state):
        first, second = (state.take(name) for name in op.inputs)
        state.put(op.outputs[0], torch.add(first, second))
