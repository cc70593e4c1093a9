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

from dataclasses import dataclass
from typing import Optional

from dhelix.ops.describe import LayerDescription
from dhelix.ops.linear_program import linear_backward, linear_forward
from dhelix.ops.moe_program import moe_backward, moe_forward
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
           inputs, outputs, key: str, movable: bool = False, channel: Optional[str] = None,
           **attrs) -> None:
        """One operator; a collective's `channel` defaults to the TP group's."""
        if channel is None:
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


@dataclass(frozen=True)
class _Half:
    """One residual half of the layer: norm -> column-parallel linear -> region ->
    row-parallel linear -> bias-dropout-add with the half's input as residual."""

    input: str              # residual stream in ("x" / "h1")
    output: str             # residual stream out ("h1" / "y")
    norm: str               # op id and module path of the norm
    norm_module: str
    col: str                # column-parallel linear: op id, module, output width, own bias
    col_module: str
    col_width: int
    col_bias: bool
    region: str             # the traced region between the linears
    region_kernel: str
    region_class: str
    region_module: str
    region_key: str         # cost-key kernel name; region_dims its dims
    region_dims: dict
    region_width: int
    row: str                # row-parallel linear (bias added by the bda)
    row_module: str
    bda: str
    bda_module: str
    aux_inputs: tuple = ()  # extra region inputs (mask, rotary table)


def _norm_kernel(d: LayerDescription) -> str:
    return {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}[d.normalization]


def _norm_forward(b: _Builder, half: _Half) -> None:
    d = b.desc
    sl, bsz, h = d.local_seq, d.micro_batch_size, d.hidden_size
    b.tensor(f"{half.norm}.out", sl, h)
    b.op("fwd", half.norm, "norm_fwd", COMP, "norm", [half.input],
         [f"{half.norm}.out", b.graph(f"{half.norm}.graph")],
         b.key(f"{_norm_kernel(d)}.fwd", s=sl, b=bsz, h=h), module=half.norm_module)


def _norm_backward(b: _Builder, half: _Half) -> None:
    """The norm's backward: its output gradient and the residual gradient of the half's
    input in, the input gradient out."""
    d = b.desc
    sl, bsz, h = d.local_seq, d.micro_batch_size, d.hidden_size
    b.tensor(f"d.{half.input}", sl, h)
    b.op("bwd", f"{half.norm}.bwd", "graph_bwd", COMP, "norm",
         [f"{half.norm}.graph", f"d.{half.norm}.out", f"d.{half.input}.res"],
         [f"d.{half.input}"], b.key(f"{_norm_kernel(d)}.bwd", s=sl, b=bsz, h=h),
         grads_of=("x",))


def _forward_half(b: _Builder, half: _Half) -> None:
    d = b.desc
    s, sl, bsz, h = d.seq_length, d.local_seq, d.micro_batch_size, d.hidden_size
    _norm_forward(b, half)
    linear_forward(b, half.col, half.col_module, f"{half.norm}.out", half.col_width,
                  column=True, bias_in_gemm=half.col_bias, in_width=h)
    b.tensor(f"{half.region}.out", s, half.region_width)
    b.op("fwd", half.region, half.region_kernel, COMP, half.region_class,
         [f"{half.col}.out", *half.aux_inputs],
         [f"{half.region}.out", b.graph(f"{half.region}.graph")],
         b.key(f"{half.region_key}.fwd", **half.region_dims), module=half.region_module)
    linear_forward(b, half.row, half.row_module, f"{half.region}.out", h, column=False,
                  bias_in_gemm=False, in_width=half.region_width)
    b.tensor(half.output, sl, h)
    b.op("fwd", half.bda, "bda_fwd", COMP, "elementwise", [f"{half.row}.out", half.input],
         [half.output, b.graph(f"{half.bda}.graph")],
         b.key("bias_dropout_add.fwd", s=sl, b=bsz, h=h, bias=d.add_bias_linear),
         module=half.bda_module, bias_module=half.row_module)


