"""Plan files: round trip, validation, fingerprints; baseline pairers."""

import json

import pytest

from dhelix.file_formats import FormatError
from planner.baselines import round_robin_pairing, sequential_pairing, staggered_pairing
from planner.blocks import pairing_violation
from planner.build import make_plan
from planner.costs import build_cost_model
from planner.plan import (PlanMismatch, check_fingerprint, check_plan_dags, dag_sha,
                          fingerprint_string, load_checked_plan, load_plan,
                          regenerate_command, save_plan)
from planner.synthetic import LayerShape, layer_dags, layer_profile

COMMAND = ("dhelix plan --fwd-dag f.json --bwd-dag b.json --profile p.json --pairer dp "
           "--max-orders 8 --wgrad-move 2 --model gpt-small --parallel tp=8 -o plan.json")


@pytest.fixture(scope="module")
def layer():
    fwd, bwd = layer_dags(dp_grad_comm=True)
    profile = layer_profile(fwd, bwd)
    return fwd, bwd, profile, build_cost_model(fwd, bwd, profile)


@pytest.fixture(scope="module")
def plan(layer):
    fwd, bwd, _, costs = layer
    return make_plan(fwd, bwd, costs, "dp", 8, 2, model="gpt-small", parallel="tp=8",
                     command=COMMAND)


def test_plan_round_trip(tmp_path, plan, layer):
    path = save_plan(plan, tmp_path / "plan.json")
    again = load_plan(path)
    assert again == plan
    document = json.loads(path.read_text())
    assert document["format"] == "dhelix-plan" and document["version"] == 1
    assert set(document["fingerprint"]) == {"model", "parallel", "hardware", "profile_sha",
                                            "dag_sha"}
    assert document["fingerprint"]["profile_sha"] == layer[2].sha
    assert document["predicted"]["speedup"] == pytest.approx(
        document["predicted"]["sequential_ms"] / document["predicted"]["planned_ms"])
    assert [op for b in document["blocks"] for op in b["fwd"]] == document["fwd_order"]
    assert plan.estimated and any(b.estimated for b in plan.blocks)  # pair_fraction < 1
    assert plan.speedup > 1


def _tampered(tmp_path, plan, edit):
    path = save_plan(plan, tmp_path / "plan.json")
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["fwd_order"].reverse(), "do not concatenate"),
    (lambda d: d["bwd_order"].pop(), "not a permutation"),
    (lambda d: d["blocks"].pop(), "do not concatenate"),
    (lambda d: d["predicted"].update(planned_ms=1.0), "planned_ms"),
    (lambda d: d["predicted"].update(speedup=9.0), "speedup"),
    (lambda d: d["fingerprint"].pop("model"), "fingerprint.model"),
    (lambda d: d["blocks"][1].update(start_ms=-1), "start_ms"),
    (lambda d: d["blocks"].append({"fwd": [], "bwd": []}), "empty"),
    (lambda d: d.pop("timeline"), "timeline"),
    (lambda d: d["timeline"].pop(), "every op exactly once"),
    (lambda d: d["timeline"][0].update(block=99), "names no block"),
    (lambda d: d["timeline"][0].update(end_ms=-1.0), "end_ms"),
])
def test_inconsistent_plans_are_rejected(tmp_path, plan, edit, message):
    with pytest.raises(FormatError, match=message) as err:
        load_plan(_tampered(tmp_path, plan, edit))
    assert "plan.json" in str(err.value)
    assert "regenerate it with `dhelix plan --fwd-dag f.json" in str(err.value)


def test_a_plan_pairing_same_channel_comms_is_rejected(tmp_path, plan):
    def pair_two_intra_comms(doc):
        doc["blocks"] = [{"fwd": doc["fwd_order"], "bwd": doc["bwd_order"], "start_ms": 0.0,
                          "predicted_ms": doc["predicted"]["planned_ms"], "estimated": True}]
    with pytest.raises(FormatError, match="same channel|both strands on channel"):
        load_plan(_tampered(tmp_path, plan, pair_two_intra_comms))


def test_corrupt_and_wrong_version_plans(tmp_path, plan):
    path = save_plan(plan, tmp_path / "plan.json")
    path.write_text(path.read_text()[:200])
    with pytest.raises(FormatError, match="corrupt or truncated JSON.*dhelix plan"):
        load_plan(path)
    newer = _tampered(tmp_path, plan, lambda d: d.update(version=2))
    with pytest.raises(FormatError, match="version 2 is not supported"):
        load_plan(newer)


def test_fingerprint_mismatch_names_fields_and_regenerate_command(plan, layer):
    fwd, bwd, profile, _ = layer
    check_fingerprint(plan, {"model": "gpt-small", "parallel": "tp=8",
                             "profile_sha": profile.sha, "dag_sha": dag_sha(fwd, bwd)})
    with pytest.raises(PlanMismatch) as err:
        check_fingerprint(plan, {"model": "gpt-large", "parallel": "tp=8",
                                 "hardware": plan.fingerprint["hardware"]}, "plan.json")
    text = str(err.value)
    assert "model: plan has 'gpt-small', this run has 'gpt-large'" in text
    assert "parallel" not in text.split("regenerate")[0]
    assert "--model gpt-large" in text and "--parallel tp=8" in text
    with pytest.raises(PlanMismatch, match="profile_sha.*this run's operator DAGs and profile"):
        check_fingerprint(plan, {"profile_sha": "0" * 64})
    with pytest.raises(ValueError, match="unknown fingerprint field"):
        check_fingerprint(plan, {"gpu": "x"})


