"""The MLP half of an MoE TransformerLayer as operators (after the attention half, which is
the dense layer's). Forward, 13 operators:

    ln2, router, counts.ag, permute, dispatch.a2a,
    experts.sort, experts.fc1, experts.act, experts.fc2, experts.unsort,
    combine.a2a, unpermute, bda2

(`counts.ag` exchanges each rank's token count per expert over the expert-parallel group:
the all-to-all split sizes are known only after routing); backward, 12 + 5 x (local
experts) operators with expert biases (or one local expert; one fewer without biases):

    bda2.bwd, unpermute.bwd, combine.a2a_grad, experts.unsort.bwd,
    for each local expert i, the last first:
        experts.fc2.dgrad.<i>, experts.fc2.wgrad.<i>, experts.act.bwd.<i>,
        experts.fc1.dgrad.<i>, experts.fc1.wgrad.<i>,
    experts.join, experts.probs_sum, experts.sort.bwd, dispatch.a2a_grad,
    permute.bwd, router.bwd, ln2.grad_sum, ln2.bwd

and with several local experts and no biases (`split_combine_grad`) 9 + 6 x (local experts):
the combine's gradient all-to-all split by local expert, `combine.a2a_grad.<i>` for each,
the last first, in place of `combine.a2a_grad` and `experts.unsort.bwd` (each delivers its
expert's rows in the experts' order), and no `experts.probs_sum`.

The `experts.*` operators are the rank's local experts (megatron-core's SequentialMLP) taken
apart as the dense MLP is: the received rows sorted by local expert, each expert's FC1 GEMM
on its rows, each expert's own MLP code between the GEMMs (FC1 bias, activation, the
routing probabilities), its FC2 GEMM, then its FC2 bias times the probabilities and the
inverse sort. Between its GEMMs each expert's rows are values of their own, and the
backward runs one expert's chain after the other (each GEMM's backward a dgrad and a
movable wgrad, `expert_linear_*`), as megatron-core's autograd runs SequentialMLP's: an
expert's saved rows and gradients are freed before the next expert's chain starts, so the
layer's backward holds one expert's gradient rows at a time, not every local expert's.
`experts.join` puts the experts' input-row and probability gradients back in row order
(autograd's backward of SequentialMLP's split). The routing probabilities feed the
activation and the FC2 bias, so their gradient is a two-term sum (`experts.probs_sum`). The layer
input of the MLP half (`ln2.out`) feeds two readers, the router and the permutation, so its
gradient is the sum of their two gradients (`ln2.grad_sum`; two terms, so the sum is
bit-identical to autograd's accumulation in either order).

With a shared expert (`--moe-shared-expert-intermediate-size`) the program also has the
shared expert's operators (`dhelix.ops.moe_shared_program`: its FC1, activation and FC2 after
`dispatch.a2a`, `shared.add` after `unpermute`, their backward after `combine.a2a_grad`, its
input gradient a third term of `ln2.grad_sum`), none depending on an all-to-all.

At TP > 1 (sequence parallelism, expert TP 1) with the aux loss, `router` becomes
`router, aux.counts.ar, router.aux` forward and `router.aux.bwd, router.bwd` backward
(`aux_over_tp`): the router's all-reduce of token counts for the loss on the TP lane.
Each TP rank routes its own sequence shard; nothing else changes (the dispatcher's TP
group is the expert-TP group, of size 1).

Token-row values are `[rows, hidden]` (`[rows]` for the routing probabilities): `T` routed
tokens of this rank (s * b), `T*k` rows after the permutation, and a variable number of
rows received from the expert-parallel group (`VariableDim` "recv", bounded by
`MoEDescription.received_high`), of which local expert i gets "recv<i>".
"""

from __future__ import annotations

from dhelix.ops.moe_shared_program import INPUT_GRAD, has_shared_expert, shared_add, \
    shared_backward, shared_forward
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


