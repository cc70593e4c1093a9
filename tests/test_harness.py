"""dhelix.harness: a rank never outlives the process that spawned it (an interrupted or
killed test run leaves no ranks behind)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.slow  # starts a forkserver (torch imported) and a rank in a subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses PR_SET_PDEATHSIG")
def test_ranks_die_with_a_killed_parent(tmp_path):
    pid_file = tmp_path / "rank.pid"
    parent = subprocess.Popen([sys.executable, str(HERE / "harness_orphan.py"), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the rank never started"
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.2)
        rank = int(pid_file.read_text())
        assert _alive(rank)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), "the rank outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
