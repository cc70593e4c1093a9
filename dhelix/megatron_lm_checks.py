"""Megatron-LM arguments that `--dhelix` cannot honour, checked on the parsed namespace
before Megatron validates it and before any process group exists
(`megatron_patches.training_hooks`). Each refusal is one line naming the argument and
what to do instead."""

from __future__ import annotations


class UnsupportedArgument(ValueError):
    """`--dhelix` cannot run with this Megatron argument; the message names it."""


def _refusals(args):
    """(condition, message) for every argument `--dhelix` refuses."""
    pp = args.pipeline_model_parallel_size
    yield (args.virtual_pipeline_model_parallel_size is not None
           or args.num_layers_per_virtual_pipeline_stage is not None
           or getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None,
           "--dhelix does not support virtual pipelining (--num-layers-per-virtual-pipeline-"
           "stage / --virtual-pipeline-model-parallel-size): with PP > 1 it folds the model "
           "into a U itself; drop the virtual pipeline argument")
    yield (args.recompute_granularity is not None,
           f"--dhelix does not support --recompute-granularity {args.recompute_granularity}: "
           "the operator programs keep their own activations; drop --recompute-granularity")
    yield (args.fp16, "--dhelix does not support --fp16 (loss scaling is not done by the "
                      "DHelix schedules); use --bf16 or fp32")
    yield (args.num_experts is not None,
           "--dhelix does not support MoE (--num-experts): the operator programs cover dense "
           "transformer layers; drop --num-experts")
    yield (args.expert_model_parallel_size > 1,
           "--dhelix does not support expert parallelism (--expert-model-parallel-size "
           f"{args.expert_model_parallel_size}); use 1")
    yield (args.context_parallel_size > 1,
           "--dhelix does not support context parallelism (--context-parallel-size "
           f"{args.context_parallel_size}); use 1")
    yield (args.overlap_grad_reduce and pp > 1,
           "--dhelix with --pipeline-model-parallel-size > 1 does not support "
           "--overlap-grad-reduce (the W schedule reduces gradients after the last backward); "
           "drop --overlap-grad-reduce")
    yield (args.hidden_dropout or args.attention_dropout,
           "--dhelix needs --hidden-dropout 0 --attention-dropout 0 (two interleaved strands "
           "would draw dropout masks in a different order than Megatron)")
    yield (getattr(args, "mtp_num_layers", None),
           "--dhelix does not support multi-token prediction (--mtp-num-layers); drop it")
    yield (getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False),
           "--dhelix does not support FSDP (--use-torch-fsdp2 / --use-megatron-fsdp); use "
           "Megatron's DDP, with --use-distributed-optimizer if needed")
    yield (getattr(args, "transformer_impl", "local") == "transformer_engine"
           and _has_transformer_engine(),
           "--dhelix runs megatron-core's local layer spec: add --transformer-impl local")


def _has_transformer_engine() -> bool:
    from megatron_patches.compat import has_transformer_engine

    return has_transformer_engine()


def check_dhelix_args(args) -> None:
    """Raise `UnsupportedArgument` for the first Megatron argument `--dhelix` cannot honour
    (virtual pipelining, recomputation, fp16, MoE/expert parallelism, context parallelism,
    dropout, multi-token prediction, FSDP, Transformer Engine layers; overlapped gradient
    reduction with PP > 1); return None when the run is supported."""
    for refused, message in _refusals(args):
        if refused:
            raise UnsupportedArgument(message)
