"""The kernel time model: fitted to the H100 Llama-8B layer profile, it gives the profile's
own operators back (GEMM and attention exactly, memory-bound classes in total and each
entry within the class's spread), gives any shape a time, and refuses incomplete profiles."""

import math
from pathlib import Path

import pytest

from dhelix.gpu_emulation.kernel_model import (
    H100_SDPA_TFLOPS, CoreAttentionTrace, attention_flops, fit_kernel_model, nominal_bytes,
    parse_cost_key, zero_kernel_latency_ms)
from profiler.profile_file import Profile, load_profile

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")
ATTN = "attention.{}(s=4096,b=1,heads=32,groups=8,d=128,rope=1,causal=1)/bfloat16"


def _profile(solo: dict) -> Profile:
    return Profile(hardware="test", solo=solo, meta={"repeats": 1, "warmup": 0, "ranks": 1,
                                                      "created": "now"})


def _small_profile() -> Profile:
    return _profile({
        "linear.fwd(m=1024,n=1024,k=1024,bias=0)/bfloat16": 0.01,
        "linear.fwd(m=4096,n=4096,k=4096,bias=0)/bfloat16": 0.2,
        "linear.wgrad(m=4096,n=4096,k=4096,bias=0)/bfloat16": 0.4,
        "rms_norm.fwd(s=1024,b=1,h=1024)/bfloat16": 0.1,
        "swiglu.fwd(s=1024,b=1,f=2048,bias=0)/bfloat16": 0.2,
        ATTN.format("fwd"): 10.0,
        ATTN.format("bwd"): 20.0,
    })


@pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")
def test_h100_profile_gives_its_own_times_back():
    profile = load_profile(H100_PROFILE)
    model = fit_kernel_model(profile)
    assert model.dtype == "bfloat16" and len(model.fitted_from) == len(profile.solo) == 20
    by_class: dict = {}
    for key, measured in profile.solo.items():
        modelled = model.solo_ms(key)
        op = parse_cost_key(key).op
        if op in ("linear", "attention"):
            assert modelled == pytest.approx(measured, rel=1e-9), key
        else:
            assert abs(modelled / measured - 1) < 0.45, (key, modelled, measured)
            cls = "norm" if op.endswith("norm") else "elementwise"
            by_class.setdefault(cls, [0.0, 0.0])
            by_class[cls][0] += modelled
            by_class[cls][1] += measured
    for cls, (modelled, measured) in by_class.items():
        assert modelled == pytest.approx(measured, rel=1e-9), cls
    # the four GEMMs at ~740 TFLOP/s, as the profile says
    assert 600 < 2 * 4096 * 28672 * 4096 / model.solo_ms(
        "linear.fwd(m=4096,n=28672,k=4096,bias=0)/bfloat16") / 1e9 < 900


def test_any_shape_gets_a_time_interpolated_and_clamped():
    model = fit_kernel_model(_small_profile())
    small = 2 * 1024**3 / 0.01 / 1e9  # TFLOP/s of the small fwd GEMM
    large = 2 * 4096**3 / 0.2 / 1e9
    mid = model.gemm_ms(2048, 2048, 2048, phase="fwd")
    rate = 2 * 2048**3 / mid / 1e9
    assert rate == pytest.approx((small + large) / 2, rel=1e-9)  # halfway in log(FLOPs)
    # beyond the largest shape the largest shape's rate holds: time scales with FLOPs
    assert model.gemm_ms(8192, 8192, 8192, phase="fwd") == pytest.approx(8 * 0.2, rel=1e-9)
    # a phase with one entry: its own rate at its shape
    assert model.gemm_ms(4096, 4096, 4096, phase="wgrad") == pytest.approx(0.4, rel=1e-9)
    # a phase the profile lacks falls back to the pooled curve
    assert model.gemm_ms(4096, 4096, 4096, phase="dgrad") == pytest.approx(
        model.gemm_ms(4096, 4096, 4096, phase="any"))
    # batched GEMMs: batch x the FLOPs
    assert model.gemm_ms(64, 64, 64, batch=4096, phase="any") > model.gemm_ms(64, 64, 64)
    # tiny kernels cost the launch floor
    assert model.gemm_ms(1, 1, 1) == model.min_kernel_ms == model.memory_ms(1)
    assert model.memory_ms(2e9, "norm") > model.memory_ms(1e9, "norm")


