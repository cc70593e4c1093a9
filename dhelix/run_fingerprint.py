"""The model and parallel-layout fingerprints a layer plan is tied to, computed from
Megatron-style arguments (`dhelix.arguments`). Shared by `dhelix ops --export-dag` (which
prints the `dhelix plan` command for a run) and `--dhelix` start-up (which checks a plan)."""

from __future__ import annotations


def model_fingerprint(args) -> str:
    """The model arguments a layer plan depends on, as one stable string."""
    return (f"gpt-h{args.hidden_size}-ffn{args.ffn_hidden_size}-a{args.num_attention_heads}"
            f"-g{args.num_query_groups}-s{args.seq_length}-b{args.micro_batch_size}"
            f"-{args.normalization}-{args.position_embedding_type}"
            f"-{'swiglu' if args.swiglu else 'gelu'}"
            f"-{'nobias' if args.disable_bias_linear else 'bias'}"
            f"-{'bf16' if args.bf16 else 'fp32'}"
            # SDPA core attention costs differently (absent: Megatron's, older plans match)
            f"{'-sdpa' if getattr(args, 'dhelix_attention', 'megatron') == 'sdpa' else ''}")


def parallel_fingerprint(args) -> str:
    return (f"tp{args.tensor_model_parallel_size}-pp{args.pipeline_model_parallel_size}"
            f"-{'sp' if args.sequence_parallel else 'nosp'}")
