"""scripts/dhelix_trainer.py under the real torchrun, launched as a user would, for tests of
what happens to a whole job: its own session, and a marker in its environment that every
process of the job inherits (torchrun puts each rank in a session of its own, so the
marker, not the session, finds the ranks and anything they start)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil

from dhelix.cluster.launch import find_torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dhelix_trainer.py"
MARKER = "DHELIX_TEST_JOB_MARKER"


class LaunchedJob:
    """A running torchrun job; use as a context manager (leaving it kills whatever of the
    job is still alive, so a failing test leaves nothing behind)."""

    def __init__(self, nproc: int, args: list[str], workdir: Path, name: str = "job"):
        self.marker = uuid.uuid4().hex
        self.stdout_path = workdir / f"{name}.out"
        self.stderr_path = workdir / f"{name}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: self.marker})
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [find_torchrun(), "--nproc-per-node", str(nproc), str(SCRIPT), *args],
                cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)

    def __enter__(self) -> "LaunchedJob":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.processes():
            try:
                proc.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def processes(self) -> list[psutil.Process]:
        """Every live process carrying this job's marker (torchrun, ranks, their children);
        zombies excluded."""
        found = []
        for proc in psutil.process_iter():
            try:
                if (proc.environ().get(MARKER) == self.marker
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def describe(self, procs: list[psutil.Process]) -> list[str]:
        out = []
        for proc in procs:
            try:
                out.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:120]}")
            except psutil.Error:
                continue
        return out

    def rank_pid(self, rank: int) -> int:
        """Pid of the training process of `rank` (a child of torchrun)."""
        for proc in psutil.Process(self.proc.pid).children():
            try:
                if proc.environ().get("RANK") == str(rank):
                    return proc.pid
            except psutil.Error:
                continue
        raise AssertionError(f"rank {rank} is not running; stderr:\n{self.stderr()}")

    def wait_for(self, condition, timeout_s: float, what: str) -> None:
        """Poll `condition()` every 10 ms; fail naming `what` if the job ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before {what}; stderr:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s} s; stderr:\n{self.stderr()}")
            time.sleep(0.01)

    def signal_rank(self, rank: int, sig: signal.Signals) -> float:
        """Send `sig` to `rank`'s training process; returns the monotonic time it was sent."""
        os.kill(self.rank_pid(rank), sig)
        return time.monotonic()

    def wait(self, timeout_s: float) -> int:
        """torchrun's exit code (fails the test if it is still running after `timeout_s`)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job still runs after {timeout_s} s; stderr:\n"
                                 f"{self.stderr()}") from None

    def leftovers(self, within_s: float) -> list[str]:
        """Processes of the job still alive after waiting up to `within_s` for them to go."""
        deadline = time.monotonic() + within_s
        while (procs := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.describe(procs)

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def error_lines(self) -> list[str]:
        """The `error: ...` lines the ranks printed (torchrun's own report excluded)."""
        return [line for line in self.stderr().splitlines() if line.startswith("error: ")]
