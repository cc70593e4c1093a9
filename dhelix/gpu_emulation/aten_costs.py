"""Which model term an aten operator is charged to, and how much.

`classify(func)` sorts an aten operator into one of:
- "real": runs for real, costs no modelled time: views (and `_unsafe_view`) and metadata
  changes, factory ops (no tensor input) and allocations (`empty_like`, `new_empty`), host
  syncs (`_local_scalar_dense`), collectives (`c10d.*`, `_c10d_functional.*`), RNG state
  queries. The filling factories among them (`is_fill_factory`: `zeros`, `ones`, `full`)
  the mode fakes when large, as it fakes compute.
- "compute": a GPU kernel: charged by `kernel_ms` and, unless the mode says otherwise, run
  on meta tensors for its output's shape.

`kernel_ms(model, func, args, out)` is the modelled time (ms) of one compute operator:
- `mm`/`addmm` (2-D GEMM): the phase by operand layout, as Megatron's linear layers issue
  them: `x @ W.t()` (second operand transposed) is "fwd", `g @ W` (neither) is "dgrad",
  `g.t() @ x` (first transposed) is "wgrad"; `bmm`/`baddbmm`: the pooled curve.
- SDPA kernels (`_scaled_dot_product_*attention*`): the model's fused attention rate, forward
  or backward by the operator's name; GQA heads from the query.
- anything else: bytes of every tensor input and output at the "norm" bandwidth for
  `*norm*` operators and the "elementwise" bandwidth otherwise.
Pure: reads shapes, strides and dtypes only, never tensor data.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from dhelix.gpu_emulation.kernel_model import KernelTimeModel

_REAL_NAMES = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "detach", "alias", "lift_fresh",
    "set_", "resize_", "resize_as_", "_resize_output_", "record_stream", "_version",
    "is_same_size", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "_nested_tensor_size", "get_rng_state", "set_rng_state",
    "_conj", "_neg_view", "conj", "resolve_conj", "resolve_neg",
    "_unsafe_view",  # a view whose schema does not say so (reshape of a fresh tensor)
    # allocations shaped like a tensor argument: no kernel runs
    "empty_like", "new_empty", "new_empty_strided",
}
_SYNC_NAMES = {"_local_scalar_dense", "item", "is_nonzero", "equal"}
# factories that fill what they allocate (a fill kernel on a GPU)
_FILL_FACTORIES = {"zeros", "ones", "full"}
_GEMM_2D = {"mm", "addmm"}
_GEMM_BATCHED = {"bmm", "baddbmm"}


def op_name(func) -> str:
    """`aten.mm.default` -> "mm"; `c10d.allreduce_.default` -> "allreduce_"."""
    return func._schema.name.split("::")[-1]


def namespace(func) -> str:
    return func._schema.name.split("::")[0]


def is_communication(func) -> bool:
    """A collective or point-to-point operator (c10d or functional collectives)."""
    return namespace(func) in ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def is_gemm(func) -> bool:
    """A matrix multiply `kernel_ms` charges at a GEMM rate (`mm`, `addmm`, `bmm`,
    `baddbmm`)."""
    return op_name(func) in _GEMM_2D or op_name(func) in _GEMM_BATCHED


def is_host_sync(func) -> bool:
    """An operator that reads a tensor's data on the host (CUDA would synchronise)."""
    return op_name(func) in _SYNC_NAMES


def classify(func, args, kwargs) -> str:
    """"real" or "compute" (see the module docstring)."""
    if namespace(func) != "aten" or func.is_view:
        return "real"
    name = op_name(func)
    if name in _REAL_NAMES or torch.Tag.inplace_view in func.tags:
        return "real"
    if not any(isinstance(x, torch.Tensor) for x in tree_leaves((args, kwargs))):
        return "real"  # factory: empty, zeros, full, arange, randn, scalar_tensor, ...
    return "compute"


def is_fill_factory(func) -> bool:
    """`zeros`, `ones`, `full`: a factory that writes every element it allocates (a memory
    kernel on a GPU; on a CPU it touches every page)."""
    return namespace(func) == "aten" and op_name(func) in _FILL_FACTORIES


def is_inplace(func) -> bool:
    """Mutates an argument (`add_`, `copy_`, out= variants): the result aliases an input."""
    return any(a.alias_info is not None and a.alias_info.is_write
               for a in func._schema.arguments)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def moved_bytes(args, kwargs, out) -> int:
    """Bytes a memory-bound operator moves: every tensor input read once, every output
    written once (what `kernel_ms` charges at a bandwidth)."""
    return _bytes(tree_leaves((args, kwargs))) + _bytes(tree_leaves(out))


def _transposed(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) != 1


def _named(func, args, kwargs) -> dict:
    """The operator's arguments by their schema names."""
    named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    named.update(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    return named


def kernel_ms(model: KernelTimeModel, func, args, kwargs, out) -> tuple[str, float]:
    """(term, modelled ms) of one compute operator; `out` its output(s) (any device)."""
    name = op_name(func)
    if name in _GEMM_2D:
        a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
        phase = "wgrad" if _transposed(a) else "fwd" if _transposed(b) else "dgrad"
        return f"gemm.{phase}", model.gemm_ms(a.shape[0], b.shape[1], a.shape[1], phase=phase)
    if name in _GEMM_BATCHED:
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return "gemm.batched", model.gemm_ms(a.shape[1], b.shape[2], a.shape[2],
                                             batch=a.shape[0], phase="any")
    if name.startswith("_scaled_dot_product") and "attention" in name:
        phase = "bwd" if name.endswith("backward") else "fwd"
        named = _named(func, args, kwargs)
        b, heads, s, d = named["query"].shape
        causal = bool(named.get("is_causal", False))
        return f"attention.sdpa.{phase}", model.attention_ms(s, b, heads, d, causal=causal,
                                                             phase=phase, kernel="sdpa")
    nbytes = moved_bytes(args, kwargs, out)
    cls = "norm" if "norm" in name else "elementwise"
    return f"memory.{cls}", model.memory_ms(nbytes, cls)
