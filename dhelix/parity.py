"""Layout-independent views of a model's parameters and gradients, for parity checks.

`gather_full_tensors` assembles every parameter (or its gradient) of the model chunks of all
ranks into full, unsharded tensors keyed by Megatron's distributed-checkpoint keys, using the
model's own `sharded_state_dict` (so TP splits, SwiGLU's interleaved FC1 shards, pipeline
layer offsets and tied embeddings are mapped exactly as Megatron's checkpoints map them).
Two runs with different TP/PP/DP layouts can then be compared key by key.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    is_main_replica,
)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _param_source(param: torch.nn.Parameter, source: str) -> torch.Tensor:
    if source == "param":
        return param.detach()
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad.detach()


def local_shards(model_chunks, source: str = "param") -> list[tuple]:
    """This rank's main-replica shards: (key, global_shape, global_offset, prepend, tensor).

    `source` is 'param' or 'grad' (DDP's `main_grad`, else `.grad`; zeros when absent).
    Tensors are CPU copies the caller owns.
    """
    if source not in ("param", "grad"):
        raise ValueError(f"source must be 'param' or 'grad', not {source!r}")
    shards = []
    for chunk in model_chunks:
        module = _unwrap(chunk)
        params = {id(p): p for p in module.parameters()}
        sharded = module.sharded_state_dict()
        keep = {}
        for i, item in enumerate(nested_values(sharded)):
            if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and id(item.data) in params:
                item.data = _param_source(params[id(item.data)], source)
                keep[str(i)] = item
        apply_factories(keep)
        for item in nested_values(keep):
            if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id):
                if item.flattened_range is not None:
                    raise NotImplementedError("flattened (distributed-optimizer) shards")
                shards.append((item.key, tuple(item.global_shape), tuple(item.global_offset),
                               item.prepend_axis_num, item.data.detach().cpu().clone()))
    return shards


def _to_bytes(tensor: torch.Tensor) -> tuple:
    """(dtype, shape, raw bytes) of a host tensor: an object collective pickles these as
    plain bytes, where a tensor goes through `torch.save` and the weights-only `torch.load`
    per storage (~5x slower for the small shards of a parity model; bit for bit the same)."""
    flat = tensor.contiguous().reshape(-1)
    return tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes()


def _from_bytes(dtype: torch.dtype, shape: tuple, raw: bytes) -> torch.Tensor:
    """The host tensor `_to_bytes` described, bit for bit."""
    if not raw:
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def gather_full_tensors(model_chunks, source: str = "param") -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (or gradient) across all ranks, on every rank.

    Collective over the default process group: every rank must call it. Raises if any
    element of a tensor is covered by no shard (a mapping bug, never silently zero).
    """
    mine = [(key, shape, offset, prepend, _to_bytes(tensor))
            for key, shape, offset, prepend, tensor in local_shards(model_chunks, source)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for shards in everyone:
        for key, shape, offset, prepend, wire in shards:
            tensor = _from_bytes(*wire)
            if key not in full:
                # host copies: compared across runs and devices, never next to the model
                full[key] = torch.zeros(shape, dtype=tensor.dtype, device="cpu")
                covered[key] = torch.zeros(shape, dtype=torch.bool, device="cpu")
            local = tensor.reshape((1,) * prepend + tuple(tensor.shape))
            index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            full[key][index] = local
            covered[key][index] = True
    for key, mask in covered.items():
        if not bool(mask.all()):
            raise RuntimeError(f"{key}: {int((~mask).sum())} elements covered by no shard")
    return full


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest |a-b| over all keys, and the key where it occurs. Keys must match."""
    if set(a) != set(b):
        raise KeyError(f"tensor sets differ: only in first {sorted(set(a) - set(b))}, "
                       f"only in second {sorted(set(b) - set(a))}")
    worst, where = 0.0, ""
    for key in sorted(a):
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: shape {tuple(a[key].shape)} vs {tuple(b[key].shape)}")
        diff = float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0
        if diff >= worst:
            worst, where = diff, key
    return worst, where
