"""Execution lanes: compute, intra-node communication, cross-node communication.

- Compute runs on the calling thread (CPU) or the current CUDA stream (GPU). Every tensor of
  both strands is allocated there, so the caching allocator sees one stream and frees
  nothing early; collectives' buffers are kept alive by the operator state until their
  reader has waited (see `dhelix.ops.runner`), and ProcessGroupNCCL records its tensors on
  its own stream (`record_stream` discipline) on GPU.
- Each communication lane has its own process group with the same ranks as the layer's
  tensor-parallel group, one per channel (intra-node, cross-node) and strand slot (the
  first and the second strand of a paired block, `STRAND_SLOTS`). Separate groups per strand
  are what make co-execution safe: which strand issues its next collective first depends on
  timing (the executor runs whichever strand is ready), so on a shared group two ranks
  could issue the strands' collectives in different orders and the transport would pair
  one strand's all-reduce with the other's. Per strand, the order is the plan's on every
  rank. (The streamed executor, `dhelix.runtime.streamed_executor`, runs one static
  sequence whose order is the same on every rank, and puts both strands on slot 0.) On
  CPU these are gloo groups whose work runs on gloo's threads while the calling thread
  computes; on GPU they are NCCL communicators, each with its own
  CUDA stream, so an intra-node collective of one strand, a cross-node collective of the
  other and the compute stream proceed concurrently. A consumer waits on the collective's
  work handle (`work.wait()`): on CPU it blocks the thread, on GPU it only makes the current
  stream wait (an event dependency), without a host synchronisation.

`CUDA_DEVICE_MAX_CONNECTIONS`: Megatron sets it to 1 so that, with sequence parallelism,
its own communication kernels are scheduled in issue order ahead of the GEMMs they overlap.
DHelix overlaps kernels of *different* streams, which needs several hardware queues: with 1
connection the GPU serialises kernels of all streams in launch order and a paired block
degrades towards running back to back. Leave it unset (driver default 8) or raise it when
training with `--dhelix`; `check_cuda_device_max_connections` warns about a value of 1.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dhelix.gloo_device import own_gloo_devices
from dhelix.parallel import Job
from dhelix.schedules.transfer_groups import TransferGroups

log = logging.getLogger(__name__)

COMM_LANES = ("intra", "inter")
STRAND_SLOTS = (0, 1)


@dataclass
class LanePool:
    """Process groups this process has created, by (ranks, channel, strand slot) (lanes)
    or (ranks, "pp-...") (`pipeline_transfer_groups`), for every runtime built in it to
    reuse. One training run builds one runtime and needs no
    pool; the benchmark builds one per system in one process, and every idle gloo group
    costs the running one CPU (its transport thread wakes every 10 ms; docs/benchmark.md).
    Reuse is safe because a system's collectives have all completed when its step ends.
    Every rank must request the same groups in the same order (creation is collective)."""

    groups: dict = field(default_factory=dict)


@dataclass
class Lanes:
    """Per-lane clones of one process group (by role, e.g. 'tp'), shared by all strands.

    Built collectively: every rank of the world must call `Lanes.build` with the same roles
    in the same order (torch.distributed.new_group is a collective over the world).
    """

    groups: dict = field(default_factory=dict)  # (role, lane, strand slot) -> ProcessGroup
    # Benchmark-only communication-free bound: attached executions replace every collective
    # with a no-op of the same output shape (TIMING ONLY, WRONG NUMERICS; see
    # `dhelix.ops.collectives`). Set only by `--dhelix-commfree-timing-only`.
    no_comm_timing_only: bool = False

    @classmethod
    def build(cls, role_groups: dict, job: Job, *, channels,
              no_comm_timing_only: bool = False, pool: LanePool | None = None) -> "Lanes":
        """`role_groups`: role -> this rank's process group for that role (e.g. Megatron's
        TP group). For each role, channel in `channels` (the channels the layers'
        collectives use: a lane nobody uses is an idle group; one tuple for every role, or
        a dict role -> channels) and strand slot, a group with
        the same ranks, for every group of that role in the world, with `job.timeout`
        (torch's default, 30 minutes, for `Job()`); taken from `pool` when it has one with
        those ranks, else created (and added to `pool`)."""
        by_role = channels if isinstance(channels, dict) else {r: channels for r in role_groups}
        unknown = sorted({c for used in by_role.values() for c in used} - set(COMM_LANES))
        if unknown:
            raise ValueError(f"unknown communication channels {unknown}; known: {COMM_LANES}")
        lanes = cls(no_comm_timing_only=no_comm_timing_only)
        for role, group in role_groups.items():
            tags = [(lane, slot) for lane in COMM_LANES if lane in by_role.get(role, ())
                    for slot in STRAND_SLOTS]
            for tag, clone in zip(tags, clone_group(group, tags, job, pool)):
                lanes.groups[(role, *tag)] = clone
        return lanes

    def attach(self, execution) -> None:
        """Route the execution's collectives to the lane of their channel (or nowhere, for
        the timing-only communication-free bound)."""
        execution.lane_groups = self.groups
        execution.no_comm_timing_only = self.no_comm_timing_only


def clone_group(group, tags: list, job: Job, pool: LanePool | None = None) -> list:
    """This rank's clones of `group`, one per tag in `tags`: groups with its ranks, made for
    every group of the world with the same role (every rank calls this with its own group of
    that role and the same tags, in the same order: torch.distributed.new_group is a
    collective over the world), with `job`'s timeout; each taken from `pool` under
    (ranks, *tag) when it has one, else created and added to it."""
    mine = tuple(dist.get_process_group_ranks(group))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = []
    for tag in tags:
        for ranks in sorted(set(everyone)):
            key = (ranks, *tag)
            clone = pool.groups.get(key) if pool is not None else None
            if clone is None:
                with own_gloo_devices():
                    clone = dist.new_group(list(ranks), timeout=job.timeout)
                if pool is not None:
                    pool.groups[key] = clone
            if ranks == mine:
                found.append(clone)
    return found


TRANSFER_TAGS = (("pp-act-up",), ("pp-act-down",), ("pp-grad-up",), ("pp-grad-down",))


def pipeline_transfer_groups(job: Job, pool: LanePool | None = None) -> TransferGroups:
    """The groups the pipeline's transfers travel on (`dhelix.schedules.executor`'s
    `transfer_groups`): four clones of Megatron's pipeline group, one per kind and
    direction of travel (`dhelix.schedules.transfer_groups` says why). Collective over the
    world; Megatron's parallel state must exist."""
    from megatron.core import parallel_state

    clones = clone_group(parallel_state.get_pipeline_model_parallel_group(),
                         list(TRANSFER_TAGS), job, pool)
    return TransferGroups(*clones)


