"""`dhelix profile` end to end on 2 gloo ranks (one launch): the tiny model (Megatron's
arguments) profiled in full within the time budget, a valid profile covering every cost key
of the run's DAGs with finite OEFs and the computation's own time in every computation x
collective pair; an interrupted job resumed without re-measuring; and
the plugin's `--dhelix --dhelix-profile` run of the same model planned from the profile with
parity against stock Megatron, and of another model refused. Plus the single-process
`--comp-only` command line with `--preset tiny`."""

import json
import math
import os
import subprocess
import sys

import pytest

from dhelix.harness import run_on_ranks
from profiler.heatmap import class_table
from profiler.profile_file import load_profile
from tests.megatron_lm_ranks import assert_parity
from tests.profiler.profile_ranks import MEGATRON, profile_resume_and_train
from tests.test_megatron_lm_parity import TOLERANCES

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

FULL_BUDGET_S = 180  # issue #6: a full tiny profile on 2 gloo ranks in under 3 minutes
OPTIONS = ["--warmup", "1", "--repeats", "3"]
STOP_AFTER = 20
STEPS = 2


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("profile")
    results = run_on_ranks(profile_resume_and_train, 2, str(workdir), OPTIONS, STOP_AFTER,
                           STEPS, timeout_s=540, env={"OMP_NUM_THREADS": "1"})
    print(f"full tiny profile on 2 gloo ranks: {results[0]['full_wall_s']:.1f} s "
          f"({len(results[0]['full_pairs'])} pairs)")
    print("plugin run planned from it, per step (loss diff, grad diff, param diff): "
          + ", ".join(f"({r['loss_diff']:.2g}, {r['grad_diff']:.2g}, {r['param_diff']:.2g})"
                      for r in results[0]["plugin"]["rows"]))
    return workdir, results


def _run_dags():
    from dhelix.ops.describe import LayerDescription
    from dhelix.ops.layer_program import build_layer_programs
    from dhelix.topology import NodeTopology
    from megatron_patches.parsed_arguments import parse_megatron_args

    args = parse_megatron_args(MEGATRON, world_size=2)
    return build_layer_programs(
        LayerDescription.from_args(args, topology=NodeTopology(2), rank=0)).dags()


def test_full_profile_is_complete_valid_and_fast(launch):
    from planner.costs import check_profile_covers
    from profiler.profile_file import load_profile, oef

    workdir, results = launch
    first = results[0]
    assert first["full_complete"]
    assert first["full_wall_s"] < FULL_BUDGET_S
    profile = load_profile(workdir / "full" / "profile.json")
    dags = _run_dags()
    check_profile_covers(profile, [dags["fwd"], dags["bwd"]])
    assert profile.pairs and first["skipped_same_channel"] == 1  # all_reduce x all_reduce
    for key, ms in profile.pairs.items():
        names = sorted(key) if isinstance(key, frozenset) else [key[0]] * 2
        assert math.isfinite(oef(profile.solo[names[0]], profile.solo[names[1]], ms))
        kinds = {profile.meta["ops"][name]["kind"] for name in names}
        if kinds == {"comp", "comm"}:  # the computation's own end in the pair, within it
            assert 0 < profile.pair_compute[key] <= ms, (key, profile.pair_compute.get(key))
        else:
            assert key not in profile.pair_compute
    assert profile.meta["parallel"] == "tp2-pp1-nosp" and profile.meta["ranks"] == 2
    assert profile.hardware["backend"] == "gloo"
    assert (workdir / "full" / "profile.png").stat().st_size > 1000
    # every rank reports the same (slowest-rank) numbers
    assert results[1]["full_pairs"] == first["full_pairs"]


def test_interrupted_profile_resumes_without_remeasuring(launch):
    _, results = launch
    r = results[0]
    assert not r["first_complete"] and r["first_measured"] >= 20
    partial = r["partial_pairs"]
    assert len(partial) == r["first_measured"]
    assert r["second_complete"] and not r["partial_left"]
    assert r["second_resumed"] == len(partial)
    assert r["second_measured"] == len(r["full_pairs"]) - len(partial)
    assert set(r["second_pairs"]) == set(r["full_pairs"])
    assert all(r["second_pairs"][name] == ms for name, ms in partial.items())


def test_plugin_plans_from_the_profile_with_parity_and_refuses_another_model(launch):
    """The fingerprints the profiler records are the ones the plugin's `--dhelix-profile`
    check computes at training time: the same model is planned from the profile (every
    co-runnable pair measured) and trains as stock Megatron does; another model is refused
    in one line naming the profile and `dhelix profile`."""
    workdir, results = launch
    plugin = results[0]["plugin"]
    assert "costs from profile" in plugin["plan_source"], plugin["plan_source"]
    assert "0 of" in plugin["plan_source"]  # every co-runnable pair measured
    assert plugin["num_microbatches"] >= 2
    assert_parity(plugin, STEPS, *TOLERANCES["cpu"])
    assert all(r["plugin"]["other_model_exit"] == 2 for r in results)
    error = plugin["other_model_error"]
    assert len(error) == 1 and error[0].startswith("error: "), error
    assert str(workdir / "full" / "profile.json") in error[0]
    assert "measured for another configuration" in error[0] and "ffn256" in error[0], error


def test_comp_only_single_process_command(tmp_path):
    """The single-device command line (as for the GPU Llama-shape profile), on CPU: no
    torchrun, TP=1, computation only; then `--show` prints the class table."""
    out = tmp_path / "comp.json"
    run = subprocess.run(
        [sys.executable, "-m", "dhelix", "profile", "--preset", "tiny", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--comp-only",
         "--repeats", "2", "--warmup", "0", "--max-pairs", "12", "-o", str(out)],
        capture_output=True, text=True, timeout=240,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
             **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    assert run.returncode == 0, run.stderr[-3000:]
    document = json.loads(out.read_text())
    assert len(document["pairs"]) == 12
    assert all(info["kind"] == "comp" for info in document["meta"]["ops"].values())
    # Which 12 pairs are kept depends on the measured solo times (largest gain first), so
    # the class rows do too: the printed table must be the written profile's own table.
    table = class_table(load_profile(out))
    assert "comp-comp" in table and table in run.stdout, (table, run.stdout[-3000:])
    assert "comm" not in table.split("\n\n")[-1]  # the kind-group rows: computation only
    shown = subprocess.run([sys.executable, "-m", "dhelix", "profile", "--show", str(out),
                            "--no-heatmap"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "comp-comp" in shown.stdout, shown.stderr[-2000:]