def test_regenerate_command_uses_the_run_s_files(plan):
    """The advice re-plans from the run's DAGs into the run's plan path; a recorded profile
    survives only while model and layout stay (a profile is tied to both)."""
    run_files = {"--fwd-dag": "run/fwd.json", "--bwd-dag": "run/bwd.json", "-o": "run.json"}
    same = regenerate_command(plan, {"model": "gpt-small"}, run_files)
    assert same == ("dhelix plan --fwd-dag run/fwd.json --bwd-dag run/bwd.json --profile "
                    "p.json --pairer dp --max-orders 8 --wgrad-move 2 --model gpt-small "
                    "--parallel tp=8 -o run.json")
    other = regenerate_command(plan, {"model": "gpt-large"}, run_files)
    assert "--profile" not in other and "--model gpt-large" in other
    given = regenerate_command(plan, {"parallel": "tp=2"}, {**run_files, "--profile": "q.json"})
    assert "--profile q.json" in given and "--parallel tp=2" in given
    with pytest.raises(PlanMismatch) as err:
        check_fingerprint(plan, {"model": "gpt-large"}, "run.json", run_files)
    assert other in str(err.value) and "pass this run's" not in str(err.value)
    # Without the run's files the recorded command is kept (only fingerprints change).
    assert regenerate_command(plan, {"model": "gpt-small"}) == COMMAND


def test_load_checked_plan_is_what_a_run_uses(tmp_path, plan, layer):
    fwd, bwd, profile, _ = layer
    path = save_plan(plan, tmp_path / "plan.json")
    expected = {"model": "gpt-small", "parallel": "tp=8", "profile_sha": profile.sha}
    assert load_checked_plan(path, expected, fwd, bwd) == plan
    with pytest.raises(PlanMismatch, match="plan.json: .*parallel: plan has 'tp=8', this run "
                                           "has 'tp=2'"):
        load_checked_plan(path, {**expected, "parallel": "tp=2"})
    with pytest.raises(PlanMismatch, match="bwd DAG"):
        load_checked_plan(path, expected, *layer_dags(dp_grad_comm=False))


def test_plan_checked_against_other_dags(plan, layer):
    fwd, bwd, _, _ = layer
    check_plan_dags(plan, fwd, bwd)
    fwd_other, bwd_other = layer_dags(dp_grad_comm=False)
    with pytest.raises(PlanMismatch, match="bwd DAG: order is not a permutation"):
        check_plan_dags(plan, fwd_other, bwd_other)
    fwd_wide, bwd_wide = layer_dags(LayerShape(hidden=8192), dp_grad_comm=True)
    with pytest.raises(PlanMismatch, match="dag_sha"):
        check_plan_dags(plan, fwd_wide, bwd_wide)


def test_fingerprint_string_is_order_independent():
    assert fingerprint_string({"tp": 2, "pp": 2, "sp": True}) == "pp=2,sp=True,tp=2"
    assert fingerprint_string({"sp": True, "tp": 2, "pp": 2}) == "pp=2,sp=True,tp=2"


def test_baselines(layer):
    fwd, bwd, _, costs = layer
    seq = make_plan(fwd, bwd, costs, "sequential")
    assert seq.planned_ms == pytest.approx(seq.sequential_ms) and len(seq.blocks) == 2
    rr_pairing = round_robin_pairing(fwd, bwd)
    assert pairing_violation(fwd, bwd, rr_pairing) is None
    paired = [b for b in rr_pairing.blocks if b.paired]
    assert paired and all(len(b.fwd) == 1 and len(b.bwd) == 1 for b in paired)
    rr = make_plan(fwd, bwd, costs, "round_robin")
    dp = make_plan(fwd, bwd, costs, "dp", 8, 2)
    assert dp.planned_ms <= rr.planned_ms and dp.planned_ms < seq.planned_ms
    assert pairing_violation(fwd, bwd, sequential_pairing(fwd, bwd)) is None
    with pytest.raises(ValueError, match="unknown pairer"):
        make_plan(fwd, bwd, costs, "greedy")


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_staggered_pairing_overlaps_each_collective_with_the_other_halfs_compute(layer,
                                                                               direction):
    """Domino-style: two strands of the same DAG, the second one unit behind; legal, and
    every block holding a collective pairs it with computation of the other strand only."""
    fwd, bwd = layer[0], layer[1]
    dag = fwd if direction == "fwd" else bwd
    pairing = staggered_pairing(dag, dag)
    assert pairing_violation(dag, dag, pairing) is None
    ops = dag.by_id()
    hidden = 0
    for block in pairing.blocks:
        kinds_a = {ops[i].kind for i in block.fwd}
        kinds_b = {ops[i].kind for i in block.bwd}
        if block.paired and "comm" in kinds_a | kinds_b:
            assert not ("comm" in kinds_a and "comm" in kinds_b)
            hidden += 1
    assert hidden >= sum(op.kind == "comm" for op in dag.ops)  # each half's collectives
