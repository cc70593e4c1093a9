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
and both backward all-to-alls use; `moe_expert_all_to_all` exchanges one local expert's rows
alone (the combine's gradient split by local expert).
"""

from __future__ import annotations

import torch
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from dhelix.ops.local_graph import LocalGraph, deliver_param_grads
from dhelix.ops.registry import Kernel, register_kernel
from dhelix.ops.weight_grad import weight_gradient
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
            _issue_all_to_all(comm, state, out_name, state.take(name).contiguous(), send,
                              receive)


def _issue_all_to_all(comm, state, out_name: str, tensor, send, receive) -> None:
    """Issue the all-to-all of `tensor` (`send` rows to each rank, `receive` from each) into
    a new tensor on its device, stored as the pending value `out_name`; the collective
    keeps `tensor` alive until it completes."""
    output = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    work = comm.all_to_all_single(output, tensor, list(receive), list(send))
    state.put_pending(out_name, output, work, keepalive=(tensor,))


@register_kernel
class OneExpertAllToAll(Kernel):
    """Asynchronous all-to-all of one local expert's (`attrs['expert']`) rows toward the
    experts over the expert-parallel group: this rank's permuted rows of every rank's local
    expert `expert` (gathered into one new tensor, which the collective keeps alive), and
    from every rank its rows of this rank's expert, in group order: that expert's rows of
    the sorted received rows, no inverse sort needed. The combine's backward split by local
    expert (`moe_program.split_combine_grad`), so that one expert's backward can start while
    the next expert's rows travel. Inputs (the permuted rows' gradient, split sizes); output
    the expert's rows (pending), on the input's device."""

    name, kind, op_class = "moe_expert_all_to_all", "comm", "all_to_all"

    def run(self, op, state):
        comm = state.collectives(op)
        rows, splits = (state.take(name) for name in op.inputs)
        ranges, send, receive = splits.one_expert_exchange(op.attrs["expert"])
        tensor = torch.cat([rows[start:stop] for start, stop in ranges])
        del rows
        _issue_all_to_all(comm, state, op.outputs[0], tensor, send, receive)


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


def _expert_operand(op, state, index: int, part: slice) -> torch.Tensor:
    """Input `index` of the per-expert operator `op` as its expert's rows: rows `part` of
    the value holding every local expert's rows when the program lists it in
    `attrs['stacked']`, else the expert's own value."""
    value = state.take(op.inputs[index])
    return value[part] if op.inputs[index] in op.attrs["stacked"] else value


def _expert_linear(state, op):
    expert = op.attrs["expert"]
    return getattr(_experts(state)[expert], op.attrs["linear"]), expert


@register_kernel
class ExpertLinearForward(Kernel):
    """Each local expert's GEMM (`attrs['linear']`: linear_fc1 or linear_fc2) on its rows:
    `rows_i @ W_i^T`, as Megatron's linear computes it (its bias is added by the traced
    regions). Inputs (rows of every expert, split sizes) or (each expert's rows, split
    sizes); outputs each expert's rows or (one output) every expert's, written into its rows
    of it (row order, no copy). Fires each linear's forward pre-hooks first."""

    name, kind, op_class = "expert_linear_fwd", "comp", "gemm"

    def run(self, op, state):
        *names, splits_name = op.inputs
        linears = [getattr(expert, op.attrs["linear"]) for expert in _experts(state)]
        parts = _expert_slices(state, splits_name)
        if len(names) == 1:
            stacked = state.take(names[0])
            rows = [stacked[part] for part in parts]
            del stacked
        else:
            rows = [state.take(name) for name in names]
        stacked_out = len(op.outputs) == 1
        if stacked_out:
            total = sum(chunk.shape[0] for chunk in rows)
            output = rows[0].new_empty((total, linears[0].weight.shape[0]))
        for i, (linear, part) in enumerate(zip(linears, parts)):
            chunk = rows[i]
            rows[i] = None
            run_forward_pre_hooks(linear, (chunk,))
            if stacked_out:
                torch.matmul(chunk, linear.weight.t(), out=output[part])
            else:
                state.put(op.outputs[i], torch.matmul(chunk, linear.weight.t()))
        if stacked_out:
            state.put(op.outputs[0], output)


