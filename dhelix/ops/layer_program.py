"""The forward and backward programs of a dense GPT/Llama TransformerLayer.

Built from a `LayerDescription` alone (no model, no process group), so `dhelix ops` and the
planner get the same programs the runtime executes. With TP+SP the forward is 14 operators:

    ln1, qkv.ag, qkv, attn, proj, proj.rs, bda1, ln2, fc1.ag, fc1, act, fc2, fc2.rs, bda2

and the backward 20: each GEMM splits into dgrad and wgrad, the sequence-parallel
all-gathers of the saved (sharded) GEMM inputs are redone for the wgrads (as Megatron does),
output gradients are all-gathered and input gradients reduce-scattered. Without SP the
collectives are all-reduces (forward: after proj and fc2; backward: of the QKV and FC1 input
gradients). With TP=1 there is no communication.

Value names (`[seq, batch, width]` tensors unless noted): `x` layer input, `y` output,
`<op>.out` operator outputs, `<op>.graph` local autograd graphs, `d.<value>` gradients.
"""

from __future__ import annotations

from dhelix.ops.describe import LayerDescription
from dhelix.ops.program import LayerPrograms, Program, ValueInfo
from dhelix.ops.registry import Operator, cost_key

COMP, COMM = "comp", "comm"


class _Builder:
    """Collects the ops and value declarations of both directions."""

    def __init__(self, desc: LayerDescription):
        self.desc = desc
        self.values: dict[str, ValueInfo] = {}
        self.fwd: list[Operator] = []
        self.bwd: list[Operator] = []

    # ------------------------------------------------------------ values
    def tensor(self, name: str, seq: int, width: int) -> str:
        self.values[name] = ValueInfo(name, "tensor", (seq, self.desc.micro_batch_size, width))
        return name

    def graph(self, name: str) -> str:
        self.values[name] = ValueInfo(name, "graph")
        return name

    def aux(self, name: str) -> str:
        self.values[name] = ValueInfo(name, "aux")
        return name

    def like(self, name: str, other: str) -> str:
        self.values[name] = ValueInfo(name, "tensor", self.values[other].shape)
        return name

    # --------------------------------------------------------------- ops
    def op(self, direction: str, op_id: str, kernel: str, kind: str, op_class: str,
           inputs, outputs, key: str, movable: bool = False, **attrs) -> None:
        channel = "compute" if kind == COMP else self.desc.tp_channel
        target = self.fwd if direction == "fwd" else self.bwd
        target.append(Operator(id=op_id, kernel=kernel, kind=kind, op_class=op_class,
                               channel=channel, inputs=tuple(inputs), outputs=tuple(outputs),
                               attrs=attrs, cost_key=key, movable=movable))

    def key(self, name: str, **dims) -> str:
        return cost_key(name, self.desc.dtype, dims)

    def comm_key(self, name: str, shape) -> str:
        return cost_key(name, self.desc.dtype, {"shape": shape},
                        group_size=self.desc.tp_size, channel=self.desc.tp_channel)

    def collective(self, direction: str, op_id: str, kernel: str, src: str, dst: str,
                   seq: int, width: int, movable: bool = False) -> None:
        """A tensor-parallel collective from `src` to a new value `dst` ([seq, b, width])."""
        self.tensor(dst, seq, width)
        full = self.values[src].shape if kernel != "all_gather" else self.values[dst].shape
        self.op(direction, op_id, kernel, COMM, kernel, [src], [dst], self.comm_key(kernel, full),
                movable=movable, group="tp", inplace=kernel == "all_reduce")


def _linear_block(b: _Builder, name: str, module: str, src: str, out_width: int,
                  column: bool, bias_in_gemm: bool, in_width: int) -> None:
    """Forward ops of one tensor-parallel linear, reading `src` and producing `<name>.out`.

    Column-parallel (QKV, FC1): with SP the sharded input is all-gathered first. Row-parallel
    (proj, FC2): the partial output is reduce-scattered (SP) or all-reduced (no SP).
    """
    d = b.desc
    s, sl = d.seq_length, d.local_seq
    gemm_in = src
    if column and d.sequence_parallel:
        gemm_in = f"{name}.in"
        b.collective("fwd", f"{name}.ag", "all_gather", src, gemm_in, s, in_width)
    comm_after = (not column) and d.tp_size > 1
    out = b.tensor(f"{name}.partial" if comm_after else f"{name}.out", s, out_width)
    m, n, k = d.tokens, out_width, in_width
    b.op("fwd", name, "linear_fwd", COMP, "gemm", [gemm_in], [out],
         b.key("linear.fwd", m=m, n=n, k=k, bias=bias_in_gemm), module=module,
         add_bias=bias_in_gemm)
    if comm_after:
        kernel = "reduce_scatter" if d.sequence_parallel else "all_reduce"
        suffix = "rs" if d.sequence_parallel else "ar"
        b.collective("fwd", f"{name}.{suffix}", kernel, out, f"{name}.out", sl, out_width)