def comm_channels(bound_layers, role: str | None = None) -> tuple:
    """The channels ('intra', 'inter') the collectives of `bound_layers`' programs use
    (`dhelix.ops.runner.BoundLayer`), in `COMM_LANES` order; with `role`, only those of
    the collectives on that process-group role ('tp', 'ep')."""
    used = set()
    for bound in bound_layers:
        for direction in ("fwd", "bwd"):
            program = bound.programs.program(direction)
            used.update(op.channel for op in program.ops if op.kind == "comm"
                        and (role is None or op.attrs.get("group") == role))
    return tuple(lane for lane in COMM_LANES if lane in used)


def layer_lanes(bound_layers, tensor_model_parallel_size: int, job: Job, *,
                no_comm_timing_only: bool = False, pool: LanePool | None = None
                ) -> Lanes | None:
    """The lanes of the layers' collectives: Megatron's tensor-parallel group (TP > 1) and,
    when MoE layers all-to-all over more than one rank, its expert-parallel group, each for
    the channels its collectives use; None when neither (a layer's own group then serves
    its few collectives). The expert-parallel lanes exist when a layer of any rank uses
    them (ranks of other pipeline stages may hold other layers). Collective over the world,
    like `Lanes.build`; Megatron's parallel state must exist."""
    from megatron.core import parallel_state

    role_groups, channels = {}, {}
    if tensor_model_parallel_size > 1:
        role_groups["tp"] = parallel_state.get_tensor_model_parallel_group()
        channels["tp"] = comm_channels(bound_layers, "tp")
    ep_channels = _world_channels(comm_channels(bound_layers, "ep")) \
        if parallel_state.get_expert_model_parallel_world_size() > 1 else ()
    if ep_channels:
        role_groups["ep"] = parallel_state.get_expert_model_parallel_group()
        channels["ep"] = ep_channels
    if not role_groups:
        return None
    return Lanes.build(role_groups, job, channels=channels,
                       no_comm_timing_only=no_comm_timing_only, pool=pool)


def _world_channels(mine: tuple) -> tuple:
    """The channels any rank of the world uses (`COMM_LANES` order), from this rank's
    `mine`: with pipelining, one stage may hold MoE layers and another none, or their
    expert-parallel groups may sit on different channels, and `Lanes.build` needs the same
    roles and channels on every rank. Collective over the world."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    used = {channel for channels in everyone for channel in channels}
    return tuple(lane for lane in COMM_LANES if lane in used)


def tensor_parallel_lanes(tensor_model_parallel_size: int, job: Job, *, channels,
                          no_comm_timing_only: bool = False,
                          pool: LanePool | None = None) -> Lanes | None:
    """The lanes of Megatron's tensor-parallel group for `channels` (normally
    `comm_channels` of the layers they will serve; with `job`'s timeout,
    reusing `pool`'s groups), or None without TP (the layer's own group then serves its few
    collectives). Collective over the world, like `Lanes.build`; Megatron's parallel state
    must exist."""
    if tensor_model_parallel_size == 1:
        return None
    from megatron.core import parallel_state

    return Lanes.build({"tp": parallel_state.get_tensor_model_parallel_group()}, job,
                       channels=channels, no_comm_timing_only=no_comm_timing_only, pool=pool)


def lane_execution(bound, lanes: Lanes | None):
    """A fresh execution of the bound layer (`dhelix.ops.runner.BoundLayer`), its
    collectives routed to `lanes` when given."""
    execution = bound.new_execution()
    if lanes is not None:
        lanes.attach(execution)
    return execution


def check_cuda_device_max_connections() -> None:
    """Warn when the GPU would serialise the lanes' kernels (see the module docstring)."""
    if torch.cuda.is_available() and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        log.warning("CUDA_DEVICE_MAX_CONNECTIONS=1 serialises kernels across streams, so "
                    "paired forward/backward blocks cannot overlap; unset it or set it >= 2 "
                    "for --dhelix")
