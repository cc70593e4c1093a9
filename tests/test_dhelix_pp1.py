"""`--dhelix` without pipelining keeps Megatron's training semantics: with plans from every
pairer (sequential, Wavelet-style round robin, the DP), TP=2 and TP=4, SP on and off, and a
Llama-style layer, losses and every gradient equal Megatron's no-pipelining schedule from
the same weights and data, step after step. The Domino-style intra-batch split
(`--dhelix-pairer domino`, a benchmark baseline) is held to the same parity. Every run is
`scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` under the plugin (the step
harness, `tests/plugin_parity_ranks.py`) and stepped by Megatron's `train_step`; one launch
per world size."""

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dhelix.harness import free_port, run_on_ranks
from tests.engine_checks import assert_ran_on_the_engine
from tests.megatron_lm_ranks import SCRIPT, TINY
from tests.plugin_parity_ranks import ParityCase, pp1_parity

FP32_LOSS = 1e-6
FP32_GRAD = 2e-7
FP32_PARAM = 2e-7   # SGD lr 0.05: param diffs are lr x grad diffs
FP32_EVAL = 1e-6    # |eval loss diff| of one forward-only global batch

TP2 = ("--tensor-model-parallel-size", "2")
TP4 = ("--tensor-model-parallel-size", "4")
SP = ("--sequence-parallel",)
ROPE = ("--position-embedding-type", "rope")
LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear")


def dhelix(pairer: str, *extra: str) -> tuple:
    return ("--dhelix", "--dhelix-pairer", pairer, *extra)


# streamed SI blocks, unbounded: setup streams only where the sequence is predicted faster
# than the block plan, and with the memory bound the two come within a few percent at these
# shapes, on either side as the measured memory moves between runs; without it the analytic
# costs decide alone (tests/test_dhelix_moe.py checks the choice itself). By default (no
# flag) where predicted faster; `--dhelix-streamed` also with a plan file or above the bound.
STREAMED = ("--dhelix-no-memory-bound",)
FORCED_STREAMED = ("--dhelix-streamed", "--dhelix-no-memory-bound")
# the block plan (a seam is injected into it: `plugin_parity_ranks.plan_with_a_seam`)
BLOCKS = ("--dhelix-no-streamed",)

CASES_TP2 = {
    "tp2_sequential": ParityCase(TP2, dhelix("sequential")),
    "tp2_round_robin": ParityCase(TP2, dhelix("round_robin")),
    "tp2_dp": ParityCase(TP2, dhelix("dp")),
    "tp2_dp_seam": ParityCase(TP2, dhelix("dp", *BLOCKS), seam=True),
    "tp2_sp_llama_dp_seam": ParityCase(TP2 + SP + LLAMA, dhelix("dp", *BLOCKS), seam=True),
    "tp2_sp_llama_dp": ParityCase(TP2 + SP + LLAMA, dhelix("dp")),
    "tp2_sp_llama_dp_streamed": ParityCase(TP2 + SP + LLAMA, dhelix("dp", *STREAMED)),
    # without SP and with RoPE: the embedding's all-reduce travels asynchronously
    "tp2_llama_dp": ParityCase(TP2 + LLAMA, dhelix("dp")),
    # ... made by the streamed sequence's first entry (autograd on, as for a block's)
    "tp2_llama_dp_streamed": ParityCase(TP2 + LLAMA, dhelix("dp", *FORCED_STREAMED)),
    "tp2_llama_dp_no_embedding_overlap": ParityCase(
        TP2 + LLAMA, dhelix("dp", "--dhelix-no-embedding-overlap")),
    # the tiny model: micro-batch 2 -> halves of 1
    "tp2_domino": ParityCase(TP2, dhelix("domino")),
    "tp2_sp_domino": ParityCase(TP2 + SP, dhelix("domino")),
}
CASES_TP4 = {
    "tp4_sp_dp": ParityCase(TP4 + SP, dhelix("dp")),
    # RoPE (no position embedding): the embedding's all-reduce on 4 ranks deferred too
    "tp4_round_robin": ParityCase(TP4 + ROPE, dhelix("round_robin")),
    "tp4_sp_dp_seam": ParityCase(TP4 + SP, dhelix("dp", *BLOCKS), seam=True),
    "tp4_sp_dp_streamed": ParityCase(TP4 + SP, dhelix("dp", *FORCED_STREAMED)),
}


