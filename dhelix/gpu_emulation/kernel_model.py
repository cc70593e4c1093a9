"""Kernel time model: how long a GPU kernel of any shape takes, fitted to a profile file.

The profile (`profiler/profile_file.py`, `dhelix profile --comp-only`) times whole operators
at one layer shape. From its solo entries this module fits, per kernel class:

- GEMM: achieved TFLOP/s per phase ("fwd" x @ W^T, "dgrad" g @ W, "wgrad" g^T @ x) as a
  function of the GEMM's FLOPs (2mnk), interpolated linearly in log(FLOPs) between the
  profile's shapes and clamped outside them; "any" pools every phase (batched GEMMs).
- memory-bound: achieved bandwidth (bytes per ms) of the profile's memory-bound entries
  (norm, SwiGLU, bias-dropout-add), from the bytes they move. Two ways (`memory_fit`):
  "traced" (`traced_bytes` given, what the emulation uses): the bytes of the aten kernels
  each profiled operator really issues under the emulation (`profile_trace`), one bandwidth
  pooled over every operator instance of the layer (the emulation charges aten kernels,
  which cannot tell which operator issued them), so the layer's memory-bound total comes
  back exactly; "nominal": each operator's nominal bytes (`nominal_bytes`: inputs read
  once, outputs written once), per class, norm ("norm") and the others ("elementwise").
- attention: FLOPs per ms of the profile's own attention entries ("unfused" fwd / bwd) and a
  stated rate for a fused SDPA kernel (`sdpa_tflops`, default the H100 measurement in
  DESIGN.md: 1.26 ms fwd+bwd at s=4096, 32 heads, d=128, causal = 382 TFLOP/s). The
  profile's attention is taken as Megatron's unfused core attention with an fp32 softmax
  (the H100 profile's: the profiler's former layer set-up kept TransformerConfig's default
  `attention_softmax_in_fp32=True`; the profile file does not record it).
  With `core_attention` (a `CoreAttentionTrace`: the core attention's batched-GEMM time and
  memory-bound bytes at the profile's shape, fp32 and bf16 softmax) the model also has
  "unfused.bf16-softmax": the profile's region time split as GEMMs + bytes / B, B the
  region's own bandwidth fitted at the fp32-softmax bytes, and charged at the bf16-softmax
  bytes (the attention Megatron-LM runs by default: `--attention-softmax-in-fp32` off).
- host latency (`host_latency_ms`, optional): the profiler records each operator's start
  event before the host issues its first kernel (`profiler.timing.Timer.time`), so every
  solo entry holds the host time of the operator's dispatch up to that kernel, which a
  training step's host hides by running ahead. An operator that issues no kernel measures
  exactly that (`zero_kernel_latency_ms`: bias-dropout-add backward, 0.281 ms on the H100
  profile). It is taken off every memory-bound and attention entry (dhelix operators that
  trace a local autograd region before their first kernel; the memory-bound bandwidth is
  pooled, so the layer's memory-bound total still comes back exactly) before the fit; not
  off the GEMM entries, whose dispatch is one call: the
  largest forward GEMM leaves at most 0.085 ms above its back-to-back rate (788 TFLOP/s,
  DESIGN.md), and they stay as measured.

With traced bytes, an attention or GEMM entry's own rate is fitted to its time less its
traced memory-bound kernels' (the attention operator's QKV split and RoPE run outside the
core-attention region, `regions`), so entry = its kernels, as the emulation charges them.

Every kernel costs at least `min_kernel_ms` (launch latency; not part of the fit). The
profile's own shapes get back their measured times (GEMM and attention: exactly;
memory-bound: their total exactly, each entry within the spread of the entries). Rates
apply to any dtype (the profile's dtype is recorded in `dtype`). Pure: no torch, no clock.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from profiler.profile_file import Profile

GEMM_PHASES = ("fwd", "dgrad", "wgrad")
MEMORY_CLASSES = ("norm", "elementwise")
ATTENTION_KERNELS = ("unfused", "unfused.bf16-softmax", "sdpa")
# H100 bf16 SDPA at s=4096, b=1, 32 heads, d=128, causal: 1.26 ms fwd+bwd (DESIGN.md).
H100_SDPA_TFLOPS = 382.0
_KEY = re.compile(r"^(?P<op>[a-z_]+)\.(?P<phase>[a-z]+)\((?P<dims>[^)]*)\)/(?P<dtype>\w+)$")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class CostKey:
    """A parsed compute cost key `op.phase(k=v,...)/dtype` (dims as ints)."""

    op: str
    phase: str
    dims: dict
    dtype: str


def parse_cost_key(key: str) -> CostKey | None:
    """The parts of a compute cost key; None for a communication key (`.../g<n>/<channel>`)
    or any key not of that form."""
    match = _KEY.match(key)
    if match is None:
        return None
    dims = {}
    for item in filter(None, match["dims"].split(",")):
        name, _, value = item.partition("=")
        try:
            dims[name] = int(value)
        except ValueError:
            return None
    return CostKey(match["op"], match["phase"], dims, match["dtype"])


def attention_flops(s: int, b: int, heads: int, d: int, causal: bool, phase: str) -> float:
    """Useful FLOPs of core attention (QK^T and PV; backward 2.5x forward; causal halves)."""
    forward = 4.0 * b * heads * s * s * d * (0.5 if causal else 1.0)
    if phase == "fwd":
        return forward
    if phase == "bwd":
        return 2.5 * forward
    raise ValueError(f"error: attention phase must be 'fwd' or 'bwd', got {phase!r}")


def nominal_bytes(key: CostKey) -> int | None:
    """Bytes a memory-bound profile operator must move (each input read once, each output
    written once), or None for an operator this model does not know."""
    elt = _DTYPE_BYTES.get(key.dtype)
    d = key.dims
    if elt is None:
        return None
    if key.op == "rms_norm" or key.op == "layer_norm":
        tokens = d["s"] * d["b"] * d["h"]
        return elt * tokens * (2 if key.phase == "fwd" else 3)  # x->y ; dy,x->dx
    if key.op == "bias_dropout_add":
        return elt * d["s"] * d["b"] * d["h"] * 3  # x,residual->y ; dy->dx,dresidual
    if key.op == "swiglu":
        full = d["s"] * d["b"] * d["f"]  # f: the fused gate+up width; output is f/2
        return int(elt * full * (1.5 if key.phase == "fwd" else 2.5))
    return None


def _interpolate(points: tuple, flops: float) -> float:
    """TFLOP/s at `flops` from sorted (flops, tflops) points, linear in log(flops), clamped."""
    if flops <= points[0][0]:
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= flops <= x1:
            w = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    raise AssertionError("unreachable: points are sorted")


@dataclass(frozen=True)
class CoreAttentionTrace:
    """Megatron's unfused core attention at the profile's attention shape, run under the
    emulation without a region (`profile_trace.trace_core_attention`), per phase ("fwd",
    "bwd"): `gemm_ms` the modelled ms of its batched GEMMs; `fp32_softmax_bytes` /
    `bf16_softmax_bytes` the bytes of its memory-bound kernels with
    `attention_softmax_in_fp32` True (as profiled) / False."""

    gemm_ms: dict
    fp32_softmax_bytes: dict
    bf16_softmax_bytes: dict


@dataclass(frozen=True)
class KernelTimeModel:
    """Fitted rates. `gemm[phase]`: sorted ((flops, tflops), ...); `bandwidth[cls]`: bytes
    per ms; `attention[(kernel, phase)]`: FLOPs per ms; `fitted_from`: the solo keys used;
    `memory_fit`: "traced" or "nominal"; `traced_bytes`: {cost key: mean traced bytes of an
    instance} when traced; `host_latency_ms`: taken off the memory-bound and attention
    entries before the fit (0: none)."""

    gemm: dict
    bandwidth: dict
    attention: dict
    dtype: str
    min_kernel_ms: float = 0.004
    fitted_from: tuple = field(default_factory=tuple)
    memory_fit: str = "nominal"
    traced_bytes: dict = field(default_factory=dict)
    host_latency_ms: float = 0.0

    def gemm_ms(self, m: int, n: int, k: int, *, batch: int = 1, phase: str = "any") -> float:
        """Time of `batch` (m x k) @ (k x n) GEMMs of the given phase's curve."""
        if phase not in self.gemm:
            raise ValueError(f"error: GEMM phase {phase!r} not in the model ({sorted(self.gemm)})")
        flops = 2.0 * m * n * k * batch
        if flops == 0:
            return self.min_kernel_ms
        tflops = _interpolate(self.gemm[phase], flops)
        return max(self.min_kernel_ms, flops / (tflops * 1e9))

    def memory_ms(self, nbytes: float, cls: str = "elementwise") -> float:
        """Time to move `nbytes` at the achieved bandwidth of class `cls`."""
        if cls not in self.bandwidth:
            raise ValueError(f"error: memory class {cls!r} not in the model ({sorted(self.bandwidth)})")
        return max(self.min_kernel_ms, nbytes / self.bandwidth[cls])

    def attention_ms(self, s: int, b: int, heads: int, d: int, *, causal: bool, phase: str,
                     kernel: str = "unfused") -> float:
        """Core attention time (`kernel` "unfused": the profile's own, fp32 softmax;
        "unfused.bf16-softmax": the same at bf16-softmax bytes, when fitted with a
        `CoreAttentionTrace`; "sdpa": fused)."""
        rate = self.attention.get((kernel, phase))
        if rate is None:
            raise ValueError(f"error: no attention rate for kernel {kernel!r}, phase {phase!r}")
        return max(self.min_kernel_ms, attention_flops(s, b, heads, d, causal, phase) / rate)

    def solo_ms(self, cost_key: str) -> float:
        """The modelled time of one of the profile's own operators (for checking the fit),
        the host latency taken off it by the fit included."""
        key = parse_cost_key(cost_key)
        if key is None:
            raise ValueError(f"error: {cost_key!r} is not a compute cost key")
        d = key.dims
        traced = self.traced_bytes.get(cost_key, 0.0) / self.bandwidth["elementwise"]
        if key.op == "linear":
            return self.gemm_ms(d["m"], d["n"], d["k"], phase=key.phase) + traced
        if key.op == "attention":
            return self.host_latency_ms + traced + self.attention_ms(
                d["s"], d["b"], d["heads"], d["d"], causal=bool(d.get("causal", 0)),
                phase=key.phase)
        if nominal_bytes(key) is None:
            raise ValueError(f"error: the model has no term for {cost_key!r}")
        if self.memory_fit == "traced":
            return self.host_latency_ms + traced
        return self.host_latency_ms + self.memory_ms(nominal_bytes(key),
                              "norm" if key.op.endswith("norm") else "elementwise")