def _a2a(b, direction: str, op_id: str, inputs, outputs, rows: int,
         kernel: str = "moe_all_to_all", to_experts: bool | None = None, **attrs) -> None:
    """An all-to-all of `rows` token rows (this rank's, on average) over the expert-parallel
    group; `kernel` moe_all_to_all (every local expert's rows) or moe_expert_all_to_all (one
    expert's, `attrs['expert']`). `to_experts` (default: `op_id` is in TO_EXPERTS): the
    rows travel to the experts."""
    d = b.desc
    key = cost_key("all_to_all", d.dtype, {"rows": rows, "h": d.hidden_size},
                   group_size=d.moe.ep_size, channel=d.ep_channel)
    if to_experts is None:
        to_experts = op_id in TO_EXPERTS
    b.op(direction, op_id, kernel, COMM, "all_to_all", inputs, outputs, key,
         group="ep", channel=d.ep_channel, to_experts=to_experts, **attrs)


def split_combine_grad(d) -> bool:
    """Whether the combine's backward all-to-all runs as one all-to-all per local expert
    (`combine.a2a_grad.<i>`, the last expert's first), each delivering its expert's rows of
    the FC2 output gradient directly (no `experts.unsort.bwd`), so that the last expert's
    backward starts while the other experts' rows still travel (the whole all-to-all
    otherwise stands before every expert's backward). With several local experts and no
    expert biases (biased experts' probabilities take a gradient in the unsort's backward,
    which keeps the one all-to-all). The same bytes move; the gradients are the same bits."""
    return d.moe.num_local_experts > 1 and not d.add_bias_linear


def _combine_grad_by_expert(b, routed: int) -> None:
    """`combine.a2a_grad.<i>` for each local expert i, the last first (`split_combine_grad`):
    the FC2 output gradient rows of expert i (`d.experts.fc2.out.<i>`) from the permuted
    rows' gradient of every rank."""
    d = b.desc
    for i in reversed(range(d.moe.num_local_experts)):
        _rows(b, f"d.experts.fc2.out.{i}", _expert_dim(d, i), d.hidden_size)
        _a2a(b, "bwd", f"combine.a2a_grad.{i}", ["d.combine.out", "dispatch.splits"],
             [f"d.experts.fc2.out.{i}"], routed // d.moe.num_local_experts,
             kernel="moe_expert_all_to_all", to_experts=True, expert=i)


def _expert_key(b, name: str, **dims) -> str:
    d = b.desc
    return b.key(name, rows=d.tokens_local * d.moe.topk, experts=d.moe.num_local_experts,
                 **dims)


def _expert_dim(d, expert: int) -> VariableDim:
    """Rows one local expert receives: at most every token of every rank of the group."""
    return VariableDim(f"recv{expert}", 0, d.moe.ep_size * d.tokens_local)


def _one_expert_key(b, name: str, **dims) -> str:
    """Cost key of an operator on one local expert's rows (its share of the routed rows)."""
    d = b.desc
    rows = d.tokens_local * d.moe.topk // d.moe.num_local_experts
    return b.key(name, rows=rows, experts=1, **dims)


