"""Faults on the plugin path as a user meets them: real `torchrun --nproc-per-node 2 -m
dhelix.megatron_lm scripts/pretrain_gpt.py` jobs (gloo, tiny GPT), each with a hard
timeout, each asserting the exact `error:` line rank 0 prints and that no process of the job
is left afterwards (found by a marker in the environment every process of the job
inherits, so a Manager or resource_tracker reparented to init is found too).

- a bad `--dhelix*` argument: one line, not Megatron's usage text from every rank;
- SIGSTOP of rank 1 (TP2, `--dhelix`: the DHelix lanes and Megatron's TP group) with
  `--distributed-timeout-minutes 1`: the job ends within the timeout plus the roll call,
  naming rank 1 (`megatron_patches.stall_roll_call`). Most of that test is the idle wait for
  the one-minute timeout, so its job starts with the module's first test, the other
  tests' jobs run while it waits (`stopped_rank_job`), and the test that reads it is marked
  `last` (tests/conftest.py): the session's later tests run during the rest of the wait;
- kill -9 of rank 1 during training with `--save` every iteration: the job ends and no
  process is left (no save Manager, `megatron_patches.checkpoint_guard`); the checkpoint it
  left, with random bytes in a shard, is refused at `--load` with one line.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from dhelix.harness import free_port
from tests.megatron_lm_ranks import ROOT, SCRIPT, TINY

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

TIMEOUT_S = 240
MARKER = "DHELIX_FAULT_TEST"


def _job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _kill_all(marker: str) -> None:
    for proc in _job_processes(marker):
        try:
            proc.kill()
        except psutil.Error:
            pass


def _alive(marker: str) -> list[psutil.Process]:
    alive = []
    for proc in _job_processes(marker):
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:  # ended since
            continue
    return alive


class Job:
    """One torchrun job of the plugin; `finish()` returns (exit code, stdout, stderr, the
    job's processes still alive 3 s after torchrun ended: it looks every 0.2 s and stops
    looking once none is left, since only a process of the job carries its marker, so none
    can appear after the last one is gone)."""

    def __init__(self, argv: list[str], workdir: Path):
        self.marker = uuid.uuid4().hex
        self.out, self.err = workdir / f"{self.marker}.out", workdir / f"{self.marker}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: self.marker})
        env.pop("DHELIX_ERROR_FILE", None)
        # torchrun's logs in the test's directory (its default, a /tmp/torchelastic_*
        # directory per job, is never removed)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()),
               "--log-dir", str(workdir / f"{self.marker}.torchrun"),
               "-m", "dhelix.megatron_lm", SCRIPT, *argv]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)
        self.started = time.monotonic()

    def rank_pid(self, rank: int) -> int:
        for proc in _job_processes(self.marker):
            try:
                env = proc.environ()
                if env.get("RANK") == str(rank) and "dhelix.megatron_lm" in proc.cmdline():
                    if env.get("TORCHELASTIC_RUN_ID") is not None and proc.pid != self.proc.pid:
                        return proc.pid
            except psutil.Error:
                continue
        raise AssertionError(f"rank {rank} not found")

    def wait_for(self, predicate, what: str) -> None:
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before {what}: {self.err.read_text()[-3000:]}")
            if time.monotonic() - self.started > TIMEOUT_S:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.5)

    def finish(self):
        try:
            code = self.proc.wait(timeout=max(1, TIMEOUT_S - (time.monotonic() -
                                                               self.started)))
        except subprocess.TimeoutExpired:
            _kill_all(self.marker)
            self.proc.kill()
            raise AssertionError("job hung: " + self.err.read_text()[-3000:]) from None
        self.ended = time.monotonic()
        self.wall_s = self.ended - self.started
        while _alive(self.marker) and time.monotonic() < self.ended + 3:
            time.sleep(0.2)
        left = []
        for proc in _alive(self.marker):
            try:
                left.append((proc.pid, " ".join(proc.cmdline())[:120]))
            except psutil.Error:  # ended since
                continue
        _kill_all(self.marker)
        return code, self.out.read_text(), self.err.read_text(), left


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


def _stop_rank_1(workdir: Path) -> dict:
    """TP2 with --dhelix, its SI blocks streamed (`--dhelix-streamed`, unbounded: at these
    shapes the default streams or not as the memory readings move; streamed, both strands'
    collectives share one group, and a wait after the first timeout reads gloo's "pair
    closure"): SIGSTOP rank 1 after iteration 2 and wait for the job to end
    (`Job.finish`); what the test checks."""
    job = Job(TINY + ["--train-iters", "100000", "--distributed-timeout-minutes", "1",
                      "--tensor-model-parallel-size", "2", "--dhelix", "--dhelix-streamed",
                      "--dhelix-no-memory-bound"], workdir)
    job.wait_for(lambda: " iteration        2/" in job.out.read_text(), "iteration 2")
    stopped = job.rank_pid(1)
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code, out, err, left = job.finish()
    return {"stopped": stopped, "code": code, "err": err, "left": left,
            "took": job.ended - stopped_at, "streamed": "SI blocks run streamed" in out}


@pytest.fixture(scope="session", autouse=True)
def stopped_rank_job(request, tmp_path_factory):
    """`_stop_rank_1` started in the background when the module's first test starts, if
    `test_stopped_rank_is_named_within_the_timeout` is selected (else None): the future
    of its result. Its job spends most of its time idle (a rank stopped, the other waiting
    out the collective timeout), so the module's other jobs, and the session's tests
    collected after this module, run meanwhile (session scope: the fixture lives until the
    test marked `last` reads it)."""
    if not any(item.name == "test_stopped_rank_is_named_within_the_timeout"
               for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(_stop_rank_1, tmp_path_factory.mktemp("stopped_rank"))


def test_bad_dhelix_argument_is_one_line_from_torchrun(workdir):
    job = Job(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-pairer", "bogus"], workdir)
    code, out, err, left = job.finish()
    assert code != 0 and left == []
    assert _errors(err) == [
        "error: argument --dhelix-pairer: invalid choice: 'bogus' (choose from 'dp', "
        "'sequential', 'round_robin', 'domino'); python -m dhelix.megatron_lm SCRIPT --help "
        "lists the arguments"], err[-3000:]
    assert "usage:" not in err and len(err.splitlines()) < 80, err[-3000:]


def test_killed_rank_leaves_no_process_and_a_damaged_save_is_refused(workdir):
    ckpt = workdir / "ckpt"
    job = Job(TINY + ["--train-iters", "100000", "--save", str(ckpt), "--save-interval", "1",
                      "--dhelix"], workdir)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    job.wait_for(lambda: tracker.is_file() and tracker.read_text().strip() not in ("", "1"),
                 "a second save")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    code, out, err, left = job.finish()
    print(f"kill -9 to the end of the job: {job.wall_s:.1f} s since start")
    assert code != 0 and left == [], left
    latest = int(tracker.read_text())
    shard = ckpt / f"iter_{latest:07d}" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 256] = os.urandom(256)
    shard.write_bytes(bytes(data))
    earlier = sorted(int(p.name[5:]) for p in ckpt.glob("iter_*") if int(p.name[5:]) < latest)
    load = Job(TINY + ["--train-iters", "100000", "--load", str(ckpt), "--dhelix"], workdir)
    code, out, err, left = load.finish()
    assert code != 0 and left == []
    assert _errors(err) == [
        f"error: --load {ckpt}: iter_{latest:07d}/__0_0.distcp does not match its saved "
        "SHA-256 (its bytes changed since the save); nothing was loaded; resume from an "
        f"earlier iteration with --ckpt-step N (saved under {ckpt}: "
        f"{', '.join(map(str, earlier))})"], err[-3000:]


@pytest.mark.last
def test_stopped_rank_is_named_within_the_timeout(stopped_rank_job):
    """TP2 with --dhelix: rank 0 waits in a DHelix lane (a clone of Megatron's TP group,
    given --distributed-timeout-minutes by the plugin) or Megatron's TP group. The job is
    `stopped_rank_job`'s, started with the module's first test (this test runs after every
    other test of the session)."""
    result = stopped_rank_job.result()
    stopped, code, err, left, took = (result[k] for k in ("stopped", "code", "err", "left",
                                                            "took"))
    print(f"SIGSTOP to the end of the job: {took:.1f} s")
    assert result["streamed"]  # the plan line: the job's SI blocks ran streamed
    assert code != 0 and left == [], (left, err[-3000:])
    errors = _errors(err)
    assert len(errors) == 1, err[-5000:]
    assert re.fullmatch(
        r"error: rank 1 of 2 stopped answering: a collective waited "
        r"--distributed-timeout-minutes 1 \(60 s\) and it did not answer a roll call within "
        rf"12 s \(rank 1: pid {stopped} on \S+, killed\); the job stops\. If it was only "
        r"slow \(a long save or first step\), raise --distributed-timeout-minutes",
        errors[0]), errors[0]
    assert took < 60 + 12 + 25, took
