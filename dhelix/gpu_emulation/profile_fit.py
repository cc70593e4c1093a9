"""The kernel model an emulated run uses, fitted to a profile at its own layer's traced bytes.

A `dhelix profile --comp-only` file times one layer's operators at one shape (tp=1). To fit
`kernel_model.fit_kernel_model` at the bytes the emulation will charge, the profile's layer
is rebuilt from its cost keys (`profile_layer`: megatron-core's local spec, unfused, as
`dhelix profile` builds it) and traced under the mode (`trace_profile_layer`: the bytes of
each profiled operator, `profile_trace.trace_operator_bytes`; its core attention with an
fp32 and a bf16 softmax, `profile_trace.trace_core_attention`); `fit_emulation_model` fits
at that trace with the host latency measured by the profile's zero-kernel entries. The
trace is a plain dict (JSON-able): trace once, in a process of its own with one rank
(`dhelix.harness.run_megatron_ranks(trace_profile_layer, 1, path)`: it needs megatron's
parallel state at tp=1), and fit on every rank from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.gpu_emulation.kernel_model import (
    CoreAttentionTrace, KernelTimeModel, fit_kernel_model, parse_cost_key,
    zero_kernel_latency_ms)
from profiler.profile_file import Profile, load_profile

PHASES = ("fwd", "bwd")


@dataclass(frozen=True)
class ProfileLayer:
    """The profiled layer's shape: hidden size, FFN size, attention heads, query groups,
    head size, sequence length, micro-batch size, dtype (torch name, e.g. "bfloat16")."""

    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    seq: int
    micro_batch: int
    dtype: str


def profile_layer(profile: Profile) -> ProfileLayer:
    """The layer `profile` timed, from its attention, norm and SwiGLU cost keys. Raises
    ValueError (`error: ...`) for a profile without them or taken with tensor parallelism."""
    keys = {}
    for name in profile.solo:
        key = parse_cost_key(name)
        if key is not None:
            keys.setdefault(key.op, key)
    if not {"attention", "rms_norm", "swiglu"} <= set(keys):
        raise ValueError("error: the profile lacks an attention, rms_norm or swiglu entry; "
                         "profile a full Llama-style layer (`dhelix profile --comp-only`)")
    if not str(profile.meta.get("parallel", "tp1")).startswith("tp1"):
        raise ValueError(f"error: the profile was taken at {profile.meta['parallel']}; the "
                         "emulation fits a tp=1 profile")
    attention = keys["attention"].dims
    return ProfileLayer(hidden=keys["rms_norm"].dims["h"], ffn=keys["swiglu"].dims["f"] // 2,
                        heads=attention["heads"], groups=attention["groups"],
                        head_dim=attention["d"], seq=attention["s"],
                        micro_batch=attention["b"], dtype=keys["attention"].dtype)


def layer_config(layer: ProfileLayer, num_layers: int, softmax_in_fp32: bool = True):
    """megatron-core's TransformerConfig of `num_layers` layers of `layer`'s shape as `dhelix
    profile` builds them (local spec, RMSNorm, SwiGLU, RoPE, no biases, no dropout, nothing
    fused; fp32 softmax: TransformerConfig's default); `softmax_in_fp32=False`: the softmax
    Megatron-LM runs by default (`--attention-softmax-in-fp32` off)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, layer.dtype)
    return TransformerConfig(
        num_layers=num_layers, hidden_size=layer.hidden, ffn_hidden_size=layer.ffn,
        num_attention_heads=layer.heads, num_query_groups=layer.groups,
        kv_channels=layer.head_dim, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=softmax_in_fp32)


def trace_profile_layer(ctx, profile_path: str) -> dict:
    """Rank function (`run_megatron_ranks`, one rank, tp=1): {"operators": the bytes each
    profiled operator issues on one layer of the profile's shape, "core_attention": {"fp32"
    / "bf16": {phase: (batched-GEMM ms, memory-bound bytes)}} of that layer's core attention
    with either softmax}. Faked under the mode: nothing is computed (~10 s, a few MB)."""
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from dhelix.devices import model_device
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from dhelix.gpu_emulation.profile_trace import trace_core_attention, trace_operator_bytes
    from dhelix.ops.runner import BoundLayer

    profile = load_profile(profile_path)
    shape = profile_layer(profile)
    model = fit_kernel_model(profile)
    layers = {}
    with GpuEmulationMode(model, EmulationConfig(time_scale=1e-9)):  # no init compute
        for fp32 in (True, False):
            layers[fp32] = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"),
                                        config=layer_config(shape, 1, fp32), layer_number=1)
        rotary = RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0)(shape.seq)
        device = model_device(layers[True])  # where the layer was built
        x, dy = (torch.empty(shape.seq, shape.micro_batch, shape.hidden, device=device,
                             dtype=getattr(torch, shape.dtype))
                 for _ in range(2))
    bound = BoundLayer(layers[True], shape.seq, shape.micro_batch, rope=True)
    return {"operators": trace_operator_bytes(bound, x, dy, rotary, model),
            "core_attention": {
                name: trace_core_attention(layers[fp32].self_attention.core_attention,
                                           shape.seq, shape.micro_batch, model)
                for name, fp32 in (("fp32", True), ("bf16", False))}}


def fit_emulation_model(profile: Profile, trace: dict,
                        host_latency: str | float = "zero-kernel") -> KernelTimeModel:
    """The kernel model fitted at `trace` (`trace_profile_layer`'s, possibly read back from
    JSON): memory-bound entries at its operator bytes, the bf16-softmax attention from its
    core-attention bytes, `host_latency` ms ("zero-kernel": `zero_kernel_latency_ms`) off
    the memory-bound and attention entries (`kernel_model` module docstring)."""
    operators = {key: tuple(v) for key, v in trace["operators"].items()}
    latency = (zero_kernel_latency_ms(profile, operators) if host_latency == "zero-kernel"
               else float(host_latency))
    attention = trace["core_attention"]
    core = CoreAttentionTrace(
        gemm_ms={p: attention["fp32"][p][0] for p in PHASES},
        fp32_softmax_bytes={p: attention["fp32"][p][1] for p in PHASES},
        bf16_softmax_bytes={p: attention["bf16"][p][1] for p in PHASES})
    return fit_kernel_model(profile, traced_bytes=operators, host_latency_ms=latency,
                            core_attention=core)
