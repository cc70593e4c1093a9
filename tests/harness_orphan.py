"""Helper program for tests/test_harness.py: spawns one rank that records its pid and then
sleeps, while this (parent) process waits for it. The test kills this process."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dhelix.harness  # noqa: E402
from dhelix.harness import run_on_ranks  # noqa: E402


def sleeping_rank(ctx, pid_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":
    # The rank only sleeps: its forkserver imports torch alone, not megatron-core (`PRELOADED`:
    # ~4 s more); how a rank dies with its parent does not depend on what the server imported.
    dhelix.harness.PRELOADED = ["torch"]
    run_on_ranks(sleeping_rank, 1, sys.argv[1], timeout_s=120)