def _experts_forward(b, recv) -> None:
    """The local experts on the received rows: sort by expert, FC1 GEMMs, activation with
    the probabilities, FC2 GEMMs, FC2 bias with the probabilities and the inverse sort.
    Between the GEMMs each expert's rows are a value of their own (`experts.fc1.out.<i>`,
    `experts.act.out.<i>`, one activation graph each), as in megatron-core's SequentialMLP,
    so the backward frees them expert by expert."""
    d = b.desc
    h, f = d.hidden_size, d.moe.ffn_hidden_size
    f1 = 2 * f if d.gated_linear_unit else f
    experts = range(d.moe.num_local_experts)
    _rows(b, "experts.in", recv, h)
    _rows(b, "experts.probs", recv)
    b.op("fwd", "experts.sort", "moe_sort", COMP, "permute",
         ["dispatch.tokens", "dispatch.probs", "dispatch.splits"],
         ["experts.in", "experts.probs", b.graph("experts.sort.graph")],
         _expert_key(b, "expert_sort.fwd", h=h), module="mlp")
    fc1_out = [_rows(b, f"experts.fc1.out.{i}", _expert_dim(d, i), f1) for i in experts]
    b.op("fwd", "experts.fc1", "expert_linear_fwd", COMP, "gemm",
         ["experts.in", "dispatch.splits"], fc1_out,
         _expert_key(b, "expert_linear.fwd", n=f1, k=h), linear="linear_fc1")
    act_out = [_rows(b, f"experts.act.out.{i}", _expert_dim(d, i), f) for i in experts]
    graphs = [b.graph(f"experts.act.graph.{i}") for i in experts]
    b.op("fwd", "experts.act", "expert_activation", COMP, "elementwise",
         [*fc1_out, "experts.probs", "dispatch.splits"], [*act_out, *graphs],
         _expert_key(b, f"expert_{d.activation_kernel}.fwd", f=f1, bias=d.add_bias_linear))
    _rows(b, "experts.fc2.out", recv, h)
    b.op("fwd", "experts.fc2", "expert_linear_fwd", COMP, "gemm",
         [*act_out, "dispatch.splits"], ["experts.fc2.out"],
         _expert_key(b, "expert_linear.fwd", n=h, k=f), linear="linear_fc2")
    _rows(b, "experts.out", recv, h)
    probs = ["experts.probs"] if d.add_bias_linear else []
    graph = [] if split_combine_grad(d) else [b.graph("experts.unsort.graph")]
    b.op("fwd", "experts.unsort", "moe_unsort", COMP, "permute",
         ["experts.fc2.out", *probs, "dispatch.splits"], ["experts.out", *graph],
         _expert_key(b, "expert_unsort.fwd", h=h, bias=d.add_bias_linear), module="mlp")


def _expert_gemm_backward(b, expert: int, gemm: str, grad: str, saved_input: str,
                          grad_input: str, n: int, k: int, stacked: str | None) -> None:
    """Expert `expert`'s dgrad and movable wgrad of its `gemm` (fc1 / fc2: n output, k input
    features) from the output gradient `grad`. `stacked` (kept as `attrs['stacked']`) is the
    input that holds every local expert's rows (the kernels take this expert's); the others
    are the expert's own (None: both are)."""
    _rows(b, grad_input, _expert_dim(b.desc, expert), k)
    b.op("bwd", f"experts.{gemm}.dgrad.{expert}", "expert_linear_dgrad", COMP, "gemm",
         [grad, "dispatch.splits"], [grad_input],
         _one_expert_key(b, "expert_linear.dgrad", n=n, k=k), linear=f"linear_{gemm}",
         expert=expert, stacked=(grad,) if grad == stacked else ())
    b.op("bwd", f"experts.{gemm}.wgrad.{expert}", "expert_linear_wgrad", COMP, "gemm",
         [grad, saved_input, "dispatch.splits"], [],
         _one_expert_key(b, "expert_linear.wgrad", n=n, k=k), movable=True,
         linear=f"linear_{gemm}", expert=expert, stacked=(stacked,) if stacked else ())


