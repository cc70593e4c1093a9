"""The built-in kernels of dense transformer layers (registered on import).

GEMM kernels reproduce megatron-core's `LinearWithGradAccumulationAndAsyncCommunication`
math operation for operation (same matmuls, same reshapes, same bias reductions), so
results equal Megatron's bit for bit on the same inputs; the tensor-parallel collectives
that Megatron hides inside that function and in `tensor_parallel.mappings` are separate
communication kernels here. Non-GEMM kernels run Megatron's own module code in a local
autograd graph (`dhelix.ops.local_graph`).

Every kernel runs under `torch.no_grad()` (the executor guarantees it) and reads/writes the
execution state only through `state.take` / `state.put` / `state.put_pending`. `take`
returns an input and, when the running operator is its last reader, drops the state's
reference at once, so a kernel that stops using an input frees it mid-operator as Megatron's
code would.
"""

from __future__ import annotations

import torch
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from dhelix.ops.local_graph import LocalGraph, deliver_param_grads
from dhelix.ops.registry import Kernel, register_kernel
from dhelix.ops.weight_grad import weight_gradient
from megatron_patches.layer_regions import attention_core, mlp_activation, run_forward_pre_hooks


# ---------------------------------------------------------------------- GEMMs
@register_kernel
class LinearForward(Kernel):
    """`out = input @ W^T (+ bias)` with the layer's own weight (Megatron's forward GEMM).
    Fires the linear module's forward pre-hooks first (DDP parameter-gather waits)."""

    name, kind, op_class = "linear_fwd", "comp", "gemm"

    def run(self, op, state):
        module = state.binding.module(op.attrs["module"])
        total_input = state.take(op.inputs[0])
        run_forward_pre_hooks(module, (total_input,))
        output = torch.matmul(total_input, module.weight.t())
        del total_input
        if op.attrs["add_bias"]:
            output = output + module.bias
        state.put(op.outputs[0], output)


@register_kernel
class LinearDgrad(Kernel):
    """`grad_input = grad_output @ W` (the input-gradient GEMM)."""

    name, kind, op_class = "linear_dgrad", "comp", "gemm"

    def run(self, op, state):
        module = state.binding.module(op.attrs["module"])
        state.put(op.outputs[0], state.take(op.inputs[0]).matmul(module.weight))


@register_kernel
class LinearWgrad(Kernel):
    """`grad_W = grad_output^T @ input` over all tokens (and `grad_b = sum(grad_output)`
    when the bias is added inside the GEMM), computed as Megatron's backward computes it
    (`weight_grad.weight_gradient`: into `main_grad` under gradient accumulation fusion) and
    delivered by `deliver_param_grads`. Inputs: (output gradient, GEMM input as used in the
    forward)."""

    name, kind, op_class = "linear_wgrad", "comp", "gemm"

    def run(self, op, state):
        module = state.binding.module(op.attrs["module"])
        operands = [state.take(op.inputs[0]), state.take(op.inputs[1])]
        with_bias = op.attrs["bias_grad"]

        def compute():
            grad_output, total_input = prepare_input_tensors_for_wgrad_compute(*operands)
            operands.clear()
            grads = [weight_gradient(module, module.weight, grad_output, total_input)]
            if with_bias:
                grads.append(grad_output.sum(dim=0))
            return grads

        params = [module.weight, module.bias] if with_bias else [module.weight]
        deliver_param_grads(params, compute)


# ------------------------------------------------------------- collectives
def _collectives(op, state):
    return state.collectives(op)


@register_kernel
class AllGather(Kernel):
    """Asynchronous all-gather along the sequence dimension (dim 0) into a new tensor.
    The output is pending until its first reader waits on the handle."""

    name, kind, op_class = "all_gather", "comm", "all_gather"

    def run(self, op, state):
        comm = _collectives(op, state)
        shard = state.take(op.inputs[0]).contiguous()
        size = list(shard.shape)
        size[0] *= comm.size()
        output = torch.empty(size, dtype=shard.dtype, device=shard.device)
        work = comm.all_gather_into_tensor(output, shard)
        state.put_pending(op.outputs[0], output, work, keepalive=(shard,))


