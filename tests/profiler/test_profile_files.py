"""Profiles that must not be used, and the profiler's pure parts (no processes): corrupt,
truncated and wrong-version files; profiles of another machine or configuration refused by
`--dhelix` start-up and by `dhelix plan`; partial files of another job refused; candidate
selection, chains, the class table/heatmap and the progress line."""

import io
import json
import subprocess
import sys

import pytest

from dhelix.file_formats import FormatError
from profiler.fingerprint import hardware_differences, hardware_fingerprint
from profiler.profile_file import Profile, load_profile, save_profile
from tests.megatron_lm_ranks import TINY as MEGATRON_TINY

# Megatron's arguments of the tiny model (tests.megatron_lm_ranks.TINY) with TP=2
TINY = [*MEGATRON_TINY, "--tensor-model-parallel-size", "2"]
MODEL = "gpt-h128-ffn512-a4-g4-s64-b2-LayerNorm-learned_absolute-gelu-bias-fp32"


def _programs(extra=()):
    from dhelix.ops.describe import LayerDescription
    from dhelix.ops.layer_program import build_layer_programs
    from dhelix.topology import NodeTopology
    from megatron_patches.parsed_arguments import parse_megatron_args

    args = parse_megatron_args([*TINY, *extra], world_size=2)
    return build_layer_programs(LayerDescription.from_args(args, topology=NodeTopology(2)))


def _profile(hardware=None, meta=None, pairs=True) -> Profile:
    """A profile covering the tiny TP=2 layer, as `dhelix profile` would write it."""
    from profiler.candidates import select_pairs
    from profiler.profile_file import pair_key

    programs = _programs()
    ops = {}
    solo = {}
    for program in (programs.forward, programs.backward):
        for op in program.ops:
            solo[op.cost_key] = 2.0 if op.kind == "comm" else 1.0 + 0.01 * len(solo)
            ops[op.cost_key] = {"class": op.op_class, "kind": op.kind, "channel": op.channel}
    measured = {}
    if pairs:
        for cand in select_pairs(programs.forward, programs.backward, solo).candidates:
            a, b = cand.name.split("|")
            comm = "all_reduce" in cand.name
            measured[pair_key(a, b)] = max(solo[a], solo[b]) + (0.2 if comm else
                                                                 min(solo[a], solo[b]))
    return Profile(hardware=hardware or hardware_fingerprint(2), solo=solo, pairs=measured,
                   meta={"repeats": 3, "warmup": 1, "ranks": 2, "created": "2026-11-22T00:00",
                         "model": MODEL, "parallel": "tp2-pp1-nosp", "ops": ops,
                         **(meta or {})})


def _foreign_hardware():
    other = hardware_fingerprint(2)
    other["device"] = "NVIDIA H100 80GB HBM3"
    other["versions"] = dict(other["versions"], torch="2.11.0+cu128")
    return other


# ------------------------------------------------------------ unreadable files
@pytest.mark.parametrize("content", [
    b'{"format": "dhelix-profile", "version": 1, "solo": {',
    b"",
    b"\x00\xff not json",
])
def test_corrupt_or_truncated_profile(tmp_path, content):
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(FormatError) as err:
        load_profile(path)
    assert "corrupt or truncated JSON" in str(err.value) and str(path) in str(err.value)
    assert "dhelix profile" in str(err.value)


def test_truncated_real_profile_and_wrong_version(tmp_path):
    path = save_profile(_profile(), tmp_path / "p.json")
    text = path.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(FormatError, match="corrupt or truncated JSON.*dhelix profile"):
        load_profile(cut)
    newer = tmp_path / "v2.json"
    newer.write_text(json.dumps(dict(json.loads(text), version=2)))
    with pytest.raises(FormatError, match=r"version 2 is not supported.*dhelix profile"):
        load_profile(newer)


