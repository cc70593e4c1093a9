"""Make a plan: run a pairer, check the result's legality, evaluate every block with the
block model and assemble the `Plan` (fingerprint, orders, blocks, predictions, timeline)."""

from __future__ import annotations

import time

from dhelix.dag import OpDAG
from planner.baselines import round_robin_pairing, sequential_pairing
from planner.blocks import Pairing, check_pairing
from planner.cosched import simulate_block
from planner.costs import CostModel
from planner.dp import dp_search
from planner.memory import MIB, MemoryBound, block_peaks, readings_mib
from planner.plan import UNSPECIFIED, Plan, PlanBlock, dag_sha

PAIRERS = ("dp", "sequential", "round_robin")
DEFAULT_MAX_ORDERS = 128
DEFAULT_WGRAD_MOVE = 4


def run_pairer(name: str, fwd: OpDAG, bwd: OpDAG, costs: CostModel,
               max_orders: int = DEFAULT_MAX_ORDERS,
               wgrad_move: int = DEFAULT_WGRAD_MOVE,
               memory: MemoryBound | None = None) -> tuple[Pairing, dict]:
    """The pairing chosen by pairer `name`, and a summary of the search it did. `memory`
    bounds the DP's blocks (`planner.dp`); the baselines ignore it."""
    if name == "dp":
        result = dp_search(fwd, bwd, costs, max_orders, wgrad_move, memory)
        return result.pairing, {"fwd_orders": result.fwd_orders,
                                "bwd_orders": result.bwd_orders,
                                "seconds": round(result.seconds, 4),
                                "predicted_ms": result.planned_ms}
    started = time.perf_counter()
    if name == "sequential":
        pairing = sequential_pairing(fwd, bwd)
    elif name == "round_robin":
        pairing = round_robin_pairing(fwd, bwd)
    else:
        raise ValueError(f"unknown pairer {name!r}; choose one of {PAIRERS}")
    return pairing, {"fwd_orders": 1, "bwd_orders": 1,
                     "seconds": round(time.perf_counter() - started, 4)}


def _memory_record(pairing: Pairing, memory: MemoryBound) -> dict:
    """What a plan records of its memory bound (MiB): the bound's summary, the plan's peak
    (`plan_peak_mib`) and each block's (`block_peak_mib`, above the layer pair's start, in
    block order), and the per-operator readings the bound was made from (`ops`: per
    direction, op id -> [delta, transient]), so `dhelix plan show` can print them and the
    plan can be re-bounded offline."""
    peaks = block_peaks(pairing, memory.fwd, memory.bwd, memory.input_bytes)
    return {**memory.summary(), "plan_peak_mib": round(max([0.0, *peaks]) / MIB, 3),
            "block_peak_mib": [round(peak / MIB, 3) for peak in peaks],
            "ops": {"fwd": readings_mib(memory.fwd), "bwd": readings_mib(memory.bwd)}}


def make_plan(fwd: OpDAG, bwd: OpDAG, costs: CostModel, pairer: str = "dp",
              max_orders: int = DEFAULT_MAX_ORDERS, wgrad_move: int = DEFAULT_WGRAD_MOVE,
              model: str = UNSPECIFIED, parallel: str = UNSPECIFIED,
              hardware: str | None = None, command: str = "",
              memory: MemoryBound | None = None) -> Plan:
    """A complete, legal plan for one layer. `hardware` defaults to the profile's hardware
    fingerprint. Guarantees: the pairing passes `check_pairing`; block times come from
    `simulate_block` and add up to `planned_ms`; for the DP pairer they equal the DP's own
    prediction (an internal cross-check between the two implementations of the model).
    With `memory` (`planner.memory`), the DP uses only blocks within its budget, and the
    plan's `search["memory"]` records the budget and the model's peak of the plan (MiB
    above the layer pair's start); without it the DP is unbounded."""
    pairing, search = run_pairer(pairer, fwd, bwd, costs, max_orders, wgrad_move, memory)
    check_pairing(fwd, bwd, pairing)
    if memory is not None:
        search["memory"] = _memory_record(pairing, memory)
    blocks, timeline, clock = [], [], 0.0
    for number, block in enumerate(pairing.blocks):
        sim = simulate_block(block.fwd, block.bwd, costs)
        estimated = costs.source != "profile" or any(
            costs.estimated_pair(f, b) for f, b in sim.corun)
        blocks.append(PlanBlock(block.fwd, block.bwd, clock, sim.ms, estimated))
        for span in sim.spans:
            timeline.append({"strand": span.strand, "op": span.op, "block": number,
                             "start_ms": clock + span.start, "end_ms": clock + span.end})
        clock += sim.ms
    predicted = search.pop("predicted_ms", None)  # only the DP predicts by itself
    if predicted is not None and abs(predicted - clock) > 1e-6 * max(1.0, clock):
        raise RuntimeError(f"internal error: the DP predicted {predicted} ms but its blocks "
                           f"simulate to {clock} ms")
    ops = {}
    for dag, solo in ((fwd, costs.solo_f), (bwd, costs.solo_b)):
        ops[dag.direction] = {op.id: {"kind": op.kind, "channel": op.channel,
                                      "op_class": op.op_class, "cost_key": op.cost_key,
                                      "solo_ms": solo[op.id]} for op in dag.ops}
    fingerprint = {"model": model, "parallel": parallel,
                   "hardware": hardware or costs.hardware,
                   "profile_sha": costs.profile_sha, "dag_sha": dag_sha(fwd, bwd)}
    return Plan(
        fingerprint=fingerprint, pairer=pairer, cost_source=costs.source,
        options={"max_orders": max_orders, "wgrad_move": wgrad_move},
        fwd_order=pairing.fwd_order, bwd_order=pairing.bwd_order, blocks=tuple(blocks),
        sequential_ms=costs.sequential_ms(), planned_ms=clock,
        estimated=any(b.estimated for b in blocks), ops=ops, timeline=tuple(timeline),
        search=search, command=command,
    )
