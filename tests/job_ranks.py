"""Rank body for tests/test_parallel_job.py (spawned by dhelix.harness; module-level so it
pickles by name). One launch runs every check: each process pays seconds of imports."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.harness import free_port
from dhelix.parallel import (
    Job,
    ParallelSizes,
    destroy_parallel_state,
    init_megatron_parallel_state,
    init_process_group_from_env,
    job_of_megatron_group,
)
from dhelix.runtime.lanes import COMM_LANES, LanePool, tensor_parallel_lanes
from dhelix.stall import StallGuard


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _lane_timeouts(lanes) -> list:
    return sorted({_timeout(group) for group in lanes.groups.values()})


def job_checks(ctx, timeout_s: float) -> dict:
    """What a Job carries, seen through real gloo groups and the real store:

    - the first and a second `init_process_group_from_env` call (the second with another
      timeout, which it must ignore): their timeouts, and a key one rank sets through the
      second Job's store read by every rank through its first Job's store;
    - the timeout of Megatron's TP group and of the TP lane clones built with the Job, and
      of lanes built with `Job()` (a group created elsewhere: torch's default);
    - `StallGuard.for_job`: its timeout, each rank's published pid as read by the other
      ranks, a roll call with every rank present, and None for `Job()`;
    - `planned_once`: every rank gets the first rank's plan, or its error;
    - after the group is re-created by plain `init_process_group` (as megatron.training
      does), `init_process_group_from_env` says it was created elsewhere, and the plugin's
      `job_of_megatron_group(timeout)` gives a Job whose timeout the lanes get and whose
      store a `StallGuard` publishes pids and holds a roll call in.
    """
    out = {}
    job = init_process_group_from_env(timeout_s=timeout_s)
    again = init_process_group_from_env(timeout_s=2 * timeout_s)
    out["timeouts"] = (job.timeout, again.timeout)
    out["created_elsewhere"] = (job.created_elsewhere, again.created_elsewhere)
    if again.store is not None:
        again.store.set(f"probe/{ctx.rank}", f"from rank {ctx.rank}")
    dist.barrier()
    keys = [f"probe/{r}" for r in range(ctx.world_size)]
    out["probes"] = [job.store.get(k).decode() if job.store.check([k]) else None for k in keys]

    init_megatron_parallel_state(ParallelSizes(ctx.world_size, 1), 1234, job)
    out["megatron_tp_timeout"] = _timeout(parallel_state.get_tensor_model_parallel_group())
    out["lane_timeouts"] = _lane_timeouts(tensor_parallel_lanes(ctx.world_size, job,
                                                                channels=COMM_LANES))
    out["elsewhere_lane_timeouts"] = _lane_timeouts(tensor_parallel_lanes(
        ctx.world_size, Job(), channels=COMM_LANES))
    # lanes for one channel only, taken from a pool the second time: the same groups, and
    # a collective on a pooled lane reaches every rank
    pool = LanePool()
    first = tensor_parallel_lanes(ctx.world_size, job, channels=("inter",), pool=pool)
    second = tensor_parallel_lanes(ctx.world_size, job, channels=("inter",), pool=pool)
    out["lane_keys"] = sorted(first.groups)
    out["pool_size"] = len(pool.groups)
    out["pool_reused"] = all(second.groups[k] is first.groups[k] for k in first.groups)
    total = torch.ones(1)
    dist.all_reduce(total, group=second.groups[("tp", "inter", 1)])
    out["pooled_lane_sum"] = total.item()
    try:
        tensor_parallel_lanes(ctx.world_size, job, channels=("nvlink",))
        out["unknown_channel"] = None
    except ValueError as exc:
        out["unknown_channel"] = str(exc)

    guard = StallGuard.for_job(job)
    out["guard_timeout_s"] = guard.timeout_s
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    keys = [f"process/{r}" for r in range(ctx.world_size)]
    out["published_pids_ok"] = [guard.store.check([k])
                                and json.loads(guard.store.get(k))["pid"] == pids[r]
                                for r, k in enumerate(keys)]
    out["roll_call_missing"] = guard.roll_call()
    out["elsewhere_guard"] = StallGuard.for_job(Job())
    # a start-up plan is searched on the stage's first rank only and handed to the rest,
    # and so is the error it raised (`dhelix.runtime.setup.planned_once`; the stage here:
    # Megatron's tensor-and-data-parallel group, the world)
    from dhelix.runtime.setup import planned_once

    out["planned"] = planned_once(lambda: f"planned on rank {ctx.rank}")

    def no_plan():
        raise ValueError(f"no plan on rank {ctx.rank}")

    try:
        planned_once(no_plan)
        out["plan_error"] = None
    except ValueError as exc:
        out["plan_error"] = str(exc)
    destroy_parallel_state()

    ports = [None] * ctx.world_size
    dist.all_gather_object(ports, free_port())
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}",
                            rank=ctx.rank, world_size=ctx.world_size)
    elsewhere = init_process_group_from_env()
    out["megatron_style_group"] = (elsewhere.store is None, elsewhere.timeout)
    # the plugin's Job of that group (megatron_patches.training_hooks, stall_roll_call):
    # its store and Megatron's --distributed-timeout-minutes reach the lanes and the guard
    plugin_job = job_of_megatron_group(timedelta(seconds=timeout_s))
    out["plugin_job_timeout"] = plugin_job.timeout
    init_megatron_parallel_state(ParallelSizes(ctx.world_size, 1), 1234, plugin_job)
    out["plugin_lane_timeouts"] = _lane_timeouts(tensor_parallel_lanes(
        ctx.world_size, plugin_job, channels=COMM_LANES))
    destroy_parallel_state()
    plugin_guard = StallGuard.for_job(plugin_job)
    dist.barrier()  # every rank published its pid before any reads
    out["plugin_guard_pids_ok"] = [
        plugin_guard.store.check([f"process/{r}"])
        and json.loads(plugin_guard.store.get(f"process/{r}"))["pid"] == pids[r]
        for r in range(ctx.world_size)]
    out["plugin_roll_call_missing"] = plugin_guard.roll_call()
    return out
