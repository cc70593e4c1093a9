"""The operators of one tensor-parallel linear layer (Megatron's ColumnParallelLinear /
RowParallelLinear), forward and backward, emitted into a program builder
(`dhelix.ops.layer_program`'s): the GEMM with its sequence-parallel all-gather or its
reduce-scatter / all-reduce, and in the backward the dgrad, the input-gradient collective and
the movable wgrad. Shared by the dense layer's attention and MLP halves and the MoE layer's
shared expert (`dhelix.ops.moe_shared_program`)."""

from __future__ import annotations

COMP = "comp"


def linear_forward(b, name: str, module: str, src: str, out_width: int, column: bool,
                   bias_in_gemm: bool, in_width: int) -> None:
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


def linear_backward(b, name: str, module: str, saved_input: str, grad_out: str,
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