def test_attention_unfused_from_profile_and_sdpa_from_stated_rate():
    model = fit_kernel_model(_small_profile(), sdpa_tflops=400.0)
    assert model.attention_ms(4096, 1, 32, 128, causal=True, phase="fwd") == pytest.approx(10.0)
    # twice the sequence: four times the FLOPs at the fitted rate
    assert model.attention_ms(8192, 1, 32, 128, causal=True, phase="bwd") == pytest.approx(80.0)
    flops = attention_flops(4096, 1, 32, 128, True, "fwd") + attention_flops(
        4096, 1, 32, 128, True, "bwd")
    fused = sum(model.attention_ms(4096, 1, 32, 128, causal=True, phase=p, kernel="sdpa")
                for p in ("fwd", "bwd"))
    assert fused == pytest.approx(flops / 400e9)
    # the default stated rate: the H100 SDPA measurement (1.26 ms fwd+bwd at this shape)
    default = fit_kernel_model(_small_profile())
    assert H100_SDPA_TFLOPS == pytest.approx(flops / 1.26 / 1e9, rel=0.01)
    assert sum(default.attention_ms(4096, 1, 32, 128, causal=True, phase=p, kernel="sdpa")
               for p in ("fwd", "bwd")) == pytest.approx(1.26, rel=0.01)


def test_cost_keys_and_bytes():
    key = parse_cost_key("swiglu.bwd(s=2,b=1,f=8,bias=0)/bfloat16")
    assert (key.op, key.phase, key.dims, key.dtype) == ("swiglu", "bwd",
                                                        {"s": 2, "b": 1, "f": 8, "bias": 0},
                                                        "bfloat16")
    assert nominal_bytes(key) == 2 * 16 * 2.5
    assert parse_cost_key("all_reduce(n=4)/bfloat16/g2/inter") is None
    assert nominal_bytes(parse_cost_key("mystery.fwd(n=4)/bfloat16")) is None


def test_incomplete_or_mixed_profiles_are_refused():
    solo = dict(_small_profile().solo)
    del solo[ATTN.format("bwd")]
    with pytest.raises(ValueError, match="error: the profile has no attention bwd"):
        fit_kernel_model(_profile(solo))
    solo = {k: v for k, v in _small_profile().solo.items() if not k.startswith("linear")}
    with pytest.raises(ValueError, match=r"no GEMM"):
        fit_kernel_model(_profile(solo))
    solo = dict(_small_profile().solo)
    solo["rms_norm.bwd(s=1024,b=1,h=1024)/float32"] = 0.3
    with pytest.raises(ValueError, match="mixes dtypes"):
        fit_kernel_model(_profile(solo))
    model = fit_kernel_model(_small_profile())
    with pytest.raises(ValueError, match="error: GEMM phase"):
        model.gemm_ms(1, 1, 1, phase="sideways")
    with pytest.raises(ValueError, match="error: the model has no term"):
        model.solo_ms("mystery.fwd(n=4)/bfloat16")
    assert math.isfinite(model.memory_ms(1e6, "norm"))


def test_fit_at_traced_bytes():
    """Memory-bound entries fitted at the bytes their aten kernels move: one pooled
    bandwidth over every operator instance (the layer's memory-bound total comes back
    exactly, each entry at its own bytes); attention and GEMM entries keep their measured
    time as their own kernels plus their traced memory-bound kernels."""
    profile = _small_profile()
    norm, swiglu = "rms_norm.fwd(s=1024,b=1,h=1024)/bfloat16", \
        "swiglu.fwd(s=1024,b=1,f=2048,bias=0)/bfloat16"
    traced = {norm: (4e7, 4e7), swiglu: (1e8,), ATTN.format("fwd"): (3e7,),
              ATTN.format("bwd"): (6e7,)}
    model = fit_kernel_model(profile, traced_bytes=traced)
    assert model.memory_fit == "traced" and fit_kernel_model(profile).memory_fit == "nominal"
    # (2 x 4e7 + 1e8) bytes over (2 x 0.1 + 0.2) ms
    bandwidth = 1.8e8 / 0.4
    assert model.bandwidth == {"norm": pytest.approx(bandwidth),
                               "elementwise": pytest.approx(bandwidth)}
    assert model.solo_ms(norm) == pytest.approx(4e7 / bandwidth)
    assert model.solo_ms(swiglu) == pytest.approx(1e8 / bandwidth)
    assert 2 * model.solo_ms(norm) + model.solo_ms(swiglu) == pytest.approx(0.4)
    # attention: the region's rate is fitted to the entry less its traced kernels (RoPE)
    for phase, ms, nbytes in (("fwd", 10.0, 3e7), ("bwd", 20.0, 6e7)):
        assert model.solo_ms(ATTN.format(phase)) == pytest.approx(ms)
        region = model.attention_ms(4096, 1, 32, 128, causal=True, phase=phase)
        assert region == pytest.approx(ms - nbytes / bandwidth)
    # GEMMs without traced bytes keep their measured rate
    assert model.solo_ms("linear.fwd(m=4096,n=4096,k=4096,bias=0)/bfloat16") == \
        pytest.approx(0.2)