# ----------------------------------------------- foreign fingerprint / configuration
def _plugin_run(argv):
    """The typed run the plugin builds for Megatron's arguments ARGV (world size 2), as
    `--dhelix` start-up gets it."""
    from megatron_patches.parsed_arguments import parse_megatron_args
    from megatron_patches.run_options import run_from_megatron_args

    return run_from_megatron_args(parse_megatron_args(argv, world_size=2))


def _run_args(tmp_path, profile_path, extra=()):
    return _plugin_run([*TINY, "--dhelix", "--dhelix-profile", str(profile_path), *extra])


def test_training_refuses_profile_of_other_hardware(tmp_path):
    from dhelix.runtime.setup import _resolve_plan

    path = save_profile(_profile(hardware=_foreign_hardware()), tmp_path / "foreign.json")
    dags = _programs().dags()
    with pytest.raises(FormatError) as err:
        _resolve_plan(_run_args(tmp_path, path), dags["fwd"], dags["bwd"])
    text = str(err.value)
    assert str(path) in text and "dhelix profile" in text
    assert "device: profile has 'NVIDIA H100 80GB HBM3'" in text and "torch" in text


def test_training_refuses_hand_written_hardware_string(tmp_path):
    from dhelix.runtime.setup import _resolve_plan

    path = save_profile(_profile(hardware="some-gpu"), tmp_path / "hand.json")
    dags = _programs().dags()
    with pytest.raises(FormatError, match=r"not a `dhelix profile` hardware fingerprint"):
        _resolve_plan(_run_args(tmp_path, path), dags["fwd"], dags["bwd"])


def test_training_refuses_profile_of_other_configuration(tmp_path):
    from dhelix.runtime.setup import _resolve_plan

    path = save_profile(_profile(meta={"parallel": "tp2-pp1-sp"}), tmp_path / "sp.json")
    dags = _programs().dags()
    with pytest.raises(FormatError) as err:
        _resolve_plan(_run_args(tmp_path, path), dags["fwd"], dags["bwd"])
    assert "parallel: profile has 'tp2-pp1-sp', this run has 'tp2-pp1-nosp'" in str(err.value)
    assert str(path) in str(err.value) and "dhelix profile" in str(err.value)
    from profiler.fingerprint import check_profile_run

    pp2 = _profile(meta={"parallel": "tp2-pp2-nosp"})  # PP does not change the layer
    check_profile_run(pp2, "pp2.json", MODEL, "tp2-pp1-nosp")


def test_training_accepts_matching_profile_and_counts_estimates(tmp_path):
    from dhelix.runtime.setup import _resolve_plan

    path = save_profile(_profile(), tmp_path / "ok.json")
    dags = _programs().dags()
    plan, source, _ = _resolve_plan(_run_args(tmp_path, path), dags["fwd"], dags["bwd"])
    assert "costs from profile, 0 of 188 pairs estimated" in source
    assert plan.fingerprint["profile_sha"] == load_profile(path).sha


def test_training_refuses_plan_made_from_foreign_profile(tmp_path):
    from dhelix.runtime.setup import _resolve_plan
    from planner.build import make_plan
    from planner.costs import build_cost_model
    from planner.plan import PlanMismatch, save_plan

    dags = _programs().dags()
    costs = build_cost_model(dags["fwd"], dags["bwd"], _profile(hardware=_foreign_hardware()))
    plan = make_plan(dags["fwd"], dags["bwd"], costs, "sequential", model=MODEL,
                     parallel="tp2-pp1-nosp")
    path = save_plan(plan, tmp_path / "plan.json")
    args = _plugin_run([*TINY, "--dhelix", "--dhelix-plan", str(path)])
    with pytest.raises(PlanMismatch, match=r"plan.json: plan was made from a profile of other "
                       r"hardware.*dhelix profile"):
        _resolve_plan(args, dags["fwd"], dags["bwd"])


def _dags_on_disk(tmp_path):
    programs = _programs()
    programs.forward.save_dag(tmp_path / "fwd.json")
    programs.backward.save_dag(tmp_path / "bwd.json")
    return ["--fwd-dag", str(tmp_path / "fwd.json"), "--bwd-dag", str(tmp_path / "bwd.json")]


