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
