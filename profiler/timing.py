"""Timing operators alone and in pairs, on the executor's lanes, as training runs them.

`Timer` times one region on every rank: all ranks first meet at a barrier (so they time the
same thing at the same moment), then the region runs; on CPU the time is a perf counter's,
on CUDA the elapsed time between two CUDA events on the current stream (read after the
pass, so measuring does not add host synchronisations inside a region). Before its first
region, a CUDA timer warms its device up (`warm_up_cuda`): otherwise the first
region also pays for creating the cuBLAS handle and its workspace (measured on an H100: a
2048x2048 fp32 GEMM's first region took 54.8 ms). `Timer.slowest`
turns one pass's local times into the slowest rank's (all_reduce MAX): collectives finish
together, and the planner needs the time the whole group takes.

`LayerUnderTest` is one bound layer with fixed inputs; it hands out executions attached to
the communication lanes (`dhelix.runtime.lanes`). A pass uses fresh executions, runs the
operators before the measured one(s) untimed in program order (a topological order, so all
dependencies are met), then times:

- `solo_pass`: every operator of the forward and then the backward program, one at a time
  (a collective's time includes waiting for its completion);
- `pair_pass`: a chain of (forward op, backward op) candidates: for each, the forward
  execution of one micro-batch and the backward execution of another are advanced to just
  before the two operators, then `strand_executor.run_block` co-executes them as one block
  with its closing barrier - exactly the runtime's path for a paired block. For a
  computation beside a collective the region is also marked when the computation has ended
  on the compute stream (`Timer.mark`): the pair's time is the collective's whenever the
  computation is the shorter, and only the mark shows how much the collective slowed it.

On an emulated GPU (`dhelix profile --gpu-emulation`, `LayerUnderTest.emulated`, a
`dhelix.gpu_emulation.emulated_run.EmulatedCalls`) every pass runs under the emulation
(`LayerUnderTest.running`: compute kernels take the modelled time x S, asleep; collectives
real), and the timer drains the emulated stream before every region starts (the untimed operators
that advanced the executions must not run into it, as `torch.cuda.synchronize` ensures on
CUDA) and at its end before reading the clock (`Timer(synchronize=...)`), as a CUDA event
ends when its stream reaches it.

Every rank runs the same operators in the same order, so collectives stay matched. The
executions are dropped after a pass (nothing is left pending: every region ends waiting on
its collectives); gradients of the layer's parameters accumulate, which a profiling model
does not mind.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from statistics import median

import torch
import torch.distributed as dist

from dhelix.dag import computation_beside_collective
from dhelix.runtime.lanes import lane_execution
from dhelix.runtime.strand_executor import Block, run_block


def warm_up_cuda() -> None:
    """On the current CUDA device and stream: run a GEMM in each floating dtype and wait
    for it, so that the one-time costs of a process's first GEMMs (cuBLAS handle,
    workspace, kernel loading) are paid now rather than inside a timed region."""
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(256, 256, device=device, dtype=dtype)
        a @ a
    torch.cuda.synchronize(device)


class Timer:
    """Barrier-aligned region timing on every rank of `group` (see the module docstring).
    `sync_group` is a gloo group over the same ranks used for barriers and the MAX
    reduction (the default group on CPU). `synchronize` (CPU timer only): called at the end
    of every region before its end is read (an emulated GPU's stream drain,
    `EmulatedCalls.synchronize`), so a region lasts until its kernels have ended; also
    called before every region, so kernels issued before it (the untimed operators that
    advanced a pass) end before its clock starts."""

    def __init__(self, sync_group=None, cuda: bool | None = None, synchronize=None):
        self.sync_group = sync_group
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        if synchronize is not None and self.cuda:
            raise ValueError("error: a CUDA timer waits on its stream; synchronize= is for "
                             "an emulated GPU's CPU timer")
        self._synchronize = synchronize
        self._events: list = []
        self._open = None  # the region being timed: (its start, its mark or None)
        self._warm = False

    def align(self) -> None:
        if self.cuda:
            if not self._warm:
                warm_up_cuda()
                self._warm = True
            torch.cuda.synchronize()
        elif self._synchronize is not None:
            self._synchronize()
        if dist.is_initialized():
            dist.barrier(group=self.sync_group)

    def time(self, fn) -> int:
        """Run `fn` as a timed region; returns a handle for `collect`. `fn` may call
        `mark()` once: the region then also reports when it reached that point."""
        self.align()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._open = (start, None)
            start.record()
            fn()
            end.record()
            self._events.append((start, end, self._open[1]))
        else:
            t0 = time.perf_counter()
            self._open = (t0, None)
            fn()
            if self._synchronize is not None:
                self._synchronize()
            mark = self._open[1]
            self._events.append(((time.perf_counter() - t0) * 1e3,
                                 None if mark is None else (mark - t0) * 1e3))
        self._open = None
        return len(self._events) - 1

    def mark(self) -> None:
        """Inside a region: note the moment the work issued so far has ended on the current
        stream (CUDA: an event recorded there, no host synchronisation; an emulated GPU:
        its stream drained, as the event would be reached; CPU: now), while what was issued
        elsewhere (a collective on its lane) goes on."""
        if self._open is None:
            raise RuntimeError("Timer.mark() outside a timed region")
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = (self._open[0], event)
        else:
            if self._synchronize is not None:
                self._synchronize()
            self._open = (self._open[0], time.perf_counter())

    def collect_marked(self) -> list[tuple[float, float | None]]:
        """(local ms of the region, local ms from its start to its mark or None) of every
        region since the last collect, in order."""
        if self.cuda:
            torch.cuda.synchronize()
            times = [(start.elapsed_time(end),
                      None if mark is None else start.elapsed_time(mark))
                     for start, end, mark in self._events]
        else:
            times = list(self._events)
        self._events = []
        return times

    def collect(self) -> list[float]:
        """Local milliseconds of every region since the last collect, in order."""
        return [total for total, _ in self.collect_marked()]

    def slowest(self, local_ms: list[float]) -> list[float]:
        """Element-wise maximum over the ranks of `sync_group`."""
        # on the host: `sync_group` is a gloo group (or the default group on CPU)
        values = torch.tensor(local_ms, dtype=torch.float64, device="cpu")
        if dist.is_initialized() and values.numel():
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.sync_group)
        return values.tolist()


def median_ms(samples) -> float:
    return float(median(samples))


@dataclass
class LayerUnderTest:
    """A bound layer (`dhelix.ops.runner.BoundLayer`), its lanes (or None) and fixed inputs:
    `x` the layer input, `dy` the gradient of its output, `rotary` the RoPE table or None;
    `emulated`: None (the operators compute) or the emulated GPU every pass runs under (a
    `dhelix.gpu_emulation.emulated_run.EmulatedCalls` of the layer's model)."""

    bound: object
    lanes: object
    x: torch.Tensor
    dy: torch.Tensor
    rotary: object = None
    emulated: object = None

    def running(self):
        """The context a pass runs its operators in: none, or one emulated call."""
        return nullcontext() if self.emulated is None else self.emulated.running()

    @property
    def forward(self):
        return self.bound.programs.forward

    @property
    def backward(self):
        return self.bound.programs.backward

    def execution(self):
        return lane_execution(self.bound, self.lanes)

    def forward_execution(self):
        """An execution in its forward phase, no operator run yet."""
        execution = self.execution()
        execution.begin_forward(self.x, None, self.rotary)
        return execution

    def backward_execution(self):
        """An execution whose forward ran completely, in its backward phase."""
        execution = self.forward_execution()
        for op_id in self.forward.ids:
            execution.run(op_id)
        execution.end_forward()
        execution.begin_backward(self.dy)
        return execution


def _advance(execution, program, start: int, stop: int) -> None:
    """Run program positions [start, stop) untimed and wait for their collectives."""
    for op in program.ops[start:stop]:
        execution.run(op.id)
    execution.wait_pending()


def _run_and_wait(execution, op_id: str):
    def region():
        execution.run(op_id)
        execution.wait_pending()
    return region


def solo_pass(layer: LayerUnderTest, timer: Timer) -> dict:
    """One pass timing every operator alone: {op id: local ms} (forward then backward)."""
    ids = []
    with layer.running():
        execution = layer.forward_execution()
        for op_id in layer.forward.ids:
            timer.time(_run_and_wait(execution, op_id))
            ids.append(op_id)
        execution.end_forward()
        execution.begin_backward(layer.dy)
        for op_id in layer.backward.ids:
            timer.time(_run_and_wait(execution, op_id))
            ids.append(op_id)
        execution.end_backward()
    return dict(zip(ids, timer.collect()))


def pair_pass(layer: LayerUnderTest, timer: Timer, chain) -> list[tuple[float, float | None]]:
    """One pass over a chain of candidates (`profiler.candidates`): for each co-executed
    pair, in chain order, (local ms of the pair, local ms until its computation ended or
    None). The second is measured for a computation x collective pair only: its block runs
    without the closing barrier, the timer marks the compute stream, then both collectives'
    waits end the region (what `run_block` with its barrier does)."""
    with layer.running():
        fwd_ex, bwd_ex = layer.forward_execution(), layer.backward_execution()
        fwd_next = bwd_next = 0
        for cand in chain:
            _advance(fwd_ex, layer.forward, fwd_next, cand.fwd_pos)
            _advance(bwd_ex, layer.backward, bwd_next, cand.bwd_pos)
            block = Block((cand.fwd,), (cand.bwd,))
            if computation_beside_collective(layer.forward[cand.fwd], layer.backward[cand.bwd]):
                timer.time(lambda: _run_marked(fwd_ex, bwd_ex, block, timer))
            else:
                timer.time(lambda: run_block(fwd_ex, bwd_ex, block))
            fwd_next, bwd_next = cand.fwd_pos + 1, cand.bwd_pos + 1
    return timer.collect_marked()


def _run_marked(fwd_ex, bwd_ex, block: Block, timer: Timer) -> None:
    run_block(fwd_ex, bwd_ex, block, barrier=False)
    timer.mark()
    fwd_ex.wait_pending()
    bwd_ex.wait_pending()
