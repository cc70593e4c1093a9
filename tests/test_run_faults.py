"""What a training job does when something goes wrong, on the real launcher (torchrun, gloo
ranks): a NaN loss stops it without touching the last checkpoint, a rank killed during or
after a save leaves no process behind (and the resumed run removes the unfinished save), a
stalled rank ends the job within the process-group timeout with the rank named."""

import re
import signal
import sys
import time

import pytest

from dhelix.checkpoint_integrity import find_damage
from dhelix.checkpointing import TRACKER, iteration_dir
from tests.launched_job import LaunchedJob

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
              pytest.mark.slow]  # multi-process: not in the fast tier

TINY = ["--preset", "tiny"]


def test_nan_stops_before_saving_and_keeps_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # Adam at lr 1e30 turns the weights into inf after one step: the loss is NaN at step 2.
    args = TINY + ["--lr", "1e30", "--train-iters", "8", "--save", str(ckpt),
                   "--save-interval", "1"]
    with LaunchedJob(2, args, tmp_path) as job:
        assert job.wait(120) != 0
        errors = job.error_lines()
    assert len(errors) == 1, job.stderr()
    match = re.match(r"error: iteration (\d+): lm loss is nan and grad norm is nan; training "
                     r"stopped before saving it; the last good checkpoint, (\S+), is untouched",
                     errors[0])
    assert match, errors
    bad = int(match.group(1))
    assert bad >= 2
    assert match.group(2) == str(iteration_dir(ckpt, bad - 1))
    assert (ckpt / TRACKER).read_text().strip() == str(bad - 1)
    assert not iteration_dir(ckpt, bad).exists()
    assert not list(ckpt.glob("*.tmp"))
    assert find_damage(iteration_dir(ckpt, bad - 1)) is None  # intact, every byte


@pytest.mark.parametrize("when,rank", [("during", 1), ("after", 0)])
def test_kill_9_of_a_rank_around_a_save_leaves_no_process(tmp_path, when, rank):
    """Before the in-process checkpoint writer, the killed rank's Manager and resource
    tracker (spawned by megatron-core's save) were still alive under init 30 s later."""
    ckpt = tmp_path / "ckpt"
    args = TINY + ["--train-iters", "1000", "--save", str(ckpt), "--save-interval", "2"]
    with LaunchedJob(2, args, tmp_path) as job:
        if when == "during":
            unfinished = ckpt / "iter_0000004.tmp"
            job.wait_for(unfinished.exists, 120, f"{unfinished.name}")
        else:
            job.wait_for(lambda: (ckpt / TRACKER).exists()
                         and (ckpt / TRACKER).read_text().strip() == "4", 120, "save of 4")
        job.signal_rank(rank, signal.SIGKILL)
        assert job.wait(60) != 0
        left = job.leftovers(within_s=5)
        assert left == [], left
    if when == "during":
        assert unfinished.is_dir(), "the save finished before the kill (test timing)"
        resume = TINY + ["--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt)]
        with LaunchedJob(2, resume, tmp_path, name="resume") as job:
            assert job.wait(120) == 0, job.stderr()
            assert f"removed {unfinished}: a save that did not finish" in job.stdout()
        assert not unfinished.exists()
        assert (ckpt / TRACKER).read_text().strip() == "3"


@pytest.mark.parametrize("nproc,layout,stalled", [
    (2, [], 1),  # DP2: rank 0 waits in Megatron's DP group (hung 30 min before the fix)
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--dhelix"], 2),  # Megatron's TP/PP groups and the DHelix lanes
])
def test_stalled_rank_ends_the_job_within_the_timeout_naming_it(tmp_path, nproc, layout,
                                                                stalled):
    """SIGSTOP of one rank: the job ends about --distributed-timeout-minutes after the stall,
    naming the rank, and nothing of it is left (the stopped rank included)."""
    timeout_s = 6
    args = TINY + layout + ["--train-iters", "100000", "--log-interval", "1",
                            "--distributed-timeout-minutes", str(timeout_s / 60)]
    with LaunchedJob(nproc, args, tmp_path) as job:
        job.wait_for(lambda: re.search(r"iteration +\d+/", job.stdout()), 240,
                     "first logged iteration")
        stopped_at = job.signal_rank(stalled, signal.SIGSTOP)
        rc = job.wait(timeout_s + 40)
        took = time.monotonic() - stopped_at
        left = job.leftovers(within_s=5)
    print(f"job ended {took:.1f} s after the stall, exit {rc}")
    assert rc != 0
    assert left == [], left
    errors = job.error_lines()
    assert len(errors) == 1, job.stderr()
    assert errors[0].startswith(f"error: rank {stalled} of {nproc} stopped answering: a "
                                "collective waited --distributed-timeout-minutes 0.1 (6 s)"), errors
    assert "killed" in errors[0]
    # the timeout, the roll call window (2 s) and a step's skew; not torchrun's 30 s grace
    assert took < timeout_s + 15, took
