"""Run a function on N local ranks joined in one torch.distributed group.

Used by the tests and the benchmarks alike. Each rank is a fresh process (no state inherited
from the caller) with the caller's environment plus torchrun's (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT). Without a GPU the ranks are forked from a
forkserver that imported torch and megatron-core once (`PRELOADED`), so a launch does not
pay those imports per rank (~4-6 s each on the 2-core machine); with a GPU they are spawned
(a fork must not inherit CUDA state). Guarantees:

- a hard timeout: if any rank has not finished when it expires, every rank is killed and
  `RankTimeout` is raised naming the ranks still running (no hang);
- a failing rank's traceback is re-raised in the caller as `RankFailed`, with the rank
  number, and the other ranks are killed instead of waiting on a collective forever;
- the function's return values come back as a list indexed by rank (must be picklable).

`run_megatron_ranks` also initialises Megatron's parallel state for given TP/PP sizes
before calling the function, and tears it down afterwards.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

# Imported once by the forkserver the ranks are forked from (no CUDA, no threads started).
PRELOADED = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
             "megatron.core.distributed", "megatron.core.pipeline_parallel"]


class RankFailed(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


class RankTimeout(RuntimeError):
    """Ranks were still running when the hard timeout expired."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank when the process that started it dies (a test
    run interrupted or killed must not leave ranks behind holding memory and ports). A rank
    forked by the forkserver drops the caller's "alive" pipe the server handed it, so the
    server sees the caller die, exits, and takes its ranks with it."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # private: multiprocessing has no public way to do this
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _rank_context():
    """The multiprocessing context ranks start from: a forkserver with `PRELOADED` imported
    where no NVIDIA device exists, else spawn."""
    if os.path.exists("/dev/nvidiactl"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # takes effect when the server starts
    return ctx


def start_rank_server() -> None:
    """Start the forkserver the ranks are forked from now, without waiting for its imports
    (`PRELOADED`, ~6 s on the 2-core machine): they run beside the caller's own work, and
    the first launch waits only for what is left of them. No-op where ranks are spawned (a
    GPU machine). Idempotent."""
    if _rank_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _rank_main(fn, rank, world_size, port, caller_env, env, args, kwargs, results):
    _die_with_parent()
    # The caller's environment now (a forkserver's is the caller's when it started, plus
    # what the preloaded imports set); then the launch's own variables.
    os.environ.update(caller_env)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    from dhelix.gloo_device import share_gloo_device_if_asked

    share_gloo_device_if_asked()  # before any group exists (DHELIX_GLOO_SHARED_DEVICE=1)
    try:
        value = fn(RankContext(rank, world_size), *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 300,
                 env: dict | None = None, **kwargs) -> list:
    """Run `fn(RankContext, *args, **kwargs)` on `world_size` spawned processes.

    `fn` must be importable by name (module-level). Returns the per-rank results.
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, dict(os.environ), dict(env or {}), args, kwargs,
                  results),
            daemon=False,  # a daemonic process may not start children; a rank may
        )
        proc.start()
        procs.append(proc)
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in outcome]
                raise RankTimeout(
                    f"ranks {running} of {world_size} still running after {timeout_s:.0f} s"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outcome and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    # Died without reporting (segfault, OOM kill); give the queue a moment.
                    time.sleep(0.5)
                    if results.empty():
                        raise RankFailed(
                            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            "without reporting"
                        )
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            outcome[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(timeout=5 if len(outcome) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [outcome[r] for r in range(world_size)]


def _megatron_rank_main(ctx: RankContext, fn, tp, pp, seed, args, kwargs):
    from dhelix.parallel import (
        ParallelSizes,
        destroy_parallel_state,
        init_megatron_parallel_state,
        init_process_group_from_env,
    )

    job = init_process_group_from_env()
    init_megatron_parallel_state(ParallelSizes(tp, pp), seed, job)
    try:
        return fn(ctx, *args, **kwargs)
    finally:
        destroy_parallel_state()


def run_megatron_ranks(fn: Callable[..., Any], world_size: int, *args, tp: int = 1,
                       pp: int = 1, seed: int = 1234, timeout_s: float = 300,
                       env: dict | None = None, **kwargs) -> list:
    """`run_on_ranks` with the process group and Megatron's TP/PP/DP state initialised."""
    return run_on_ranks(_megatron_rank_main, world_size, fn, tp, pp, seed, args, kwargs,
                        timeout_s=timeout_s, env=env)
