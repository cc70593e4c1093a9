"""SDPA core attention (`megatron_patches.sdpa_attention`) against megatron-core's own
`DotProductAttention`: forward output and the gradients of query, key and value, causal,
MHA and GQA, at the per-rank head counts TP (with or without SP: attention sees the full
sequence either way) hands it. fp32 on CPU to rounding; bf16 on CUDA (skipped without it).
Plus the layer spec swap and the argument refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_patches.sdpa_attention import (
    SDPAttention, SDPAttentionError, check_attention_args, layer_spec_for, sdpa_layer_spec,
)

FP32_TOL = 1e-5   # max |diff| of outputs/grads of unit-scale inputs (rounding, s <= 64)
# bf16: max |diff| relative to the largest |value| of Megatron's result (fused flash/cuDNN
# kernels vs Megatron's bf16 matmuls around an fp32 softmax; bf16 keeps 8 mantissa bits)
BF16_REL_TOL = 3e-2


@dataclasses.dataclass(frozen=True)
class _RankShape:
    """The only thing both modules read from their TP group: its size (the per-rank head
    and query-group counts). No collective runs inside core attention."""

    tp: int

    def size(self) -> int:
        return self.tp


def _pair(heads: int, groups: int, tp: int, dtype, sequence_parallel: bool):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patches.cpu_shims import apply_cpu_shims

    apply_cpu_shims()  # no-op with CUDA
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # DotProductAttention's score buffer
        parallel_state._set_global_memory_buffer()
    tracker = tensor_parallel.get_cuda_rng_tracker()  # forked around its (p=0) dropout
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", 1234)
    config = TransformerConfig(
        num_layers=1, hidden_size=heads * 16, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=16, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_cpu_initialization=True)
    pg = type("PG", (), {"tp": _RankShape(tp)})()
    kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", pg_collection=pg)
    return DotProductAttention(**kwargs), SDPAttention(**kwargs)


def _compare(heads, groups, tp, sp, dtype, device, seq=64, batch=2):
    megatron, sdpa = _pair(heads, groups, tp, dtype, sp)
    gen = torch.Generator().manual_seed(heads * 100 + groups * 10 + tp)
    n, g = heads // tp, groups // tp
    shapes = [(seq, batch, n, 16), (seq, batch, g, 16), (seq, batch, g, 16)]
    inputs = [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]
    grad_out = torch.randn(seq, batch, n * 16, generator=gen).to(device=device, dtype=dtype)
    results = []
    for module in (megatron, sdpa):
        leaves = [t.clone().requires_grad_() for t in inputs]
        # Megatron passes its causal mask ([b, 1, s, s], True = masked) along; only the
        # unfused path reads it.
        mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
        out = module(*leaves, mask)
        out.backward(grad_out)
        results.append((out.detach(), *[t.grad for t in leaves]))
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*results)]
    scales = [a.float().abs().max().item() for a in results[0]]
    assert results[1][0].shape == (seq, batch, n * 16)
    assert results[1][0].dtype == dtype and results[1][0].device.type == device
    return diffs, scales


@pytest.mark.parametrize("heads,groups,tp,sp", [
    (4, 4, 1, False),   # MHA
    (8, 2, 1, False),   # GQA 4:1
    (8, 4, 2, False),   # GQA at TP2: 4 heads, 2 groups per rank
    (8, 4, 2, True),    # the same with sequence parallelism (the full sequence reaches it)
    (8, 8, 4, True),    # MHA at TP4 + SP
])
def test_sdpa_matches_megatron_fp32_cpu(heads, groups, tp, sp):
    diffs, _ = _compare(heads, groups, tp, sp, torch.float32, "cpu")
    print(f"heads {heads} groups {groups} tp {tp} sp {sp}: max |diff| out/dq/dk/dv {diffs}")
    assert max(diffs) <= FP32_TOL, diffs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,groups", [(8, 8), (32, 8)])
def test_sdpa_matches_megatron_bf16_cuda(heads, groups):
    diffs, scales = _compare(heads, groups, 1, False, torch.bfloat16, "cuda", seq=512)
    relative = [d / s for d, s in zip(diffs, scales)]
    print(f"bf16 heads {heads} groups {groups}: max |diff| / max |Megatron| out/dq/dk/dv "
          f"{relative}")
    assert max(relative) <= BF16_REL_TOL, relative


def test_causality_changes_the_output():
    # The check above can fail: a non-causal SDPA call differs from Megatron's output.
    megatron, sdpa = _pair(4, 4, 1, torch.float32, False)
    q, k, v = (torch.randn(16, 1, 4, 16) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]
    full = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v))).permute(2, 0, 1, 3).reshape(16, 1, 64)
    assert (full - megatron(q, k, v, mask)).abs().max() > 1e-2
    assert (sdpa(q, k, v, mask) - megatron(q, k, v, mask)).abs().max() <= FP32_TOL


def test_layer_spec_swap_and_refusals():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    swapped = sdpa_layer_spec(spec)
    assert swapped.submodules.self_attention.submodules.core_attention is SDPAttention
    assert spec.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert layer_spec_for(spec, "megatron") is spec
    with pytest.raises(SDPAttentionError, match="local layer spec"):
        sdpa_layer_spec(swapped)  # its core attention is no longer DotProductAttention
    with pytest.raises(SDPAttentionError, match="not one of"):
        layer_spec_for(spec, "flash")
    # an MoE model's block spec (Megatron's --moe-layer-freq stack): every layer swapped
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm"), spec],
        layer_norm=torch.nn.LayerNorm)
    block_sdpa = layer_spec_for(block, "sdpa")
    cores = [layer.submodules.self_attention.submodules.core_attention
             for layer in block_sdpa.layer_specs]
    assert cores == [SDPAttention, SDPAttention] and block_sdpa.layer_norm == block.layer_norm
    assert all(layer.submodules.self_attention.submodules.core_attention is DotProductAttention
               for layer in block.layer_specs)
    assert block_sdpa.layer_specs[0].submodules.mlp == block.layer_specs[0].submodules.mlp
    args = type("Args", (), {"dhelix_attention": "sdpa", "reset_attention_mask": True})()
    with pytest.raises(SDPAttentionError, match="--reset-attention-mask"):
        check_attention_args(args)
    args.dhelix_attention = "megatron"
    check_attention_args(args)  # megatron's attention takes any mask
