"""The torch norms of dhelix's local layer spec (`megatron_patches.norms`) take the model's
`params_dtype`, as Megatron's Float16Module would cast them: a bf16 model's RMSNorm gets a
bf16 weight, so torch's fused kernel runs (no "Mismatch dtype" fallback warning)."""

from __future__ import annotations

import warnings

import pytest
import torch


def _norm(normalization: str, dtype, sequence_parallel: bool):
    from megatron.core.transformer import TransformerConfig

    from megatron_patches.norms import SequenceParallelTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               tensor_model_parallel_size=2 if sequence_parallel else 1,
                               sequence_parallel=sequence_parallel, normalization=normalization,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype,
                               use_cpu_initialization=True)
    return SequenceParallelTorchNorm(config, 32, normalization=normalization)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_bf16_norm_weight_matches_input_without_warning(normalization, sequence_parallel):
    norm = _norm(normalization, torch.bfloat16, sequence_parallel)
    params = list(norm.parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    assert all(getattr(p, "sequence_parallel", False) == sequence_parallel for p in params)
    x = torch.randn(8, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = norm(x)
        y.float().sum().backward()
    mismatch = [str(w.message) for w in caught if "Mismatch dtype" in str(w.message)]
    assert not mismatch, mismatch
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


def test_fp32_norm_stays_fp32():
    assert all(p.dtype == torch.float32 for p in _norm("RMSNorm", torch.float32, False)
               .parameters())


def test_the_warning_this_guards_against_exists():
    # The check above can fail: an fp32 RMSNorm weight against a bf16 input warns on CPU too.
    norm = torch.nn.RMSNorm(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm(torch.randn(4, 32, dtype=torch.bfloat16))
    assert any("Mismatch dtype" in str(w.message) for w in caught)