@register_kernel
class ReduceScatter(Kernel):
    """Asynchronous reduce-scatter (sum) along dim 0 into a new tensor; pending output."""

    name, kind, op_class = "reduce_scatter", "comm", "reduce_scatter"

    def run(self, op, state):
        comm = _collectives(op, state)
        full = state.take(op.inputs[0]).contiguous()
        size = list(full.shape)
        if size[0] % comm.size():
            raise RuntimeError(f"{op.id}: dim 0 ({size[0]}) not divisible by the group size")
        size[0] //= comm.size()
        output = torch.empty(size, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter_tensor(output, full)
        state.put_pending(op.outputs[0], output, work, keepalive=(full,))


@register_kernel
class AllReduce(Kernel):
    """Asynchronous in-place all-reduce (sum) of its input, which it owns (the program
    guarantees it is the input's only reader); the output is the same tensor, pending."""

    name, kind, op_class = "all_reduce", "comm", "all_reduce"

    def run(self, op, state):
        tensor = state.take(op.inputs[0])
        if not tensor.is_contiguous():
            raise RuntimeError(f"{op.id}: all-reduce input must be contiguous")
        work = _collectives(op, state).all_reduce(tensor)
        state.put_pending(op.outputs[0], tensor, work)


# ------------------------------------------------- traced (non-GEMM) regions
def _put_traced(op, state, outputs, graph):
    (output,) = outputs
    state.put(op.outputs[0], output)
    state.put(op.outputs[1], graph)


@register_kernel
class NormForward(Kernel):
    """The layer's LayerNorm/RMSNorm module; outputs (normed, graph).

    The norm's input is also the residual stream, whose gradient the backward adds to the
    norm's input gradient. The traced region therefore also returns the input itself (a
    view, not stored): the backward feeds the residual gradient in there, and autograd
    accumulates it with the norm's internal input gradients in the same order as in
    Megatron's whole-model backward - bit-identical even for composite norms (RMSNorm) whose
    input gradient is itself a sum."""

    name, kind, op_class = "norm_fwd", "comp", "norm"

    def run(self, op, state):
        norm = state.binding.module(op.attrs["module"])

        def region(inputs):
            x = inputs.pop("x")
            return norm(x), x.view_as(x)

        (output, _residual), graph = LocalGraph.trace(
            op.id, region, {"x": state.take(op.inputs[0])},
            state.binding.own_params(op.attrs["module"])
        )
        state.put(op.outputs[0], output)
        state.put(op.outputs[1], graph)


@register_kernel
class AttentionForward(Kernel):
    """Megatron's SelfAttention between its two GEMMs (QKV split, RoPE, core attention);
    inputs (QKV GEMM output, attention mask, rotary table); outputs (context, graph)."""

    name, kind, op_class = "attention_fwd", "comp", "attention"

    def run(self, op, state):
        attn = state.binding.module(op.attrs["module"])
        mixed_qkv, mask, rotary = (state.take(name) for name in op.inputs)
        outputs, graph = LocalGraph.trace(
            op.id, lambda inputs, **kw: attention_core(attn, inputs.pop("x"), **kw),
            {"x": mixed_qkv},
            state.binding.own_params(op.attrs["module"], ("linear_qkv", "linear_proj")),
            attention_mask=mask, rotary_pos_emb=rotary,
        )
        _put_traced(op, state, outputs, graph)


@register_kernel
class ActivationForward(Kernel):
    """Megatron's MLP between FC1 and FC2: FC1 bias add and (gated) activation; outputs
    (activation, graph). FC1's bias gradient comes out of this operator's backward. The
    FC1 output is handed to Megatron's code the way its own FC1 would return it, so it is
    freed right after the bias add, as in Megatron."""

    name, kind, op_class = "activation_fwd", "comp", "elementwise"

    def run(self, op, state):
        mlp = state.binding.module(op.attrs["module"])
        params = (mlp.linear_fc1.bias,
                  *state.binding.own_params(op.attrs["module"], ("linear_fc1", "linear_fc2")))
        outputs, graph = LocalGraph.trace(
            op.id, lambda inputs: mlp_activation(mlp, lambda: inputs.pop("x")),
            {"x": state.take(op.inputs[0])}, params,
        )
        _put_traced(op, state, outputs, graph)


@register_kernel
class BiasDropoutAddForward(Kernel):
    """The layer's bias-dropout-add (`residual + dropout(x + bias)`) with the row-parallel
    linear's skipped bias (none for an MoE MLP); inputs (x, residual); outputs (sum,
    graph)."""

    name, kind, op_class = "bda_fwd", "comp", "elementwise"

    def run(self, op, state):
        layer = state.binding.layer
        bda = getattr(layer, op.attrs["module"])(layer.training, layer.config.bias_dropout_fusion)
        bias_module = op.attrs["bias_module"]  # None: no bias (an MoE MLP returns none)
        bias = None if bias_module is None else state.binding.module(bias_module).bias

        def region(inputs):
            with layer.bias_dropout_add_exec_handler():
                return bda((inputs.pop("x"), bias), inputs.pop("residual"), layer.hidden_dropout)

        outputs, graph = LocalGraph.trace(
            op.id, region, {"x": state.take(op.inputs[0]), "residual": state.take(op.inputs[1])},
            [bias],
        )
        _put_traced(op, state, outputs, graph)


@register_kernel
class GraphBackward(Kernel):
    """Backward of a traced region. Inputs: (graph, gradient of each region output - for
    norms the normed output and the residual stream); outputs: the gradients of the region
    inputs named by `attrs['grads_of']` (the traced regions call their main input `x`,
    bias-dropout-add also has `residual`). Parameter gradients are delivered by
    `deliver_param_grads`; the graph (and what it saved) is freed."""

    name, kind, op_class = "graph_bwd", "comp", "elementwise"

    def run(self, op, state):
        graph = state.take(op.inputs[0])
        grads = graph.backward([state.take(name) for name in op.inputs[1:]])
        for name, key in zip(op.outputs, op.attrs["grads_of"]):
            state.put(name, grads.pop(key))
