"""Megatron's `Float16Module` (megatron-core `megatron/core/transformer/module.py`) for the
folded model: the precision conversions at the folded model's ends.

Stock Megatron wraps each model chunk of a `--bf16` (or `--fp16`) run in `Float16Module`: the
chunk's parameters are cast to bf16, floating-point fp32 inputs are cast to bf16 on the first
pipeline stage and the outputs are cast back to fp32 on the last stage. A folded stage
(`megatron_patches.folded_model.FoldedGPTModel`) has both ends on stage 0: the first-half
chunk takes the embedding's input there and the second-half chunk ends in the loss there;
the last pipeline stage is the turn of the U, whose outputs are hidden states for the next
hop (they travel in `config.pipeline_dtype`, bf16, as between stock stages). So
`FoldedFloat16Module` converts inputs where stage 0's first-half chunk takes them and outputs
where stage 0's second-half chunk returns them (per-token loss or logits), and nowhere else.

Everything else is `Float16Module`'s: the bf16 cast of the wrapped module, `state_dict`,
`sharded_state_dict`, `set_input_tensor`; Megatron's optimizer, DDP grad buffers and fp32
main parameters see the same module tree as in a stock bf16 run.
"""

from __future__ import annotations

from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

from dhelix.folding import FIRST_HALF, SECOND_HALF
from megatron_patches.folded_model import FoldedGPTModel


class FoldedFloat16Module(Float16Module):
    """`Float16Module` around a `FoldedGPTModel` stage (module docstring). `forward` takes the
    folded model's `chunk` keyword and converts at the folded ends only."""

    def __init__(self, config, module: FoldedGPTModel):
        if not isinstance(module, FoldedGPTModel):
            raise TypeError(f"FoldedFloat16Module wraps a FoldedGPTModel, not "
                            f"{type(module).__name__}")
        super().__init__(config, module)

    def forward(self, *inputs, chunk: int, fp32_output: bool = True, **kwargs):
        """The wrapped stage's `forward(*inputs, chunk=chunk, **kwargs)` in model precision:
        fp32 positional inputs are cast to bf16/fp16 on the chunk that embeds (stage 0,
        first half), and the output is cast to fp32 on the chunk that ends in the loss
        (stage 0, second half) when `fp32_output`, as `Float16Module.forward` does on the
        first and last stock stages."""
        module = self.module
        if module.pre_process and chunk == FIRST_HALF:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = module(*inputs, chunk=chunk, **kwargs)
        if module.post_process and chunk == SECOND_HALF and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs


def float16_module(config, module):
    """The `mixed_precision_wrapper` for `GPTModelBuilder.build_distributed_models` in a
    folded run (`megatron_patches.training_hooks`): `FoldedFloat16Module` for a folded stage,
    Megatron's `Float16Module` for anything else."""
    if isinstance(module, FoldedGPTModel):
        return FoldedFloat16Module(config, module)
    return Float16Module(config, module)
