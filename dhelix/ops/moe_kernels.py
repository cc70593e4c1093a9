"""The MoE kernels (registered on import): router, permute, token-count exchange, the
expert-parallel all-to-alls, the local experts (sort, per-expert GEMMs as forward, dgrad
and wgrad, activation, FC2 bias and inverse sort) and unpermute of megatron-core's MoELayer
with the alltoall dispatcher (`dhelix.ops.moe_program`).

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
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from dhelix.ops.local_graph import LocalGraph, deliver_param_grads
from dhelix.ops.registry import Kernel, register_kernel
from megatron_patches import moe_regions
from megatron_patches.layer_regions import expert_activation, expert_fc2_bias, \
    run_forward_pre_hooks


def _moe(state, op):
    return state.binding.module(op.attrs["module"])


@register_kernel
class RouterForward(Kernel):
    """Megatron's router on the MLP input: outputs (probabilities with the auxiliary loss
    attached, routing map, graph). The routing map carries no gradient."""

    name, kind, op_class = "router_fwd", "comp", "router"

    def run(self, op, state):
        moe = _moe(state, op)
        params = state.binding.own_params(f"{op.attrs['module']}.router")
        if op.attrs.get("defer_aux"):
            _route_deferring_aux_loss(op, state, moe, params)
            return
        routing = {}

        def region(inputs):
            probs, routing["map"] = moe_regions.route(moe, inputs.pop("x"))
            return probs

        (probs,), graph = LocalGraph.trace(op.id, region, {"x": state.take(op.inputs[0])},
                                           params)
        state.put(op.outputs[0], probs)
        state.put(op.outputs[1], routing.pop("map"))
        state.put(op.outputs[2], graph)


def _route_deferring_aux_loss(op, state, moe, params) -> None:
    """The router with its auxiliary loss left for `router_aux_fwd`: outputs (probabilities
    without the loss, routing map, the aux-loss scores - None when the router attaches no
    loss, as in evaluation -, this rank's token counts per expert for the loss - zeros
    then -, graph)."""
    routing = {}

    def region(inputs):
        route = moe_regions.route_deferring_aux_loss(moe, inputs.pop("x"))
        routing.update(map=route.routing_map, counts=route.local_counts)
        return (route.probs,) if route.scores is None else (route.probs, route.scores)

    outputs, graph = LocalGraph.trace(op.id, region, {"x": state.take(op.inputs[0])}, params)
    probs, scores = outputs if len(outputs) == 2 else (outputs[0], None)
    for name, value in zip(op.outputs, (probs, routing.pop("map"), scores,
                                        routing.pop("counts"), graph)):
        state.put(name, value)


@register_kernel
class RouterAuxLoss(Kernel):
    """Megatron's auxiliary load-balancing loss from the aux-loss scores and the token
    counts per expert reduced over the tensor-parallel group, attached to the routing
    probabilities and recorded in Megatron's MoE metrics tracker
    (`moe_regions.attach_aux_loss`). Inputs (probabilities, scores or None, reduced
    counts); outputs (probabilities with the loss attached, graph)."""

    name, kind, op_class = "router_aux_fwd", "comp", "router"

    def run(self, op, state):
        moe = _moe(state, op)
        probs, scores, counts = (state.take(name) for name in op.inputs)
        entered = {"probs": probs}
        if scores is not None:
            entered["scores"] = scores

        def region(inputs):
            return moe_regions.attach_aux_loss(moe, inputs.pop("probs"), inputs.pop("scores", None),
                                               counts)

        (output,), graph = LocalGraph.trace(op.id, region, entered, ())
        state.put(op.outputs[0], output)
        state.put(op.outputs[1], graph)


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
class SortByExpert(Kernel):
    """Received rows and probabilities sorted by local expert. Inputs (rows, row
    probabilities, split sizes); outputs (sorted rows, sorted probabilities, graph)."""

    name, kind, op_class = "moe_sort", "comp", "permute"

    def run(self, op, state):
        moe = _moe(state, op)
        tokens, probs, splits = (state.take(name) for name in op.inputs)
        outputs, graph = LocalGraph.trace(
            op.id, lambda inputs: moe_regions.sort_received(
                moe, inputs.pop("x"), inputs.pop("probs"), splits),
            {"x": tokens, "probs": probs}, ())
        for name, value in zip(op.outputs, (*outputs, graph)):
            state.put(name, value)


def _expert_slices(state, splits_name: str) -> list:
    return [slice(a, b) for a, b in moe_regions.expert_rows(state.take(splits_name))]


@register_kernel
class ExpertLinearForward(Kernel):
    """Each local expert's GEMM (`attrs['linear']`: linear_fc1 or linear_fc2) on its rows:
    `rows_i @ W_i^T`, as Megatron's linear computes it (its bias is added by the traced
    regions), each written into its rows of one output (stacked in row order, no copy).
    Inputs (rows, split sizes). Fires each linear's forward pre-hooks first."""

    name, kind, op_class = "expert_linear_fwd", "comp", "gemm"

    def run(self, op, state):
        rows = state.take(op.inputs[0])
        linears = [getattr(expert, op.attrs["linear"]) for expert in _experts(state)]
        output = rows.new_empty((rows.shape[0], linears[0].weight.shape[0]))
        for linear, part in zip(linears, _expert_slices(state, op.inputs[1])):
            chunk = rows[part]
            run_forward_pre_hooks(linear, (chunk,))
            torch.matmul(chunk, linear.weight.t(), out=output[part])
        del rows
        state.put(op.outputs[0], output)