def make_plan_file(directory: Path, megatron_args: list) -> Path:
    """The documented user flow: `dhelix ops --export-dag` prints the `dhelix plan` command
    for the run; run it. Returns the plan path."""
    ops = subprocess.run([sys.executable, "-m", "dhelix", "ops", *megatron_args,
                          "--export-dag", str(directory)], capture_output=True, text=True,
                         check=True, cwd=directory.parent, timeout=120)
    command = ops.stdout.strip().splitlines()[-1].split("  [")[0].strip()
    words = shlex.split(command)
    assert words[:2] == ["dhelix", "plan"], ops.stdout
    words[words.index("-o") + 1] = str(directory / "plan.json")
    subprocess.run([sys.executable, "-m", "dhelix", *words[1:]], check=True, timeout=120,
                   cwd=directory.parent, capture_output=True)
    return directory / "plan.json"


ADVICE_TEST = "test_advice_for_a_plan_of_another_model_makes_an_accepted_plan"


@pytest.fixture(scope="module")
def advice(request, tmp_path_factory):
    """`_advice_flow` (what `ADVICE_TEST` checks) started in a thread when the first test
    that asks for it starts, if `ADVICE_TEST` is selected (else None): its future. The TP=2
    plan file's fixture asks first: the flow is a chain of single-process commands (dhelix
    ops, dhelix plan, one-rank training), so it runs on the core that chain of the TP=2 plan
    leaves free, and beside the module's launches, instead of after them."""
    if not any(item.name == ADVICE_TEST for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(_advice_flow, tmp_path_factory.mktemp("advice"))


@pytest.fixture(scope="module")
def plan_file_tp2(tmp_path_factory, advice):
    # (`advice` is asked for only to start it beside this fixture's commands)
    return make_plan_file(tmp_path_factory.mktemp("plan") / "dags",
                          [*TINY, *TP2, "--optimizer", "sgd", "--train-iters", "1"])


def _launch(world, cases, refusals=None):
    report = run_on_ranks(pp1_parity, world, cases, refusals=refusals, timeout_s=480,
                          env={"OMP_NUM_THREADS": "1"})[0]
    for name, entry in report.items():
        for i, row in enumerate(entry.get("rows", ())):
            print(f"{name} ({entry['blocks']} blocks, m={entry['num_microbatches']}) step {i}: "
                  f"loss diff {row['loss_diff']:.2e} grad diff {row['grad_diff']:.2e} "
                  f"param diff {row['param_diff']:.2e}")
    return report


@pytest.fixture(scope="module")
def tp2(plan_file_tp2):
    """The TP=2 matrix, the same run from a plan file (`--dhelix-plan`), and that plan
    given to a TP=2 + SP run (refused), in one launch."""
    cases = dict(CASES_TP2)
    cases["tp2_plan_file"] = ParityCase(TP2, dhelix("dp", "--dhelix-plan", str(plan_file_tp2)))
    refusals = {"tp2_sp_with_the_tp2_plan":
                [*TP2, *SP, *dhelix("dp", "--dhelix-plan", str(plan_file_tp2))]}
    return _launch(2, cases, refusals)


@pytest.fixture(scope="module")
def tp4():
    return _launch(4, CASES_TP4)


def _check(entry):
    assert entry["num_microbatches"] >= 2  # there were SI blocks to run
    assert len(entry["rows"]) == 2
    for row in entry["rows"]:
        assert row["loss_diff"] < FP32_LOSS, row
        assert row["grad_diff"] < FP32_GRAD, row
        assert row["param_diff"] < FP32_PARAM, row
    assert entry["eval_loss_diff"] < FP32_EVAL  # evaluation on the forward-only list


@pytest.mark.slow  # reads the module's 4-rank parity launch (the tp2 fixture)
@pytest.mark.parametrize("name,kind,passes", [
    ("tp2_dp", "si", "OperatorPasses"),
    ("tp2_round_robin", "si", "OperatorPasses"),           # the Wavelet-style pairing
    ("tp2_domino", "sequential", "IntraBatchPasses"),      # the Domino-style pairing
    ("tp2_sp_domino", "sequential", "IntraBatchPasses"),
])
def test_pp1_pairings_run_on_the_one_engine(tp2, name, kind, passes):
    """PP=1 `--dhelix` (the DP plan and the Wavelet-style round robin: the one-stage SI
    list, m-1 SI blocks) and the Domino-style split (Megatron's no-pipelining list) all ran
    through the schedule engine's executor, as observed while they ran; so did evaluation
    (the forward-only list). The PP>1 runs are held to the same check in
    tests/test_dhelix_pipeline.py."""
    executed = tp2[name]["executed"]
    assert_ran_on_the_engine(executed, kind, passes, path="linear")
    m = tp2[name]["num_microbatches"]
    expected_si = m - 1 if kind == "si" else 0
    assert all(rank["si_blocks"] == expected_si for rank in executed["train"])


@pytest.mark.slow  # reads the module's parity launches (the tp2 and tp4 fixtures)
def test_si_blocks_ran_streamed_where_the_plan_line_says(tp2, tp4):
    """Every SI block of every training step ran as one streamed sequence
    (`LayerRunner._run_streamed`) exactly where the plan line says so: by default where the
    dp plan is built at start-up and the streamed sequence is predicted faster than its
    blocks (always at these shapes without the memory bound, whose analytic costs alone
    decide; with it, the two come within a few percent either way), and with
    `--dhelix-streamed`; never with `--dhelix-no-streamed`, a plan file or another pairer."""
    trained = {name: entry for name, entry in {**tp2, **tp4}.items() if "rows" in entry}
    for name, entry in trained.items():
        expected = (len(entry["rows"]) * (entry["num_microbatches"] - 1)
                    if "SI blocks run streamed" in entry["describe"] else 0)
        assert entry["streamed_si_blocks"] == expected, (name, entry["describe"])
    streamed = {name for name, entry in trained.items() if entry["streamed_si_blocks"]}
    forced = {"tp2_sp_llama_dp_streamed", "tp4_sp_dp_streamed", "tp2_llama_dp_streamed"}
    assert forced <= streamed
    considered = {"tp2_dp", "tp2_sp_llama_dp", "tp4_sp_dp", "tp2_llama_dp",  # the default's
                  "tp2_llama_dp_no_embedding_overlap"}                    # own choice
    assert streamed <= considered | forced, streamed
    for name in considered:  # weighed, whichever way it went
        assert "streamed SI blocks" in trained[name]["describe"], name
    for name in streamed:
        assert not trained[name]["seam"], name


@pytest.mark.slow  # reads the module's parity launches (the tp2 and tp4 fixtures)
def test_embedding_all_reduce_travels_where_that_is_exact(tp2, tp4):
    """The embedding's TP all-reduce ran asynchronously (`megatron_patches.deferred_reduce`,
    each micro-batch's waited on once) exactly where it can be without changing a bit -
    without SP and without a position embedding - and only for the pairers that co-execute
    strands: the sequential baseline keeps it blocking, as `--dhelix-no-embedding-overlap`
    does. The parity rows above hold for those same runs."""
    def deferred(name):
        entry = {**tp2, **tp4}[name]
        return entry["deferred_reduces"], len(entry["rows"]) * entry["num_microbatches"]

    for name in ("tp2_llama_dp", "tp2_llama_dp_streamed", "tp4_round_robin"):  # RoPE, no SP
        counts, n = deferred(name)
        assert counts == {"embedding": n}, (name, counts)
    for name in ("tp2_dp", "tp2_round_robin",  # a learned position embedding
                 "tp2_sequential", "tp2_llama_dp_no_embedding_overlap", "tp2_sp_llama_dp",
                 "tp4_sp_dp"):
        assert deferred(name)[0] == {}, name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES_TP2) + ["tp2_plan_file"])
