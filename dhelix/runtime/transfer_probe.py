"""How long one pipeline transfer takes on this cluster: the input of the planner's choice
between the dp plan and the sequential pairing on a folded stage
(`planner.pipeline_transfers`).

`measure_transfer_ms` times exchanges of one activation-sized tensor between neighbouring
pipeline stages, both directions at once as the W schedule's steady state exchanges them,
each direction on its group of the executor's (`TransferGroups.activations_up` /
`activations_down`: one direction a connection, which also keeps gloo from taking turns on
one connection). Collective over the world (every rank calls it; pipelining only). The
buffers live on `device`, are the function's own and are freed on return; with CUDA the
host synchronises the device around each exchange.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dhelix.schedules.actions import FORWARD
from dhelix.schedules.transfer_groups import TransferGroups

PROBE_REPEATS = 3


def measure_transfer_ms(shape: tuple, dtype: torch.dtype, device: torch.device,
                        pipeline_group, groups: TransferGroups) -> float:
    """The median over `PROBE_REPEATS` exchanges (after one untimed) of a rank's time to send
    one tensor of `shape` / `dtype` to each neighbouring stage and receive one from each, in
    ms, the largest over the world (so every rank of a stage makes the same choice)."""
    size = dist.get_world_size(pipeline_group)
    stage = dist.get_rank(pipeline_group)
    peers = sorted({s for s in (stage - 1, stage + 1) if 0 <= s < size})
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    incoming = [torch.empty(shape, dtype=dtype, device=device) for _ in peers]
    times = []
    for repeat in range(PROBE_REPEATS + 1):
        dist.barrier(group=pipeline_group)
        _synchronize(device)
        start = time.perf_counter()
        works = []
        for peer, buffer in zip(peers, incoming):
            rank = dist.get_global_rank(pipeline_group, peer)
            send_group = groups.group(FORWARD, upward=peer > stage)
            recv_group = groups.group(FORWARD, upward=peer < stage)
            works.append(dist.irecv(buffer, src=rank, group=recv_group))
            works.append(dist.isend(outgoing, dst=rank, group=send_group))
        for work in works:
            work.wait()
        _synchronize(device)
        if repeat:
            times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank of a stage chooses alike
    return float(slowest.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
