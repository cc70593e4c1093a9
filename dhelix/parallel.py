"""Process-group and Megatron parallel-state set-up for one training process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.gloo_device import share_gloo_device_if_asked
from megatron_patches.cpu_shims import apply_cpu_shims
from megatron_patches.stage_rng import seed_pipeline_stage


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron parallel sizes; data-parallel size is derived from the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1

    def data_parallel_size(self, world_size: int) -> int:
        model = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP = {model}"
            )
        return world_size // model


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class Job:
    """This process's part in the training job: what `init_process_group_from_env` set up,
    held in one object and passed explicitly to what needs it (in the style of torchtitan's
    ParallelDims), instead of module state.

    - `store`: the key/value store every rank joined through (torch's default-group store,
      i.e. the rendezvous store under torch's prefixes; under torchrun it lives in the
      agent, so it answers while any rank is stalled), prefixed for dhelix's own keys.
    - `timeout`: the process-group timeout; pass it to every group created later, whose own
      default (torch's and Megatron's: 30 minutes) would otherwise let a stalled rank hang
      the job.

    `Job()` (both None) says the default process group was created elsewhere (e.g. by
    megatron.training's `initialize_megatron` under the plugin): groups then get torch's and
    Megatron's default timeouts and no stall guard is built, as before this object existed.
    """

    store: object = None
    timeout: timedelta | None = None

    @property
    def created_elsewhere(self) -> bool:
        """True when `init_process_group_from_env` did not create the default group."""
        return self.store is None


def _dhelix_store():
    # torch holds the default group's store for as long as the group exists (torch 2.13 has
    # no public accessor for it)
    return dist.PrefixStore("dhelix", dist.distributed_c10d._get_default_store())


def job_of_megatron_group(timeout: timedelta) -> Job:
    """The Job of a default group that megatron.training's `initialize_megatron` created
    (under the plugin): that group's store, prefixed for dhelix's keys, and its timeout
    (Megatron's --distributed-timeout-minutes). Call after the group exists."""
    return Job(_dhelix_store(), timeout)


def _timeout_key() -> str:
    # one key per rank: each process reads back exactly the timeout it joined with
    return f"job/timeout_us/{dist.get_rank()}"


def _job_of_default_group() -> Job:
    """The Job `init_process_group_from_env` recorded in the default group's store
    (`Job()` when another caller created the group)."""
    store = _dhelix_store()
    if not store.check([_timeout_key()]):
        return Job()
    return Job(store, timedelta(microseconds=int(store.get(_timeout_key()))))


def init_process_group_from_env(backend: str | None = None, timeout_s: float = 300) -> Job:
    """Join the torchrun-style group (RANK, WORLD_SIZE, MASTER_ADDR/PORT) if not joined yet,
    and return this process's `Job`.

    Installs the CPU shims first on a CPU-only torch (and one gloo device for every group
    with `DHELIX_GLOO_SHARED_DEVICE=1`, `dhelix.gloo_device`), and picks this rank's GPU on
    CUDA.
    `timeout_s` bounds every collective and store wait (the process-group timeout). Joins
    exactly as `init_process_group(init_method="env://")` does.

    The Job is recorded in the default group's own store (a key per rank), not in module
    state, so a later call while the group exists (e.g. a test body after
    `dhelix.harness.run_megatron_ranks` joined) returns a Job with the first call's store
    and timeout (its `timeout_s` and `backend` are then ignored), and a group created by
    another caller (megatron.training) gives `Job()`. The record ends with the group
    (`destroy_process_group`).
    """
    apply_cpu_shims()
    share_gloo_device_if_asked()
    if dist.is_initialized():
        return _job_of_default_group()
    backend = backend or default_backend()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    job = Job(_dhelix_store(), timeout)
    job.store.set(_timeout_key(), str(timeout // timedelta(microseconds=1)))
    return job


def folded_embedding_ranks(pp_ranks, *_unused) -> list:
    """Embedding-group ranks of a folded model: the first stage only, because it holds both
    the input embedding and the output layer (no cross-stage tied-weight sync)."""
    return [pp_ranks[0]]


def init_megatron_parallel_state(sizes: ParallelSizes, seed: int, job: Job,
                                 folded: bool = False) -> None:
    """(Re)initialise Megatron's model-parallel groups and seed every RNG like Megatron does.

    Megatron's groups get `job.timeout` (Megatron's default, 30 minutes, for `Job()`).

    Seeds: python/numpy/torch get `seed + 100 * pp_rank` (Megatron's `_set_random_seed`);
    the model-parallel RNG tracker is seeded by `model_parallel_cuda_manual_seed(seed')`
    (`megatron_patches.stage_rng.seed_pipeline_stage`).
    `folded=True` (model folding, `dhelix.folding`) puts only the first pipeline stage in the
    embedding group, so Megatron's tied-embedding sync and `finalize_model_grads` involve no
    other stage; stock GPTModel chunks need the default (first and last stage).
    """
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    sizes.data_parallel_size(dist.get_world_size())  # raises on inconsistent sizes
    extra = {"get_embedding_ranks": folded_embedding_ranks} if folded else {}
    if job.timeout is not None:
        extra["distributed_timeout_minutes"] = job.timeout.total_seconds() / 60
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor_model_parallel_size,
        pipeline_model_parallel_size=sizes.pipeline_model_parallel_size,
        **extra,
    )
    seed_pipeline_stage(seed, parallel_state.get_pipeline_model_parallel_rank())


def destroy_parallel_state() -> None:
    """Tear down Megatron's groups (the default process group stays)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def process_groups() -> list:
    """Every process group alive in this process but the default (world) one, oldest first.
    torch keeps each group in its registry (`distributed_c10d._world.pg_map`, no public
    list) until `destroy_process_group(group)`, whoever else holds it; on gloo each live
    group keeps transport threads that wake every few ms, so a process that builds many
    runs must destroy the groups it no longer uses ([] before the default group exists)."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return []
    world = distributed_c10d._get_default_group()
    return [group for group in distributed_c10d._world.pg_map if group is not world]


def destroy_process_groups_since(earlier: list) -> None:
    """Destroy every group `process_groups()` lists now that `earlier` (an older reading of
    it) did not: the groups made since, by Megatron's `initialize_megatron`, the plugin's
    lanes or anyone else, once nothing will use them again. Every rank calls it at the same
    point (torch asks every member of a group to destroy it)."""
    before = {id(group) for group in earlier}
    for group in process_groups():
        if id(group) not in before:
            dist.destroy_process_group(group)
