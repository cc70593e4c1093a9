"""The memory bound of a layer pair: how much a block may add to the bytes the two
micro-batches already hold, and which blocks stay within a budget.

Without pipelining, at a layer pair (forward of layer l of micro-batch i+1, backward of
layer L-1-l of micro-batch i) the two micro-batches hold L layers of saved activations, as
Megatron's schedule does when its backward starts. Everything the pair's forward allocates
before its backward has freed the same is on top of that.

Model (`OpMemory`, measured once per run by `dhelix.runtime.memory_profile`): per op, the
bytes it leaves live (`delta`: its outputs kept for later readers minus the inputs it was
the last reader of) and its transient (`transient`: the most it holds above the live bytes
it started from while it runs, its temporaries and outputs together). An op's delta is
taken as the same in every candidate order: it is measured in program order, and the bounded
search uses only orders in which every value is last read by the same op as there
(`frees_as_measured`; moving a weight-gradient op later moves its frees with it).

For an order, `L[k]` is the live bytes after its first k ops (relative to the strand's
start) and `P[k]` the most during op k (`L[k-1] + transient`). Only one operator runs at a
time on the compute thread (`dhelix.runtime.strand_executor`), so a block cutting F[a:i]
and B[b:j] holds at most

    max( max L_f[a..i] + max P_b(b..j],  max P_f(a..i] + max L_b[b..j] )

above the pair's start, whatever the interleaving. The reference is the sequential plan
(`planner.baselines.sequential_pairing`: the whole backward layer, then the whole forward
layer) in program order, whose peak is that of Megatron's backward over the same L layers:
`max(max P_b, L_b[m] + max P_f)`, or, where it is larger, what the step holds outside the
layer pairs on top of the same L layers (`outside_bytes`: without pipelining, the loss
part's forward and backward at the first backward's start, which is where Megatron's step
peaks), less what a layer pair holds at its start beyond those L layers and Megatron does
not hold there (`pair_start_bytes`, which the caller gives where it applies; the loss
part's own hidden state and its gradient are in its reading): a layer pair reaching the rest
raises no peak. Measured at Llama-8B shapes: with one layer the pair starts with the
embedding's output and the loss part's input gradient besides (two [s, b, h] tensors, the
step's peak came out those 64 MiB above the plan's prediction before they were taken off);
with four layers the step's peak is the plan's less the loss part's reading, nothing to take
off (`dhelix.runtime.setup._memory_bound`). The budget is that plus a margin; the plan "all
of B, then all of F" of the program orders always fits it, so the DP always has a plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from dhelix.dag import topological_sort

MIB = 2 ** 20


@dataclass(frozen=True)
class OpMemory:
    """Measured memory of one layer's operators, by op id (bytes): `delta` live bytes left
    after the op, `transient` the most above its starting live bytes while it runs."""

    delta: Mapping[str, int]
    transient: Mapping[str, int]

    def covers(self, ops) -> bool:
        return all(o in self.delta and o in self.transient for o in ops)


@dataclass(frozen=True)
class MemoryBound:
    """Measured memory of both directions and the budget a block must fit (bytes above
    the layer pair's start). `reference_bytes`: the sequential plan's peak (program
    orders, backward first); `outside_bytes`: the most the step holds outside the layer
    pairs above the same layers' activations (0: not known); `pair_start_bytes`: what a
    layer pair holds at its start beyond those activations, which comes off
    `outside_bytes` (module docstring); `margin_bytes`: the allowance above the larger of
    the reference and what is left of `outside_bytes`; `input_bytes`: the forward's input
    where the pair's start does not hold it (without pipelining an SI block's first layer
    pair reads the next micro-batch's embedding output, made in the block), counted from
    the forward's first operator on (`block_peak_table`)."""

    fwd: OpMemory
    bwd: OpMemory
    reference_bytes: float
    margin_bytes: float
    outside_bytes: float = 0.0
    pair_start_bytes: float = 0.0
    input_bytes: float = 0.0
    # the sequential plan's peak with its forward's input made before the forward (-inf:
    # not given): the budget never goes below it, so that plan always fits
    sequential_bytes: float = float("-inf")

    @property
    def budget_bytes(self) -> float:
        outside = max(0.0, self.outside_bytes - self.pair_start_bytes)
        return max(max(self.reference_bytes, outside) + self.margin_bytes,
                   self.sequential_bytes)

    def summary(self) -> dict:
        """What a plan records of the bound (MiB)."""
        return {"reference_mib": round(self.reference_bytes / MIB, 3),
                "outside_mib": round(self.outside_bytes / MIB, 3),
                "pair_start_mib": round(self.pair_start_bytes / MIB, 3),
                "input_mib": round(self.input_bytes / MIB, 3),
                "margin_mib": round(self.margin_bytes / MIB, 3),
                "budget_mib": round(self.budget_bytes / MIB, 3)}


def readings_mib(memory: OpMemory) -> dict:
    """Per-operator readings as a plan records them (`planner.build`): op id -> [delta,
    transient] in MiB (3 decimals); `bound_from_record` reads them back."""
    return {op: [round(memory.delta[op] / MIB, 3), round(memory.transient[op] / MIB, 3)]
            for op in memory.delta}


def bound_from_record(record: dict, fwd_order, bwd_order,
                      margin_mib: float | None = None) -> MemoryBound:
    """The bound a plan recorded (`search.memory`: `MemoryBound.summary` and the readings of
    both directions, `ops`), rebuilt over these program orders, with `margin_mib` in place of
    its margin when given."""
    readings = [OpMemory({o: v[0] * MIB for o, v in record["ops"][d].items()},
                         {o: v[1] * MIB for o, v in record["ops"][d].items()})
                for d in ("fwd", "bwd")]
    margin = record["margin_mib"] if margin_mib is None else margin_mib
    return make_bound(fwd_order, bwd_order, *readings, margin * MIB,
                      record["outside_mib"] * MIB, record["pair_start_mib"] * MIB,
                      record["input_mib"] * MIB)


def live_and_peak(order: Sequence[str], memory: OpMemory) -> tuple[np.ndarray, np.ndarray]:
    """(L, P) of an order: `L[k]` live bytes after k ops (k = 0..n, L[0] = 0), `P[k]` the
    most while op k runs (k = 1..n; P[0] = -inf)."""
    live = np.concatenate([[0.0], np.cumsum([float(memory.delta[o]) for o in order])])
    peak = np.full(len(order) + 1, -np.inf)
    for k, op in enumerate(order, start=1):
        peak[k] = live[k - 1] + max(float(memory.transient[op]), 0.0, live[k] - live[k - 1])
    return live, peak


def layer_activation_bytes(fwd_order, fwd: OpMemory) -> float:
    """Bytes one layer's forward leaves live for its backward (the sum of its deltas)."""
    return float(max(0.0, live_and_peak(fwd_order, fwd)[0][-1]))


def sequential_peak(fwd_order, bwd_order, fwd: OpMemory, bwd: OpMemory,
                    input_bytes: float = 0.0) -> float:
    """Peak above the pair's start of the whole backward, then the whole forward (with its
    input, `input_bytes`, made before it: Megatron's order)."""
    live_b, peak_b = live_and_peak(bwd_order, bwd)
    _, peak_f = live_and_peak(fwd_order, fwd)
    return float(max(0.0, peak_b.max(), live_b[-1] + input_bytes + peak_f.max()))


def make_bound(fwd_order, bwd_order, fwd: OpMemory, bwd: OpMemory,
               margin_bytes: float, outside_bytes: float = 0.0,
               pair_start_bytes: float = 0.0, input_bytes: float = 0.0) -> MemoryBound:
    """The bound for these measurements, the reference being the sequential plan over the
    program orders `fwd_order` / `bwd_order` (Megatron's peak at a backward's start), or
    `outside_bytes` less `pair_start_bytes` where larger; blocks count `input_bytes` from
    the forward's first operator on, and the budget holds at least the sequential plan with
    it (`MemoryBound.sequential_bytes`)."""
    if min(margin_bytes, outside_bytes, pair_start_bytes, input_bytes) < 0:
        raise ValueError(f"memory margin, outside peak, pair start and input must be >= 0, "
                         f"got {margin_bytes}, {outside_bytes}, {pair_start_bytes} and "
                         f"{input_bytes}")
    return MemoryBound(fwd, bwd, sequential_peak(fwd_order, bwd_order, fwd, bwd),
                       float(margin_bytes), float(outside_bytes), float(pair_start_bytes),
                       float(input_bytes),
                       sequential_peak(fwd_order, bwd_order, fwd, bwd, input_bytes))


def _range_max(values: np.ndarray, closed: bool) -> np.ndarray:
    """R[a, i] = max values[a..i] (closed) or values(a..i] (half-open: a < k <= i),
    -inf where the range is empty or i < a."""
    n = len(values)
    out = np.full((n, n), -np.inf)
    for a in range(n):
        acc = -np.inf
        for i in range(a, n):
            if closed or i > a:
                acc = max(acc, values[i])
            out[a, i] = acc
    return out


def block_peak_table(fwd_order, bwd_order, fwd: OpMemory, bwd: OpMemory,
                     input_bytes: float = 0.0) -> np.ndarray:
    """`M[i, j, a, b]`: the most a block cutting F[a:i] and B[b:j] can hold above the pair's
    start (module docstring), over every interleaving of its two segments; same layout as
    `planner.cosched.block_cost_table` (entries with i < a or j < b are meaningless).
    `input_bytes` (`MemoryBound.input_bytes`) is held from the forward's first operator
    on."""
    live_f, peak_f = live_and_peak(fwd_order, fwd)
    live_f[1:] += input_bytes
    peak_f[1:] += input_bytes
    live_b, peak_b = live_and_peak(bwd_order, bwd)
    rl_f, rp_f = _range_max(live_f, True), _range_max(peak_f, False)
    rl_b, rp_b = _range_max(live_b, True), _range_max(peak_b, False)
    with np.errstate(invalid="ignore"):
        worst = np.maximum(rl_f[:, :, None, None] + rp_b[None, None, :, :],
                           rp_f[:, :, None, None] + rl_b[None, None, :, :])  # [a, i, b, j]
    return np.ascontiguousarray(worst.transpose(1, 3, 0, 2))  # -> [i, j, a, b]


def seam_peak(fwd_order, bwd_order, head: int, tail_ops: int, fwd: OpMemory,
              bwd: OpMemory) -> float:
    """Peak above a layer pair's start of its seam (`planner.blocks.Seam`): the pair's
    forward done and its backward but for the last `tail_ops` operators, co-executed with
    the next pair's first `head` forward operators."""
    live_f, peak_f = live_and_peak(fwd_order, fwd)
    live_b, peak_b = live_and_peak(bwd_order, bwd)
    start = len(bwd_order) - tail_ops
    head_l, head_p = live_f[:head + 1].max(), peak_f[1:head + 1].max(initial=-np.inf)
    tail_l, tail_p = live_b[start:].max(), peak_b[start + 1:].max(initial=-np.inf)
    return float(live_f[-1] + max(head_l + tail_p, head_p + tail_l))


def block_peaks(pairing, fwd: OpMemory, bwd: OpMemory, input_bytes: float = 0.0) -> list:
    """Each block's bound of `block_peak_table` (bytes above the layer pair's start: the
    most the block can hold over any interleaving of its two segments), in the order of
    `pairing.blocks` (`planner.blocks.Pairing`)."""
    table = block_peak_table(pairing.fwd_order, pairing.bwd_order, fwd, bwd, input_bytes)
    peaks, i, j = [], 0, 0
    for block in pairing.blocks:
        a, b = i, j
        i, j = i + len(block.fwd), j + len(block.bwd)
        peaks.append(float(table[i, j, a, b]))
    return peaks


def pairing_peak(pairing, fwd: OpMemory, bwd: OpMemory, input_bytes: float = 0.0) -> float:
    """The model's peak above the pair's start of a pairing: the largest of its
    `block_peaks` (0 for no blocks)."""
    return max([0.0, *block_peaks(pairing, fwd, bwd, input_bytes)])


def early_input_block(pairing, fwd: OpMemory, bwd: OpMemory, budget_bytes: float,
                      input_bytes: float) -> int:
    """The earliest block of `pairing` before which the forward's input (`input_bytes`, a
    tensor the pair's start does not hold: the next micro-batch's embedding output while
    its all-reduce travels) may be allocated with every block up to the first one with
    forward operators still within `budget_bytes` (each block's bound of
    `block_peak_table` plus the input). That first block is always allowed: there the
    forward reads its input, as with no early start. So a block that cannot hold the input
    beside the backward strand keeps it out of every block before it too."""
    table = block_peak_table(pairing.fwd_order, pairing.bwd_order, fwd, bwd)
    first = next((k for k, block in enumerate(pairing.blocks) if block.fwd),
                 len(pairing.blocks))
    bounds, i, j = [], 0, 0
    for block in pairing.blocks[:first]:
        a, b = i, j
        i, j = i + len(block.fwd), j + len(block.bwd)
        bounds.append(float(table[i, j, a, b]))
    return earliest_fitting_start(bounds, input_bytes, budget_bytes)


def earliest_fitting_start(holds: Sequence[float], extra_bytes: float,
                           budget_bytes: float) -> int:
    """The earliest index k such that every one of `holds[k:]` (what each step before a
    tensor's reader holds) plus `extra_bytes` (the tensor) stays within `budget_bytes`;
    `len(holds)` (start at the reader) where the last one does not fit. The rule of
    `early_input_block` (per block) and `planner.streamed.early_input_step` (per entry)."""
    start = len(holds)
    while start > 0 and holds[start - 1] + extra_bytes <= budget_bytes:
        start -= 1
    return start


def frees_as_measured(dag, order: Sequence[str]) -> bool:
    """True if, in `order`, every op's outputs are last read by the same op as in program
    order (`dhelix.dag.topological_sort`), where the measurement attributed their free.
    Moving a reader after the measured last reader (a weight-gradient op before its
    data-gradient op) would free later than `OpMemory.delta` says; the bounded search
    skips such orders. Readers are taken from the DAG's deps (an op reads its deps'
    outputs)."""
    program = {op: k for k, op in enumerate(topological_sort(dag))}
    position = {op: k for k, op in enumerate(order)}
    readers: dict = {}
    for op in dag.ops:
        for dep in op.deps:
            readers.setdefault(dep, []).append(op.id)
    for ops in readers.values():
        if max(ops, key=program.__getitem__) != max(ops, key=position.__getitem__):
            return False
    return True
