"""Symbolic operator programs: structure, channels, cost keys, DAG export and order
checks, and the refusals for unsupported configurations. No process group needed."""

from __future__ import annotations

import json

import pytest
from megatron.training.argument_utils import core_transformer_config_from_args

from dhelix.dag import check_order, load_dag
from dhelix.file_formats import FormatError
from dhelix.ops.describe import LayerDescription, UnsupportedLayerError
from dhelix.ops.layer_program import build_layer_programs
from dhelix.ops.registry import get_kernel, kernel_names
from dhelix.topology import NodeTopology
from megatron_patches.parsed_arguments import parse_megatron_args
from tests.megatron_lm_ranks import TINY

SP_FWD = ["ln1", "qkv.ag", "qkv", "attn", "proj", "proj.rs", "bda1", "ln2", "fc1.ag", "fc1",
          "act", "fc2", "fc2.rs", "bda2"]
SP_BWD = ["bda2.bwd", "fc2.ag_grad", "fc2.dgrad", "fc2.wgrad", "act.bwd", "fc1.ag_in",
          "fc1.dgrad", "fc1.rs_grad", "fc1.wgrad", "ln2.bwd", "bda1.bwd", "proj.ag_grad",
          "proj.dgrad", "proj.wgrad", "attn.bwd", "qkv.ag_in", "qkv.dgrad", "qkv.rs_grad",
          "qkv.wgrad", "ln1.bwd"]


def describe(tp=4, sp=True, ranks_per_node=None, **overrides):
    fields = dict(hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                  num_query_groups=4, kv_channels=8, seq_length=16, micro_batch_size=2,
                  tp_size=tp, sequence_parallel=sp, topology=NodeTopology(ranks_per_node))
    fields.update(overrides)
    return LayerDescription(**fields)


def test_tp_sp_programs_are_the_paper_operator_bases():
    programs = build_layer_programs(describe())
    assert programs.forward.ids == SP_FWD
    assert programs.backward.ids == SP_BWD
    comm = [op.op_class for op in programs.forward.ops if op.kind == "comm"]
    assert comm == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    movable = {op.id for op in programs.backward.ops if op.movable}
    assert movable == {"fc2.wgrad", "fc1.ag_in", "fc1.wgrad", "proj.wgrad", "qkv.ag_in",
                       "qkv.wgrad"}
    assert not any(op.movable for op in programs.forward.ops)


def test_tp_without_sp_uses_all_reduce_and_tp1_has_no_communication():
    no_sp = build_layer_programs(describe(sp=False))
    assert [op.id for op in no_sp.forward.ops if op.kind == "comm"] == ["proj.ar", "fc2.ar"]
    assert [op.id for op in no_sp.backward.ops if op.kind == "comm"] == ["fc1.ar_grad",
                                                                          "qkv.ar_grad"]
    assert all(op.op_class == "all_reduce" for op in no_sp.forward.ops if op.kind == "comm")
    tp1 = build_layer_programs(describe(tp=1, sp=False, num_query_groups=8))
    assert all(op.kind == "comp" for op in (*tp1.forward.ops, *tp1.backward.ops))
    assert (len(tp1.forward), len(tp1.backward)) == (10, 14)


def test_backward_deps_follow_data_flow():
    bwd = build_layer_programs(describe()).backward
    assert bwd["fc1.wgrad"].deps == ("act.bwd", "fc1.ag_in")
    assert bwd["ln2.bwd"].deps == ("fc1.rs_grad", "bda2.bwd")  # norm grad + residual grad
    assert bwd["qkv.ag_in"].deps == ()  # re-gathers a saved forward activation
    fwd = build_layer_programs(describe()).forward
    assert fwd["bda2"].deps == ("fc2.rs", "bda1")


def test_saved_values_and_consumers():
    programs = build_layer_programs(describe())
    assert set(programs.saved) == {"ln1.out", "ln1.graph", "attn.out", "attn.graph",
                                   "bda1.graph", "ln2.out", "ln2.graph", "act.out",
                                   "act.graph", "bda2.graph"}
    assert programs.consumers["ln1.out"] == {"qkv.ag", "qkv.ag_in"}
    assert programs.consumers["act.out"] == {"fc2", "fc2.wgrad"}
    assert programs.values["qkv.in"].shape == (16, 2, 64)      # gathered: full sequence
    assert programs.values["ln1.out"].shape == (4, 2, 64)      # sharded: s / tp
    assert programs.values["qkv.out"].shape == (16, 2, (2 + 2 * 1) * 8)


