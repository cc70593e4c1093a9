"""`dhelix plan`, `dhelix plan show`, `dhelix plan check` end to end, and the renderers."""

import json

import pytest

from dhelix.cli import main
from dhelix.dag import save_dag
from planner.build import make_plan
from planner.costs import build_cost_model
from planner.plan import load_plan
from planner.render import chrome_trace, plan_table, render_png
from planner.synthetic import layer_dags, layer_profile
from profiler.profile_file import save_profile


@pytest.fixture()
def files(tmp_path):
    fwd, bwd = layer_dags(dp_grad_comm=True)
    save_dag(fwd, tmp_path / "fwd.json")
    save_dag(bwd, tmp_path / "bwd.json")
    save_profile(layer_profile(fwd, bwd), tmp_path / "profile.json")
    return tmp_path


def _build(files, *extra):
    return main(["plan", "--fwd-dag", str(files / "fwd.json"), "--bwd-dag",
                 str(files / "bwd.json"), "--max-orders", "6", "--wgrad-move", "2",
                 *extra, "-o", str(files / "plan.json")])


def test_build_show_check(files, capsys):
    assert _build(files, "--profile", str(files / "profile.json"), "--model", "m1",
                  "--parallel", "tp=8") == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "speedup" in out and "1 x 6 orders" in out
    plan = load_plan(files / "plan.json")
    assert plan.fingerprint["model"] == "m1" and plan.search["bwd_orders"] == 6
    assert plan.command.startswith("dhelix plan --fwd-dag")

    png, trace = files / "t.png", files / "t.json"
    assert main(["plan", "show", str(files / "plan.json"), "--png", str(png),
                 "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "sequential" in out and "speedup" in out and "forward ops" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert json.loads(trace.read_text())["traceEvents"]

    assert main(["plan", "check", str(files / "plan.json"), "--profile",
                 str(files / "profile.json"), "--model", "m1", "--fwd-dag",
                 str(files / "fwd.json"), "--bwd-dag", str(files / "bwd.json")]) == 0
    assert "matches" in capsys.readouterr().out
    assert main(["plan", "check", str(files / "plan.json"), "--model", "m2",
                 "--parallel", "tp=4"]) == 2
    err = capsys.readouterr().err
    assert "model: plan has 'm1', this run has 'm2'" in err
    assert "parallel: plan has 'tp=8', this run has 'tp=4'" in err
    assert "--model m2" in err and "--parallel tp=4" in err


def test_build_without_profile_is_marked_analytic(files, capsys):
    assert _build(files, "--pairer", "round_robin") == 0
    out = capsys.readouterr().out
    assert "analytic default" in out and "'unspecified'" in out
    plan = load_plan(files / "plan.json")
    assert plan.cost_source == "analytic" and plan.estimated and plan.pairer == "round_robin"


def test_cli_errors_are_clear(files, capsys):
    assert main(["plan", "-o", str(files / "x.json")]) == 2
    assert "needs --fwd-dag, --bwd-dag" in capsys.readouterr().err
    (files / "broken.json").write_text("{not json")
    assert main(["plan", "show", str(files / "broken.json")]) == 2
    assert "corrupt or truncated JSON" in capsys.readouterr().err
    # DAGs given the wrong way round
    assert main(["plan", "--fwd-dag", str(files / "bwd.json"), "--bwd-dag",
                 str(files / "fwd.json"), "-o", str(files / "p.json")]) == 2
    assert "is a bwd DAG, expected a fwd DAG" in capsys.readouterr().err
    # a profile made for another layer
    other_f, other_b = layer_dags()
    save_dag(other_f, files / "fwd.json")
    from planner.synthetic import LayerShape
    wide_f, wide_b = layer_dags(LayerShape(hidden=8192))
    save_profile(layer_profile(wide_f, wide_b), files / "wide.json")
    assert _build(files, "--profile", str(files / "wide.json")) == 2
    assert "no solo time for" in capsys.readouterr().err


def test_renderers_show_every_op_and_block(tmp_path):
    fwd, bwd = layer_dags(dp_grad_comm=True)
    costs = build_cost_model(fwd, bwd, layer_profile(fwd, bwd))
    plan = make_plan(fwd, bwd, costs, "dp", 4, 1)
    table = plan_table(plan)
    for number in range(1, len(plan.blocks) + 1):
        assert f"\n{number:>3} " in table
    assert all(op in table for op in plan.fwd_order + plan.bwd_order)
    trace = chrome_trace(plan)
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "block"]
    assert sorted(e["name"] for e in ops) == sorted(plan.fwd_order + plan.bwd_order)
    assert all(e["dur"] >= 0 and "pid" in e and "tid" in e for e in ops)
    blocks = [e for e in trace["traceEvents"] if e.get("cat") == "block"]
    assert len(blocks) == len(plan.blocks)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "cross-node comm / backward strand" in names
    # blocks tile the timeline and every op lies inside its block
    for span in plan.timeline:
        block = plan.blocks[span["block"]]
        assert block.start_ms - 1e-9 <= span["start_ms"] <= span["end_ms"] \
            <= block.start_ms + block.predicted_ms + 1e-9
    assert render_png(plan, tmp_path / "p.png").stat().st_size > 20_000


def test_benchmark_script_runs(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_planner.py"
    spec = importlib.util.spec_from_file_location("bench_planner", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--max-orders", "4", "--wgrad-move", "1", "--repeat", "1",
                       "--write", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "search time: median" in out and "14 fwd x 18 bwd ops" in out
    written = tmp_path / "tp8_sp_intra_node"
    assert load_plan(written / "plan.json").pairer == "dp"
    assert (written / "plan.png").stat().st_size > 20_000


def _saved_with_memory(files):
    """A plan saved as `--dhelix-save-plan` writes one: built within a memory bound from
    per-operator readings (synthetic here: each forward op keeps 2 MiB, each backward op
    frees 1 MiB after 3 MiB of temporaries), with a model and parallel fingerprint."""
    from dhelix.dag import load_dag, topological_sort
    from planner.memory import MIB, OpMemory, make_bound
    from planner.plan import save_plan
    from profiler.profile_file import load_profile

    fwd, bwd = load_dag(files / "fwd.json"), load_dag(files / "bwd.json")
    mem_f = OpMemory({o.id: 2 * MIB for o in fwd.ops}, {o.id: 2 * MIB for o in fwd.ops})
    mem_b = OpMemory({o.id: -MIB for o in bwd.ops}, {o.id: 3 * MIB for o in bwd.ops})
    bound = make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, 4 * MIB)
    costs = build_cost_model(fwd, bwd, load_profile(files / "profile.json"))
    plan = make_plan(fwd, bwd, costs, max_orders=6, wgrad_move=2, model="m1", parallel="tp=8",
                     memory=bound)  # the search `_build` runs
    save_plan(plan, files / "saved.json")
    return plan


def test_replan_within_a_saved_plans_memory_bound(files, capsys):
    """`--memory-from SAVED` plans within the bound SAVED recorded (its readings, the
    run's fingerprints), as the run did; `--memory-margin` trades memory for time."""
    saved = _saved_with_memory(files)
    common = ["--profile", str(files / "profile.json"), "--memory-from",
              str(files / "saved.json")]
    assert _build(files, *common) == 0
    out = capsys.readouterr().out
    same = load_plan(files / "plan.json")
    assert "memory bound: " in out and same.fingerprint["model"] == "m1"
    assert same.fingerprint["parallel"] == "tp=8"
    assert [(b.fwd, b.bwd) for b in same.blocks] == [(b.fwd, b.bwd) for b in saved.blocks]
    assert same.search["memory"]["budget_mib"] == saved.search["memory"]["budget_mib"]
    assert _build(files, *common, "--memory-margin", "0") == 0
    tight = load_plan(files / "plan.json")
    assert tight.search["memory"]["margin_mib"] == 0.0
    assert tight.search["memory"]["plan_peak_mib"] <= tight.search["memory"]["budget_mib"]
    assert "--memory-margin 0" in tight.command
    assert _build(files, *common, "--memory-margin", "1000") == 0
    loose = load_plan(files / "plan.json")
    assert loose.planned_ms <= same.planned_ms <= tight.planned_ms
    capsys.readouterr()


def test_replan_refuses_saved_plans_without_fitting_readings(files, capsys):
    assert _build(files, "--memory-margin", "10") == 2
    assert "--memory-margin needs --memory-from SAVED" in capsys.readouterr().err
    assert _build(files) == 0  # a plan without a memory bound: no readings
    (files / "plan.json").rename(files / "unbounded.json")
    assert _build(files, "--memory-from", str(files / "unbounded.json")) == 2
    assert "holds no per-operator memory readings" in capsys.readouterr().err
    _saved_with_memory(files)
    other_f, other_b = layer_dags()  # another layer's operators
    save_dag(other_f, files / "fwd.json")
    save_dag(other_b, files / "bwd.json")
    assert _build(files, "--memory-from", str(files / "saved.json")) == 2
    assert "memory readings are for other bwd operators" in capsys.readouterr().err
