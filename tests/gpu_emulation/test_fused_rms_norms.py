"""`regions.fused_rms_norms`: under a `GpuEmulationMode` an RMSNorm whose weight has its
input's dtype runs as CUDA's fused kernels do. Single process, small shapes:

- what its autograd saves: the input, the fp32 rstd ([..., 1]) and the weight, against
  torch's CPU decomposition, which saves fp32 copies of the input;
- what each direction allocates while it runs, read by `dhelix.memtrace.measure_peak`: the
  output and rstd forward, the input's and weight's gradients backward (no fp32
  temporaries), so the whole forward/backward peaks lower than the decomposition;
- one "norm.fused.fwd/bwd" charge each way and no aten kernel of its own;
- tensors the mode runs for real (cheap ones): the same values and gradients as torch's
  RMSNorm; an fp32 weight against a bf16 input, or no mode: torch's own path;
- the patch is process-wide while open, re-entrant, and gone when the last context
  closes.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_emulation.test_mode import H100_PROFILE, _mode

pytestmark = pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")

S, B, H = 256, 2, 512


def _saved_bytes(fn) -> tuple:
    """((dtype name, numel) of every tensor autograd saves while `fn()` runs, `fn`'s
    result)."""
    saved = []

    def pack(t):
        saved.append((str(t.dtype), t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def _norm(dtype=torch.bfloat16):
    return torch.nn.RMSNorm(H, eps=1e-5).to(dtype)


def test_saves_input_rstd_and_weight_only():
    from dhelix.gpu_emulation.regions import fused_rms_norms

    norm = _norm()
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    with _mode(scale=1e-6):
        decomposed, _ = _saved_bytes(lambda: norm(x))
    with fused_rms_norms(), _mode(scale=1e-6):
        fused, y = _saved_bytes(lambda: norm(x))
    assert sorted(fused) == sorted([("torch.bfloat16", S * B * H), ("torch.float32", S * B),
                                    ("torch.bfloat16", H)]), fused
    assert y.shape == x.shape and y.dtype == x.dtype
    fp32_saved = sum(n for dtype, n in decomposed if dtype == "torch.float32")
    assert fp32_saved >= S * B * H, decomposed  # torch's CPU path keeps fp32 copies


def test_allocations_and_charges_are_the_fused_kernels():
    from dhelix.gpu_emulation.regions import fused_rms_norms
    from dhelix.memtrace import measure_peak

    norm = _norm()
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(S, B, H, dtype=torch.bfloat16)
    bf16 = S * B * H * 2

    def step():
        y = norm(x)
        y.backward(grad)

    with _mode(scale=1e-6):
        _, decomposed = measure_peak(step)
    norm.weight.grad = x.grad = None
    mode = _mode(scale=1e-6)
    with fused_rms_norms(), mode:
        _, fused = measure_peak(step)
    # forward: output + rstd; backward (output freed at its last use or held by the caller's
    # y): the input's gradient + the weight's; nothing of fp32 [s, b, h]
    assert fused.compute_peak_bytes <= 2 * bf16 + S * B * 4 + 2 * H * 2 + 4096, fused
    assert decomposed.compute_peak_bytes > fused.compute_peak_bytes + bf16, (decomposed, fused)
    terms = mode.report().by_term
    assert terms["norm.fused.fwd"].count == 1 and terms["norm.fused.bwd"].count == 1
    assert not any(name.startswith("memory.") for name in terms), terms
    assert x.grad.shape == x.shape and norm.weight.grad.shape == norm.weight.shape


def test_cheap_tensors_compute_torchs_values():
    from dhelix.gpu_emulation.regions import fused_rms_norms

    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8) + 0.5)
    x = torch.randn(4, 3, 8, requires_grad=True)
    grad = torch.randn(4, 3, 8)
    reference = norm(x)
    reference.backward(grad)
    expected = (reference.detach(), x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    with fused_rms_norms(), _mode(scale=1e-6):
        y = norm(x)
        assert type(y.grad_fn).__name__ == "_FusedRMSNormBackward"
        y.backward(grad)
    for got, want in zip((y.detach(), x.grad, norm.weight.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torchs_path_where_cuda_takes_it_too_and_outside_the_mode(monkeypatch):
    from dhelix.gpu_emulation import regions

    # torch's own forward (the one the patch replaces), observed (calling it for an fp32
    # weight against a bf16 input would spend torch's once-a-process "Mismatch dtype"
    # warning that tests/test_norm_dtype.py checks)
    calls = []
    monkeypatch.setattr(torch.nn.RMSNorm, "forward",
                        lambda module, x: calls.append(module.weight.dtype) or x * 1)
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    with regions.fused_rms_norms():
        with _mode(scale=1e-6):
            y = _norm(torch.float32)(x)
        assert type(y.grad_fn).__name__ != "_FusedRMSNormBackward"
        y = _norm()(x)  # no mode active
        assert type(y.grad_fn).__name__ != "_FusedRMSNormBackward"
    assert calls == [torch.float32, torch.bfloat16]


def test_patch_is_reentrant_and_removed_on_exit():
    from dhelix.gpu_emulation.regions import fused_rms_norms

    original = torch.nn.RMSNorm.forward
    with fused_rms_norms():
        patched = torch.nn.RMSNorm.forward
        assert patched is not original
        with fused_rms_norms():
            assert torch.nn.RMSNorm.forward is patched
        assert torch.nn.RMSNorm.forward is patched  # the outer context still open
    assert torch.nn.RMSNorm.forward is original
