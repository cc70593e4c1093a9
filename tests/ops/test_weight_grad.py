"""The operators' weight gradient against Megatron's own backward
(`LinearWithGradAccumulationAndAsyncCommunication`), with and without gradient accumulation
fusion (`dhelix.ops.weight_grad`).

Fusion needs Apex's CUDA extension `fused_weight_gradient_mlp_cuda`, which cannot be
installed on this CPU machine: a CPU stand-in with the extension's contract (`main_grad +=
grad_output^T @ input`, accumulated in `main_grad`'s dtype) takes its place in Megatron's
module, for Megatron's backward and the operators' alike, and records its calls. What is
checked is that the operators call it as Megatron does and leave `main_grad`, the weight's
flag and the gradient handed to autograd as Megatron's backward leaves them."""

import types

import pytest
import torch
from megatron.core.tensor_parallel import layers

from dhelix.ops.weight_grad import fuses_accumulation, weight_gradient


class _FusedWgradStandIn:
    """CPU stand-in for `fused_weight_gradient_mlp_cuda` (Apex, CUDA only)."""

    def __init__(self):
        self.calls = []

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        self.calls.append(("fp32", total_input, grad_output, main_grad))
        main_grad.add_(grad_output.t().float().matmul(total_input.float()))

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad):
        self.calls.append(("fp16", total_input, grad_output, main_grad))
        main_grad.add_(grad_output.t().float().matmul(total_input.float()).to(main_grad.dtype))


@pytest.fixture
def extension(monkeypatch):
    stand_in = _FusedWgradStandIn()
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", stand_in, raising=False)
    monkeypatch.setattr(layers, "HAVE_TE", False)
    # Megatron's backward makes its dummy gradient on the current CUDA device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return stand_in


def _weights(main_dtype, flagged=True):
    """Two equal bf16 weights with equal DDP-style `main_grad` buffers."""
    generator = torch.Generator().manual_seed(1)
    data = torch.randn(6, 4, generator=generator).bfloat16()
    main = torch.randn(6, 4, generator=generator).to(main_dtype)
    weights = []
    for _ in range(2):
        weight = torch.nn.Parameter(data.clone())
        weight.main_grad = main.clone()
        if flagged:
            weight.grad_added_to_main_grad = False
        weights.append(weight)
    return weights


def _operands():
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(5, 4, generator=generator).bfloat16(),   # the GEMM input
            torch.randn(5, 6, generator=generator).bfloat16())   # the output gradient


def _megatron_backward(weight, total_input, grad_output, fusion: bool):
    """Megatron's linear forward and backward (TP 1, no sequence parallelism)."""
    x = total_input.clone().requires_grad_()
    out = layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, weight, None, fusion, False, False, None, 0, None, 1)
    out.backward(grad_output)


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_fused_accumulation_as_megatron_does_it(extension, main_dtype):
    megatron, ours = _weights(main_dtype)
    total_input, grad_output = _operands()
    _megatron_backward(megatron, total_input, grad_output, fusion=True)
    module = types.SimpleNamespace(gradient_accumulation_fusion=True)
    assert fuses_accumulation(module, ours)
    handed = weight_gradient(module, ours, grad_output, total_input)
    assert torch.equal(ours.main_grad, megatron.main_grad)  # accumulated, not via bf16
    assert ours.grad_added_to_main_grad and megatron.grad_added_to_main_grad
    assert handed.shape == megatron.grad.shape and handed.dtype == megatron.grad.dtype
    kind = "fp32" if main_dtype == torch.float32 else "fp16"
    assert [call[0] for call in extension.calls] == [kind, kind]
    for theirs, mine in zip(extension.calls[0][1:3], extension.calls[1][1:3]):
        assert torch.equal(theirs, mine)  # the same operands, in the same order
    # a weight without Megatron DDP's flag gets no gradient from Megatron either
    bare, _ = _weights(main_dtype, flagged=False)
    assert weight_gradient(module, bare, grad_output, total_input) is None


def test_without_fusion_the_gradient_is_megatrons(extension):
    megatron, ours = _weights(torch.float32)
    total_input, grad_output = _operands()
    before = ours.main_grad.clone()
    _megatron_backward(megatron, total_input, grad_output, fusion=False)
    module = types.SimpleNamespace(gradient_accumulation_fusion=False)
    handed = weight_gradient(module, ours, grad_output, total_input)
    assert torch.equal(handed, megatron.grad) and handed.dtype == torch.bfloat16
    assert torch.equal(ours.main_grad, before) and not extension.calls


def test_a_weight_that_takes_no_gradient_leaves_main_grad_alone(extension):
    """The memory measurement runs the layer with its parameters not requiring grad
    (`dhelix.runtime.memory_profile`): the fused path must not touch `main_grad` there."""
    _, ours = _weights(torch.float32)
    ours.requires_grad_(False)
    before = ours.main_grad.clone()
    total_input, grad_output = _operands()
    module = types.SimpleNamespace(gradient_accumulation_fusion=True)
    assert not fuses_accumulation(module, ours)
    handed = weight_gradient(module, ours, grad_output, total_input)
    assert handed.shape == (6, 4) and torch.equal(ours.main_grad, before)
    assert not extension.calls
