"""The MLP half of an MoE TransformerLayer as operators (after the attention half, which is
the dense layer's). Forward, 8 operators:

    ln2, router, counts.ag, permute, dispatch.a2a, experts, combine.a2a, unpermute, bda2

(`counts.ag` exchanges each rank's token count per expert over the expert-parallel group:
the all-to-all split sizes are known only after routing); backward, 9 operators:

    bda2.bwd, unpermute.bwd, combine.a2a_grad, experts.bwd, dispatch.a2a_grad,
    permute.bwd, router.bwd, ln2.grad_sum, ln2.bwd

`experts` runs the rank's local experts (megatron-core's SequentialMLP, with the sort of
the received tokens by local expert before and the inverse sort after); its backward is
one operator (`experts.bwd`, a traced graph: dgrad and wgrad are not split). The layer
input of the MLP half (`ln2.out`) feeds two readers, the router and the permutation, so its
gradient is the sum of their two gradients (`ln2.grad_sum`; two terms, so the sum is
bit-identical to autograd's accumulation in either order).

Token-row values are `[rows, hidden]` (`[rows]` for the routing probabilities): `T` routed
tokens of this rank (s * b), `T*k` rows after the permutation, and a variable number of
rows received from the expert-parallel group (`VariableDim` "recv", bounded by
`MoEDescription.received_high`).
"""

from __future__ import annotations

from dhelix.ops.program import ValueInfo, VariableDim
from dhelix.ops.registry import cost_key

COMP, COMM = "comp", "comm"
# the all-to-alls that carry token rows to the experts (the others carry them back)
TO_EXPERTS = ("dispatch.a2a", "combine.a2a_grad")


def _rows(b, name: str, *shape) -> str:
    b.values[name] = ValueInfo(name, "tensor", tuple(shape))
    return name


def _dims(desc) -> tuple:
    moe = desc.moe
    tokens = desc.tokens_local
    recv = VariableDim("recv", 0, moe.received_high(tokens))
    return moe, tokens, tokens * moe.topk, recv


def _a2a(b, direction: str, op_id: str, inputs, outputs, rows: int) -> None:
    d = b.desc
    key = cost_key("all_to_all", d.dtype, {"rows": rows, "h": d.hidden_size},
                   group_size=d.moe.ep_size, channel=d.ep_channel)
    b.op(direction, op_id, "moe_all_to_all", COMM, "all_to_all", inputs, outputs, key,
         group="ep", channel=d.ep_channel, to_experts=op_id in TO_EXPERTS)


def moe_forward(b, norm) -> None:
    """Forward ops of the MoE MLP half from `h1` to `y`; `norm(b)` emits `ln2`."""
    d = b.desc
    moe, tokens, routed, recv = _dims(d)
    h, e = d.hidden_size, moe.num_experts
    norm(b)
    b.aux("router.map")
    _rows(b, "router.probs", tokens, e)
    b.op("fwd", "router", "router_fwd", COMP, "router", ["ln2.out"],
         ["router.probs", "router.map", b.graph("router.graph")],
         b.key("router.fwd", t=tokens, h=h, e=e, k=moe.topk, aux=moe.aux_loss), module="mlp")
    _rows(b, "counts", moe.ep_size * e)
    b.op("fwd", "counts.ag", "moe_token_counts", COMM, "all_gather", ["router.map"], ["counts"],
         cost_key("all_gather", "int64", {"shape": moe.ep_size * e},
                  group_size=moe.ep_size, channel=d.ep_channel),
         group="ep", channel=d.ep_channel)
    _rows(b, "permute.tokens", routed, h)
    _rows(b, "permute.probs", routed)
    b.op("fwd", "permute", "moe_permute", COMP, "permute", ["ln2.out", "router.probs",
                                                           "router.map"],
         ["permute.tokens", "permute.probs", b.aux("permute.rows"), b.graph("permute.graph")],
         b.key("permute.fwd", t=tokens, h=h, e=e, k=moe.topk), module="mlp")
    _rows(b, "dispatch.tokens", recv, h)
    _rows(b, "dispatch.probs", recv)
    _a2a(b, "fwd", "dispatch.a2a", ["permute.tokens", "permute.probs", "counts"],
         ["dispatch.tokens", "dispatch.probs", b.aux("dispatch.splits")], routed)
    _rows(b, "experts.out", recv, h)
    b.op("fwd", "experts", "moe_experts", COMP, "gemm",
         ["dispatch.tokens", "dispatch.probs", "dispatch.splits"],
         ["experts.out", b.graph("experts.graph")],
         b.key("experts.fwd", rows=routed, h=h, f=moe.ffn_hidden_size,
               experts=moe.num_local_experts, act=d.activation_kernel,
               bias=d.add_bias_linear), module="mlp.experts")
    _rows(b, "combine.out", routed, h)
    _a2a(b, "fwd", "combine.a2a", ["experts.out", "dispatch.splits"], ["combine.out"], routed)
    b.tensor("mlp.out", d.local_seq, h)
    b.op("fwd", "unpermute", "moe_unpermute", COMP, "permute",
         ["combine.out", "permute.rows", "router.map"], ["mlp.out", b.graph("unpermute.graph")],
         b.key("unpermute.fwd", t=tokens, h=h, e=e, k=moe.topk), module="mlp")
    b.tensor("y", d.local_seq, h)
    b.op("fwd", "bda2", "bda_fwd", COMP, "elementwise", ["mlp.out", "h1"],
         ["y", b.graph("bda2.graph")],
         b.key("bias_dropout_add.fwd", s=d.local_seq, b=d.micro_batch_size, h=h, bias=False),
         module="mlp_bda", bias_module=None)