def _backward_half(b: _Builder, half: _Half) -> None:
    """Backward of one half, from `d.<output>` to `d.<input>` (the residual gradient
    `d.<input>.res` joins the norm's input gradient inside the norm's backward)."""
    d = b.desc
    s, sl, bsz, h = d.seq_length, d.local_seq, d.micro_batch_size, d.hidden_size
    row_grad, residual_grad = f"d.{half.row}.out", f"d.{half.input}.res"
    b.like(row_grad, f"{half.row}.out")
    b.like(residual_grad, half.input)
    b.op("bwd", f"{half.bda}.bwd", "graph_bwd", COMP, "elementwise",
         [f"{half.bda}.graph", f"d.{half.output}"], [row_grad, residual_grad],
         b.key("bias_dropout_add.bwd", s=sl, b=bsz, h=h, bias=d.add_bias_linear),
         grads_of=("x", "residual"))
    b.tensor(f"d.{half.region}.out", s, half.region_width)
    linear_backward(b, half.row, half.row_module, f"{half.region}.out", row_grad,
                     f"d.{half.region}.out", h, half.region_width, column=False,
                     bias_in_gemm=False)
    b.tensor(f"d.{half.col}.out", s, half.col_width)
    b.op("bwd", f"{half.region}.bwd", "graph_bwd", COMP, half.region_class,
         [f"{half.region}.graph", f"d.{half.region}.out"], [f"d.{half.col}.out"],
         b.key(f"{half.region_key}.bwd", **half.region_dims), grads_of=("x",))
    b.tensor(f"d.{half.norm}.out", sl, h)
    linear_backward(b, half.col, half.col_module, f"{half.norm}.out", f"d.{half.col}.out",
                     f"d.{half.norm}.out", half.col_width, h, column=True,
                     bias_in_gemm=half.col_bias)
    _norm_backward(b, half)


def build_layer_programs(desc: LayerDescription) -> LayerPrograms:
    """The forward and backward programs of the layer `desc` describes."""
    b = _Builder(desc)
    d = desc
    b.tensor("x", d.local_seq, d.hidden_size)
    attention = _Half(
        input="x", output="h1", norm="ln1", norm_module="input_layernorm",
        col="qkv", col_module="self_attention.linear_qkv", col_width=d.qkv_out_per_rank,
        col_bias=d.add_qkv_bias, region="attn", region_kernel="attention_fwd",
        region_class="attention", region_module="self_attention", region_key=d.attention_kernel,
        region_dims=dict(s=d.seq_length, b=d.micro_batch_size, heads=d.heads_per_rank,
                         groups=d.groups_per_rank, d=d.kv_channels, rope=d.rope,
                         causal=d.causal),
        region_width=d.proj_in_per_rank, row="proj", row_module="self_attention.linear_proj",
        bda="bda1", bda_module="self_attn_bda",
        aux_inputs=(b.aux("attention_mask"), b.aux("rotary_pos_emb")),
    )
    mlp = _Half(
        input="h1", output="y", norm="ln2", norm_module="pre_mlp_layernorm",
        col="fc1", col_module="mlp.linear_fc1", col_width=d.fc1_out_per_rank, col_bias=False,
        region="act", region_kernel="activation_fwd", region_class="elementwise",
        region_module="mlp", region_key=d.activation_kernel,
        region_dims=dict(s=d.seq_length, b=d.micro_batch_size, f=d.fc1_out_per_rank,
                         bias=d.add_bias_linear),
        region_width=d.ffn_per_rank, row="fc2", row_module="mlp.linear_fc2",
        bda="bda2", bda_module="mlp_bda",
    )
    _forward_half(b, attention)
    if d.moe is None:
        _forward_half(b, mlp)
    else:
        moe_forward(b, lambda b: _norm_forward(b, mlp))
    b.like("d.y", "y")
    if d.moe is None:
        _backward_half(b, mlp)
    else:
        moe_backward(b, lambda b: _norm_backward(b, mlp))
    _backward_half(b, attention)

    forward = Program("fwd", b.fwd, inputs=("x", "attention_mask", "rotary_pos_emb"),
                      outputs=("y",))
    saved = sorted({v for op in b.bwd for v in op.inputs
                    if v in forward.producers or v in forward.inputs})
    backward = Program("bwd", b.bwd, inputs=("d.y", *saved), outputs=("d.x",))
    return LayerPrograms(desc, forward, backward, b.values)