def test_traced_bytes_that_do_not_match_the_profile_are_refused():
    profile = _small_profile()
    norm, swiglu = "rms_norm.fwd(s=1024,b=1,h=1024)/bfloat16", \
        "swiglu.fwd(s=1024,b=1,f=2048,bias=0)/bfloat16"
    full = {norm: (4e7,), swiglu: (1e8,), ATTN.format("fwd"): (3e7,), ATTN.format("bwd"): (0.0,)}
    for missing in (swiglu, ATTN.format("fwd")):
        traced = {k: v for k, v in full.items() if k != missing}
        with pytest.raises(ValueError, match="error: traced_bytes has no instance of"):
            fit_kernel_model(profile, traced_bytes=traced)
    with pytest.raises(ValueError, match="error: the traced memory-bound operators move no bytes"):
        fit_kernel_model(profile, traced_bytes=full | {norm: (0.0,), swiglu: (0.0,)})
    # an attention entry whose traced kernels alone take longer than it was measured
    with pytest.raises(ValueError, match="the trace does not match the profile"):
        fit_kernel_model(profile, traced_bytes=full | {ATTN.format("fwd"): (1e12,)})


def test_host_latency_and_bf16_softmax_attention():
    """The latency measured by a zero-kernel entry comes off every memory-bound and
    attention entry (not the GEMMs) before the fit, and the attention and GEMM entries and
    the memory-bound total come back as measured; the bf16-softmax attention is the profiled region split as GEMMs + bytes at
    the region's own bandwidth, charged at the bf16-softmax bytes."""
    bda = "bias_dropout_add.bwd(s=1024,b=1,h=1024,bias=0)/bfloat16"
    profile = _profile(_small_profile().solo | {bda: 0.05})
    norm, swiglu = "rms_norm.fwd(s=1024,b=1,h=1024)/bfloat16", \
        "swiglu.fwd(s=1024,b=1,f=2048,bias=0)/bfloat16"
    traced = {norm: (4e7,), swiglu: (1e8,), bda: (0.0, 0.0), ATTN.format("fwd"): (3e7,),
              ATTN.format("bwd"): (6e7,)}
    assert zero_kernel_latency_ms(profile, traced) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="error: no profiled operator issues zero kernels"):
        zero_kernel_latency_ms(profile, traced | {bda: (1e6, 0.0)})
    core = CoreAttentionTrace(gemm_ms={"fwd": 1.0, "bwd": 2.0},
                              fp32_softmax_bytes={"fwd": 6e9, "bwd": 8e9},
                              bf16_softmax_bytes={"fwd": 2e9, "bwd": 9e9})
    model = fit_kernel_model(profile, traced_bytes=traced, host_latency_ms=0.05,
                             core_attention=core)
    # (4e7 + 1e8 + 0) bytes over (0.1 + 0.2 + 2 x 0.05 - 4 x 0.05) ms
    bandwidth = 1.4e8 / 0.2
    assert model.bandwidth["elementwise"] == pytest.approx(bandwidth)
    assert model.host_latency_ms == 0.05
    for key in (ATTN.format("fwd"), ATTN.format("bwd"),
                "linear.fwd(m=4096,n=4096,k=4096,bias=0)/bfloat16"):
        assert model.solo_ms(key) == pytest.approx(profile.solo[key]), key
    assert model.solo_ms(bda) == pytest.approx(0.05)  # the latency alone
    memory = (norm, swiglu, bda, bda)
    assert sum(map(model.solo_ms, memory)) == pytest.approx(
        sum(profile.solo[k] for k in memory))
    for phase, ms, nbytes in (("fwd", 10.0, 3e7), ("bwd", 20.0, 6e7)):
        region = model.attention_ms(4096, 1, 32, 128, causal=True, phase=phase)
        assert region == pytest.approx(ms - 0.05 - nbytes / bandwidth)
        gemm, fp32, bf16 = (core.gemm_ms[phase], core.fp32_softmax_bytes[phase],
                            core.bf16_softmax_bytes[phase])
        assert model.attention_ms(4096, 1, 32, 128, causal=True, phase=phase,
                                  kernel="unfused.bf16-softmax") == pytest.approx(
            gemm + bf16 * (region - gemm) / fp32)
    with pytest.raises(ValueError, match="error: host_latency_ms=0.3 leaves"):
        fit_kernel_model(profile, traced_bytes=traced, host_latency_ms=0.3)
    with pytest.raises(ValueError, match="error: the core attention's fwd GEMMs"):
        fit_kernel_model(profile, traced_bytes=traced, core_attention=CoreAttentionTrace(
            gemm_ms={"fwd": 50.0, "bwd": 2.0}, fp32_softmax_bytes=core.fp32_softmax_bytes,
            bf16_softmax_bytes=core.bf16_softmax_bytes))