def moe_backward(b, norm_backward) -> None:
    """Backward ops of the MoE MLP half from `d.y` to `d.h1`; `norm_backward(b)` emits
    `ln2.bwd` reading `d.ln2.out` and the residual gradient `d.h1.res`."""
    d = b.desc
    moe, tokens, routed, recv = _dims(d)
    h, e, s, bsz = d.hidden_size, moe.num_experts, d.local_seq, d.micro_batch_size
    b.like("d.mlp.out", "mlp.out")
    b.like("d.h1.res", "h1")
    b.op("bwd", "bda2.bwd", "graph_bwd", COMP, "elementwise", ["bda2.graph", "d.y"],
         ["d.mlp.out", "d.h1.res"],
         b.key("bias_dropout_add.bwd", s=s, b=bsz, h=h, bias=False), grads_of=("x", "residual"))
    _rows(b, "d.combine.out", routed, h)
    b.op("bwd", "unpermute.bwd", "graph_bwd", COMP, "permute", ["unpermute.graph", "d.mlp.out"],
         ["d.combine.out"], b.key("unpermute.bwd", t=tokens, h=h, e=e, k=moe.topk),
         grads_of=("x",))
    _rows(b, "d.experts.out", recv, h)
    _a2a(b, "bwd", "combine.a2a_grad", ["d.combine.out", "dispatch.splits"], ["d.experts.out"],
         routed)
    _rows(b, "d.dispatch.tokens", recv, h)
    _rows(b, "d.dispatch.probs", recv)
    b.op("bwd", "experts.bwd", "graph_bwd", COMP, "gemm", ["experts.graph", "d.experts.out"],
         ["d.dispatch.tokens", "d.dispatch.probs"],
         b.key("experts.bwd", rows=routed, h=h, f=moe.ffn_hidden_size,
               experts=moe.num_local_experts, act=d.activation_kernel,
               bias=d.add_bias_linear), grads_of=("x", "probs"))
    _rows(b, "d.permute.tokens", routed, h)
    _rows(b, "d.permute.probs", routed)
    _a2a(b, "bwd", "dispatch.a2a_grad", ["d.dispatch.tokens", "d.dispatch.probs",
                                         "dispatch.splits"],
         ["d.permute.tokens", "d.permute.probs"], routed)
    b.tensor("d.ln2.out.tokens", s, h)
    _rows(b, "d.router.probs", tokens, e)
    b.op("bwd", "permute.bwd", "graph_bwd", COMP, "permute",
         ["permute.graph", "d.permute.tokens", "d.permute.probs"],
         ["d.ln2.out.tokens", "d.router.probs"],
         b.key("permute.bwd", t=tokens, h=h, e=e, k=moe.topk), grads_of=("x", "probs"))
    b.tensor("d.ln2.out.router", s, h)
    b.op("bwd", "router.bwd", "graph_bwd", COMP, "router", ["router.graph", "d.router.probs"],
         ["d.ln2.out.router"], b.key("router.bwd", t=tokens, h=h, e=e, k=moe.topk,
                                     aux=moe.aux_loss), grads_of=("x",))
    b.tensor("d.ln2.out", s, h)
    b.op("bwd", "ln2.grad_sum", "grad_sum", COMP, "elementwise",
         ["d.ln2.out.tokens", "d.ln2.out.router"], ["d.ln2.out"],
         b.key("add", s=s, b=bsz, h=h))
    norm_backward(b)
