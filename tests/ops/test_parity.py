"""Operator programs vs Megatron's autograd path on real gloo process groups.

One launch per world size (TP = world size, so DP = 1): every layer variant (LayerNorm /
RMSNorm x learned-absolute / RoPE x MHA / GQA x GeLU / SwiGLU x bias on / off) with SP off
and (TP > 1) on, a stack of two layers each; the backward in program order, with the
movable ops (wgrads) moved to the end, and in a random legal order. Plus Megatron DDP
(main_grad, grad-sync hooks), peak memory on the tiny preset, and value lifetimes.
Run `scripts/ops_report.py` for the same numbers as a table.
"""

from __future__ import annotations

import pytest

from tests.ops import rank_checks as rc

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

# "Equal to fp32 rounding". The kernels reproduce Megatron's operations one for one, so
# the differences measured on CPU are exactly 0; the bound leaves room for a GPU whose
# kernels may pick different reduction orders for identical calls.
TOLERANCE = 1e-5
MEMORY_BOUND = 1.05


_LAUNCHED: dict = {}


def launched(world: int) -> list:
    """Per-rank results of the launch for `world`, run once per test session."""
    if world not in _LAUNCHED:
        _LAUNCHED[world] = rc.launch(world)
    return _LAUNCHED[world]


@pytest.fixture(scope="module", params=sorted(rc.LAUNCHES), ids=lambda w: f"tp{w}")
def results(request):
    return request.param, launched(request.param)


def test_every_variant_matches_megatron(results):
    world, per_rank = results
    rows = [row for rank in per_rank for row in rank["parity"]]
    expected = len(rc.LAUNCHES[world]["variants"]) * len(rc.LAUNCHES[world]["sp_options"]) * world
    assert len(rows) == expected
    for row in rows:
        diffs = {k: v for k, v in row.items() if k.split("_")[0] in ("out", "dx", "grad")}
        assert len(diffs) == 9, row
        bad = {k: v for k, v in diffs.items() if not v <= TOLERANCE}
        assert not bad, f"{row['variant']} tp={row['tp']} sp={row['sp']}: {bad}"


def test_operator_counts(results):
    world, per_rank = results
    for row in per_rank[0]["parity"]:
        if world == 1:
            assert (row["fwd_ops"], row["bwd_ops"]) == (10, 14)
        elif row["sp"]:
            assert (row["fwd_ops"], row["bwd_ops"]) == (14, 20)
        else:
            assert (row["fwd_ops"], row["bwd_ops"]) == (12, 16)


def test_ddp_main_grad_and_hooks(results):
    _, per_rank = results
    for rank in per_rank:
        assert rank["ddp"]
        for row in rank["ddp"]:
            assert row["main_grad"] <= TOLERANCE, row
            assert row["grad_cleared"], row
            assert row["sync_dispatched"], row


def test_peak_memory_within_bound(results):
    _, per_rank = results
    for rank in per_rank:
        for row in rank["memory"]:
            assert row["ratio"] <= MEMORY_BOUND, row
            assert row["megatron_peak"] > 0 and row["programs_peak"] > 0, row


def test_value_lifetimes(results):
    world, per_rank = results
    for rank in per_rank:
        for report in rank["lifetime"]:
            assert report["live_after_forward"] == report["saved"]
            assert report["live_after_backward"] == []
            assert report["released_late"] == []
            assert all(report["pending_after_comm"])
            assert report["refused"] and "before its dependencies" in report["refused"]
            if world > 1:  # the layer has collectives
                assert report["missing_lane"] and "no communication lane" in report["missing_lane"]


def test_unsupported_layers_and_inputs_are_refused():
    messages = launched(1)[0]["refusals"]
    assert "Transformer Engine" in messages["te"]
    assert "TELayerNormColumnParallelLinear" in messages["te"]
    assert "IdentityOp" in messages["fused_norm"]
    assert "expected a megatron-core TransformerLayer" in messages["not_a_layer"]
    assert "plain tensor" in messages["needs_grad_input"]
    assert "has shape" in messages["wrong_shape"]
    assert "without RoPE" in messages["rope_mismatch"]
    assert messages["pre_hooks_fired"] == {name: 1 for name in rc.HOOKED_MODULES}
