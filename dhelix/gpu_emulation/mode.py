"""`GpuEmulationMode`: run real PyTorch code (Megatron's modules, dhelix's operators) as if its
compute kernels ran on a GPU, taking the time a `KernelTimeModel` gives them, asleep.

Under the mode every aten compute operator (`aten_costs.classify`) is not computed: its
output's shape, strides and dtype come from running it on meta tensors, and the caller gets
`torch.empty_strided` tensors of that layout on the operator's device (never-touched pages
cost no memory; their values are garbage, so the mode is TIMING ONLY: numerics stay in the
parity tests). An in-place compute operator (`add_`, `copy_`, out=) is charged and skipped:
its mutated arguments are returned (their version counters were already bumped by autograd's
in-place key above this mode). Views, metadata changes, factory ops, host reads and every
operator whose tensors all have at most `cheap_numel` elements run for real, so autograd,
losses read with `.item()` and small bookkeeping keep working; a filling factory (`zeros`,
`ones`, `full`) of more elements is faked and charged like a compute operator (so the
gradient buffers of a model built under the mode stay untouched pages too). An operator
meta cannot run (data-dependent output shape) also runs for real, and is charged.

Time: the mode keeps a stream clock like a CUDA stream. A kernel starts at max(now, the end
of the previous kernel) and ends `modelled ms x time_scale` later, progressing at
1 / (1 + overlap_slowdown) for the part of it an async collective issued under the mode is
forecast to run beside (`collective_clock`: the collective's stream start plus the shortest
duration seen for its kind; a kind never seen slows the whole kernel; a point-to-point send
or receive does not count: a pipeline's isend stays in flight until its receiver takes it,
mostly without moving bytes); the host runs ahead without waiting. A collective starts when
the stream reaches it (its inputs must be computed: c10d and functional collectives are
dispatched operators): with `stream_ordered_collectives` (the default) an in-place c10d
collective issued while the stream is busy is handed to a `StreamOrderedIssuer`, which
issues it for real at that stream time while the host goes on issuing kernels, as a GPU's
host does (`stream_ordered_issue`). Other collectives, those issued under another dispatch
mode entered before this one (which must see them on this thread, in order:
`dhelix.bench.link_floor`'s recorder), and all with the option off, make the host wait
(sleep, GIL released, no core held) until the stream is drained and then issue. The host
also waits for the stream before a host read (`.item()`) and at `drain()` (a timer's
mark), not for the collectives handed to the issuer, and for both at `synchronize()` /
leaving the mode. `Work.wait()` is not a dispatched operator and needs no flush: on a GPU it orders
only the kernels issued after it, which the stream clock starts after the wait returned (on
these CPU ranks the host blocks there until the bytes arrived). Collectives themselves run
for real.

Regions (`enter_region` / `exit_region`): a stretch of code whose GPU time is known as a
whole (Megatron's unfused core attention, `dhelix.gpu_emulation.regions`) is charged once;
the compute operators inside are faked as elsewhere and charged nothing (`absorbed`).

Values the host acts on run for real (and are charged as usual): every operator whose
tensors are all index data (bool or integer: routing maps, token counts, sort indices, so
the split sizes an MoE all-to-all reads on the host are real), and between `enter_real()`
and `exit_real()` every compute operator but the GEMMs (an MoE router:
`regions.routing_regions`; its GEMM's output is replaced by random logits there, so it need
not be computed). Their inputs must then be real too, which is what the two rules give the
MoE routing path.

Ownership: outputs are new tensors owned by the caller, on the device of the operator's first
tensor argument; the mode keeps no tensor (only the Work handles of in-flight collectives,
until they complete). One mode per thread; autograd's backward on CPU runs on the calling
thread and so under the same mode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map

from dhelix.c10d_ops import process_group_of, unboxed_work, work_handles
from dhelix.gpu_emulation.all_to_all_exchange import AllToAllExchanges
from dhelix.gpu_emulation.aten_costs import (
    classify, is_communication, is_fill_factory, is_gemm, is_host_sync, is_inplace, kernel_ms,
    moved_bytes, op_name)
from dhelix.gpu_emulation.collective_clock import (
    CollectiveDurations, CollectiveKind, InFlightCollective, slowed_kernel_s)
from dhelix.gpu_emulation.kernel_model import KernelTimeModel
from dhelix.gpu_emulation.link_record import LinkRecord
from dhelix.gpu_emulation.stream_ordered_issue import StreamOrderedIssuer, deferrable

# DHelix paper, Table 7: concurrent compute and communication kernels run 20-30% slower on H100.
H100_OVERLAP_SLOWDOWN = 0.25
# point-to-point operators: an isend is in flight until its receiver takes it, which a
# pipeline schedule may do much later (the W schedule's sends wait for the step's end), so
# most of that time no bytes move; they do not slow kernels (only collectives do)
POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})


@dataclass(frozen=True)
class EmulationConfig:
    """`time_scale` S: every modelled kernel time is multiplied by S (divide the link rate by
    the same S to keep the GPU cluster's compute/communication ratio); `overlap_slowdown`:
    a kernel that runs while a collective is in flight takes (1 + this) x its time;
    `cheap_numel`: operators whose tensors all have at most this many elements run for real
    (and operators on index data only, `_index_data`: a generator's byte state, routing);
    `stream_ordered_collectives`: collectives issued while the stream is busy start when it
    reaches them without holding the host (a GPU's behaviour); False: the host waits for
    the stream to drain before every collective; `full_duplex_all_to_all`: gloo all-to-alls
    issued as `all_to_all_exchange` exchanges (both directions at once, as NCCL's), where
    it can carry them."""

    time_scale: float = 1.0
    overlap_slowdown: float = H100_OVERLAP_SLOWDOWN
    cheap_numel: int = 4096
    stream_ordered_collectives: bool = True
    full_duplex_all_to_all: bool = True

    def __post_init__(self):
        if not self.time_scale > 0:
            raise ValueError(f"error: time_scale must be > 0, got {self.time_scale}")
        if not self.overlap_slowdown >= 0:
            raise ValueError(f"error: overlap_slowdown must be >= 0, got {self.overlap_slowdown}")
        if self.cheap_numel < 0:
            raise ValueError(f"error: cheap_numel must be >= 0, got {self.cheap_numel}")


@dataclass(frozen=True)
class TermTotal:
    """Kernels charged to one term: how many, their modelled ms (unscaled, slowdown
    included), how many ran beside a collective in flight, and the bytes the memory-bound
    ones move (`aten_costs.moved_bytes`; 0 for GEMM, attention and region charges)."""

    count: int
    modelled_ms: float
    slowed: int
    nbytes: float = 0.0


@dataclass(frozen=True)
class EmulationReport:
    """What the mode charged: `modelled_ms` (unscaled, sum over kernels), `by_term` (gemm.fwd,
    memory.norm, attention.sdpa.bwd, attention.unfused.fwd (a region), ...), `by_op` (aten
    operator names; a region by its term), `slept_s` (seconds the host slept waiting for
    the stream), `collectives` issued, `ran_for_real` compute ops that meta could not run,
    `absorbed` compute ops issued inside a region (charged nothing of their own),
    `stream_idle_s` (seconds the emulated stream sat empty between its first and last
    kernel: the host had not yet issued the next one, e.g. it was waiting on a collective or
    running Python after a drain; the wall time a GPU whose host ran ahead would not lose),
    `stream_ordered` (collectives issued at their stream time without holding the host)."""

    modelled_ms: float
    by_term: dict
    by_op: dict
    slept_s: float
    collectives: int
    ran_for_real: int
    absorbed: int = 0
    stream_idle_s: float = 0.0
    stream_ordered: int = 0


def _index_data(t: torch.Tensor) -> bool:
    """Bool or integer (routing maps, counts, indices; uint8: an RNG state, which Megatron's
    RNG tracker clones and restores, where a faked clone is garbage `torch.set_rng_state`
    refuses): values the host acts on, computed for real."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex)


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class GpuEmulationMode(TorchDispatchMode):
    """See the module docstring. `report()` at any time; `synchronize()` drains the stream.
    `emulates_gpu` marks it for `dhelix.devices.gpu_emulated`. `durations`: the
    collective durations observed so far, shared by the modes of one process (a fresh
    record when None). `link`: when each collective on a process group was issued for real
    and completed (`link_record.LinkRecord`)."""

    emulates_gpu = True

    def __init__(self, model: KernelTimeModel, config: EmulationConfig = EmulationConfig(),
                 durations: CollectiveDurations | None = None):
        super().__init__()
        self.model = model
        self.config = config
        self.durations = durations if durations is not None else CollectiveDurations()
        self._stream_end = 0.0
        self._in_flight: list = []
        self._terms: dict = {}
        self._ops: dict = {}
        self._slept = 0.0
        self._collectives = 0
        self._ran_for_real = 0
        self._region: str | None = None
        self._absorbed = 0
        self._stream_idle = 0.0
        self._gaps: list = []
        self.link = LinkRecord()  # every collective's issue and completion (link_record)
        self._issuer = StreamOrderedIssuer(self.link)  # which notes them in it
        self._exchanges = AllToAllExchanges()
        self._deferred = 0
        self._real_depth = 0

    # -- time ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Sleep until every kernel charged so far has ended (host = stream) and every
        collective issued so far has been issued for real (what the host needs before it
        issues a collective on its own thread, in order, or leaves the mode)."""
        start = time.perf_counter()
        self._wait_for_stream()
        self._issuer.flush()
        self._slept += time.perf_counter() - start

    def drain(self) -> None:
        """Sleep until every kernel charged so far has ended (host = stream), and no longer:
        the collectives handed to the issuer go on, as a CUDA event on the compute stream or
        a host read of a kernel's output waits for that stream and not for the
        communication's. (A collective waiting for its group's previous one is issued only
        once that one completed; `synchronize()` waits for that, so a host read or a timer
        mark after an operator that issues two collectives on one group waited for the
        first to complete: the MoE dispatch's rows and probabilities.)"""
        start = time.perf_counter()
        self._wait_for_stream()
        self._slept += time.perf_counter() - start

    def stream_time(self) -> float:
        """When the kernels charged so far end on the emulated stream (`time.perf_counter`
        seconds), or now where it has run them all: the device's clock, which a host running
        ahead of it has not reached yet."""
        return max(time.perf_counter(), self._stream_end)

    def idle_gaps(self) -> list:
        """(start_s, end_s) of every stretch the emulated stream sat empty between two
        kernels so far, in order (`time.perf_counter` seconds; they sum to
        `report().stream_idle_s`): the stream ran dry at start_s and the host charged the
        next kernel at end_s. A new list; the mode keeps its own."""
        return list(self._gaps)

    def _wait_for_stream(self) -> None:
        while (left := self._stream_end - time.perf_counter()) > 0:
            time.sleep(left)

    def _busy_until(self, now: float) -> float | None:
        """Drop the completed collectives (noting their durations); when the ones still in
        flight are expected to end (perf_counter s, `now` at the latest for one already
        late), None when one is of a kind never observed, `now` when none is in flight."""
        still, busy_until, unknown = [], now, False
        for record in self._in_flight:
            if record.work.is_completed():
                self.durations.observe(record, now)
                continue
            still.append(record)
            end = self.durations.expected_end(record)
            unknown = unknown or end is None
            busy_until = busy_until if end is None else max(busy_until, end)
        self._in_flight = still
        return None if unknown else busy_until

    def _charge(self, term: str, name: str, ms: float, nbytes: float = 0.0) -> None:
        now = time.perf_counter()
        start = max(now, self._stream_end)
        base_s = ms * self.config.time_scale / 1000.0
        busy_until = self._busy_until(now)
        seconds = slowed_kernel_s(base_s, start, busy_until, self.config.overlap_slowdown)
        slowed = seconds > base_s
        ms = seconds * 1000.0 / self.config.time_scale
        if self._stream_end and now > self._stream_end:
            self._stream_idle += now - self._stream_end
            self._gaps.append((self._stream_end, now))
        self._stream_end = start + seconds
        for table, key in ((self._terms, term), (self._ops, name)):
            count, total, n_slowed, moved = table.get(key, (0, 0.0, 0, 0.0))
            table[key] = (count + 1, total + ms, n_slowed + slowed, moved + nbytes)

    def _group_expected_end(self, group) -> float:
        """When the collectives in flight on `group` should end (0.0 when none is, or when
        one's kind was never observed): a collective issued behind them starts then, one
        communicator running one collective at a time."""
        ends = [self.durations.expected_end(r) for r in self._in_flight
                if r.kind.group is not None and r.kind.group == group
                and not r.work.is_completed()]
        return max((e for e in ends if e is not None), default=0.0)

    # -- regions ------------------------------------------------------------------------
    def enter_region(self, term: str, ms: float) -> None:
        """Charge one kernel of `ms` (modelled, unscaled) to `term`, and charge nothing for
        the compute operators issued until `exit_region()` (they are still faked or run as
        outside a region, and counted in `absorbed`): a stretch of code whose GPU time is
        known as a whole (`dhelix.gpu_emulation.regions`). Regions do not nest."""
        if self._region is not None:
            raise RuntimeError(f"error: region {term!r} entered inside region {self._region!r}; "
                               "regions do not nest")
        self._charge(term, term, ms)
        self._region = term

    def exit_region(self) -> None:
        """End the region `enter_region` opened; compute operators are charged again."""
        if self._region is None:
            raise RuntimeError("error: exit_region() without enter_region()")
        self._region = None

    @property
    def in_region(self) -> bool:
        return self._region is not None

    def enter_real(self) -> None:
        """Until the matching `exit_real()`, every compute operator but the GEMMs runs for
        real (charged as usual): code whose values the host acts on (an MoE router's
        routing decisions, `regions.routing_regions`). Nests."""
        self._real_depth += 1

    def exit_real(self) -> None:
        if not self._real_depth:
            raise RuntimeError("error: exit_real() without enter_real()")
        self._real_depth -= 1

    def report(self) -> EmulationReport:
        def totals(table):
            return {k: TermTotal(*v) for k, v in sorted(table.items())}
        return EmulationReport(
            modelled_ms=sum(v[1] for v in self._terms.values()), by_term=totals(self._terms),
            by_op=totals(self._ops), slept_s=self._slept, collectives=self._collectives,
            ran_for_real=self._ran_for_real, absorbed=self._absorbed,
            stream_idle_s=self._stream_idle, stream_ordered=self._deferred)

    def __exit__(self, *exc):
        try:
            self.synchronize()
        finally:
            try:
                self._issuer.close()  # raises a deferred collective's error
            finally:
                try:
                    self._exchanges.close()  # its watcher threads stop on error too
                finally:
                    super().__exit__(*exc)
        return False

    # -- dispatch -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_communication(func):
            self._collectives += 1
            outermost = not _get_current_dispatch_mode_stack()
            # a mode outside this one (the link floor's recorder) must see c10d's own call
            issue = (self._exchanges.stand_in(func, args)
                     if outermost and self.config.full_duplex_all_to_all else func)
            group = process_group_of(args) if deferrable(func) else None
            kind = CollectiveKind(op_name(func), group, sum(
                t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)))
            if (self.config.stream_ordered_collectives and deferrable(func) and outermost
                    and (self._issuer.pending or self._stream_end > time.perf_counter()
                         or self._issuer.busy(group))):
                self._deferred += 1
                start = max(self._stream_end, self._group_expected_end(group))
                result = self._issuer.submit(self._stream_end, issue, args, kwargs)
                self._in_flight += [InFlightCollective(unboxed_work(w), start, kind)
                                    for w in work_handles(result)]
                return result
            self.synchronize()
            start = time.perf_counter()
            result = issue(*args, **kwargs)
            if op_name(func) not in POINT_TO_POINT:
                handles = [unboxed_work(w) for w in work_handles(result)]
                self._in_flight += [InFlightCollective(h, start, kind) for h in handles]
                if group is not None and handles:
                    self._issuer.note_issued(group, handles[-1])
            return result
        if is_fill_factory(func):
            return self._fill_factory(func, args, kwargs)
        if classify(func, args, kwargs) == "real":
            if is_host_sync(func):
                self.drain()
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self._runs_for_real(tensors, is_gemm(func)):
            out = func(*args, **kwargs)
        elif is_inplace(func):
            out = self._mutated(func, args, kwargs)
        else:
            out = self._fake_outputs(func, args, kwargs, tensors[0].device)
        if self._region is not None:
            self._absorbed += 1
            return out
        term, ms = kernel_ms(self.model, func, args, kwargs, out)
        nbytes = moved_bytes(args, kwargs, out) if term.startswith("memory.") else 0.0
        self._charge(term, op_name(func), ms, nbytes)
        return out

    def fakes(self, *tensors: torch.Tensor) -> bool:
        """Whether a (non-GEMM) compute operator on `tensors` would be faked here rather
        than run for real (`_runs_for_real`)."""
        return not self._runs_for_real(list(tensors))

    def _runs_for_real(self, tensors: list, gemm: bool = False) -> bool:
        """Whether an operator on (or making) `tensors` runs for real: all of them at most
        `cheap_numel` elements, all index data, or inside a real scope unless a GEMM."""
        return (all(t.numel() <= self.config.cheap_numel for t in tensors)
                or all(_index_data(t) for t in tensors)
                or bool(self._real_depth and not gemm))

    def _fill_factory(self, func, args, kwargs):
        """`zeros` / `ones` / `full`: run for real up to `cheap_numel` elements, of index
        data, or between `enter_real` and `exit_real`; else an
        untouched `empty_strided` of the same layout (garbage values, like every faked
        output: model building touches no gradient buffer), charged as a memory kernel."""
        meta_out = func(*args, **{**kwargs, "device": "meta"})
        if self._runs_for_real([meta_out]):
            return func(*args, **kwargs)
        device = kwargs.get("device") or torch.get_default_device()
        out = torch.empty_strided(meta_out.shape, meta_out.stride(), dtype=meta_out.dtype,
                                  device=device, pin_memory=bool(kwargs.get("pin_memory")))
        if self._region is not None:
            self._absorbed += 1
            return out
        term, ms = kernel_ms(self.model, func, args, kwargs, out)
        self._charge(term, op_name(func), ms, moved_bytes(args, kwargs, out))
        return out

    def _mutated(self, func, args, kwargs):
        """What an in-place operator returns: its written arguments, in schema order."""
        schema = func._schema
        by_name = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        written = [by_name[a.name] for a in schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
        return written[0] if len(schema.returns) == 1 else tuple(written)

    def _fake_outputs(self, func, args, kwargs, device):
        """Outputs of `func`'s layout on `device` (or on the device it names: `_to_copy(...,
        device=)`), computed on meta tensors; run for real where meta cannot."""
        meta_kwargs = tree_map(_meta, kwargs)
        if kwargs.get("device") is not None:
            device = kwargs["device"]
            meta_kwargs["device"] = "meta"
        try:
            meta_out = func(*tree_map(_meta, args), **meta_kwargs)
        except (NotImplementedError, RuntimeError):
            self._ran_for_real += 1
            return func(*args, **kwargs)
        return tree_map(
            lambda o: torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device)
            if isinstance(o, torch.Tensor) else o, meta_out)