def zero_kernel_latency_ms(profile: Profile, traced_bytes: dict) -> float:
    """The host latency inside a solo entry, measured by the profile's memory-bound entries
    whose traced instances issue no kernel (`traced_bytes` of every instance 0: the
    bias-dropout-add backward without dropout passes its gradient through): their mean
    measured ms. Raises ValueError when the profile has no such entry."""
    zero = [ms for name, ms in profile.solo.items()
            if (key := parse_cost_key(name)) is not None and key.op not in ("linear", "attention")
            and nominal_bytes(key) is not None and name in traced_bytes
            and not any(traced_bytes[name])]
    if not zero:
        raise ValueError("error: no profiled operator issues zero kernels in the trace; give "
                         "host_latency_ms explicitly (or 0)")
    return sum(zero) / len(zero)


def fit_kernel_model(profile: Profile, *, sdpa_tflops: float = H100_SDPA_TFLOPS,
                     min_kernel_ms: float = 0.004, traced_bytes: dict | None = None,
                     host_latency_ms: float = 0.0,
                     core_attention: CoreAttentionTrace | None = None) -> KernelTimeModel:
    """Fit a `KernelTimeModel` to the profile's solo entries; memory-bound entries at their
    nominal bytes, or, with `traced_bytes` ({cost key: bytes of each operator instance of
    one layer}, `profile_trace.trace_operator_bytes`), at those; `host_latency_ms` off every
    memory-bound and attention entry; with `core_attention`, the bf16-softmax attention too
    (see the module docstring). Raises ValueError (`error: ...`) when the profile lacks a
    GEMM, a norm, an element-wise or an attention entry (each class needs one to be
    fitted), mixes dtypes, when `traced_bytes` misses one of its memory-bound or attention
    entries or leaves an entry no time of its own, or when the latency or the core
    attention's GEMMs leave the memory-bound or attention entries no time."""
    if host_latency_ms < 0:
        raise ValueError(f"error: host_latency_ms must be >= 0, got {host_latency_ms}")
    entries, dtypes = [], set()
    for name, ms in profile.solo.items():
        key = parse_cost_key(name)
        if key is None or not (key.op == "linear" and key.phase in GEMM_PHASES
                               or key.op == "attention" or nominal_bytes(key) is not None):
            continue
        entries.append((name, key, ms if key.op == "linear" else ms - host_latency_ms))
        dtypes.add(key.dtype)
    if len(dtypes) > 1:
        raise ValueError(f"error: the profile mixes dtypes {sorted(dtypes)}; fit one dtype's entries")
    memory = [(name, key, ms) for name, key, ms in entries
              if key.op not in ("linear", "attention")]
    missing = [f"{cls} entry" for cls in MEMORY_CLASSES
               if not any(_cls(key) == cls for _, key, _ in memory)]
    if traced_bytes is None:
        per_entry: dict = {}
        bandwidth = {cls: sum(nominal_bytes(k) for _, k, _ in memory if _cls(k) == cls)
                     / sum(ms for _, k, ms in memory if _cls(k) == cls)
                     for cls in MEMORY_CLASSES if f"{cls} entry" not in missing}
    else:
        lacking = [name for name, key, _ in entries
                   if key.op != "linear" and not traced_bytes.get(name)]
        if lacking:
            raise ValueError(f"error: traced_bytes has no instance of {', '.join(lacking)}; "
                             "trace the profile's own layer (profile_trace.trace_operator_bytes)")
        per_entry = {name: sum(traced_bytes[name]) / len(traced_bytes[name])
                     for name, _, _ in entries if traced_bytes.get(name)}
        moved = sum(sum(traced_bytes[name]) for name, _, _ in memory)
        spent = sum(len(traced_bytes[name]) * ms for name, _, ms in memory)
        if memory and not moved:
            raise ValueError("error: the traced memory-bound operators move no bytes; trace "
                             "the profile's own layer (profile_trace.trace_operator_bytes)")
        if memory and spent <= 0:
            raise ValueError(f"error: host_latency_ms={host_latency_ms} leaves the memory-bound "
                             "entries no time; give a smaller latency")
        bandwidth = {cls: moved / spent for cls in MEMORY_CLASSES} if moved else {}
    gemm: dict = {phase: {} for phase in GEMM_PHASES}
    attention: dict = {}
    for name, key, ms in entries:
        if key.op not in ("linear", "attention"):
            continue
        own = ms - (per_entry.get(name, 0.0) / bandwidth["elementwise"] if bandwidth else 0.0)
        if own <= 0:
            raise ValueError(f"error: {name}: its traced memory-bound kernels take {ms - own:.3f}"
                             f" ms of its {ms:.3f} ms; the trace does not match the profile")
        d = key.dims
        if key.op == "linear":
            flops = 2.0 * d["m"] * d["n"] * d["k"]
            gemm[key.phase].setdefault(flops, []).append(flops / own / 1e9)
        else:
            flops = attention_flops(d["s"], d["b"], d["heads"], d["d"],
                                    bool(d.get("causal", 0)), key.phase)
            attention.setdefault(("unfused", key.phase), []).append(flops / own)
    pooled_gemm: dict = {}
    for phase in GEMM_PHASES:
        for flops, rates in gemm[phase].items():
            pooled_gemm.setdefault(flops, []).extend(rates)
    gemm["any"] = pooled_gemm
    problems = ["GEMM (any)"] if not gemm["any"] else []
    problems += missing
    problems += [f"attention {p}" for p in ("fwd", "bwd") if ("unfused", p) not in attention]
    if problems:
        raise ValueError(f"error: the profile has no {', '.join(problems)}; profile a full "
                         "layer (`dhelix profile --comp-only`)")
    curves = {phase: tuple(sorted((f, sum(r) / len(r)) for f, r in table.items()))
              for phase, table in gemm.items() if table}
    for phase in GEMM_PHASES:
        curves.setdefault(phase, curves["any"])
    rates = {k: sum(v) / len(v) for k, v in attention.items()}
    if core_attention is not None:
        rates |= _bf16_softmax_rates(entries, rates, core_attention)
    for phase in ("fwd", "bwd"):
        rates[("sdpa", phase)] = sdpa_tflops * 1e9
    return KernelTimeModel(gemm=curves, bandwidth=bandwidth, attention=rates,
                           dtype=dtypes.pop(), min_kernel_ms=min_kernel_ms,
                           fitted_from=tuple(sorted(name for name, _, _ in entries)),
                           memory_fit="nominal" if traced_bytes is None else "traced",
                           traced_bytes=per_entry, host_latency_ms=host_latency_ms)


