"""A realistic synthetic transformer layer for tests, benchmarks and demos: the forward (14 ops)
and backward (18 ops) DAGs of a GPT layer with tensor + sequence parallelism, and a matching
profile whose times follow from FLOPs and bytes on a configurable GPU.

Forward: ln1, ag1 (all-gather), qkv, attn, proj, rs1 (reduce-scatter), bda1, ln2, ag2, fc1,
gelu, fc2, rs2, bda2 - a chain.
Backward (GEMMs split into dgrad and wgrad; wgrads are movable):
ag_g2 (all-gather of the output grad), fc2_dgrad, fc2_wgrad, gelu_bwd, ag_x2 (re-gather of
the LN2 output for fc1's wgrad), fc1_dgrad, rs_g2, fc1_wgrad, ln2_bwd, ag_g1, proj_dgrad,
proj_wgrad, attn_bwd, ag_x1, qkv_dgrad, rs_g1, qkv_wgrad, ln1_bwd.
With `dp_grad_comm` the backward also ends with a cross-node gradient reduce-scatter that
reads every wgrad (data parallelism across nodes), putting work on the third lane.

Nothing here is measured; the numbers only have to be plausible (an H100-class GPU by
default) so the planner has a realistic problem to solve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dhelix.dag import OpDAG, OpNode
from profiler.profile_file import Profile, pair_key

_FWD = [  # id, op_class, comm?
    ("ln1", "norm", False), ("ag1", "all_gather", True), ("qkv", "gemm", False),
    ("attn", "attention", False), ("proj", "gemm", False), ("rs1", "reduce_scatter", True),
    ("bda1", "elementwise", False), ("ln2", "norm", False), ("ag2", "all_gather", True),
    ("fc1", "gemm", False), ("gelu", "elementwise", False), ("fc2", "gemm", False),
    ("rs2", "reduce_scatter", True), ("bda2", "elementwise", False),
]

_BWD = [  # id, op_class, comm?, movable, deps
    ("ag_g2", "all_gather", True, False, ()),
    ("fc2_dgrad", "gemm", False, False, ("ag_g2",)),
    ("fc2_wgrad", "gemm", False, True, ("ag_g2",)),
    ("gelu_bwd", "elementwise", False, False, ("fc2_dgrad",)),
    ("ag_x2", "all_gather", True, False, ()),
    ("fc1_dgrad", "gemm", False, False, ("gelu_bwd",)),
    ("rs_g2", "reduce_scatter", True, False, ("fc1_dgrad",)),
    ("fc1_wgrad", "gemm", False, True, ("gelu_bwd", "ag_x2")),
    ("ln2_bwd", "norm", False, False, ("rs_g2",)),
    ("ag_g1", "all_gather", True, False, ("ln2_bwd",)),
    ("proj_dgrad", "gemm", False, False, ("ag_g1",)),
    ("proj_wgrad", "gemm", False, True, ("ag_g1",)),
    ("attn_bwd", "attention", False, False, ("proj_dgrad",)),
    ("ag_x1", "all_gather", True, False, ()),
    ("qkv_dgrad", "gemm", False, False, ("attn_bwd",)),
    ("rs_g1", "reduce_scatter", True, False, ("qkv_dgrad",)),
    ("qkv_wgrad", "gemm", False, True, ("attn_bwd", "ag_x1")),
    ("ln1_bwd", "norm", False, False, ("rs_g1",)),
]

# Overlap effectiveness of the synthetic hardware by class pair (default 0 for comp-comp).
_CLASS_OEF = {
    ("gemm", "all_gather"): 0.82, ("gemm", "reduce_scatter"): 0.78,
    ("attention", "all_gather"): 0.7, ("attention", "reduce_scatter"): 0.66,
    ("norm", "all_gather"): 0.5, ("norm", "reduce_scatter"): 0.45,
    ("elementwise", "all_gather"): 0.5, ("elementwise", "reduce_scatter"): 0.45,
    ("gemm", "gemm"): -0.05, ("attention", "gemm"): -0.15,
    ("all_gather", "reduce_scatter"): 0.6,  # only ever co-run across channels
}


@dataclass(frozen=True)
class LayerShape:
    """Shapes and machine speeds of the synthetic layer (defaults: a Llama-8B-sized layer,
    TP 8 on an H100 node: ~600 dense TFLOP/s achieved, 150 GB/s effective NVLink bus
    bandwidth per collective, 25 GB/s cross-node, 2.5 TB/s HBM)."""

    seq: int = 8192
    hidden: int = 4096
    ffn: int = 14336
    tp: int = 8
    bytes_per_elem: int = 2
    tflops: float = 600.0
    hbm_gbs: float = 2500.0
    intra_gbs: float = 150.0
    inter_gbs: float = 25.0
    tp_channel: str = "intra"


def _key(op_id: str, op_class: str, shape: LayerShape, channel: str) -> str:
    return (f"{op_class}:{op_id}:s{shape.seq}:h{shape.hidden}:f{shape.ffn}:tp{shape.tp}:"
            f"{channel}:bf16")


def _channel(comm: bool, shape: LayerShape) -> str:
    return shape.tp_channel if comm else "compute"


def layer_dags(shape: LayerShape = LayerShape(), dp_grad_comm: bool = False):
    """(fwd DAG, bwd DAG) of one TP+SP transformer layer; 14 and 18 (+1) operators."""
    fwd_ops, prev = [], ()
    for op_id, op_class, comm in _FWD:
        channel = _channel(comm, shape)
        fwd_ops.append(OpNode(op_id, "comm" if comm else "comp", channel, prev,
                              _key(op_id, op_class, shape, channel), False, op_class))
        prev = (op_id,)
    bwd_ops = []
    for op_id, op_class, comm, movable, deps in _BWD:
        channel = _channel(comm, shape)
        bwd_ops.append(OpNode(op_id, "comm" if comm else "comp", channel, deps,
                              _key(op_id, op_class, shape, channel), movable, op_class))
    if dp_grad_comm:
        wgrads = tuple(op.id for op in bwd_ops if op.movable)
        bwd_ops.append(OpNode("grad_rs", "comm", "inter", wgrads,
                              _key("grad_rs", "reduce_scatter", shape, "inter"), False,
                              "reduce_scatter"))
    return OpDAG("fwd", fwd_ops), OpDAG("bwd", bwd_ops)


def _solo_ms(op: OpNode, shape: LayerShape) -> float:
    s, h, f, tp, e = shape.seq, shape.hidden, shape.ffn, shape.tp, shape.bytes_per_elem
    gemm_flops = {"qkv": 2 * s * h * 3 * h / tp, "proj": 2 * s * h * h / tp,
                  "fc1": 2 * s * h * f / tp, "fc2": 2 * s * f * h / tp}
    base = op.id.split("_")[0]
    if op.op_class == "gemm":
        return gemm_flops[base] / (shape.tflops * 1e9)
    if op.op_class == "attention":
        flops = 2 * s * s * h / tp * (2.5 if op.id.endswith("bwd") else 1.0)  # causal
        return flops / (shape.tflops * 0.7 * 1e9)
    if op.op_class in ("norm", "elementwise"):
        # gelu works on the gathered, TP-sharded [s, f/tp]; norms and bias-dropout-add on
        # the sequence-parallel shard [s/tp, h]
        rows, width = (s, f / tp) if base == "gelu" else (s / tp, h)
        passes = 3 if op.id.endswith("bwd") else 2
        return passes * rows * width * e / (shape.hbm_gbs * 1e6) + 0.01
    if op.kind == "comm":
        gbs = shape.intra_gbs if op.channel == "intra" else shape.inter_gbs
        volume = s * h * e
        if op.id == "grad_rs":
            volume = (4 * h * h + 2 * h * f) / tp * e
        return (tp - 1) / tp * volume / (gbs * 1e6) + 0.015
    raise ValueError(f"no synthetic cost for {op.id} ({op.op_class})")


def layer_profile(fwd: OpDAG, bwd: OpDAG, shape: LayerShape = LayerShape(),
                  pair_fraction: float = 0.6, seed: int = 0) -> Profile:
    """A plausible profile for `layer_dags(shape)`: every solo time, and pair times for
    `pair_fraction` of the cross-strand pairs (the rest are left for the planner to estimate
    from class OEFs). Pair times follow `_CLASS_OEF` with +-5% deterministic jitter."""
    rng = random.Random(seed)
    solo = {}
    for op in list(fwd.ops) + list(bwd.ops):
        solo[op.cost_key] = round(_solo_ms(op, shape), 5)
    pairs = {}
    for a in fwd.ops:
        for b in bwd.ops:
            if rng.random() >= pair_fraction:
                continue
            if a.kind == "comm" and b.kind == "comm" and a.channel == b.channel:
                continue  # never co-run, so never profiled
            classes = tuple(sorted((a.op_class, b.op_class)))
            value = _CLASS_OEF.get(classes, 0.0) * rng.uniform(0.95, 1.05)
            t_a, t_b = solo[a.cost_key], solo[b.cost_key]
            pairs[pair_key(a.cost_key, b.cost_key)] = round(
                t_a + t_b - value * min(t_a, t_b), 5)
    hardware = {"gpu": "synthetic-H100", "tflops": shape.tflops, "intra_gbs": shape.intra_gbs,
                "inter_gbs": shape.inter_gbs}
    meta = {"repeats": 1, "warmup": 0, "ranks": shape.tp, "created": "synthetic"}
    return Profile(hardware=hardware, solo=solo, pairs=pairs, meta=meta)
