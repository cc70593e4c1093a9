#!/usr/bin/env python
"""Planner benchmark: search time and predicted speedup for a full TP+SP transformer layer
(14 forward x 18 backward operators, dgrad/wgrad split, movable wgrads) with plausible
H100-class costs (`planner.synthetic`), next to the baseline pairers.

    .venv/bin/python scripts/bench_planner.py [--max-orders N] [--wgrad-move K] [--repeat R]
                                              [--write DIR]

Prints the DP search time (the target is under 2 s on the 2-core development machines; the
script exits 1 if the median misses it) and the predicted sequential / round-robin / DP
times. `--write DIR` also writes the DAGs, the profile, the plan, its PNG and Chrome trace,
for `dhelix plan show` demos.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dhelix.dag import save_dag  # noqa: E402
from planner.build import DEFAULT_MAX_ORDERS, DEFAULT_WGRAD_MOVE, make_plan  # noqa: E402
from planner.costs import build_cost_model  # noqa: E402
from planner.plan import save_plan  # noqa: E402
from planner.synthetic import LayerShape, layer_dags, layer_profile  # noqa: E402

TARGET_S = 2.0


def bench(label, shape, dp_grad_comm, args) -> float:
    fwd, bwd = layer_dags(shape, dp_grad_comm)
    profile = layer_profile(fwd, bwd, shape)
    costs = build_cost_model(fwd, bwd, profile)
    times, plan = [], None
    for _ in range(args.repeat):
        started = time.perf_counter()
        plan = make_plan(fwd, bwd, costs, "dp", args.max_orders, args.wgrad_move)
        times.append(time.perf_counter() - started)
    fixed = make_plan(fwd, bwd, costs, "dp", 1, 0)
    rr = make_plan(fwd, bwd, costs, "round_robin")
    seq = plan.sequential_ms
    median = statistics.median(times)
    print(f"\n{label}: {len(fwd.ops)} fwd x {len(bwd.ops)} bwd ops, "
          f"{plan.search['fwd_orders']} x {plan.search['bwd_orders']} candidate orders "
          f"(max_orders {args.max_orders}, wgrad_move {args.wgrad_move})")
    print(f"  search time: median {median:.3f} s, min {min(times):.3f} s over {args.repeat} "
          f"runs (target < {TARGET_S} s)")
    print(f"  {'pairer':<28} {'predicted ms':>12} {'speedup':>8}")
    for name, p in (("sequential", None), ("round robin (Wavelet-style)", rr),
                    ("dp, program order only", fixed), ("dp + wgrad movement", plan)):
        ms = seq if p is None else p.planned_ms
        print(f"  {name:<28} {ms:>12.3f} {seq / ms:>7.3f}x")
    if args.write:
        out = Path(args.write) / re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
        save_dag(fwd, out / "fwd_dag.json")
        save_dag(bwd, out / "bwd_dag.json")
        from profiler.profile_file import save_profile
        save_profile(profile, out / "profile.json")
        save_plan(plan, out / "plan.json")
        from planner.render import render_png, write_trace
        render_png(plan, out / "plan.png")
        write_trace(plan, out / "plan.trace.json")
        print(f"  wrote DAGs, profile, plan, PNG and trace to {out}")
    return median


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-orders", type=int, default=DEFAULT_MAX_ORDERS)
    parser.add_argument("--wgrad-move", type=int, default=DEFAULT_WGRAD_MOVE)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", metavar="DIR")
    args = parser.parse_args(argv)
    medians = [
        bench("TP8+SP intra-node", LayerShape(), False, args),
        bench("TP8+SP intra-node + cross-node grad reduce-scatter", LayerShape(), True, args),
        bench("TP16+SP across nodes", LayerShape(tp=16, tp_channel="inter"), False, args),
    ]
    worst = max(medians)
    verdict = "met" if worst < TARGET_S else "NOT met"
    print(f"\nslowest median search {worst:.3f} s: target < {TARGET_S} s {verdict}")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
