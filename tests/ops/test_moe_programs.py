"""Symbolic MoE operator programs (megatron-core's MoELayer with the alltoall dispatcher):
their operators, the expert-parallel channel, the variable token counts of the all-to-all
outputs as declared shapes, the layer kinds of a `--moe-layer-freq` stack, the refusals,
and the analytic planner on MoE layer pairs. No process group needed (the numerics are
checked through the plugin in tests/test_dhelix_moe.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from megatron.training.argument_utils import core_transformer_config_from_args

from dhelix.ops.describe import LayerDescription, UnsupportedLayerError, check_supported_config
from dhelix.ops.layer_program import build_layer_programs
from dhelix.ops.moe_describe import MoEDescription
from dhelix.ops.program import ValueInfo, VariableDim
from dhelix.topology import NodeTopology
from megatron_patches.parsed_arguments import parse_megatron_args
from tests.megatron_lm_ranks import TINY

MOE_FWD = ["ln2", "router", "counts.ag", "permute", "dispatch.a2a", "experts.sort",
           "experts.fc1", "experts.act", "experts.fc2", "experts.unsort", "combine.a2a",
           "unpermute", "bda2"]
# each local expert's backward chain, the last expert first (2 local experts)
EXPERT_CHAIN = ["experts.fc2.dgrad.{i}", "experts.fc2.wgrad.{i}", "experts.act.bwd.{i}",
                "experts.fc1.dgrad.{i}", "experts.fc1.wgrad.{i}"]
MOE_BWD = ["bda2.bwd", "unpermute.bwd", "combine.a2a_grad", "experts.unsort.bwd",
           *(op.format(i=1) for op in EXPERT_CHAIN), *(op.format(i=0) for op in EXPERT_CHAIN),
           "experts.join", "experts.probs_sum", "experts.sort.bwd", "dispatch.a2a_grad",
           "permute.bwd", "router.bwd", "ln2.grad_sum", "ln2.bwd"]
MOE_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
            "alltoall", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.01"]


def describe_moe(ranks_per_node=None, ep_ranks=(0, 1), **moe):
    fields = dict(num_experts=4, topk=2, ffn_hidden_size=96, ep_ranks=ep_ranks, aux_loss=True)
    fields.update(moe)
    return LayerDescription(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=4, kv_channels=16, seq_length=8,
                            micro_batch_size=2, topology=NodeTopology(ranks_per_node),
                            moe=MoEDescription(**fields))


def test_moe_mlp_operators():
    programs = build_layer_programs(describe_moe())
    assert programs.forward.ids[5:] == MOE_FWD
    assert programs.backward.ids[:len(MOE_BWD)] == MOE_BWD
    # the attention half is the dense layer's
    assert programs.forward.ids[:5] == ["ln1", "qkv", "attn", "proj", "bda1"]
    comm = {op.id: op for op in (*programs.forward.ops, *programs.backward.ops)
            if op.kind == "comm"}
    assert sorted(comm) == ["combine.a2a", "combine.a2a_grad", "counts.ag", "dispatch.a2a",
                            "dispatch.a2a_grad"]
    assert all(op.attrs["group"] == "ep" for op in comm.values())
    assert {op.id for op in comm.values() if op.op_class == "all_to_all"} == {
        "dispatch.a2a", "combine.a2a", "combine.a2a_grad", "dispatch.a2a_grad"}
    # rows go to the experts in the dispatch and in the combine's backward
    assert {op.id for op in comm.values() if op.attrs.get("to_experts")} == {
        "dispatch.a2a", "combine.a2a_grad"}
    fwd = programs.forward
    assert set(fwd["dispatch.a2a"].deps) == {"permute", "counts.ag"}
    assert programs.backward["ln2.grad_sum"].deps == ("permute.bwd", "router.bwd")
    assert fwd["experts.fc1"].cost_key == ("expert_linear.fwd(rows=32,experts=2,n=96,k=64)"
                                           "/float32")
    # between the GEMMs each expert's rows are its own values, one graph per expert
    assert fwd["experts.fc1"].outputs == ("experts.fc1.out.0", "experts.fc1.out.1")
    assert fwd["experts.act"].outputs == ("experts.act.out.0", "experts.act.out.1",
                                          "experts.act.graph.0", "experts.act.graph.1")
    assert fwd["experts.fc2"].outputs == ("experts.fc2.out",)
    assert programs.values["experts.act.out.1"].shape == (VariableDim("recv1", 0, 32), 96)
    bwd = programs.backward
    # each expert GEMM's backward: a dgrad and a movable wgrad (reading the saved input),
    # expert by expert
    assert {op.id for op in bwd.ops if op.movable} == {
        "experts.fc1.wgrad.0", "experts.fc1.wgrad.1", "experts.fc2.wgrad.0",
        "experts.fc2.wgrad.1", "proj.wgrad", "qkv.wgrad"}
    assert bwd["experts.fc1.wgrad.0"].deps == ("experts.act.bwd.0",)
    assert bwd["experts.act.bwd.0"].deps == ("experts.fc2.dgrad.0",)
    assert bwd["experts.fc1.dgrad.1"].attrs["stacked"] == ()
    assert bwd["experts.fc1.wgrad.1"].attrs["stacked"] == ("experts.in",)
    assert bwd["experts.fc2.dgrad.1"].attrs["stacked"] == ("d.experts.fc2.out",)
    assert bwd["experts.fc2.dgrad.0"].cost_key == (
        "expert_linear.dgrad(rows=16,experts=1,n=64,k=96)/float32")
    assert set(bwd["experts.join"].deps) == {"experts.fc1.dgrad.0", "experts.fc1.dgrad.1",
                                             "experts.act.bwd.0", "experts.act.bwd.1"}
    assert "experts.in" in programs.saved and "experts.act.out.0" in programs.saved
    # without biases the probabilities have one gradient: no sum
    no_bias = build_layer_programs(replace(describe_moe(), add_bias_linear=False))
    assert "experts.probs_sum" not in no_bias.backward.ids
    assert len(no_bias.backward) == len(bwd) - 1
    assert fwd["dispatch.a2a"].cost_key == "all_to_all(rows=32,h=64)/float32/g2/intra"


def test_combine_gradient_split_by_local_expert_without_biases():
    """Without expert biases, with two local experts, the combine's backward all-to-all runs
    per local expert, the last first, each delivering its expert's FC2 output gradient rows
    (no unsort backward; the forward's unsort keeps no graph), so the last expert's backward
    depends on its own all-to-all alone."""
    programs = build_layer_programs(replace(describe_moe(), add_bias_linear=False))
    fwd, bwd = programs.forward, programs.backward
    split = ["combine.a2a_grad.1", "combine.a2a_grad.0"]
    assert bwd.ids[:4] == ["bda2.bwd", "unpermute.bwd", *split]
    assert "combine.a2a_grad" not in bwd.ids and "experts.unsort.bwd" not in bwd.ids
    assert fwd["experts.unsort"].outputs == ("experts.out",)
    for i in (0, 1):
        a2a = bwd[f"combine.a2a_grad.{i}"]
        assert (a2a.kernel, a2a.kind, a2a.op_class) == ("moe_expert_all_to_all", "comm",
                                                        "all_to_all")
        assert a2a.attrs["expert"] == i and a2a.attrs["to_experts"]
        assert a2a.deps == ("unpermute.bwd",)
        # one expert's share of this rank's T * k = 32 routed rows
        assert a2a.cost_key == "all_to_all(rows=16,h=64)/float32/g2/intra"
        dgrad = bwd[f"experts.fc2.dgrad.{i}"]
        assert dgrad.deps == (f"combine.a2a_grad.{i}",) and dgrad.attrs["stacked"] == ()
        assert bwd[f"experts.fc2.wgrad.{i}"].attrs["stacked"] == ()
        assert programs.values[f"d.experts.fc2.out.{i}"].shape == (VariableDim(f"recv{i}", 0,
                                                                               32), 64)
    assert "combine.a2a_grad.0" not in _ancestors(bwd, "experts.fc1.wgrad.1")
    assert "combine.a2a_grad.0" in _ancestors(bwd, "experts.join")
    # one local expert, or biased experts: the one all-to-all and the unsort's backward
    for desc in (replace(describe_moe(num_experts=2), add_bias_linear=False), describe_moe()):
        ids = build_layer_programs(desc).backward.ids
        assert "combine.a2a_grad" in ids and "experts.unsort.bwd" in ids


def test_one_expert_exchange_sends_that_expert_of_every_rank():
    """`DispatchSplits.one_expert_exchange`: rank 1 of 2, 2 local experts (global experts 0-3,
    rank 0 holds 0-1, rank 1 holds 2-3), its permuted rows grouped by global expert."""
    import torch

    from megatron_patches.moe_regions import DispatchSplits

    splits = DispatchSplits(input_splits=(5, 9), output_splits=(7, 9), tokens_per_expert=(6, 10),
                            per_local_expert=torch.tensor([[3, 4], [3, 6]]),
                            sent_per_expert=(2, 3, 3, 6))
    # local expert 0: global expert 0 (rows 0-1) to rank 0, global expert 2 (rows 5-7) to
    # rank 1; received: 3 rows from each rank
    assert splits.one_expert_exchange(0) == ([(0, 2), (5, 8)], [2, 3], [3, 3])
    assert splits.one_expert_exchange(1) == ([(2, 5), (8, 14)], [3, 6], [4, 6])


def test_all_to_all_channel_follows_the_expert_parallel_group():
    def channels(**kw):
        programs = build_layer_programs(describe_moe(**kw))
        return {op.channel for op in (*programs.forward.ops, *programs.backward.ops)
                if op.kind == "comm"}

    assert channels(ranks_per_node=2) == {"intra"}
    assert channels(ranks_per_node=1) == {"inter"}  # EP=2 across two nodes
    assert channels(ranks_per_node=2, ep_ranks=(1, 2)) == {"inter"}


def test_received_rows_are_a_declared_variable_dimension():
    programs = build_layer_programs(describe_moe())
    info = programs.values["dispatch.tokens"]
    rows, width = info.shape
    # 16 tokens per rank, each to at most min(topk, local experts) = 2 of my experts, from
    # 2 ranks
    assert isinstance(rows, VariableDim) and (rows.low, rows.high) == (0, 64) and width == 64
    assert info.admits((0, 64)) and info.admits((37, 64)) and info.admits((64, 64))
    assert not info.admits((65, 64))      # more rows than any routing can deliver
    assert not info.admits((37, 63))      # the fixed width still has to match
    assert not info.admits((37,))
    assert programs.values["dispatch.probs"].shape == (rows,)
    assert programs.values["permute.tokens"].shape == (32, 64)   # T * k, fixed
    assert ValueInfo("x", "tensor", (2, 3)).admits((2, 3))
    assert not ValueInfo("x", "tensor", (2, 3)).admits((2, 4))


def test_layer_kinds_of_a_moe_layer_freq_stack():
    args = parse_megatron_args([*TINY, *MOE_ARGS, "--moe-layer-freq", "[1,0,1,0]"],
                               world_size=4)
    kinds = [LayerDescription.from_args(args, layer=i, rank=3).moe for i in range(4)]
    assert [k is not None for k in kinds] == [True, False, True, False]
    assert kinds[0].ep_ranks == (2, 3) and kinds[0].num_local_experts == 2
    dense = build_layer_programs(LayerDescription.from_args(args, layer=1))
    assert "fc1" in dense.forward.ids and "router" not in dense.forward.ids
    with pytest.raises(UnsupportedLayerError, match="outside"):
        LayerDescription.from_args(args, layer=4)


@pytest.mark.parametrize("change, message", [
    (dict(moe_token_dispatcher_type="allgather"), "--moe-token-dispatcher-type alltoall"),
    (dict(moe_grouped_gemm=True), "--moe-grouped-gemm"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "aux_loss or none"),
    (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True),
     "--moe-shared-expert-gate"),
    (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True),
     "--moe-shared-expert-overlap"),
    (dict(moe_expert_capacity_factor=1.0), "token dropping"),
    (dict(moe_z_loss_coeff=1e-3), "z-loss"),
])
def test_unsupported_moe_settings_are_named(change, message):
    config = core_transformer_config_from_args(parse_megatron_args(TINY))
    moe = replace(config, num_moe_experts=4, moe_ffn_hidden_size=128,
                  moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss")
    check_supported_config(moe)  # the supported configuration passes
    with pytest.raises(UnsupportedLayerError, match=message):
        check_supported_config(replace(moe, **change))


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(UnsupportedLayerError, match="--sequence-parallel"):
        replace(describe_moe(), tp_size=2, tp_ranks=(0, 1), num_query_groups=4)


def test_moe_with_tensor_and_sequence_parallelism():
    """TP=2 with SP (expert TP 1): the MoE half works on the rank's sequence shard (s/tp
    tokens, no all-gather around the experts); the router's aux-loss token counts are
    all-reduced over the TP group by their own operator between the router and the
    loss, on the TP channel, while the token exchange stays on the EP channel."""
    desc = replace(describe_moe(ranks_per_node=2, ep_ranks=(0, 2)), tp_size=2,
                   tp_ranks=(0, 1), sequence_parallel=True)
    programs = build_layer_programs(desc)
    fwd, bwd = programs.forward, programs.backward
    moe_fwd = fwd.ids[fwd.ids.index("ln2"):]
    assert moe_fwd[:4] == ["ln2", "router", "aux.counts.ar", "router.aux"]
    assert moe_fwd[4:] == MOE_FWD[2:]
    ar = fwd["aux.counts.ar"]
    assert (ar.kind, ar.op_class, ar.attrs["group"], ar.channel) == ("comm", "all_reduce",
                                                                     "tp", "intra")
    assert fwd["dispatch.a2a"].channel == "inter" and fwd["dispatch.a2a"].attrs["group"] == "ep"
    assert set(fwd["router.aux"].deps) == {"router", "aux.counts.ar"}
    assert set(fwd["permute"].deps) >= {"router.aux"}
    # the router's backward takes the probabilities' gradient through the aux-loss graph
    assert bwd["router.aux.bwd"].deps == ("permute.bwd",)
    assert bwd["router.bwd"].deps == ("router.aux.bwd",)
    # rows of this rank's sequence shard: s/tp * b tokens
    assert programs.values["router.probs"].shape == (4 * 2, 4)
    assert programs.values["permute.tokens"].shape == (4 * 2 * 2, 64)
    # without the aux loss the router is one operator, with no TP communication
    plain = build_layer_programs(replace(desc, moe=replace(desc.moe, aux_loss=False)))
    tp_comm = [op.id for op in (*plain.forward.ops, *plain.backward.ops)
               if op.kind == "comm" and op.attrs["group"] == "tp"]
    assert tp_comm and all(op.startswith(("qkv.", "proj.")) for op in tp_comm), tp_comm
    assert "router.aux" not in plain.forward.ids


def test_analytic_planner_pairs_moe_with_dense_and_moe_layers():
    from planner.build import make_plan
    from planner.costs import build_cost_model

    moe = build_layer_programs(describe_moe())
    dense = build_layer_programs(replace(describe_moe(), moe=None))
    for fwd, bwd in ((moe, moe), (moe, dense), (dense, moe)):
        f, b = fwd.forward.dag(), bwd.backward.dag()
        plan = make_plan(f, b, build_cost_model(f, b, None), pairer="dp")
        assert sorted(plan.fwd_order) == sorted(fwd.forward.ids)
        assert sorted(plan.bwd_order) == sorted(bwd.backward.ids)
        assert plan.speedup >= 1.0


def _ancestors(program, op_id: str) -> set:
    """Every operator `op_id` depends on, directly or through others."""
    found, todo = set(), list(program[op_id].deps)
    while todo:
        dep = todo.pop()
        if dep not in found:
            found.add(dep)
            todo.extend(program[dep].deps)
    return found


def test_shared_expert_gemms_are_independent_of_the_all_to_alls():
    """With a shared expert the MoE program has its FC1 / activation / FC2 (forward) and
    their dgrads and movable wgrads (backward) on the MLP input, and no path in the
    dependency DAG joins them with the token-count exchange or an all-to-all: the planner
    may co-execute them with those collectives."""
    desc = describe_moe(shared_ffn_hidden_size=80)
    programs = build_layer_programs(desc)
    fwd, bwd = programs.forward, programs.backward
    assert fwd.ids[5:] == MOE_FWD[:5] + ["shared.fc1", "shared.act", "shared.fc2"] \
        + MOE_FWD[5:-1] + ["shared.add", "bda2"]
    shared_bwd = ["shared.fc2.dgrad", "shared.fc2.wgrad", "shared.act.bwd", "shared.fc1.dgrad",
                  "shared.fc1.wgrad"]
    assert bwd.ids[:len(MOE_BWD) + 5] == MOE_BWD[:3] + shared_bwd + MOE_BWD[3:]
    assert fwd["shared.fc1"].deps == ("ln2",)
    assert fwd["shared.fc1"].cost_key == "linear.fwd(m=16,n=80,k=64,bias=0)/float32"
    assert fwd["shared.fc1"].attrs["module"] == "mlp.shared_experts.linear_fc1"
    assert set(fwd["shared.add"].deps) == {"unpermute", "shared.fc2"}
    assert set(fwd["bda2"].deps) == {"shared.add", "bda1"}
    assert bwd["shared.fc2.dgrad"].deps == ("bda2.bwd",)
    assert {"shared.fc1.wgrad", "shared.fc2.wgrad"} <= {op.id for op in bwd.ops if op.movable}
    # the MLP input's gradient: permutation, router, then the shared expert's term
    assert bwd["ln2.grad_sum"].deps == ("permute.bwd", "router.bwd", "shared.fc1.dgrad")
    comm = {op.id for program in (fwd, bwd) for op in program.ops if op.kind == "comm"}
    assert comm == {"counts.ag", "dispatch.a2a", "combine.a2a", "combine.a2a_grad",
                    "dispatch.a2a_grad"}
    for program, ids in ((fwd, ["shared.fc1", "shared.act", "shared.fc2"]), (bwd, shared_bwd)):
        for op_id in ids:
            assert not _ancestors(program, op_id) & comm, op_id
            assert not any(op_id in _ancestors(program, c) for c in comm if c in program.ids), \
                op_id
    # the routed path still runs through the all-to-alls (the check above can fail)
    assert "dispatch.a2a" in _ancestors(fwd, "shared.add")
    assert "combine.a2a_grad" in _ancestors(bwd, "ln2.grad_sum")
    # a gated shared FFN doubles FC1's width (SwiGLU)
    gated = build_layer_programs(replace(desc, gated_linear_unit=True, activation="silu"))
    assert gated.forward["shared.fc1"].cost_key.startswith("linear.fwd(m=16,n=160,k=64,")


def test_shared_experts_are_refused_with_tensor_parallelism():
    """The shared-expert operators are TP=1 only (no SP all-gather / reduce-scatter)."""
    from types import SimpleNamespace

    from megatron_patches.moe_support import check_supported_moe

    moe = dict(moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
               moe_shared_expert_intermediate_size=64, expert_tensor_parallel_size=1)
    assert check_supported_moe(SimpleNamespace(**moe, tensor_model_parallel_size=1)) == []
    (problem,) = check_supported_moe(SimpleNamespace(**moe, tensor_model_parallel_size=2,
                                                     sequence_parallel=True))
    assert "shared experts" in problem and "--tensor-model-parallel-size 1 only" in problem
