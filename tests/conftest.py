"""Test-session environment, set before any test starts a process.

Without an NVIDIA device, `TORCH_COMPILE_DISABLE=1` (unless the caller set it): every
process this session starts inherits it (the forkserver `dhelix.harness` forks gloo ranks
from, and the `dhelix` / torchrun subprocesses that take `os.environ`), so Megatron's
`jit_fuser` functions run eagerly there. Without CUDA the only `torch.compile` in a run is
Megatron's JIT warm-up (`megatron.training.initialize._warmup_jit_function`): the plugin
turns every fusion off on CPU (`megatron_patches.machine_arguments`), so the model never
calls what the warm-up compiles, and compiling it cost each rank ~5 s on the 2-core machine
(a 4-rank launch's first run: 6.5 s of set-up, 1.2 s without). The warm-up still runs and
draws its random tensors (eager dropout draws another RNG stream than inductor's, so the
initial weights differ from a compiled run's; every comparison is between runs of one
environment). The README quick start (tests/test_megatron_lm_quickstart.py) gives its
torchrun jobs their own environment and keeps the compiled warm-up: there `--dhelix` with
PP=2, whose folded model replays that warm-up's draws, must log stock Megatron's losses.
With a GPU the fusions are on and compiled, as in a user's run, so nothing is set.

When a selected test is marked `slow`, `dhelix.harness`'s rank server (the forkserver its
ranks are forked from) starts with the session's first test (`start_rank_server`), so
its imports (torch, megatron-core: ~6 s of one core) run beside the session's first tests,
most of them single-process, not inside the first multi-rank launch.

Tests marked `last` run after every other selected test, in their collected order
(`pytest_collection_modifyitems`): each reads the result of a background job that a
session-scoped fixture started with its module's first test and that spends most of its
time idle (tests/test_megatron_lm_faults.py: a stopped rank, the other waiting out the
one-minute collective timeout), so the tests collected after that module run during the
wait instead of after it.
"""

import os

import pytest

if not os.path.exists("/dev/nvidiactl"):  # `dhelix.harness`'s test for a GPU
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    """Move the tests marked `last` behind every other test (module docstring)."""
    last = [item for item in items if item.get_closest_marker("last") is not None]
    if last:
        items[:] = [item for item in items if item.get_closest_marker("last") is None] + last


@pytest.fixture(scope="session", autouse=True)
def rank_server(request):
    """Start the rank server when the session's first test is set up, if a selected test is
    marked slow (module docstring). Started inside a test, as before, the server and every
    rank forked from it write where pytest's capture points file descriptors 1 and 2, so a
    rank's output shows in the report of the test that was running (started in a
    collection hook they went to the terminal)."""
    if any(item.get_closest_marker("slow") is not None for item in request.session.items):
        from dhelix.harness import start_rank_server

        start_rank_server()
