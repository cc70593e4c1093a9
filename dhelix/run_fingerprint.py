"""The model and parallel-layout fingerprints a layer plan is tied to, computed from the typed
run (`dhelix.options.DHelixRun`). Shared by `dhelix ops --export-dag` (which prints the
`dhelix plan` command for a run), `dhelix profile` (which records them in the profile) and
`--dhelix` start-up (which checks a plan or profile against them)."""

from __future__ import annotations

from dhelix.options import DHelixRun


def model_fingerprint(run: DHelixRun) -> str:
    """The model arguments a layer plan depends on, as one stable string."""
    m = run.model
    return (f"gpt-h{m.hidden_size}-ffn{m.ffn_hidden_size}-a{m.num_attention_heads}"
            f"-g{m.num_query_groups}-s{m.seq_length}-b{run.parallel.micro_batch_size}"
            f"-{m.normalization}-{m.position_embedding_type}"
            f"-{'swiglu' if m.swiglu else 'gelu'}"
            f"-{'bias' if m.add_bias_linear else 'nobias'}-{m.dtype}"
            # SDPA core attention costs differently (absent: Megatron's, older plans match)
            f"{'-sdpa' if run.options.attention == 'sdpa' else ''}")


def parallel_fingerprint(run: DHelixRun) -> str:
    p = run.parallel
    return (f"tp{p.tensor_model_parallel_size}-pp{p.pipeline_model_parallel_size}"
            f"-{'sp' if p.sequence_parallel else 'nosp'}")