@register_kernel
class ExpertLinearDgrad(Kernel):
    """One local expert's (`attrs['expert']`) input-gradient GEMM `grad_i @ W_i`. Inputs
    (output-gradient rows, split sizes); output the expert's input-gradient rows."""

    name, kind, op_class = "expert_linear_dgrad", "comp", "gemm"

    def run(self, op, state):
        linear, expert = _expert_linear(state, op)
        part = _expert_slices(state, op.inputs[1])[expert]
        grad = _expert_operand(op, state, 0, part)
        state.put(op.outputs[0], torch.matmul(grad, linear.weight))


@register_kernel
class ExpertLinearWgrad(Kernel):
    """One local expert's (`attrs['expert']`) weight gradient `grad_i^T @ input_i`
    (Megatron's wgrad computation, `weight_grad.weight_gradient`: into `main_grad` under
    gradient accumulation fusion), delivered to its weight by `deliver_param_grads`, as
    Megatron's backward delivers it. Inputs (output-gradient rows, GEMM input rows, split
    sizes)."""

    name, kind, op_class = "expert_linear_wgrad", "comp", "gemm"

    def run(self, op, state):
        linear, expert = _expert_linear(state, op)
        part = _expert_slices(state, op.inputs[2])[expert]
        grad, rows = _expert_operand(op, state, 0, part), _expert_operand(op, state, 1, part)

        def compute():
            grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad, rows)
            return [weight_gradient(linear, linear.weight, grad_output, total_input)]

        deliver_param_grads([linear.weight], compute)


@register_kernel
class ExpertActivation(Kernel):
    """Each local expert's MLP code between its GEMMs on its rows (FC1 bias, activation,
    routing probabilities applied), each expert in a graph of its own so that its backward
    frees the expert's saved rows. Inputs (each expert's FC1 output rows, sorted
    probabilities, split sizes); outputs (each expert's activation rows, then each expert's
    graph)."""

    name, kind, op_class = "expert_activation", "comp", "elementwise"

    def run(self, op, state):
        experts = _experts(state)
        *fc1_names, probs_name, splits_name = op.inputs
        parts = _expert_slices(state, splits_name)
        probs = state.take(probs_name)
        count = len(experts)
        for i, (expert, part) in enumerate(zip(experts, parts)):
            def region(inputs, expert=expert):
                return expert_activation(expert, lambda: inputs.pop("x"), inputs.pop("probs"))

            (output,), graph = LocalGraph.trace(
                f"{op.id}.{i}", region,
                {"x": state.take(fc1_names[i]), "probs": probs[part]},
                [expert.linear_fc1.bias])
            state.put(op.outputs[i], output)
            state.put(op.outputs[count + i], graph)


@register_kernel
class ExpertRowsJoin(Kernel):
    """The local experts' gradient rows back in row order, one `torch.cat` per output (what
    autograd's backward of SequentialMLP's split computes). Inputs: each output's per-expert
    parts, output by output; outputs: the joined rows."""

    name, kind, op_class = "expert_rows_join", "comp", "permute"

    def run(self, op, state):
        per_output = len(op.inputs) // len(op.outputs)
        for k, name in enumerate(op.outputs):
            parts = [state.take(n) for n in op.inputs[k * per_output:(k + 1) * per_output]]
            state.put(name, torch.cat(parts))


@register_kernel
class UnsortFromExpert(Kernel):
    """Each local expert's FC2 bias times its probabilities added to its FC2 output rows
    (when the experts have biases), then the rows back in received order. Inputs (FC2
    output rows, [sorted probabilities,] split sizes); outputs (rows, graph), or the rows
    alone, with no graph, where the backward does not run through it (the combine's
    gradient split by expert, `moe_program.split_combine_grad`)."""

    name, kind, op_class = "moe_unsort", "comp", "permute"

    def run(self, op, state):
        moe = _moe(state, op)
        experts = _experts(state)
        *names, splits_name = op.inputs
        splits = state.take(splits_name)
        counts = list(splits.tokens_per_expert)
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

        if len(op.outputs) == 1:
            with torch.no_grad():
                state.put(op.outputs[0], region(entered))
            return
        params = [expert.linear_fc2.bias for expert in experts]
        outputs, graph = LocalGraph.trace(op.id, region, entered, params)
        _put(op, state, outputs, graph)


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
