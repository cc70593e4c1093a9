"""The calibration's two mechanisms on real megatron-core code (one launch, one gloo rank):

- the profile trace (`profile_trace.trace_operator_bytes`) of the H100 profile's own layer
  (Llama-8B shapes, faked: nothing computed) finds every profiled operator, gives the GEMMs
  no memory-bound bytes, the norms their fp32 up-casts (several times their nominal bytes),
  and the attention operator only its kernels outside the core attention (RoPE, split);
  fitted at those bytes the model gives back the GEMM and attention entries exactly and the
  layer's memory-bound total exactly;
- the attention region (`regions.attention_regions`): a megatron-core GPT layer (local spec,
  small shapes) charges its core attention once forward and once backward at the profile's
  unfused rate for its shape, none of the s x s kernels inside, and after the context closes
  the same layer's softmax is charged per kernel again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dhelix.harness import run_megatron_ranks

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")
pytestmark = [pytest.mark.slow,  # one gloo rank, ~20 s
              pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")]


def _trace_and_region(ctx):
    import torch

    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from dhelix.gpu_emulation.kernel_model import CostKey, fit_kernel_model, nominal_bytes
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from dhelix.gpu_emulation.regions import attention_regions, fused_rms_norms
    from profiler.profile_file import load_profile
    from dhelix.gpu_emulation.profile_fit import fit_emulation_model, trace_profile_layer
    from tests.gpu_emulation.test_mode import _gpt_layer

    trace = trace_profile_layer(ctx, str(H100_PROFILE))
    out = {"traced": trace["operators"], "core_attention": trace["core_attention"]}
    model = fit_kernel_model(load_profile(H100_PROFILE), traced_bytes=out["traced"])
    layer = _gpt_layer()  # 8 heads of 64, seq 256, micro-batch 2, causal
    x = torch.randn(256, 2, 512, requires_grad=True)
    mode = GpuEmulationMode(model, EmulationConfig(time_scale=1e-6))
    with attention_regions(layer), mode:
        y, _ = layer(x)
        y.sum().backward()
    report = mode.report()
    out["terms"] = {k: (v.count, v.modelled_ms) for k, v in report.by_term.items()}
    out["ops"] = sorted(report.by_op)
    out["absorbed"] = report.absorbed
    out["expected"] = {p: model.attention_ms(256, 2, 8, 64, causal=True, phase=p)
                       for p in ("fwd", "bwd")}
    with GpuEmulationMode(model, EmulationConfig(time_scale=1e-6)) as after:
        layer(x)[0].sum().backward()
    out["ops_after"] = sorted(after.report().by_op)

    # the step's configuration: bf16 softmax, bf16 norm weights (Float16Module's cast)
    step_model = fit_emulation_model(load_profile(H100_PROFILE), trace)
    step_layer = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"),
                              config=dataclasses.replace(layer.config,
                                                         attention_softmax_in_fp32=False),
                              layer_number=1).bfloat16()
    xb = torch.randn(256, 2, 512, dtype=torch.bfloat16, requires_grad=True)
    step = GpuEmulationMode(step_model, EmulationConfig(time_scale=1e-6))
    with attention_regions(step_layer), fused_rms_norms(), step:
        step_layer(xb)[0].sum().backward()
    out["step_terms"] = {k: (v.count, v.modelled_ms) for k, v in step.report().by_term.items()}
    out["step_ops"] = sorted(step.report().by_op)
    out["step_expected"] = {
        **{f"attention.unfused.bf16-softmax.{p}": step_model.attention_ms(
            256, 2, 8, 64, causal=True, phase=p, kernel="unfused.bf16-softmax")
           for p in ("fwd", "bwd")},
        **{f"norm.fused.{p}": step_model.memory_ms(
            nominal_bytes(CostKey("rms_norm", p, {"s": 512, "b": 1, "h": 512}, "bfloat16")),
            "norm") for p in ("fwd", "bwd")}}
    return out


def test_profile_trace_and_attention_region():
    from dhelix.gpu_emulation.kernel_model import fit_kernel_model, nominal_bytes, parse_cost_key
    from profiler.profile_file import load_profile

    (r,) = run_megatron_ranks(_trace_and_region, 1, timeout_s=300, env={"OMP_NUM_THREADS": "1"})
    profile = load_profile(H100_PROFILE)
    traced = r["traced"]
    assert set(traced) == set(profile.solo), set(profile.solo) ^ set(traced)
    memory_ms = memory_modelled = 0.0
    model = fit_kernel_model(profile, traced_bytes=traced)
    for key, instances in traced.items():
        parsed = parse_cost_key(key)
        if parsed.op == "linear":
            assert instances == (0.0,), key
            assert model.solo_ms(key) == pytest.approx(profile.solo[key], rel=1e-9)
        elif parsed.op == "attention":
            # RoPE and the QKV split only: well under one s x s pass (32 x 4096^2 x 2 bytes)
            assert 0 < instances[0] < 32 * 4096**2 * 2, key
            assert model.solo_ms(key) == pytest.approx(profile.solo[key], rel=1e-9)
        else:
            memory_ms += len(instances) * profile.solo[key]
            memory_modelled += len(instances) * model.solo_ms(key)
            if parsed.op == "rms_norm":  # bf16 input, fp32 weight: computed in fp32
                assert instances[0] > 5 * nominal_bytes(parsed), key
    assert len(traced["rms_norm.fwd(s=4096,b=1,h=4096)/bfloat16"]) == 2  # two norms a layer
    assert memory_modelled == pytest.approx(memory_ms, rel=1e-9)

    terms = r["terms"]
    for phase in ("fwd", "bwd"):
        count, ms = terms[f"attention.unfused.{phase}"]
        assert count == 1 and ms == pytest.approx(r["expected"][phase]), (phase, terms)
    inside = {"_softmax", "_softmax_backward_data", "baddbmm", "masked_fill", "masked_fill_"}
    assert not inside & set(r["ops"]), r["ops"]
    assert "gemm.batched" not in terms and r["absorbed"] > len(inside)
    assert {"_softmax", "_softmax_backward_data", "baddbmm"} <= set(r["ops_after"])

    # the step's configuration: each core attention one bf16-softmax region, each of the
    # two norms one fused region forward and backward; none of their kernels charged
    core = r["core_attention"]
    assert core["bf16"]["fwd"][1] < core["fp32"]["fwd"][1] / 2  # no fp32 s x s copies
    assert core["fp32"]["fwd"][0] == core["bf16"]["fwd"][0] > 0  # same batched GEMMs
    step_terms = r["step_terms"]
    for term, ms in r["step_expected"].items():
        count, charged = step_terms[term]
        assert count == (1 if term.startswith("attention") else 2), (term, step_terms)
        assert charged == pytest.approx(count * ms), term
    assert not {"attention.unfused.fwd", "attention.unfused.bwd"} & set(step_terms)
    assert not {"rsqrt", "pow", "_softmax"} & set(r["step_ops"]), r["step_ops"]