def _experts_backward(b, recv) -> None:
    """Backward of `_experts_forward`, one local expert's chain after the other (the last
    expert first, as megatron-core's autograd runs SequentialMLP's): its FC2 dgrad and
    movable wgrad, its activation's graph, its FC1 dgrad and movable wgrad; then its input
    rows' and probabilities' gradients joined in row order (`experts.join`) and, when the
    experts have biases, the probabilities' two gradients (activation, FC2 bias) summed.
    The FC2 output gradient comes from the combine's all-to-all through the unsort's
    backward, or, split by expert (`split_combine_grad`), as each expert's own rows."""
    d = b.desc
    h, f = d.hidden_size, d.moe.ffn_hidden_size
    f1 = 2 * f if d.gated_linear_unit else f
    bias = d.add_bias_linear
    experts = range(d.moe.num_local_experts)
    split = split_combine_grad(d)
    if not split:
        _rows(b, "d.experts.fc2.out", recv, h)
        probs_grads = ["d.experts.probs.bias"] if bias else []
        for name in probs_grads:
            _rows(b, name, recv)
        b.op("bwd", "experts.unsort.bwd", "graph_bwd", COMP, "permute",
             ["experts.unsort.graph", "d.experts.out"], ["d.experts.fc2.out", *probs_grads],
             _expert_key(b, "expert_unsort.bwd", h=h, bias=bias),
             grads_of=("x", "probs") if bias else ("x",))
    act_probs = "d.experts.probs.act" if bias else "d.experts.probs"
    for i in reversed(experts):
        dim = _expert_dim(d, i)
        _rows(b, f"d.experts.act.out.{i}", dim, f)
        fc2_grad = f"d.experts.fc2.out.{i}" if split else "d.experts.fc2.out"
        _expert_gemm_backward(b, i, "fc2", fc2_grad, f"experts.act.out.{i}",
                              f"d.experts.act.out.{i}", n=h, k=f,
                              stacked=None if split else fc2_grad)
        _rows(b, f"d.experts.fc1.out.{i}", dim, f1)
        _rows(b, f"{act_probs}.{i}", dim)
        b.op("bwd", f"experts.act.bwd.{i}", "graph_bwd", COMP, "elementwise",
             [f"experts.act.graph.{i}", f"d.experts.act.out.{i}"],
             [f"d.experts.fc1.out.{i}", f"{act_probs}.{i}"],
             _one_expert_key(b, f"expert_{d.activation_kernel}.bwd", f=f1, bias=bias),
             grads_of=("x", "probs"))
        _expert_gemm_backward(b, i, "fc1", f"d.experts.fc1.out.{i}", "experts.in",
                              f"d.experts.in.{i}", n=f1, k=h, stacked="experts.in")
    _rows(b, "d.experts.in", recv, h)
    _rows(b, act_probs, recv)
    b.op("bwd", "experts.join", "expert_rows_join", COMP, "permute",
         [*(f"d.experts.in.{i}" for i in experts), *(f"{act_probs}.{i}" for i in experts)],
         ["d.experts.in", act_probs], _expert_key(b, "expert_join.bwd", h=h))
    if bias:
        _rows(b, "d.experts.probs", recv)
        b.op("bwd", "experts.probs_sum", "grad_sum", COMP, "elementwise",
             ["d.experts.probs.act", "d.experts.probs.bias"], ["d.experts.probs"],
             _expert_key(b, "add"))
    _rows(b, "d.dispatch.tokens", recv, h)
    _rows(b, "d.dispatch.probs", recv)
    b.op("bwd", "experts.sort.bwd", "graph_bwd", COMP, "permute",
         ["experts.sort.graph", "d.experts.in", "d.experts.probs"],
         ["d.dispatch.tokens", "d.dispatch.probs"], _expert_key(b, "expert_sort.bwd", h=h),
         grads_of=("x", "probs"))


def aux_over_tp(d) -> bool:
    """True when the router's auxiliary load-balancing loss needs the token counts of the
    whole tensor-parallel group (TP > 1: each rank routes its sequence-parallel shard, and
    Megatron's router all-reduces the counts per expert over its TP x CP group before it
    computes the loss): the router is then three operators, `router`, `aux.counts.ar`
    and `router.aux`, so that all-reduce runs on the strand's TP lane."""
    return d.tp_size > 1 and d.moe.aux_loss


def _router_with_aux_over_tp(b, tokens: int) -> None:
    """The router as gating and top-k (`router`: the probabilities without the auxiliary
    loss, the routing map, the aux-loss scores and this rank's token counts per expert),
    the asynchronous all-reduce of those counts over the TP group (`aux.counts.ar`), and
    the auxiliary loss computed from the reduced counts and attached to the probabilities
    (`router.aux`), as Megatron's `TopKRouter._apply_aux_loss` does in one call."""
    d = b.desc
    moe, h, e = d.moe, d.hidden_size, d.moe.num_experts
    _rows(b, "router.probs.raw", tokens, e)
    _rows(b, "router.aux.counts", e)
    b.op("fwd", "router", "router_fwd", COMP, "router", ["ln2.out"],
         ["router.probs.raw", "router.map", b.aux("router.scores"), "router.aux.counts",
          b.graph("router.graph")],
         b.key("router.fwd", t=tokens, h=h, e=e, k=moe.topk, aux=moe.aux_loss), module="mlp",
         defer_aux=True)
    _rows(b, "router.aux.counts.sum", e)
    b.op("fwd", "aux.counts.ar", "all_reduce", COMM, "all_reduce", ["router.aux.counts"],
         ["router.aux.counts.sum"],
         cost_key("all_reduce", "int64", {"shape": e}, group_size=d.tp_size,
                  channel=d.tp_channel), group="tp", inplace=True)
    b.op("fwd", "router.aux", "router_aux_fwd", COMP, "router",
         ["router.probs.raw", "router.scores", "router.aux.counts.sum"],
         ["router.probs", b.graph("router.aux.graph")],
         b.key("router_aux.fwd", t=tokens, e=e, k=moe.topk), module="mlp")


