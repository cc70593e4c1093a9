"""The step harness (`megatron_patches.step_harness`): runs set up by
`megatron.training.pretrain` and stepped by the caller, several alive in one process.

One launch of 2 gloo ranks builds four runs of scripts/pretrain_gpt.py under the plugin and
keeps them all alive: stock Megatron and `--dhelix` with TP=2 (the SI schedule), then stock
and `--dhelix` with PP=2 (another layout: new process groups; the folded model with the W
schedule), and steps them in turn, so every step runs after another run, of another layout,
has run. Same seed and data: each `--dhelix` run starts from its stock run's parameters and
keeps its losses and parameters (the parity the plugin's own tests hold, bounds of
tests/test_megatron_lm_parity.py), which a run stepped with another run's globals would not
(another layout's groups, another micro-batch calculator or data iterator). Closed while the
rank body still holds them, the runs let their process groups go: each live gloo group keeps
transport threads, counted before, with all four alive and after."""

import pytest

from dhelix.harness import run_on_ranks
from dhelix.parity import max_abs_diff
from tests.step_harness_ranks import four_runs_alive

pytestmark = pytest.mark.slow  # multi-process

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {"stock_tp2": TP2, "dhelix_tp2": TP2 + ["--dhelix"],
           "stock_pp2": PP2, "dhelix_pp2": PP2 + ["--dhelix"]}
STEPS = 3


@pytest.fixture(scope="module")
def launch():
    return run_on_ranks(four_runs_alive, 2, LAYOUTS, STEPS, timeout_s=300,
                        env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def record(launch):
    return [rank["runs"] for rank in launch]


def test_closed_runs_let_their_process_groups_go(launch):
    # the rank body still holds the four closed runs; their gloo groups' threads must end
    # with them (each live group keeps transport threads that wake the cores)
    for rank in launch:
        threads = rank["threads"]
        print(f"threads of a rank: {threads}")
        assert threads["models_dropped"], threads
        assert threads["alive"] >= threads["start"] + 100, threads  # the check can fail
        assert threads["closed"] <= threads["start"] + 30, threads


def test_runs_keep_their_own_layout(record):
    rank0 = record[0]
    assert rank0["stock_tp2"]["layout"][:2] == rank0["dhelix_tp2"]["layout"][:2] == (2, 1)
    assert rank0["stock_pp2"]["layout"][:2] == rank0["dhelix_pp2"]["layout"][:2] == (1, 2)
    assert rank0["dhelix_pp2"]["layout"][3] and not rank0["stock_pp2"]["layout"][3]
    assert rank0["dhelix_tp2"]["dhelix"] and rank0["stock_tp2"]["dhelix"] is None
    assert all(r["iteration"] == STEPS for r in rank0.values())


@pytest.mark.parametrize("stock,dhelix", [("stock_tp2", "dhelix_tp2"),
                                          ("stock_pp2", "dhelix_pp2")])
def test_interleaved_runs_match_stock(record, stock, dhelix):
    # the loss report is on the last pipeline stage (rank 1 with PP=2; both ranks with TP=2)
    losses = [(a, b) for rank in record for a, b in zip(rank[stock]["loss"], rank[dhelix]["loss"])
              if a]
    assert len(losses) >= STEPS
    for a, b in losses:
        assert abs(a["lm loss"] - b["lm loss"]) <= 2e-6
    params = zip(record[0][stock]["params"], record[0][dhelix]["params"])
    diffs = [max_abs_diff(a, b) for a, b in params]
    assert diffs[0][0] == 0.0, diffs[0][1]  # same seed: identical initial weights
    assert max(d for d, _ in diffs) <= 1e-6, diffs