def test_plan_cli_reports_hardware_and_estimates_and_refuses_other_config(tmp_path, capsys):
    from dhelix.cli import main

    dags = _dags_on_disk(tmp_path)
    profile = _profile(hardware=_foreign_hardware())
    half = Profile(profile.hardware, profile.solo,
                   dict(list(profile.pairs.items())[: len(profile.pairs) // 2]), profile.meta)
    path = save_profile(half, tmp_path / "half.json")
    assert main(["plan", *dags, "--profile", str(path), "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "measured on NVIDIA H100 80GB HBM3" in out
    assert "not this machine's" in out and "refuses this plan" in out
    assert "co-runnable operator pairs:" in out and "estimated (class" in out
    code = main(["plan", *dags, "--profile", str(path), "--parallel", "tp2-pp1-sp",
                 "-o", str(tmp_path / "q.json")])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and "dhelix profile" in err
    assert "parallel: profile has 'tp2-pp1-nosp', this run has 'tp2-pp1-sp'" in err


def test_hardware_differences_name_fields():
    here = hardware_fingerprint(2)
    assert hardware_differences(here, hardware_fingerprint(4)) == []  # node count not compared
    diffs = hardware_differences(_foreign_hardware(), here)
    assert [d.split(":")[0] for d in diffs] == ["device", "versions"]


# -------------------------------------------------------------- partial files
def test_partial_file_of_another_job_is_refused(tmp_path):
    from dhelix.file_formats import write_versioned
    from profiler.session import (PARTIAL_KIND, PARTIAL_VERSION, PartialState,
                                  _resume_decision, partial_path)

    out = tmp_path / "profile.json"
    hardware = hardware_fingerprint(2)
    run = {"model": MODEL, "parallel": "tp2-pp1-nosp", "world_size": 2, "ranks_per_node": 2}
    options = {"warmup": 1, "repeats": 3, "max_pairs": None, "comp_only": False}
    state = PartialState(hardware=hardware, run=run, options=options, solo={"a": 1.0},
                         solo_samples={"a": [1.0, 1.1]}, pairs={}, ops={})
    write_versioned(partial_path(out), PARTIAL_KIND, PARTIAL_VERSION, state.to_document())
    status, loaded = _resume_decision(out, hardware, run, options, overwrite=False)
    assert status == "ok" and loaded.solo == {"a": 1.0}
    assert loaded.solo_samples == {"a": [1.0, 1.1]}
    other_run = dict(run, parallel="tp2-pp1-sp")
    status, message = _resume_decision(out, hardware, other_run, options, overwrite=False)
    assert status == "error"
    assert str(partial_path(out)) in message and "--overwrite" in message
    assert "run.parallel: partial file has 'tp2-pp1-nosp', this job has 'tp2-pp1-sp'" in message
    status, message = _resume_decision(out, _foreign_hardware(), run, options, False)
    assert status == "error" and "device" in message
    status, message = _resume_decision(out, hardware, run, dict(options, repeats=5), False)
    assert status == "error" and "options.repeats" in message
    assert _resume_decision(out, hardware, other_run, options, overwrite=True) == ("ok", None)
    partial_path(out).write_text('{"format": "dhelix-profile-partial", "version": 1, "solo"')
    status, message = _resume_decision(out, hardware, run, options, overwrite=False)
    assert status == "error" and "corrupt or truncated" in message


# ---------------------------------------------------------- pure parts
def test_candidates_skip_same_channel_rank_by_gain_and_cap():
    from profiler.candidates import chains, select_pairs

    programs = _programs()
    solo = _profile(pairs=False).solo
    full = select_pairs(programs.forward, programs.backward, solo)
    assert full.skipped_same_channel == 1 and full.capped == 0
    assert not any(n.count("all_reduce") == 2 for n in (c.name for c in full.candidates))
    gains = [c.gain_ms for c in full.candidates]
    assert gains == sorted(gains, reverse=True)
    assert len({c.name for c in full.candidates}) == len(full.candidates)
    capped = select_pairs(programs.forward, programs.backward, solo, max_pairs=10)
    assert capped.candidates == full.candidates[:10]
    assert capped.capped == len(full.candidates) - 10
    comp = select_pairs(programs.forward, programs.backward, solo, comp_only=True)
    assert all("all_reduce" not in c.name for c in comp.candidates)
    groups = chains(full.candidates)
    assert sorted(c.name for g in groups for c in g) == sorted(c.name for c in full.candidates)
    for group in groups:
        for before, after in zip(group, group[1:]):
            assert before.fwd_pos < after.fwd_pos and before.bwd_pos < after.bwd_pos
    assert chains(full.candidates) == groups  # deterministic (same on every rank)


def test_class_table_and_heatmap(tmp_path):
    from profiler.heatmap import class_table, pair_oefs, render_heatmap

    profile = _profile()
    table = class_table(profile)
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines() if line}
    assert float(rows["comp-comp"][1]) == pytest.approx(0.0, abs=1e-9)
    assert float(rows["comp-comm"][1]) > 0.5
    assert "GEMM x all-reduce" in table
    assert len(pair_oefs(profile)) == len(profile.pairs)
    png = render_heatmap(profile, tmp_path / "h.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_progress_line_and_eta():
    from profiler.progress import Progress

    stream = io.StringIO()
    bar = Progress(total=4, done=1, stream=stream, interval_s=0.0)
    assert "ETA ?" in bar.line()
    bar.advance(note="pairs")
    bar.advance()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("profile [") and "2/4" in lines[0] and "pairs" in lines[0]
    assert "3/4" in lines[1] and "ETA 0:" in lines[1]
    quiet = io.StringIO()
    Progress(total=2, stream=quiet, enabled=False).advance()
    assert quiet.getvalue() == ""


def test_profile_command_errors(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "dhelix", "profile", "--show",
                              str(tmp_path / "none.json")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert "dhelix profile" in missing.stderr


@pytest.mark.parametrize("argv, message", [
    # the preset expands as for `dhelix train`: Megatron's dropout default 0.1 stays
    (["--preset", "tiny"], "dhelix profile: error: dhelix operator programs support dropout 0 "
                           "only"),
    ([*TINY, "--dhelix"], "dhelix profile: error: --dhelix: the profiler measures the layer "
                          "for a --dhelix run, not with one"),
    ([*TINY, "--no-such-argument"], "error: unrecognized arguments: --no-such-argument"),
    (["--preset", "no-such-preset"], "dhelix profile: error: --preset: no preset"),
    # one layer kind per job: a stack of MoE and dense layers is refused (EP=2, TP=1)
    ([*MEGATRON_TINY, "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall",
      "--expert-model-parallel-size", "2", "--moe-layer-freq", "[1,0,1,0]"],
     "dhelix profile: error: --moe-layer-freq: dhelix profile measures one layer kind"),
    # an MoE setting the operators do not implement is named before launching
    ([*MEGATRON_TINY, "--num-experts", "4", "--expert-model-parallel-size", "2"],
     "dhelix profile: error: MoE token dispatcher 'allgather'"),
])
def test_profile_refuses_bad_megatron_arguments_before_launching(argv, message, tmp_path,
                                                                  monkeypatch, capsys):
    """Megatron's parser and validation (under the plugin) and the layer's refusals run
    before any process group or model exists: one `error:` line, exit code 2, no file."""
    import torch.distributed as dist

    from profiler.cli import main

    monkeypatch.setenv("RANK", "0")  # rank 0 of torchrun's world of 2 (TINY has TP=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "p.json"
    assert main([*argv, "-o", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith(message), err
    assert not dist.is_initialized() and not list(tmp_path.iterdir())
