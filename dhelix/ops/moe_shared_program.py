"""The shared expert of an MoE MLP (megatron-core's `SharedExpertMLP`, `--moe-shared-expert-
intermediate-size`, without its gate) as operators of the MoE program
(`dhelix.ops.moe_program`). Forward, 4 operators:

    shared.fc1, shared.act, shared.fc2      (on the MLP input `ln2.out`, all tokens)
    shared.add                              (routed output + shared output -> `mlp.out`)

backward, 5 operators:

    shared.fc2.dgrad, shared.fc2.wgrad, shared.act.bwd, shared.fc1.dgrad, shared.fc1.wgrad

The shared expert is a dense MLP on the layer's own tokens (megatron-core runs
`MLP.forward` on the MoE layer input and adds its output to the unpermuted routed output:
`MoELayer.postprocess`), so its operators are the dense MLP's kernels (`linear_fwd`,
`activation_fwd`, `linear_dgrad`, `linear_wgrad`, the generic `graph_bwd`) bound to
`mlp.shared_experts.*` (its linears through `dhelix.ops.linear_program`, as the dense
MLP's, at TP = 1: shared experts at TP > 1 are refused, `megatron_patches.moe_support`):
each GEMM's backward a dgrad and a movable wgrad. The sum's
backward is the identity for both terms, so it has no operator: the routed unpermute's
backward and the shared FC2's dgrad and wgrad all read `d.mlp.out`.

None of these operators reads an output of the token-count exchange or the all-to-alls:
in the dependency DAG the shared expert's GEMMs are independent of `counts.ag`,
`dispatch.a2a`, `combine.a2a` and their gradients, which is what lets the planner
co-execute them with those collectives. Its FC1 input gradient is the third term of the
MLP input's gradient (`ln2.grad_sum`), added last, as autograd adds it in Megatron's
backward (the shared expert's autograd nodes are older than the routed path's).
"""

from __future__ import annotations

from dhelix.ops.linear_program import linear_backward, linear_forward

COMP = "comp"
MODULE = "mlp.shared_experts"
FORWARD = ("shared.fc1", "shared.act", "shared.fc2")
BACKWARD = ("shared.fc2.dgrad", "shared.fc2.wgrad", "shared.act.bwd", "shared.fc1.dgrad",
            "shared.fc1.wgrad")
OUTPUT = "shared.fc2.out"
INPUT_GRAD = "d.ln2.out.shared"


def has_shared_expert(desc) -> bool:
    return desc.moe is not None and bool(desc.moe.shared_ffn_hidden_size)


def _widths(d) -> tuple:
    """(FC1 output width, FC2 input width) of the shared expert."""
    f = d.moe.shared_ffn_hidden_size
    return (2 * f if d.gated_linear_unit else f), f


def shared_forward(b) -> None:
    """The shared expert's FC1, activation and FC2 on `ln2.out`, output `shared.fc2.out`
    ([s, b, h]). Emit before the routed output is summed (`shared_add`)."""
    d = b.desc
    s, h = d.seq_length, d.hidden_size
    f1, f = _widths(d)
    linear_forward(b, "shared.fc1", f"{MODULE}.linear_fc1", "ln2.out", f1, column=True,
                   bias_in_gemm=False, in_width=h)  # no biases (Megatron requires it)
    b.tensor("shared.act.out", s, f)
    b.op("fwd", "shared.act", "activation_fwd", COMP, "elementwise", ["shared.fc1.out"],
         ["shared.act.out", b.graph("shared.act.graph")],
         b.key(f"{d.activation_kernel}.fwd", s=s, b=d.micro_batch_size, f=f1, bias=False),
         module=MODULE)
    linear_forward(b, "shared.fc2", f"{MODULE}.linear_fc2", "shared.act.out", h, column=False,
                   bias_in_gemm=False, in_width=f)  # -> OUTPUT


def shared_add(b, routed: str, output: str) -> None:
    """`output = routed + shared.fc2.out` (Megatron's `output + shared_expert_output`)."""
    d = b.desc
    b.op("fwd", "shared.add", "grad_sum", COMP, "elementwise", [routed, OUTPUT], [output],
         b.key("add", s=d.local_seq, b=d.micro_batch_size, h=d.hidden_size))


def shared_backward(b, grad_out: str) -> None:
    """Backward of the shared expert from the MLP output gradient `grad_out`: each GEMM a
    dgrad and a movable wgrad; the MLP input gradient term `d.ln2.out.shared`."""
    d = b.desc
    s, h = d.seq_length, d.hidden_size
    f1, f = _widths(d)
    fc1, fc2 = f"{MODULE}.linear_fc1", f"{MODULE}.linear_fc2"
    linear_backward(b, "shared.fc2", fc2, "shared.act.out", grad_out, "d.shared.act.out",
                    h, f, column=False, bias_in_gemm=False)
    b.tensor("d.shared.fc1.out", s, f1)
    b.op("bwd", "shared.act.bwd", "graph_bwd", COMP, "elementwise",
         ["shared.act.graph", "d.shared.act.out"], ["d.shared.fc1.out"],
         b.key(f"{d.activation_kernel}.bwd", s=s, b=d.micro_batch_size, f=f1, bias=False),
         grads_of=("x",))
    linear_backward(b, "shared.fc1", fc1, "ln2.out", "d.shared.fc1.out", INPUT_GRAD, f1, h,
                    column=True, bias_in_gemm=False)
