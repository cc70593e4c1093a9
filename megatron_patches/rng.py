"""CPU replacement for Megatron's model-parallel RNG tracker.

Replaces: `megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add` and `.fork`, which
call `torch.cuda.get_rng_state`/`torch.cuda.manual_seed` (absent on a CPU-only torch) and hit
every `model_parallel_cuda_manual_seed` and every forward that forks for dropout.

On CPU the generator that dropout and initialisation draw from is the CPU default
generator, so the tracker stores CPU generator states: `add(name, seed)` records the state
that `torch.manual_seed(seed)` would produce without disturbing the current one, and
`fork(name)` swaps that state in for the duration of the block and saves it back afterwards,
exactly as the CUDA tracker does with CUDA states.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mcore_random


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's tracker API over CPU generator states (subclass, so isinstance checks in
    `get_all_rng_states` and checkpointing keep working)."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(
                    f"current rng state {self._current_state_name} is not the forked {name}"
                )
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def install_cpu_rng_tracker() -> None:
    """Make `initialize_rng_tracker` build CPU trackers; reset any CUDA tracker built so far."""
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random.initialize_rng_tracker(force_reset=True)
