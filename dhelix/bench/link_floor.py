"""How long a step's communication takes alone: the link's own floor under a step.

`record_collectives` runs a piece of code (one forward/backward of Megatron's schedule)
under a dispatch mode that notes every collective it issues (`c10d.*` operators: the
process group and reduce op are part of each call, the tensors' shapes and dtypes are
kept, not their data). `replay` issues the same collectives again on the same groups with
zero-filled tensors of those shapes and nothing else running (a gloo all-to-all as the
full-duplex exchange the emulated GPU issues, `dhelix.gpu_emulation.all_to_all_exchange`,
where it can carry it: the link's own floor, not gloo's turn-taking): one at a time (each
waited before the next) or all at once (every one issued, then every one waited, so the transport
may keep several in flight). What no schedule of the same step can beat is the faster of
the two: the link must carry those bytes whatever computation runs beside them.

Point-to-point transfers (pipeline send/recv) and barriers are not replayed (a replay in
program order could deadlock where the step relied on batching them); they are counted in
`skipped`. Ownership: the recorder keeps no tensor of the recorded code; a replay allocates
its own zero-filled tensors before its clock starts and frees them when it returns
(`ReplayBuffers`): one flat buffer per (dtype, device) and position within a call (the k-th
tensor of that dtype in the call's arguments), as large as the largest tensor recorded
there, and every call's tensors are views of it. A replay so holds about one call's bytes,
not the step's (a step's collectives at four Llama-8B layers and 16 micro-batches carry
~12.6 GB a rank, which the 24 GiB machine could not hold twice), also where the shapes
differ from call to call (an MoE all-to-all's rows follow each micro-batch's routing). The
data is zero everywhere, so collectives in flight at once over one buffer write back the
zeros it holds. Every rank must call `replay` with the same list in the same order (the
ranks of a group recorded the same sequence), like any collective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dhelix.c10d_ops import work_handles
from dhelix.gpu_emulation.all_to_all_exchange import AllToAllExchanges

_NOT_REPLAYED = ("send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_")


@dataclass(frozen=True)
class RecordedCollective:
    """One collective call: the operator, its arguments with every tensor replaced by a
    (shape, dtype) spec, and the bytes of its tensors (inputs and outputs)."""

    op: object
    args: tuple
    kwargs: tuple
    tensor_bytes: int


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple
    dtype: torch.dtype
    device: torch.device


def _spec(value):
    """(value with tensors as _TensorSpec, their bytes)."""
    if isinstance(value, torch.Tensor):
        return (_TensorSpec(tuple(value.shape), value.dtype, value.device),
                value.numel() * value.element_size())
    if isinstance(value, (list, tuple)):
        parts = [_spec(v) for v in value]
        return type(value)(p[0] for p in parts), sum(p[1] for p in parts)
    return value, 0


class ReplayBuffers:
    """Zero-filled tensors for replayed calls: the k-th tensor of a (dtype, device) within
    one call is a view of that key's k-th flat buffer, sized by `reserve` (or grown on
    first use by a larger tensor) and kept for every later call."""

    def __init__(self):
        self._buffers: dict = {}

    def reserve(self, collectives: list) -> None:
        """Size the buffers for every call of `collectives` at once (before handing out
        views: a buffer grown later leaves the earlier views on the smaller one)."""
        needed: dict = {}
        for collective in collectives:
            taken: dict = {}
            for spec in _tensor_specs((collective.args, collective.kwargs)):
                key = _position(spec, taken)
                needed[key] = max(needed.get(key, 0), math.prod(spec.shape))
        for key, numel in needed.items():
            self._flat(key, numel)

    def arguments(self, collective: RecordedCollective) -> tuple:
        """(args, kwargs) of `collective` with its tensor specs made buffers."""
        taken: dict = {}
        return (self._materialise(collective.args, taken),
                dict(self._materialise(collective.kwargs, taken)))

    def _flat(self, key: tuple, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:  # on the recorded tensor's device
            _, dtype, device = key
            buffer = self._buffers[key] = torch.zeros(numel, dtype=dtype, device=device)
        return buffer

    def _materialise(self, value, taken: dict):
        if isinstance(value, _TensorSpec):
            numel = math.prod(value.shape)
            return self._flat(_position(value, taken), numel)[:numel].view(value.shape)
        if isinstance(value, (list, tuple)):
            return type(value)(self._materialise(v, taken) for v in value)
        return value

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


def _tensor_specs(value) -> list:
    """The `_TensorSpec`s in `value` (nested lists and tuples), in order."""
    if isinstance(value, _TensorSpec):
        return [value]
    if isinstance(value, (list, tuple)):
        return [spec for v in value for spec in _tensor_specs(v)]
    return []


def _position(spec: _TensorSpec, taken: dict) -> tuple:
    """(k, dtype, device) of `spec`: the k-th tensor of its dtype and device in the call
    whose earlier tensors `taken` counted (updated)."""
    kind = (spec.dtype, spec.device)
    index = taken.get(kind, 0)
    taken[kind] = index + 1
    return (index, *kind)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.collectives: list = []
        self.skipped: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("c10d."):
            op_name = name.split(".")[1]
            if op_name in _NOT_REPLAYED:
                self.skipped.append(op_name)
            else:
                spec_args, arg_bytes = _spec(tuple(args))
                spec_kwargs, kw_bytes = _spec(tuple(kwargs.items()))
                self.collectives.append(RecordedCollective(func, spec_args, spec_kwargs,
                                                           arg_bytes + kw_bytes))
        return func(*args, **kwargs)


def record_collectives(fn):
    """Run `fn()` on this thread, noting every collective it issues; returns (fn's result,
    the collectives in issue order, names of the c10d calls not recorded for replay)."""
    recorder = _Recorder()
    with recorder:
        result = fn()
    return result, recorder.collectives, recorder.skipped


def replay(collectives: list, all_at_once: bool, buffers: ReplayBuffers | None = None
           ) -> float:
    """Seconds to issue `collectives` again on their groups and see every one finish (this
    rank's clock, from the first issue to the last wait). Collective: every rank of the
    groups involved must call it with the same list. `buffers`: the tensors to replay on
    (a fresh `ReplayBuffers` by default, filled before the clock starts)."""
    if buffers is None:
        buffers = ReplayBuffers()
    buffers.reserve(collectives)
    exchanges = AllToAllExchanges()
    try:
        calls = [(c.op, *buffers.arguments(c)) for c in collectives]
        calls = [(exchanges.stand_in(op, args), args, kwargs) for op, args, kwargs in calls]
        start = time.perf_counter()
        pending = []
        for op, args, kwargs in calls:
            works = work_handles(op(*args, **kwargs))
            if all_at_once:
                pending += works
            else:
                for work in works:
                    work.wait()
        for work in pending:
            work.wait()
        return time.perf_counter() - start
    finally:
        exchanges.close()
