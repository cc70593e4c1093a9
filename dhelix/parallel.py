"""Process-group and Megatron parallel-state set-up for one training process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

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


_job_store = None
_job_timeout: timedelta | None = None


def init_process_group_from_env(backend: str | None = None, timeout_s: float = 300) -> None:
    """Join the torchrun-style group (RANK, WORLD_SIZE, MASTER_ADDR/PORT) if not joined yet.

    Installs the CPU shims first on a CPU-only torch, and picks this rank's GPU on CUDA.
    `timeout_s` bounds every collective and store wait (the process-group timeout). Joins
    exactly as `init_process_group(init_method="env://")` does, keeping the rendezvous store
    for `job_store`.
    """
    global _job_store, _job_timeout
    apply_cpu_shims()
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    _job_store = dist.PrefixStore("dhelix", store)
    _job_timeout = timeout


def job_timeout() -> timedelta | None:
    """The process-group timeout `init_process_group_from_env` set (None when the group was
    created elsewhere): pass it to every group created later, whose own default (torch's
    and Megatron's: 30 minutes) would otherwise let a stalled rank hang the job."""
    return _job_timeout if dist.is_initialized() else None


def job_store():
    """The key/value store every rank joined through (under torchrun it lives in the agent,
    so it answers while any rank is stalled), prefixed for dhelix's own keys; None when the
    process group was not created by `init_process_group_from_env`."""
    return _job_store if dist.is_initialized() else None


def folded_embedding_ranks(pp_ranks, *_unused) -> list:
    """Embedding-group ranks of a folded model: the first stage only, because it holds both
    the input embedding and the output layer (no cross-stage tied-weight sync)."""
    return [pp_ranks[0]]


def init_megatron_parallel_state(sizes: ParallelSizes, seed: int, folded: bool = False) -> None:
    """(Re)initialise Megatron's model-parallel groups and seed every RNG like Megatron does.

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
    if job_timeout() is not None:
        extra["distributed_timeout_minutes"] = job_timeout().total_seconds() / 60
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