def moe_forward(b, norm) -> None:
    """Forward ops of the MoE MLP half from `h1` to `y`; `norm(b)` emits `ln2`."""
    d = b.desc
    moe, tokens, routed, recv = _dims(d)
    h, e = d.hidden_size, moe.num_experts
    norm(b)
    b.aux("router.map")
    _rows(b, "router.probs", tokens, e)
    if aux_over_tp(d):
        _router_with_aux_over_tp(b, tokens)
    else:
        b.op("fwd", "router", "router_fwd", COMP, "router", ["ln2.out"],
             ["router.probs", "router.map", b.graph("router.graph")],
             b.key("router.fwd", t=tokens, h=h, e=e, k=moe.topk, aux=moe.aux_loss),
             module="mlp")
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
    shared = has_shared_expert(d)
    if shared:  # the shared expert's GEMMs next to the dispatch they do not depend on
        shared_forward(b)
    _experts_forward(b, recv)
    _rows(b, "combine.out", routed, h)
    _a2a(b, "fwd", "combine.a2a", ["experts.out", "dispatch.splits"], ["combine.out"], routed)
    routed_out = b.tensor("unpermute.out" if shared else "mlp.out", d.local_seq, h)
    b.op("fwd", "unpermute", "moe_unpermute", COMP, "permute",
         ["combine.out", "permute.rows", "router.map"], [routed_out, b.graph("unpermute.graph")],
         b.key("unpermute.fwd", t=tokens, h=h, e=e, k=moe.topk), module="mlp")
    if shared:
        shared_add(b, routed_out, b.tensor("mlp.out", d.local_seq, h))
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
    if split_combine_grad(d):
        _combine_grad_by_expert(b, routed)
    else:
        _rows(b, "d.experts.out", recv, h)
        _a2a(b, "bwd", "combine.a2a_grad", ["d.combine.out", "dispatch.splits"],
             ["d.experts.out"], routed)
    shared = has_shared_expert(d)
    if shared:  # the shared expert's backward next to the all-to-all it does not depend on
        shared_backward(b, "d.mlp.out")
    _experts_backward(b, recv)
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
    router_grads = ["d.router.probs"]
    if aux_over_tp(d):
        _rows(b, "d.router.probs.raw", tokens, e)
        _rows(b, "d.router.scores", tokens, e)
        b.op("bwd", "router.aux.bwd", "graph_bwd", COMP, "router",
             ["router.aux.graph", "d.router.probs"], ["d.router.probs.raw", "d.router.scores"],
             b.key("router_aux.bwd", t=tokens, e=e, k=moe.topk), grads_of=("probs", "scores"))
        router_grads = ["d.router.probs.raw", "d.router.scores"]
    b.tensor("d.ln2.out.router", s, h)
    b.op("bwd", "router.bwd", "graph_bwd", COMP, "router", ["router.graph", *router_grads],
         ["d.ln2.out.router"], b.key("router.bwd", t=tokens, h=h, e=e, k=moe.topk,
                                     aux=moe.aux_loss), grads_of=("x",))
    b.tensor("d.ln2.out", s, h)
    b.op("bwd", "ln2.grad_sum", "grad_sum", COMP, "elementwise",
         ["d.ln2.out.tokens", "d.ln2.out.router", *([INPUT_GRAD] if shared else [])],
         ["d.ln2.out"],
         b.key("add", s=s, b=bsz, h=h))
    norm_backward(b)