def test_dhelix_matches_megatron_tp2(tp2, name):
    _check(tp2[name])


@pytest.mark.slow
def test_layer_pairs_meet_at_seams_only_where_the_plan_has_one(tp2, tp4):
    """The parity rows above include plans whose layer pairs overlap at a seam (TP=2,
    TP=2+SP with Llama layers, TP=4+SP); the tiny model's own plans have none."""
    trained = {name: entry for name, entry in {**tp2, **tp4}.items() if "rows" in entry}
    assert set(trained) == {*CASES_TP2, *CASES_TP4, "tp2_plan_file"}
    seamed = {name for name, entry in trained.items() if entry["seam"]}
    assert seamed == {"tp2_dp_seam", "tp2_sp_llama_dp_seam", "tp4_sp_dp_seam"}
    for name in seamed:  # the log line says so
        assert "layer pairs overlap at a seam (the first 1 and last 2 blocks)" in \
            trained[name]["describe"]


@pytest.mark.slow
def test_plan_file_is_used(tp2, plan_file_tp2):
    assert tp2["tp2_plan_file"]["plan_source"] == f"file {plan_file_tp2}"


@pytest.mark.slow
def test_plan_for_another_layout_is_rejected(tp2):
    """A plan made for TP=2 without SP, given to a TP=2 SP run: the plugin refuses it (exit
    code 2) with one error line that names the differing fingerprint fields and the command
    that regenerates the plan."""
    refused = tp2["tp2_sp_with_the_tp2_plan"]
    assert refused["code"] == 2, refused
    errors = [line for line in refused["stderr"] if line.startswith("error: ")]
    assert len(errors) == 1, refused["stderr"][-20:]
    assert "parallel: plan has 'tp2-pp1-nosp', this run has 'tp2-pp1-sp'" in errors[0]
    assert "dhelix plan" in errors[0]


