"""The profiled layer's shape read back from a profile's cost keys (pure, fast)."""

from pathlib import Path

import pytest

from dhelix.gpu_emulation.profile_fit import ProfileLayer, profile_layer
from profiler.profile_file import Profile, load_profile

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")


@pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")
def test_h100_profile_layer():
    assert profile_layer(load_profile(H100_PROFILE)) == ProfileLayer(
        hidden=4096, ffn=14336, heads=32, groups=8, head_dim=128, seq=4096, micro_batch=1,
        dtype="bfloat16")


def test_incomplete_or_tensor_parallel_profiles_are_refused():
    meta = {"repeats": 1, "warmup": 0, "ranks": 1, "created": "now"}
    attention = "attention.fwd(s=64,b=1,heads=4,groups=2,d=16,rope=1,causal=1)/bfloat16"
    solo = {attention: 1.0, "rms_norm.fwd(s=64,b=1,h=64)/bfloat16": 0.1,
            "swiglu.fwd(s=64,b=1,f=256,bias=0)/bfloat16": 0.1}
    assert profile_layer(Profile(hardware="t", solo=solo, meta=meta)).ffn == 128
    with pytest.raises(ValueError, match="error: the profile lacks an attention"):
        profile_layer(Profile(hardware="t", solo={attention: 1.0}, meta=meta))
    with pytest.raises(ValueError, match="error: the profile was taken at tp2-pp1"):
        profile_layer(Profile(hardware="t", solo=solo, meta=meta | {"parallel": "tp2-pp1"}))