def test_channels_follow_node_topology(monkeypatch):
    one_node = build_layer_programs(describe(ranks_per_node=8))
    assert {op.channel for op in one_node.forward.ops if op.kind == "comm"} == {"intra"}
    spanning = build_layer_programs(describe(ranks_per_node=2))
    assert {op.channel for op in spanning.forward.ops if op.kind == "comm"} == {"inter"}
    assert {op.channel for op in spanning.forward.ops if op.kind == "comp"} == {"compute"}
    monkeypatch.setenv("DHELIX_RANKS_PER_NODE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert NodeTopology.detect().ranks_per_node == 2
    assert NodeTopology.detect(4).ranks_per_node == 4
    monkeypatch.delenv("DHELIX_RANKS_PER_NODE")
    assert NodeTopology.detect().ranks_per_node == 8
    topo = NodeTopology(2)
    assert topo.channel_for_group([2, 3]) == "intra"
    assert topo.channel_for_group([1, 2]) == "inter"
    monkeypatch.setenv("DHELIX_RANKS_PER_NODE", "zero")
    with pytest.raises(ValueError, match="DHELIX_RANKS_PER_NODE"):
        NodeTopology.detect()


def test_cost_keys_name_kernel_shapes_dtype_and_group():
    programs = build_layer_programs(describe(ranks_per_node=2, dtype="bfloat16"))
    fwd = programs.forward
    assert fwd["qkv"].cost_key == "linear.fwd(m=32,n=32,k=64,bias=1)/bfloat16"
    assert fwd["qkv.ag"].cost_key == "all_gather(shape=16x2x64)/bfloat16/g4/inter"
    assert programs.backward["qkv.wgrad"].cost_key == (
        "linear.wgrad(m=32,n=32,k=64,bias=1)/bfloat16")
    for op in (*fwd.ops, *programs.backward.ops):
        assert "|" not in op.cost_key and op.cost_key.endswith(
            ("/bfloat16", "/inter")), op.cost_key
    # Equal shapes share a key (one profile entry serves every layer and both GEMMs).
    same = build_layer_programs(describe(ranks_per_node=2, dtype="bfloat16"))
    assert same.forward["qkv"].cost_key == fwd["qkv"].cost_key


def test_registry_kinds_match_programs():
    programs = build_layer_programs(describe())
    for op in (*programs.forward.ops, *programs.backward.ops):
        kernel = get_kernel(op.kernel)
        assert kernel.kind == op.kind, op.id
    assert {"linear_fwd", "linear_dgrad", "linear_wgrad", "all_gather", "reduce_scatter",
            "all_reduce", "norm_fwd", "attention_fwd", "activation_fwd", "bda_fwd",
            "graph_bwd"} <= set(kernel_names())
    with pytest.raises(KeyError, match="no kernel named"):
        get_kernel("grouped_gemm")


def test_dag_export_round_trips(tmp_path):
    programs = build_layer_programs(describe(ranks_per_node=2))
    for direction in ("fwd", "bwd"):
        program = programs.program(direction)
        path = tmp_path / f"{direction}.json"
        program.save_dag(path)
        loaded = load_dag(path)
        assert loaded == program.dag()
        assert loaded.to_dict() == program.dag().to_dict()
        document = json.loads(path.read_text())
        assert document["format"] == "dhelix-dag" and document["version"] == 1
        assert {"id", "kind", "channel", "deps", "cost_key", "movable", "op_class"} <= set(
            document["ops"][0])
    document["version"] = 2
    path.write_text(json.dumps(document))
    with pytest.raises(FormatError, match="version"):
        load_dag(path)


def test_orders_breaking_a_dependency_are_rejected():
    bwd = build_layer_programs(describe()).backward
    legal = [op.id for op in bwd.ops if not op.movable] + [op.id for op in bwd.ops if op.movable]
    assert bwd.check_order(legal) == legal
    wgrad_first = ["fc1.wgrad"] + [i for i in bwd.ids if i != "fc1.wgrad"]
    with pytest.raises(ValueError, match="fc1.wgrad.*before its dependency"):
        bwd.check_order(wgrad_first)
    swapped = list(bwd.ids)
    i, j = swapped.index("qkv.ag_in"), swapped.index("qkv.wgrad")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="qkv.wgrad"):
        check_order(bwd.dag(), swapped)
    with pytest.raises(ValueError, match="not a permutation"):
        bwd.check_order(bwd.ids[:-1])


@pytest.mark.parametrize("overrides, message", [
    (dict(num_query_groups=2), "num_query_groups 2"),
    (dict(seq_length=18), "not divisible by tensor-parallel size"),
    (dict(normalization="ScaleNorm"), "normalization"),
    (dict(tp_size=1, tp_ranks=(0,), sequence_parallel=True), "sequence parallelism needs"),
])
def test_unsupported_sizes_raise(overrides, message):
    with pytest.raises(UnsupportedLayerError, match=message):
        describe(**overrides)


@pytest.mark.parametrize("flags, message", [
    (["--hidden-dropout", "0.1"], "dropout 0 only"),
    (["--attention-dropout", "0.1"], "dropout 0 only"),
])
def test_unsupported_configs_raise(flags, message):
    args = parse_megatron_args([*TINY, *flags])
    with pytest.raises(UnsupportedLayerError, match=message):
        LayerDescription.from_args(args)