def _bf16_softmax_rates(entries, rates: dict, trace: CoreAttentionTrace) -> dict:
    """{("unfused.bf16-softmax", phase): FLOPs per ms}: the profile's core-attention region
    (its fitted rate at the profile's attention shape) as GEMMs + fp32-softmax bytes / B,
    charged at the bf16-softmax bytes (the module docstring)."""
    out = {}
    for phase in ("fwd", "bwd"):
        d = next(key.dims for _, key, _ in entries
                 if key.op == "attention" and key.phase == phase)
        flops = attention_flops(d["s"], d["b"], d["heads"], d["d"], bool(d.get("causal", 0)),
                                phase)
        region = flops / rates[("unfused", phase)]
        memory = region - trace.gemm_ms[phase]
        if memory <= 0 or trace.fp32_softmax_bytes[phase] <= 0:
            raise ValueError(f"error: the core attention's {phase} GEMMs ({trace.gemm_ms[phase]:.3f}"
                             f" ms) leave its profiled {region:.3f} ms no memory-bound time; "
                             "trace the profile's own attention shape")
        bandwidth = trace.fp32_softmax_bytes[phase] / memory
        out[("unfused.bf16-softmax", phase)] = flops / (
            trace.gemm_ms[phase] + trace.bf16_softmax_bytes[phase] / bandwidth)
    return out


def _cls(key: CostKey) -> str:
    return "norm" if key.op.endswith("norm") else "elementwise"