def _linear_backward(b: _Builder, name: str, module: str, saved_input: str, grad_out: str,
                     grad_in: str, out_width: int, in_width: int, column: bool,
                     bias_in_gemm: bool) -> None:
    """Backward ops of one linear: output-grad collective (row-parallel with SP), dgrad,
    input-grad collective (column-parallel), and the movable wgrad (with its own
    all-gather of the saved sharded input under SP)."""
    d = b.desc
    s, sl = d.seq_length, d.local_seq
    if not column and d.sequence_parallel:
        gathered = f"d.{name}.partial"
        b.collective("bwd", f"{name}.ag_grad", "all_gather", grad_out, gathered, s, out_width)
        grad_out = gathered
    wgrad_input = saved_input
    if column and d.sequence_parallel:
        wgrad_input = f"{name}.in.bwd"
        b.collective("bwd", f"{name}.ag_in", "all_gather", saved_input, wgrad_input, s, in_width,
                     movable=True)
    m, n, k = d.tokens, out_width, in_width
    column_comm = column and d.tp_size > 1
    dgrad_out = f"d.{name}.in" if column_comm else grad_in
    b.tensor(dgrad_out, s, in_width)
    b.op("bwd", f"{name}.dgrad", "linear_dgrad", COMP, "gemm", [grad_out], [dgrad_out],
         b.key("linear.dgrad", m=m, n=n, k=k), module=module)
    if column_comm:
        kernel = "reduce_scatter" if d.sequence_parallel else "all_reduce"
        suffix = "rs_grad" if d.sequence_parallel else "ar_grad"
        b.collective("bwd", f"{name}.{suffix}", kernel, dgrad_out, grad_in, sl, in_width)
    b.op("bwd", f"{name}.wgrad", "linear_wgrad", COMP, "gemm", [grad_out, wgrad_input], [],
         b.key("linear.wgrad", m=m, n=n, k=k, bias=bias_in_gemm), movable=True,
         module=module, bias_grad=bias_in_gemm)


