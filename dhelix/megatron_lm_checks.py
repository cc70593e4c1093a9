"""Megatron-LM arguments that `--dhelix` cannot honour, and `--dhelix*` arguments that
cannot work, checked on the parsed namespace before Megatron validates it and before any
process group exists (`megatron_patches.training_hooks`). Each refusal is one line naming
the argument and what to do instead."""

from __future__ import annotations

from megatron_patches.moe_support import check_supported_moe


class UnsupportedArgument(ValueError):
    """`--dhelix` cannot run with this Megatron argument; the message names it."""


def _arg(args, name, default=None):
    return getattr(args, name, default)


def _refusals(args):
    """(condition, message) for every argument `--dhelix` refuses, in argument order."""
    pp = args.pipeline_model_parallel_size
    yield (_arg(args, "num_layers_per_virtual_pipeline_stage") is not None
           or _arg(args, "num_virtual_stages_per_pipeline_rank") is not None,
           "--dhelix does not support virtual pipelining (--num-layers-per-virtual-pipeline-"
           "stage / --num-virtual-stages-per-pipeline-rank): with PP > 1 it folds the model "
           "into a U itself; drop the virtual pipeline argument")
    yield (_arg(args, "pipeline_model_parallel_layout") is not None
           or _arg(args, "decoder_first_pipeline_num_layers") is not None
           or _arg(args, "decoder_last_pipeline_num_layers") is not None
           or _arg(args, "account_for_embedding_in_pipeline_split", False)
           or _arg(args, "account_for_loss_in_pipeline_split", False),
           "--dhelix does not support uneven pipeline stages (--pipeline-model-parallel-layout"
           " / --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers / "
           "--account-for-*-in-pipeline-split): the folded model splits the layers evenly; "
           "drop them")
    yield (_arg(args, "recompute_granularity") is not None,
           f"--dhelix does not support --recompute-granularity "
           f"{_arg(args, 'recompute_granularity')}: the operator programs keep their own "
           "activations; drop --recompute-granularity")
    yield (_arg(args, "fp16", False),
           "--dhelix does not support --fp16 (its schedules do no fp16 loss scaling); use "
           "--bf16 or fp32")
    yield (_arg(args, "fp8") is not None or _arg(args, "fp4") is not None,
           "--dhelix does not support --fp8-format / --fp4-format; drop them")
    moe = _arg(args, "num_experts") is not None
    moe_problems = check_supported_moe(args) if moe else []
    yield (bool(moe_problems),
           f"--dhelix with MoE (--num-experts): {moe_problems[0] if moe_problems else ''}")
    yield (moe and pp > 1 and _arg(args, "tensor_model_parallel_size", 1) > 1,
           "--dhelix with MoE (--num-experts) and --pipeline-model-parallel-size > 1 runs "
           "with --tensor-model-parallel-size 1 (MoE with TP > 1 is held to Megatron's "
           "schedule without pipelining only); use TP 1 or PP 1")
    yield (moe and _arg(args, "dhelix_pairer") == "domino",
           "--dhelix-pairer domino does not support MoE layers; use the default pairer")
    yield (_arg(args, "context_parallel_size", 1) > 1
           or _arg(args, "hybrid_context_parallel", False),
           "--dhelix does not support context parallelism (--context-parallel-size "
           f"{_arg(args, 'context_parallel_size')}); use 1")
    yield (pp > 1 and (_arg(args, "overlap_grad_reduce", False)
                       or _arg(args, "overlap_param_gather", False)),
           "--dhelix with --pipeline-model-parallel-size > 1 does not support "
           "--overlap-grad-reduce / --overlap-param-gather (the W schedule reduces gradients "
           "after the last backward); drop them")
    yield (pp > 1 and _arg(args, "calculate_per_token_loss", False),
           "--dhelix with --pipeline-model-parallel-size > 1 does not support "
           "--calculate-per-token-loss; drop it")
    yield (_arg(args, "mtp_num_layers"),
           "--dhelix does not support multi-token prediction (--mtp-num-layers); drop it")
    yield (_arg(args, "use_torch_fsdp2", False) or _arg(args, "use_megatron_fsdp", False),
           "--dhelix does not support FSDP (--use-torch-fsdp2 / --use-megatron-fsdp); use "
           "Megatron's DDP, with --use-distributed-optimizer if needed")
    yield (_arg(args, "tp_comm_overlap", False),
           "--dhelix does not support --tp-comm-overlap (Transformer Engine's GEMM/"
           "communication overlap); DHelix overlaps communication itself: drop it")
    yield (_arg(args, "reset_attention_mask", False),
           "--dhelix does not support --reset-attention-mask (the DHelix layers apply the "
           "plain causal mask); drop it")
    yield (_arg(args, "transformer_impl", "local") == "transformer_engine"
           and _has_transformer_engine(),
           "--dhelix runs megatron-core's local layer spec: add --transformer-impl local")


def _has_transformer_engine() -> bool:
    from megatron_patches.compat import has_transformer_engine

    return has_transformer_engine()


def check_plugin_args(args, dhelix_refusals: bool = True) -> None:
    """Raise `UnsupportedArgument` for the first problem of a plugin run's arguments, with
    or without `--dhelix`: `--dhelix-plan`/`--dhelix-profile` without `--dhelix`, missing,
    not a file, unreadable, corrupt or of another format version
    (`dhelix.dhelix_arguments.check_dhelix_files`); with `--dhelix` and `dhelix_refusals`,
    every refusal of `check_dhelix_args` and a `--num-layers` the folded model cannot split
    (`dhelix.options.folding_problem`: before Megatron's own layer assertions)."""
    from dhelix.argument_error import ArgumentError
    from dhelix.dhelix_arguments import check_dhelix_files
    from dhelix.options import folding_problem

    if args.dhelix and dhelix_refusals:
        check_dhelix_args(args)
        problem = folding_problem(args.num_layers, args.pipeline_model_parallel_size)
        if problem is not None:
            raise UnsupportedArgument(problem)
    try:
        check_dhelix_files(args)
    except ArgumentError as exc:
        raise UnsupportedArgument(str(exc)) from None


def check_dhelix_args(args) -> None:
    """Raise `UnsupportedArgument` for the first Megatron argument `--dhelix` cannot honour
    (virtual pipelining, uneven pipeline stages, recomputation, fp16/fp8/fp4, MoE settings
    the MoE operators do not implement (`megatron_patches.moe_support`) and MoE with
    TP > 1 and pipelining or with the Domino split, context parallelism, multi-token prediction, FSDP, TE's TP
    overlap, reset attention masks, Transformer Engine layers; with PP > 1 also overlapped
    gradient reduction and per-token loss); return None when the run is supported.
    Dropout, layer counts and the `--dhelix*` options are checked on the typed run
    (`dhelix.options.check_run`)."""
    for refused, message in _refusals(args):
        if refused:
            raise UnsupportedArgument(message)