def test_config_checks_name_moe_and_context_parallelism():
    from dataclasses import replace

    from dhelix.ops.describe import check_supported_config

    config = core_transformer_config_from_args(parse_megatron_args(TINY))
    check_supported_config(config)
    moe = replace(config, num_moe_experts=4, moe_ffn_hidden_size=128)  # allgather dispatcher
    with pytest.raises(UnsupportedLayerError, match="MoE token dispatcher 'allgather'"):
        check_supported_config(moe)
    cp = replace(config, context_parallel_size=2)
    with pytest.raises(UnsupportedLayerError, match="context parallelism"):
        check_supported_config(cp)


def _op(op_id, inputs, outputs, kernel="linear_fwd", **attrs):
    from dhelix.ops.registry import Operator

    return Operator(id=op_id, kernel=kernel, kind="comp", op_class="gemm", channel="compute",
                    inputs=inputs, outputs=outputs, attrs=attrs)


def test_program_validation_refuses_broken_data_flow():
    from dhelix.ops.program import LayerPrograms, Program, ValueInfo

    values = {n: ValueInfo(n, "tensor", (1, 1, 1)) for n in ("x", "a", "b", "y", "d.y", "d.x")}
    with pytest.raises(ValueError, match="no earlier op produces"):
        Program("fwd", [_op("f", ["a"], ["y"])], inputs=["x"], outputs=["y"])
    with pytest.raises(ValueError, match="produced twice"):
        Program("fwd", [_op("f", ["x"], ["a"]), _op("g", ["x"], ["a"])], ["x"], ["a"])
    with pytest.raises(ValueError, match="reads a value twice"):
        Program("fwd", [_op("f", ["x", "x"], ["y"])], ["x"], ["y"])
    with pytest.raises(ValueError, match="never produces"):
        Program("fwd", [_op("f", ["x"], ["a"])], ["x"], ["y"])
    fwd = Program("fwd", [_op("f", ["x"], ["a"]), _op("g", ["a"], ["b"]),
                          _op("h", ["b"], ["y"])], ["x"], ["y"])
    bwd = Program("bwd", [_op("fb", ["d.y", "a"], ["d.x"])], ["d.y", "a"], ["d.x"])
    with pytest.raises(ValueError, match="never read"):
        LayerPrograms(None, Program("fwd", [_op("f", ["x"], ["a"]), _op("g", ["x"], ["y"])],
                                    ["x"], ["y"]),
                      Program("bwd", [_op("fb", ["d.y"], ["d.x"])], ["d.y"], ["d.x"]), values)
    inplace = Program("fwd", [_op("f", ["x"], ["a"]), _op("g", ["a"], ["b"], inplace=True),
                              _op("h", ["b"], ["y"])], ["x"], ["y"])
    with pytest.raises(ValueError, match="in place"):
        LayerPrograms(None, inplace, bwd, values)
    programs = LayerPrograms(None, fwd, bwd, values)
    assert programs.saved == ("a",)
    assert programs.consumers["a"] == {"g", "fb"}


def test_sdpa_attention_has_its_own_cost_keys():
    """`--dhelix-attention sdpa`: the same operators, the attention region's forward and
    backward (its dgrad; core attention has no weights) under SDPA's own cost keys, so a
    profile never serves one attention's time for the other."""
    megatron_args = parse_megatron_args(TINY)
    sdpa_args = parse_megatron_args([*TINY, "--dhelix-attention", "sdpa"])
    megatron = LayerDescription.from_args(megatron_args)
    sdpa = LayerDescription.from_args(sdpa_args)
    assert (megatron.attention, sdpa.attention) == ("megatron", "sdpa")
    assert "sdpa attention" in sdpa.summary()
    a, b = build_layer_programs(megatron), build_layer_programs(sdpa)
    for direction, op_id in (("forward", "attn"), ("backward", "attn.bwd")):
        ours, theirs = getattr(b, direction), getattr(a, direction)
        assert [op.id for op in ours.ops] == [op.id for op in theirs.ops]
        assert ours[op_id].cost_key == theirs[op_id].cost_key.replace("attention.",
                                                                       "sdpa_attention.", 1)
        assert ours[op_id].cost_key.startswith("sdpa_attention."), ours[op_id].cost_key
        others = [op.cost_key for op in ours.ops if op.id != op_id]
        assert others == [op.cost_key for op in theirs.ops if op.id != op_id]
    with pytest.raises(UnsupportedLayerError, match="core attention"):
        describe(attention="flash")
    # a plan made for one attention is not taken for the other (default: unchanged string)
    from dhelix.run_fingerprint import model_fingerprint
    from megatron_patches.run_options import run_from_megatron_args

    plain = model_fingerprint(run_from_megatron_args(megatron_args))
    assert not plain.endswith("-sdpa")
    assert model_fingerprint(run_from_megatron_args(sdpa_args)) == plain + "-sdpa"