def build_layer_programs(desc: LayerDescription) -> LayerPrograms:
    """The forward and backward programs of the layer `desc` describes."""
    b = _Builder(desc)
    d = desc
    s, sl, bsz, h = d.seq_length, d.local_seq, d.micro_batch_size, d.hidden_size
    norm = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}[d.normalization]
    act = d.activation_kernel
    bias = d.add_bias_linear
    attn_dims = dict(s=s, b=bsz, heads=d.heads_per_rank, groups=d.groups_per_rank,
                     d=d.kv_channels, rope=d.rope, causal=d.causal)

    # ------------------------------------------------------------ forward
    x = b.tensor("x", sl, h)
    mask, rope = b.aux("attention_mask"), b.aux("rotary_pos_emb")

    b.tensor("ln1.out", sl, h)
    b.op("fwd", "ln1", "norm_fwd", COMP, "norm", [x], ["ln1.out", b.graph("ln1.graph")],
         b.key(f"{norm}.fwd", s=sl, b=bsz, h=h), module="input_layernorm")
    _linear_block(b, "qkv", "self_attention.linear_qkv", "ln1.out",
                              d.qkv_out_per_rank, column=True, bias_in_gemm=d.add_qkv_bias,
                              in_width=h)
    b.tensor("attn.out", s, d.proj_in_per_rank)
    b.op("fwd", "attn", "attention_fwd", COMP, "attention", ["qkv.out", mask, rope],
         ["attn.out", b.graph("attn.graph")], b.key("attention.fwd", **attn_dims),
         module="self_attention")
    _linear_block(b, "proj", "self_attention.linear_proj", "attn.out", h, column=False,
                  bias_in_gemm=False, in_width=d.proj_in_per_rank)
    b.tensor("h1", sl, h)
    b.op("fwd", "bda1", "bda_fwd", COMP, "elementwise", ["proj.out", x],
         ["h1", b.graph("bda1.graph")], b.key("bias_dropout_add.fwd", s=sl, b=bsz, h=h, bias=bias),
         module="self_attn_bda", bias_module="self_attention.linear_proj")

    b.tensor("ln2.out", sl, h)
    b.op("fwd", "ln2", "norm_fwd", COMP, "norm", ["h1"], ["ln2.out", b.graph("ln2.graph")],
         b.key(f"{norm}.fwd", s=sl, b=bsz, h=h), module="pre_mlp_layernorm")
    _linear_block(b, "fc1", "mlp.linear_fc1", "ln2.out", d.fc1_out_per_rank,
                              column=True, bias_in_gemm=False, in_width=h)
    b.tensor("act.out", s, d.ffn_per_rank)
    b.op("fwd", "act", "activation_fwd", COMP, "elementwise", ["fc1.out"],
         ["act.out", b.graph("act.graph")],
         b.key(f"{act}.fwd", s=s, b=bsz, f=d.fc1_out_per_rank, bias=bias), module="mlp")
    _linear_block(b, "fc2", "mlp.linear_fc2", "act.out", h, column=False, bias_in_gemm=False,
                  in_width=d.ffn_per_rank)
    b.tensor("y", sl, h)
    b.op("fwd", "bda2", "bda_fwd", COMP, "elementwise", ["fc2.out", "h1"],
         ["y", b.graph("bda2.graph")], b.key("bias_dropout_add.fwd", s=sl, b=bsz, h=h, bias=bias),
         module="mlp_bda", bias_module="mlp.linear_fc2")

    # ----------------------------------------------------------- backward
    b.like("d.y", "y")
    b.like("d.fc2.out", "fc2.out")
    b.like("d.h1.res", "h1")
    b.op("bwd", "bda2.bwd", "graph_bwd", COMP, "elementwise", ["bda2.graph", "d.y"],
         ["d.fc2.out", "d.h1.res"], b.key("bias_dropout_add.bwd", s=sl, b=bsz, h=h, bias=bias),
         grads_of=("x", "residual"))
    b.tensor("d.act.out", s, d.ffn_per_rank)
    _linear_backward(b, "fc2", "mlp.linear_fc2", "act.out", "d.fc2.out", "d.act.out", h,
                     d.ffn_per_rank, column=False, bias_in_gemm=False)
    b.tensor("d.fc1.out", s, d.fc1_out_per_rank)
    b.op("bwd", "act.bwd", "graph_bwd", COMP, "elementwise", ["act.graph", "d.act.out"],
         ["d.fc1.out"], b.key(f"{act}.bwd", s=s, b=bsz, f=d.fc1_out_per_rank, bias=bias),
         grads_of=("x",))
    b.tensor("d.ln2.out", sl, h)
    _linear_backward(b, "fc1", "mlp.linear_fc1", "ln2.out", "d.fc1.out", "d.ln2.out",
                     d.fc1_out_per_rank, h, column=True, bias_in_gemm=False)
    b.tensor("d.h1", sl, h)
    b.op("bwd", "ln2.bwd", "graph_bwd", COMP, "norm", ["ln2.graph", "d.ln2.out", "d.h1.res"],
         ["d.h1"], b.key(f"{norm}.bwd", s=sl, b=bsz, h=h), grads_of=("x",))

    b.like("d.proj.out", "proj.out")
    b.like("d.x.res", "x")
    b.op("bwd", "bda1.bwd", "graph_bwd", COMP, "elementwise", ["bda1.graph", "d.h1"],
         ["d.proj.out", "d.x.res"], b.key("bias_dropout_add.bwd", s=sl, b=bsz, h=h, bias=bias),
         grads_of=("x", "residual"))
    b.tensor("d.attn.out", s, d.proj_in_per_rank)
    _linear_backward(b, "proj", "self_attention.linear_proj", "attn.out", "d.proj.out",
                     "d.attn.out", h, d.proj_in_per_rank, column=False, bias_in_gemm=False)
    b.tensor("d.qkv.out", s, d.qkv_out_per_rank)
    b.op("bwd", "attn.bwd", "graph_bwd", COMP, "attention", ["attn.graph", "d.attn.out"],
         ["d.qkv.out"], b.key("attention.bwd", **attn_dims), grads_of=("x",))
    b.tensor("d.ln1.out", sl, h)
    _linear_backward(b, "qkv", "self_attention.linear_qkv", "ln1.out", "d.qkv.out", "d.ln1.out",
                     d.qkv_out_per_rank, h, column=True, bias_in_gemm=d.add_qkv_bias)
    b.tensor("d.x", sl, h)
    b.op("bwd", "ln1.bwd", "graph_bwd", COMP, "norm", ["ln1.graph", "d.ln1.out", "d.x.res"],
         ["d.x"], b.key(f"{norm}.bwd", s=sl, b=bsz, h=h), grads_of=("x",))

    forward = Program("fwd", b.fwd, inputs=("x", "attention_mask", "rotary_pos_emb"),
                      outputs=("y",))
    saved = sorted({v for op in b.bwd for v in op.inputs
                    if v in forward.producers or v in forward.inputs})
    backward = Program("bwd", b.bwd, inputs=("d.y", *saved), outputs=("d.x",))
    return LayerPrograms(desc, forward, backward, b.values)
