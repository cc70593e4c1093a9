"""The CPU shims in one process: device mapping, CUDA type names, the CPU RNG tracker, and
the sequence-parallel norm factory (its multi-rank effect is covered in
test_layout_parity.py)."""

import pytest
import torch

from megatron_patches.cpu_shims import apply_cpu_shims

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only shims")


@pytest.fixture(scope="module", autouse=True)
def shims():
    assert apply_cpu_shims() is True


def test_cuda_devices_map_to_cpu():
    for device in (0, "cuda", "cuda:0", torch.device("cuda"), torch.cuda.current_device()):
        assert torch.empty(2, device=device).device.type == "cpu"
        assert torch.zeros(2).to(device).device.type == "cpu"
        assert torch.zeros(2).new_empty((3,), device=device).device.type == "cpu"
        assert torch.zeros(2).new_zeros((3,), device=device).device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"


def test_cuda_type_names_for_megatron_asserts():
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64


def test_cpu_rng_tracker_fork_is_isolated_and_reproducible():
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_patches.rng import CpuRNGStatesTracker

    mcore_random.initialize_rng_tracker(force_reset=True)
    tracker = mcore_random.get_cuda_rng_tracker()
    assert isinstance(tracker, CpuRNGStatesTracker)
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the forked stream advanced
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), first)  # and started at seed 123


def test_sequence_parallel_norm_is_tagged():
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.norms import SequenceParallelTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               tensor_model_parallel_size=2, sequence_parallel=True,
                               use_cpu_initialization=True)
    norm = SequenceParallelTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is not modified
    plain = SequenceParallelTorchNorm(
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                          use_cpu_initialization=True), 8)
    assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())


def test_local_norm_is_replaced_on_every_machine(monkeypatch):
    """The sequence-parallel norm is bound wherever megatron-core bound `WrappedTorchNorm`,
    by `install_plugin` on any machine (a GPU without TE/Apex gets the same norm; on the
    H100 the CPU-only binding refused `--sequence-parallel`); another norm stays."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_patches.norms import (SequenceParallelTorchNorm,
                                        install_sequence_parallel_torch_norm)

    class OtherNorm:  # stands for Apex's fused norm
        pass

    monkeypatch.setattr(backends, "LNImpl", WrappedTorchNorm)
    monkeypatch.setattr(gpt_layer_specs, "LNImpl", WrappedTorchNorm)
    monkeypatch.setattr(transformer_block, "LayerNormImpl", OtherNorm)
    install_sequence_parallel_torch_norm()
    assert backends.LNImpl is SequenceParallelTorchNorm
    assert gpt_layer_specs.LNImpl is SequenceParallelTorchNorm
    assert transformer_block.LayerNormImpl is OtherNorm


_WHERE_A_16_MIB_TENSOR_LIVES = """
import torch
from megatron_patches.cpu_allocator import keep_freed_memory
applied = keep_freed_memory()
t = torch.empty(1 << 22)
where = "anonymous mapping"
for line in open("/proc/self/maps"):
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    if lo <= t.data_ptr() < hi and line.split()[-1] == "[heap]":
        where = "heap"
print(applied, where)
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="Linux only")
def test_freed_memory_kept_unless_the_environment_sets_glibcs_thresholds():
    """`keep_freed_memory`: a 16 MiB tensor comes from glibc's heap (kept across steps);
    with `MALLOC_MMAP_THRESHOLD_` in the environment (the GPU emulation's benchmark sets
    it) the setting is left alone and the tensor is its own fresh mapping."""
    import os
    import subprocess
    import sys

    def run(extra_env):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _WHERE_A_16_MIB_TENSOR_LIVES],
                             env={**env, **extra_env}, capture_output=True, text=True,
                             check=True, timeout=120)
        return out.stdout.split()[-3:]

    assert run({}) == ["True", "heap"]
    assert run({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}) == ["False", "anonymous", "mapping"]
