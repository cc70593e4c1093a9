"""The RNG stream stock Megatron builds each pipeline stage's model from.

Megatron-LM's `_set_random_seed(seed)` (megatron/training/initialize.py) seeds python,
numpy and torch with `seed + 100 * pp_rank` and `model_parallel_cuda_manual_seed` with the
same value (which, per TP rank, seeds the model-parallel RNG tracker). The stage then
builds its model: every initial weight is a draw from these generators, in construction
order (the CPU default generator with `use_cpu_initialization`, else the CUDA generator
and the tracker's model-parallel state). A folded stage holds layers of other stock stages,
so it must draw them from those stages' streams: `pipeline_stage_rng`.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from megatron.core import tensor_parallel


def seed_pipeline_stage(seed: int, pp_rank: int) -> None:
    """Seed every generator as Megatron's `_set_random_seed(seed)` does on pipeline rank
    `pp_rank` (without data-parallel random init): python, numpy and torch with
    `seed + 100 * pp_rank`, and the model-parallel RNG tracker of this TP rank."""
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def _copy(state):
    return state.clone() if isinstance(state, torch.Tensor) else state


def capture_rng_states() -> dict:
    """Copies of every generator state `seed_pipeline_stage` sets (python, numpy, torch CPU,
    CUDA where available, the model-parallel tracker's named states)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {name: _copy(s) for name, s in tracker.get_states().items()},
        "tracker_initialized": tracker.is_initialized(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict) -> None:
    """Put back what `capture_rng_states` returned; afterwards every generator draws exactly
    what it would have drawn at capture time."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if states["tracker_initialized"]:
        tracker.set_states(dict(states["tracker"]))
    else:
        tracker.reset()


@contextlib.contextmanager
def pipeline_stage_rng(seed: int, pp_rank: int, prelude=None):
    """Inside: every generator as stock Megatron's pipeline rank `pp_rank` has it right after
    `seed_pipeline_stage(seed, pp_rank)` and then `prelude()` (what the training loop draws
    between seeding and building the model, e.g. `megatron.training.pretrain`'s JIT warm-up
    on random tensors), i.e. before that stage builds its model. On exit (also on error)
    every generator is back in the state it had on entry."""
    saved = capture_rng_states()
    try:
        seed_pipeline_stage(seed, pp_rank)
        if prelude is not None:
            prelude()
        yield
    finally:
        restore_rng_states(saved)
