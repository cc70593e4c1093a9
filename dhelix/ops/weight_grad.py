"""A Megatron linear layer's weight gradient, computed as Megatron's own backward computes it
(`megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication`),
for the operators' weight-gradient kernels (`linear_wgrad`, `expert_linear_wgrad`).

With gradient accumulation fusion (the layer's `gradient_accumulation_fusion`: Megatron's
default where Apex's `fused_weight_gradient_mlp_cuda` is installed, which a GPU machine
with Apex has and this CPU one does not, `megatron_patches.machine_arguments`) the GEMM
accumulates straight into the weight's `main_grad` (fp32, or fp16/bf16) through that
extension, and autograd gets a dummy gradient with the weight flagged
`grad_added_to_main_grad`, which Megatron DDP's backward hook does not add again. Without
it, the GEMM's gradient in the activations' dtype, which the hook adds to `main_grad`. Same
extension, same arguments, same rounding as Megatron's schedule either way: with fusion the
product is accumulated in `main_grad`'s precision, never rounded to bf16 first.
"""

from __future__ import annotations

import torch


def fuses_accumulation(module, weight: torch.nn.Parameter) -> bool:
    """Whether `weight`'s gradient goes straight into its `main_grad` as Megatron's backward
    sends it there: the layer has gradient accumulation fusion on, the weight has a
    `main_grad` (Megatron DDP's buffer) and takes gradients (not during the memory
    measurement, `dhelix.runtime.memory_profile`, which must leave `main_grad` alone)."""
    return (bool(getattr(module, "gradient_accumulation_fusion", False))
            and weight.requires_grad and getattr(weight, "main_grad", None) is not None)


def weight_gradient(module, weight: torch.nn.Parameter, grad_output: torch.Tensor,
                    total_input: torch.Tensor):
    """`grad_output^T @ total_input` (2-D, as `prepare_input_tensors_for_wgrad_compute`
    returns them) for `module`'s `weight`, to hand to `local_graph.deliver_param_grads`.
    With fused accumulation (`fuses_accumulation`): accumulated into `weight.main_grad` by
    Megatron's extension and returned as Megatron returns it (a dummy on `main_grad`'s
    device, flagged `grad_added_to_main_grad`, Transformer Engine's shared dummy where it is
    installed; None for a weight without that attribute). Otherwise the returned tensor is
    the caller's, on the inputs' device; nothing else keeps it."""
    if not fuses_accumulation(module, weight):
        return grad_output.t().matmul(total_input)
    from megatron.core.tensor_parallel import layers

    main_grad = weight.main_grad
    if main_grad.dtype == torch.float32:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output,
                                                                   main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output,
                                                                   main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion: unsupported main_grad dtype "
                           f"{main_grad.dtype} (Megatron's fused kernels take fp32, fp16 "
                           "and bf16)")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    shape, dtype = list(main_grad.shape), total_input.dtype
    if getattr(weight, "zero_out_wgrad", False):
        dummy = (layers.get_dummy_wgrad(shape, dtype, zero=True) if layers.HAVE_TE
                 else torch.zeros(shape, dtype=dtype, device=main_grad.device))
    else:
        dummy = (layers.get_dummy_wgrad(shape, dtype) if layers.HAVE_TE
                 else torch.empty(shape, dtype=dtype, device=main_grad.device))
    weight.grad_added_to_main_grad = True
    return dummy