@register_kernel
class ExpertLinearDgrad(Kernel):
    """Each local expert's input-gradient GEMM `grad_i @ W_i`, each written into its rows
    of one output (row order, no copy). Inputs (output-gradient rows, split sizes)."""

    name, kind, op_class = "expert_linear_dgrad", "comp", "gemm"

    def run(self, op, state):
        grad = state.take(op.inputs[0])
        weights = [getattr(expert, op.attrs["linear"]).weight for expert in _experts(state)]
        output = grad.new_empty((grad.shape[0], weights[0].shape[1]))
        for weight, part in zip(weights, _expert_slices(state, op.inputs[1])):
            torch.matmul(grad[part], weight, out=output[part])
        del grad
        state.put(op.outputs[0], output)


@register_kernel
class ExpertLinearWgrad(Kernel):
    """Each local expert's weight gradient `grad_i^T @ input_i` (Megatron's wgrad
    computation), delivered to its weight by `deliver_param_grads` expert by expert, as
    Megatron's backward delivers them: one expert's gradient (a whole weight's size) alive
    at a time, not all of the rank's at once. Inputs (output-gradient rows, GEMM input
    rows, split sizes)."""

    name, kind, op_class = "expert_linear_wgrad", "comp", "gemm"

    def run(self, op, state):
        grad, rows = state.take(op.inputs[0]), state.take(op.inputs[1])
        parts = _expert_slices(state, op.inputs[2])
        weights = [getattr(expert, op.attrs["linear"]).weight for expert in _experts(state)]

        def compute(part):
            grad_output, total_input = prepare_input_tensors_for_wgrad_compute(
                grad[part], rows[part])
            return [grad_output.t().matmul(total_input)]

        for weight, part in zip(weights, parts):
            deliver_param_grads([weight], lambda part=part: compute(part))


@register_kernel
class ExpertActivation(Kernel):
    """Each local expert's MLP code between its GEMMs on its rows (FC1 bias, activation,
    routing probabilities applied), outputs stacked in row order. Inputs (FC1 output rows,
    sorted probabilities, split sizes); outputs (activation rows, graph). Without FC1
    biases that code is element-wise and the same for every expert, so it runs once over
    all rows (the first expert's module): the same values without splitting and
    concatenating the widest rows of the layer."""

    name, kind, op_class = "expert_activation", "comp", "elementwise"

    def run(self, op, state):
        experts = _experts(state)
        counts = state.take(op.inputs[2]).tokens_per_expert.tolist()

        def region(inputs):
            if not any(_has_fc1_bias(expert) for expert in experts):
                # element-wise on every row alike: one call, the same values, no copies
                fc1 = [inputs.pop("x")]
                return expert_activation(experts[0], fc1.pop, inputs.pop("probs"))
            fc1_parts = list(torch.split(inputs.pop("x"), counts))
            prob_parts = torch.split(inputs.pop("probs"), counts)
            outputs = []
            for expert, probs in zip(experts, prob_parts):
                outputs.append(expert_activation(expert, lambda: fc1_parts.pop(0), probs))
            return torch.cat(outputs)

        params = [expert.linear_fc1.bias for expert in experts]
        outputs, graph = LocalGraph.trace(
            op.id, region, {"x": state.take(op.inputs[0]), "probs": state.take(op.inputs[1])},
            params)
        _put(op, state, outputs, graph)


@register_kernel
class UnsortFromExpert(Kernel):
    """Each local expert's FC2 bias times its probabilities added to its FC2 output rows
    (when the experts have biases), then the rows back in received order. Inputs (FC2
    output rows, [sorted probabilities,] split sizes); outputs (rows, graph)."""

    name, kind, op_class = "moe_unsort", "comp", "permute"

    def run(self, op, state):
        moe = _moe(state, op)
        experts = _experts(state)
        *names, splits_name = op.inputs
        splits = state.take(splits_name)
        counts = splits.tokens_per_expert.tolist()
        entered = {"x": state.take(names[0])}
        if len(names) == 2:
            entered["probs"] = state.take(names[1])

        def region(inputs):
            rows = inputs.pop("x")
            if "probs" in inputs:
                prob_parts = torch.split(inputs.pop("probs"), counts)
                rows = torch.cat([expert_fc2_bias(expert, part, probs) for expert, part, probs
                                  in zip(experts, torch.split(rows, counts), prob_parts)])
            return moe_regions.unsort_expert_rows(moe, rows, splits)

        params = [expert.linear_fc2.bias for expert in experts]
        outputs, graph = LocalGraph.trace(op.id, region, entered, params)
        _put(op, state, outputs, graph)


def _has_fc1_bias(expert) -> bool:
    return getattr(expert.linear_fc1, "bias", None) is not None


def _put(op, state, outputs, graph) -> None:
    (output,) = outputs
    state.put(op.outputs[0], output)
    state.put(op.outputs[1], graph)


def _experts(state) -> list:
    return moe_regions.local_experts(_moe_of(state))


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
    """The sum of its inputs from left to right, `(a + b) + c ...`: the gradients of one
    value with several readers, which equals autograd's accumulation of the same terms in
    the same order bit for bit (the first two terms commute); also the shared expert's
    output added to the routed output (`shared.add`)."""

    name, kind, op_class = "grad_sum", "comp", "elementwise"

    def run(self, op, state):
        total = torch.add(state.take(op.inputs[0]), state.take(op.inputs[1]))
        for name in op.inputs[2:]:
            total = torch.add(total, state.take(name))
        state.put(op.outputs[0], total)
