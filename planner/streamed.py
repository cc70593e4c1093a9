"""Streamed SI blocks: both strands of an SI block run as two continuous operator streams,
layer after layer, with no block barriers, their collectives on one FIFO lane per channel in
an order fixed in advance.

The block model (`planner.cosched`, `planner.dp`) ends every block with a barrier and allows
one collective of a channel per block; measured on the emulated GPU cluster that keeps the
link ~65% busy inside a layer pair (docs/benchmark.md). A streamed SI block instead issues
one static sequence of operators - the forward strand's layers in order and the backward
strand's in order, interleaved - on one compute lane; each collective goes to its channel's
lane when the sequence reaches it and starts when the lane's previous collective has ended
(one NCCL communicator per channel: one stream, kernels in issue order); a computation that
reads a collective waits for it (a stream wait on a GPU). Because the sequence is static, every
rank issues the same collectives in the same order, so both strands may share one process
group per channel.

`plan_streamed` searches strand orders (`planner.orders.candidate_orders`) and, per layer
pair, the order of the pair's collectives on the lane (every interleaving of the forward's
and the backward's collectives that keeps each strand's own order), list-scheduling the
compute lane for each (the ready strand that owns the lane's next collective first) and
simulating layer pairs as the executor runs them (`dhelix.runtime.streamed_executor`): a
layer's operators start after the same strand's previous layer has ended (its collectives
waited), compute is slowed by the largest `collective_sigma` of the collectives in flight,
collectives take their solo time. It ranks every candidate on one layer pair, simulates a
shortlist on the SI block's whole length, keeps the fastest, and returns its operator
sequence. Pure: no torch, no process group.

Memory (`planner.memory.MemoryBound`, optional): the sequence is static, so the live bytes
above the SI block's start (a layer pair's start) are known at every entry: the sum of the
deltas of every operator run so far, both strands, all layers, plus the running operator's
transient, less what whole layer pairs left behind (the measured deltas of a forward
layer and a backward layer need not cancel, while every layer pair's start holds the same
L layers' activations: the block model measures every pair from its own start, and so does
this, from the start of the latest layer pair both strands have finished). With a bound,
the list scheduler runs a strand's computation only where that stays within a cap
(else the other strand's, which frees: a backward; or, where neither fits, the backward),
and a candidate whose sequence still exceeds the budget is kept only when none fits (the
one with the least peak; `within_budget` says so). Steering is greedy, and holding a
strand back to a tighter cap can give a faster sequence within the budget than steering
to the budget itself, so each candidate is steered to several caps from the budget down to
the sequential plan's peak (`steer_caps`).

Pipeline transfers (`transfer_ms`, optional: a folded stage of the W schedule): the block's
forward input and output gradient travel between the stages, and a block whose strands
start and end together leaves both transfers exposed (`planner.pipeline_transfers`). With a
transfer time the search also simulates every candidate with the forward strand held back
until that time (its input still in flight: the backward strand runs alone first, and
tends to end first, so its output leaves early), and ranks candidates by the simulated
time plus the exposure the strands' starts and ends leave (`exposed_ms`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dhelix.dag import OpDAG
from planner.cosched import collective_sigma
from planner.costs import CostModel
from planner.memory import MemoryBound, earliest_fitting_start, live_and_peak
from planner.orders import candidate_orders
from planner.pipeline_transfers import strands_exposure

FWD, BWD = "fwd", "bwd"
# candidates one search ranks (each simulated on one layer pair: ~0.2 ms for a Llama layer)
MAX_CANDIDATES = 2048
# candidates simulated again on the SI block's whole length (`plan_streamed`)
SHORTLIST = 16


@dataclass(frozen=True)
class StreamedStep:
    """One entry of a streamed SI block's sequence: operator `op` of layer pair `pair`
    (0-based, in the SI block's order) of strand `strand` ('fwd' or 'bwd')."""

    strand: str
    pair: int
    op: str


@dataclass(frozen=True)
class StreamedSchedule:
    """The fastest streamed interleaving found for `pairs` layer pairs: the strand orders
    (one per layer, the same for every layer), the lane order of one pair's collectives
    (strand names, e.g. ('bwd', 'fwd', 'bwd', 'fwd')), the static operator sequence of the
    whole SI block and its simulated time; `searched` counts the candidates simulated. With
    a memory bound: the sequence's peak above the SI block's start (`peak_bytes`), the
    budget, whether the peak is within it (None: no bound), and the fastest candidate's time
    and peak had there been no bound (`unbounded_ms`, `unbounded_peak_bytes`: what the bound
    costs, and what a margin would have to allow to avoid it), and `input_step`: the earliest
    entry of the sequence before which the forward's input (`MemoryBound.input_bytes`) may
    be made with every entry up to the first forward one within the budget
    (`early_input_step`; 0 without a bound). With pipeline transfers (`transfer_ms`): the
    time the forward strand was held back in the simulation (`fwd_hold_ms`) and the
    transfers' exposure (`exposed_ms`; `block_ms` adds it to the simulated time), and
    `unbounded_ms` includes that exposure too. `first_strand`: the strand the sequence
    ends first in the simulation (on a pipeline stage its output leaves first)."""

    fwd_order: tuple
    bwd_order: tuple
    lane_pattern: tuple
    sequence: tuple
    pairs: int
    total_ms: float
    searched: int
    peak_bytes: float | None = None
    budget_bytes: float | None = None
    unbounded_ms: float | None = None
    unbounded_peak_bytes: float | None = None
    input_step: int = 0
    transfer_ms: float | None = None
    fwd_hold_ms: float = 0.0
    exposed_ms: float = 0.0
    first_strand: str = BWD

    @property
    def block_ms(self) -> float:
        """The SI block's time with its pipeline transfers' exposure (the simulated time
        without transfers)."""
        return self.total_ms + self.exposed_ms

    @property
    def first_forward_step(self) -> int:
        """Index of the sequence's first forward entry (where the forward reads its input)."""
        return _first_forward(self.sequence)

    @property
    def within_budget(self) -> bool | None:
        if self.budget_bytes is None:
            return None
        return self.peak_bytes <= self.budget_bytes

    @property
    def pair_ms(self) -> float:
        """Simulated time per layer pair."""
        return self.total_ms / self.pairs


class _Model:
    """What the simulation reads of both directions: op nodes, solo times, collective
    slowdowns, and per memory bound its operators' tables (`memory_tables`)."""

    def __init__(self, fwd: OpDAG, bwd: OpDAG, costs: CostModel):
        self.ops = {FWD: fwd.by_id(), BWD: bwd.by_id()}
        self.is_comm = {d: {o: n.kind == "comm" for o, n in self.ops[d].items()}
                        for d in (FWD, BWD)}
        self.deps = {d: {o: tuple(n.deps) for o, n in self.ops[d].items()} for d in (FWD, BWD)}
        self.solo = {FWD: costs.solo_f, BWD: costs.solo_b}
        compute = {d: [o for o, n in self.ops[d].items() if n.kind != "comm"]
                   for d in (FWD, BWD)}
        self.sigma = {(d, o): collective_sigma(costs, o, d, compute[_other(d)])
                      for d in (FWD, BWD) for o, n in self.ops[d].items() if n.kind == "comm"}
        self._memory_tables: dict = {}

    def memory_tables(self, memory: MemoryBound) -> tuple[dict, dict]:
        """Per direction and operator: its live-bytes delta, and what it holds above the
        live bytes while it runs (its transient, its delta, or nothing); kept per bound."""
        key = id(memory)
        if key not in self._memory_tables:
            per = {FWD: memory.fwd, BWD: memory.bwd}
            delta = {d: {o: float(per[d].delta[o]) for o in self.ops[d]} for d in per}
            extra = {d: {o: max(float(per[d].transient[o]), 0.0, delta[d][o])
                         for o in self.ops[d]} for d in per}
            self._memory_tables[key] = (memory, delta, extra)  # (holds the key's object)
        return self._memory_tables[key][1:]


def _other(direction: str) -> str:
    return BWD if direction == FWD else FWD


def lane_patterns(fwd_collectives: int, bwd_collectives: int) -> list[tuple]:
    """Every order of one layer pair's collectives on the lane that keeps each strand's own
    order: the distinct arrangements of that many 'fwd' and 'bwd' entries."""
    slots = fwd_collectives + bwd_collectives
    patterns = []
    for chosen in itertools.combinations(range(slots), fwd_collectives):
        picked = set(chosen)
        patterns.append(tuple(FWD if i in picked else BWD for i in range(slots)))
    return patterns


def simulate_streamed(model: _Model, fwd_order: Sequence[str], bwd_order: Sequence[str],
                      pattern: Sequence[str], pairs: int, memory: MemoryBound | None = None,
                      steer: bool = True) -> tuple[float, tuple, float]:
    """(simulated ms, operator sequence, peak bytes above the start) of `pairs` layer
    pairs streamed as the module docstring says; the lane order of every pair's collectives
    follows `pattern`; `memory` measures the peak (0.0 without it) and, with `steer`, keeps
    the compute lane within its budget."""
    run = _simulate(model, fwd_order, bwd_order, pattern, pairs, memory, steer)
    return run.ms, _steps(run.sequence), run.peak


def _steps(sequence: tuple) -> tuple:
    """`_simulate`'s (strand, pair, op) entries as `StreamedStep`s."""
    return tuple(StreamedStep(d, p, o) for d, p, o in sequence)


class _Run(NamedTuple):
    """One simulation (`_simulate`): its time, (strand, pair, op) sequence and peak, and
    each strand's first start and last end (ms from the block's start)."""

    ms: float
    sequence: tuple
    peak: float
    starts: dict
    ends: dict


def _simulate(model: _Model, fwd_order: Sequence[str], bwd_order: Sequence[str],
              pattern: Sequence[str], pairs: int, memory: MemoryBound | None,
              steer: bool, fwd_hold: float = 0.0, steer_cap: float | None = None) -> _Run:
    """`simulate_streamed` with the sequence as (strand, pair, op) tuples, the forward
    strand's first operator ready no earlier than `fwd_hold` ms (its input in flight);
    with `steer`, the compute lane is kept within `steer_cap` bytes (default: the budget).

    (The planner runs this thousands of times per plan, so it keeps each strand's head
    operator and the time it is ready until the strand moves on, each layer's end once
    known, and only the collectives still in flight after the compute lane's clock: a
    computation starts at or after that clock, so one that has ended cannot slow it.)"""
    orders = {FWD: tuple(fwd_order), BWD: tuple(bwd_order)}
    size = {d: len(orders[d]) for d in orders}
    position = {FWD: 0, BWD: 0}  # index into the strand's whole stream (pairs x order)
    length = {d: pairs * size[d] for d in orders}
    is_comm, deps = model.is_comm, model.deps
    lane_queue = [(direction, pair) for pair in range(pairs) for direction in pattern]
    next_lane = 0  # the next collective of lane_queue to issue
    done_at: dict = {}  # (direction, pair, op) -> end time
    layer_end: dict = {}  # (direction, pair) -> when every op of that layer had ended
    lanes: dict = {}  # channel -> end time of the last collective queued on it
    running: list = []  # collectives in flight after the compute clock: (start, end, sigma)
    last_end = 0.0  # of every collective issued
    sequence = []
    starts: dict = {}  # strand -> its first operator's start
    t = 0.0
    live, peak = 0.0, 0.0
    bounded = memory is not None
    if bounded:
        budget = memory.budget_bytes if steer_cap is None else steer_cap
        delta, running_extra = model.memory_tables(memory)
        # what one layer pair leaves behind (module docstring)
        pair_drift = sum(delta[d][o] for d in (FWD, BWD) for o in orders[d])
        fwd_input = memory.input_bytes

    def during(direction, op):
        """Live bytes while `op` runs next, from `live`, above the start of the latest
        layer pair both strands have finished; in the first, with the forward's input from
        its first operator on (`MemoryBound.input_bytes`; later pairs start with it)."""
        finished = min(position[FWD] // size[FWD], position[BWD] // size[BWD])
        held = live - finished * pair_drift + running_extra[direction][op]
        if finished == 0 and (position[FWD] > 0 or direction == FWD):
            held += fwd_input
        return held

    def layer_started(direction, pair):
        """The strand's previous layer has ended (every op and collective done) by then."""
        if pair == 0:
            return fwd_hold if direction == FWD else 0.0
        key = (direction, pair - 1)
        if key not in layer_end:
            layer_end[key] = max(done_at[(direction, pair - 1, o)] for o in orders[direction])
        return layer_end[key]

    def head_of(direction):
        """(pair, op, ready time) of the strand's next operator, None when it has ended.
        Its dependencies precede it in the strand's order, so they have ended already and
        the ready time holds until the strand moves on."""
        index = position[direction]
        if index >= length[direction]:
            return None
        pair, op = index // size[direction], orders[direction][index % size[direction]]
        ready = layer_started(direction, pair)
        for dep in deps[direction][op]:
            ready = max(ready, done_at[(direction, pair, dep)])
        return pair, op, ready

    head = {FWD: head_of(FWD), BWD: head_of(BWD)}
    while head[FWD] is not None or head[BWD] is not None:
        # issue every collective at a strand's head that is the lane's next
        issued = True
        while issued:
            issued = False
            for direction in (FWD, BWD):
                if head[direction] is None:
                    continue
                pair, op, ready = head[direction]
                if not is_comm[direction][op] or next_lane >= len(lane_queue) \
                        or lane_queue[next_lane] != (direction, pair):
                    continue
                channel = model.ops[direction][op].channel
                start = max(t, ready, lanes.get(channel, 0.0))
                starts.setdefault(direction, start)
                end = start + model.solo[direction][op]
                lanes[channel] = end
                last_end = max(last_end, end)
                done_at[(direction, pair, op)] = end
                running.append((start, end, model.sigma[(direction, op)]))
                sequence.append((direction, pair, op))
                if bounded:
                    peak = max(peak, during(direction, op))
                    live += delta[direction][op]
                position[direction] += 1
                head[direction] = head_of(direction)
                next_lane += 1
                issued = True
        # the compute lane's next operator: a strand whose head is computation
        heads = [d for d in (FWD, BWD) if head[d] is not None and not is_comm[d][head[d][1]]]
        if not heads:
            if head[FWD] is not None or head[BWD] is not None:
                raise ValueError(f"lane pattern {tuple(pattern)} does not fit the strand "
                                 "orders (a collective can never be issued)")
            break
        if bounded and steer and len(heads) > 1:
            fits = [d for d in heads if during(d, head[d][1]) <= budget]
            heads = fits or ([BWD] if BWD in heads else heads)
        owner = lane_queue[next_lane][0] if next_lane < len(lane_queue) else None
        heads.sort(key=lambda d: (head[d][2], d != owner))
        direction = heads[0]
        if owner in heads and head[owner][2] <= max(t, head[direction][2]):
            direction = owner
        pair, op, ready = head[direction]
        start = max(t, ready)
        starts.setdefault(direction, start)
        t = _compute_end(start, model.solo[direction][op], running)
        running = [c for c in running if c[1] > t]
        done_at[(direction, pair, op)] = t
        sequence.append((direction, pair, op))
        if bounded:
            peak = max(peak, during(direction, op))
            live += delta[direction][op]
        position[direction] += 1
        head[direction] = head_of(direction)
    ends = {d: max(done_at[(d, pairs - 1, o)] for o in orders[d]) for d in orders}
    return _Run(max(t, last_end), tuple(sequence), peak, starts, ends)


def early_input_step(sequence: Sequence, memory: MemoryBound) -> int:
    """The earliest entry of `sequence` (`StreamedStep`s) before which the forward's input
    (`memory.input_bytes`) may be made with every entry up to the first forward one still
    within `memory`'s budget (each entry's live bytes above the SI block's start while it
    runs, as `_simulate` counts them, plus the input); that first forward entry always
    (there the forward reads it). The entries before it are the backward strand's."""
    first = _first_forward(sequence)
    _, holds = live_and_peak([step.op for step in sequence[:first]], memory.bwd)
    return earliest_fitting_start(holds[1:], memory.input_bytes, memory.budget_bytes)


def _first_forward(sequence: Sequence) -> int:
    """Index of the first forward entry of `sequence` (its length if none)."""
    return next((k for k, step in enumerate(sequence) if step.strand == FWD), len(sequence))


def _compute_end(start: float, work: float, running: list) -> float:
    """When `work` ms of computation started at `start` ends, progressing at 1 / sigma of
    the collectives in flight (the largest sigma) and at full speed otherwise."""
    t = start
    while work > 1e-12:
        active = [(s, e, sig) for s, e, sig in running if s <= t < e]
        if active:
            sigma = max(sig for _, _, sig in active)
            horizon = min(e for _, e, _ in active)
        else:
            sigma = 1.0
            upcoming = [s for s, _, _ in running if s > t]
            horizon = min(upcoming) if upcoming else float("inf")
        span = horizon - t
        if span * 1.0 / sigma >= work:
            return t + work * sigma
        work -= span / sigma
        t = horizon
    return t


class _Outcome(NamedTuple):
    """One candidate simulated over some layer pairs: its better sequence by `key` (within
    the budget first, then faster, transfers' exposure counted; outside it, smaller peak
    first), that sequence's time, peak, forward hold and exposure, and the fastest sequence's
    time (exposure included) and peak, within the budget or not ("free": what the bound
    costs). The sequence is `_simulate`'s (strand, pair, op) tuples."""

    key: tuple
    ms: float
    sequence: tuple
    peak: float
    hold: float
    exposed: float
    first_strand: str
    free_ms: float
    free_peak: float


# how many caps a candidate is steered to where its free sequence peaks above them
# (`steer_caps`): the budget and, evenly below it, down to the sequential plan's peak
STEER_LEVELS = 4


def steer_caps(memory: MemoryBound) -> tuple:
    """The caps (bytes) to steer a candidate's compute lane to, largest first: the budget,
    then `STEER_LEVELS - 1` levels evenly below it down to the sequential plan's peak
    (`reference_bytes`; where the budget is not above it, the budget alone). Steering is
    greedy: holding a strand back earlier can leave a sequence that is faster and still
    within the budget, which steering to the budget itself misses (on the (d) benchmark's
    Llama layer: 1,695 ms a layer pair within a 159 MiB budget, steered to the sequential
    plan's 112, against 1,850 steered to the budget)."""
    top, low = memory.budget_bytes, min(memory.reference_bytes, memory.budget_bytes)
    if top <= low:
        return (top,)
    step = (top - low) / (STEER_LEVELS - 1)
    return tuple(top - k * step for k in range(STEER_LEVELS))


def _exposure(run: _Run, transfer_ms: float | None) -> tuple[float, str]:
    """The pipeline transfers' exposure of `run` (0 without transfers) and the strand it
    ends first."""
    exposure = strands_exposure(run.ms, run.starts, run.ends, transfer_ms or 0.0)
    return (exposure.exposed_ms if transfer_ms is not None else 0.0), exposure.first_strand


def _evaluate(model: _Model, candidate: tuple, pairs: int, memory: MemoryBound | None,
              transfer_ms: float | None = None) -> tuple[_Outcome, int]:
    """The outcome of one candidate (lane pattern, forward order, backward order) over
    `pairs` layer pairs, and how many simulations it took: per forward hold (none, and with
    `transfer_ms` that long too), the free sequence and, with a bound, the sequences
    steered to each of `steer_caps` below the free one's peak (steering to a cap the free
    one stays within changes no decision: the same sequence). The lowest cap, the
    sequential plan's peak, is every budget's, so no budget ranks a slower candidate first
    than a budget at that peak does. The fastest of all these sequences, within the budget
    or not, is what the candidate would give without a bound (`free_ms`, `free_peak`)."""
    pattern, f, b = candidate
    budget = memory.budget_bytes if memory is not None else None
    holds = (0.0,) if transfer_ms is None else (0.0, transfer_ms)
    best, fastest_free, count = None, None, 0
    for hold in holds:
        free = _simulate(model, f, b, pattern, pairs, memory, steer=False, fwd_hold=hold)
        runs = [free]
        if budget is not None:  # steered below the free run's peak (`steer_caps`)
            runs[:0] = [_simulate(model, f, b, pattern, pairs, memory, steer=True,
                                  fwd_hold=hold, steer_cap=cap)
                        for cap in steer_caps(memory) if free.peak > cap]
        count += len(runs)
        for run in runs:
            exposed, first = _exposure(run, transfer_ms)
            block = run.ms + exposed
            key = (0, block) if budget is None or run.peak <= budget else (1, run.peak)
            if best is None or key < best[0]:
                best = (key, run.ms, run.sequence, run.peak, hold, exposed, first)
            # a steered sequence is one the unbounded search could run too
            if fastest_free is None or block < fastest_free[0]:
                fastest_free = (block, run.peak)
    return _Outcome(*best, free_ms=fastest_free[0], free_peak=fastest_free[1]), count


def plan_streamed(fwd: OpDAG, bwd: OpDAG, costs: CostModel, pairs: int,
                  max_orders: int = 64, wgrad_move: int = 4,
                  fwd_orders: Sequence[Sequence[str]] | None = None,
                  bwd_orders: Sequence[Sequence[str]] | None = None,
                  memory: MemoryBound | None = None,
                  max_candidates: int = MAX_CANDIDATES,
                  shortlist: int = SHORTLIST,
                  transfer_ms: float | None = None) -> StreamedSchedule:
    """The fastest streamed interleaving of `pairs` layer pairs (module docstring) over the
    candidate strand orders (`candidate_orders(dag, max_orders, wgrad_move)` unless given)
    and every lane pattern, at most `max_candidates` candidates (every lane pattern, each
    with the first strand orders that fit: program orders first); with `memory`, the fastest
    whose peak fits its budget (where none does, the one with the least peak).

    Every candidate is simulated on one layer pair; the `shortlist` best by that ranking
    (within the budget and faster first) and the `shortlist` fastest free ones are simulated
    again on `pairs` pairs, and the best of those is kept, so only those few simulations grow
    with the layer count (at the emulated benchmarks' Llama and MoE shapes the one-pair
    ranking put the full search's best first). Deterministic: ties keep the first candidate
    (program orders first). With `transfer_ms` (a folded stage's pipeline transfer), ranked
    with the transfers' exposure counted, each candidate also simulated with the forward
    held back that long (module docstring)."""
    if pairs < 1:
        raise ValueError(f"a streamed SI block pairs at least one layer, got {pairs}")
    if transfer_ms is not None and transfer_ms < 0:
        raise ValueError(f"a transfer time is >= 0 ms, got {transfer_ms}")
    model = _Model(fwd, bwd, costs)
    fwd_orders = [tuple(o) for o in (fwd_orders or candidate_orders(fwd, max_orders, wgrad_move))]
    bwd_orders = [tuple(o) for o in (bwd_orders or candidate_orders(bwd, max_orders, wgrad_move))]
    counts = {d: sum(1 for n in model.ops[d].values() if n.kind == "comm") for d in (FWD, BWD)}
    patterns = lane_patterns(counts[FWD], counts[BWD])
    # many collectives a layer (MoE) make many lane orders: fewer strand orders each
    room = max(1, max_candidates // len(patterns))
    fwd_orders = fwd_orders[:max(1, int(room ** 0.5))] if len(fwd_orders) * len(
        bwd_orders) > room else fwd_orders
    bwd_orders = bwd_orders[:max(1, room // len(fwd_orders))]
    candidates = [(p, f, b) for p in patterns for f in fwd_orders for b in bwd_orders]
    searched = 0
    one_pair = []
    for candidate in candidates:
        result, runs = _evaluate(model, candidate, 1, memory, transfer_ms)
        one_pair.append(result)
        searched += runs
    if pairs > 1:
        ranked = sorted(range(len(candidates)), key=lambda i: one_pair[i].key)
        fastest_free = sorted(range(len(candidates)), key=lambda i: one_pair[i].free_ms)
        kept = sorted(set(ranked[:shortlist]) | set(fastest_free[:shortlist]))
        results = []
        for i in kept:
            result, runs = _evaluate(model, candidates[i], pairs, memory, transfer_ms)
            results.append((i, result))
            searched += runs
    else:
        results = list(enumerate(one_pair))
    index, best = min(results, key=lambda r: (r[1].key, r[0]))
    fastest = min(results, key=lambda r: (r[1].free_ms, r[0]))[1]  # what the bound costs
    pattern, f, b = candidates[index]
    bounded = memory is not None
    return StreamedSchedule(fwd_order=f, bwd_order=b, lane_pattern=tuple(pattern),
                            sequence=_steps(best.sequence), pairs=pairs, total_ms=best.ms,
                            searched=searched, peak_bytes=best.peak if bounded else None,
                            budget_bytes=memory.budget_bytes if bounded else None,
                            unbounded_ms=fastest.free_ms if bounded else None,
                            unbounded_peak_bytes=fastest.free_peak if bounded else None,
                            input_step=(early_input_step(_steps(best.sequence), memory)
                                        if bounded else 0),
                            transfer_ms=transfer_ms, fwd_hold_ms=best.hold,
                            exposed_ms=best.exposed, first_strand=best.first_strand)


class StreamedPlanner:
    """Streamed schedules of one layer's DAGs and costs (and memory bound, or None) for any
    SI block size, each searched once (`plan_streamed`) and kept: an SI block pairs all of a
    rank's layers without pipelining and a chunk's on a folded stage; with `transfer_ms`
    (the folded stage's pipeline transfer) each searched with its transfers counted."""

    def __init__(self, fwd: OpDAG, bwd: OpDAG, costs: CostModel, max_orders: int = 64,
                 wgrad_move: int = 4, memory: MemoryBound | None = None,
                 transfer_ms: float | None = None):
        self.fwd, self.bwd, self.costs, self.memory = fwd, bwd, costs, memory
        self.max_orders, self.wgrad_move = max_orders, wgrad_move
        self.transfer_ms = transfer_ms
        self._schedules: dict = {}

    def adopt(self, schedules: dict) -> None:
        """Take `schedules` (pairs -> `StreamedSchedule`, searched by a planner of the same
        DAGs, costs and bound elsewhere, e.g. on another rank) as this planner's own."""
        self._schedules.update(schedules)

    def for_pairs(self, pairs: int) -> StreamedSchedule:
        if pairs not in self._schedules:
            self._schedules[pairs] = plan_streamed(self.fwd, self.bwd, self.costs, pairs,
                                                   self.max_orders, self.wgrad_move,
                                                   memory=self.memory,
                                                   transfer_ms=self.transfer_ms)
        return self._schedules[pairs]