def _train_one_rank(cwd: Path, megatron_args: list) -> subprocess.CompletedProcess:
    """`python -m dhelix.megatron_lm scripts/pretrain_gpt.py ARGS` as torchrun starts a
    world of one rank. This runs in the background beside other tests' ranks, so the free
    port it picked can be taken before its store binds it (EADDRINUSE, seen once in a
    clean-clone CI run): then it runs again on a new port, up to three times."""
    for _ in range(3):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env.pop("DHELIX_ERROR_FILE", None)  # the error line goes to stderr
        done = subprocess.run(
            [sys.executable, "-m", "dhelix.megatron_lm", SCRIPT, *megatron_args], cwd=cwd,
            env=env, capture_output=True, text=True, timeout=180)
        if "EADDRINUSE" not in done.stderr:
            break
    return done


def _advice_flow(directory: Path) -> dict:
    """The commands `ADVICE_TEST` checks, in order, run in `directory`: the plan for model A
    (`make_plan_file`), model B trained with it ("refused"), the `dhelix plan` command its
    error printed ("advice": every such command; "words": the one, split) run literally
    ("regenerated"), then the same training command again ("accepted"). Stops where a step
    leaves nothing to run next (the test's assertions say why)."""
    plan = make_plan_file(directory / "dags_a", [*TINY, "--train-iters", "1"])
    train_b = [*TINY, "--hidden-size", "256", "--train-iters", "1", "--dhelix",
               "--dhelix-plan", str(plan)]
    flow = {"plan": plan, "refused": _train_one_rank(directory, train_b)}
    flow["advice"] = re.findall(r"regenerate it with `([^`]*)`", flow["refused"].stderr)
    if len(flow["advice"]) != 1:
        return flow
    flow["words"] = shlex.split(flow["advice"][0])
    if flow["words"][:2] != ["dhelix", "plan"]:
        return flow
    flow["regenerated"] = subprocess.run([sys.executable, "-m", "dhelix", *flow["words"][1:]],
                                         cwd=directory, capture_output=True, text=True,
                                         timeout=120)
    if flow["regenerated"].returncode == 0:
        flow["accepted"] = _train_one_rank(directory, train_b)
    return flow


@pytest.mark.slow
def test_advice_for_a_plan_of_another_model_makes_an_accepted_plan(advice):
    """Plan for model A (hidden 128), train model B (hidden 256) with it: refused, with a
    `dhelix plan` command. Run that command literally, then the same training command: the
    new plan is accepted and used (the advice must not reuse A's operator DAGs). The
    commands ran in the background (`advice`); the checks are in their order."""
    flow = advice.result()
    plan, refused = flow["plan"], flow["refused"]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert len(flow["advice"]) == 1, refused.stderr[-3000:]
    assert "model: plan has 'gpt-h128" in refused.stderr
    words = flow["words"]
    assert words[:2] == ["dhelix", "plan"]
    assert str(plan.parent / "fwd.json") not in words  # not model A's DAGs
    regenerated = flow["regenerated"]
    assert regenerated.returncode == 0, regenerated.stderr[-3000:]
    accepted = flow["accepted"]
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert f"dhelix: SI schedule, plan file {plan}" in accepted.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES_TP4))
def test_dhelix_matches_megatron_tp4(tp4, name):
    _check(tp4[name])


@pytest.mark.slow
def test_plans_differ_between_pairers(tp2):
    """The pairers really produced different plans (so parity covers several)."""
    blocks = {tp2[n]["blocks"] for n in ("tp2_sequential", "tp2_round_robin", "tp2_dp")}
    assert len(blocks) == 3
