"""`dhelix schedule show`: build, validate and simulate a pipeline schedule, print it, and
draw it like the paper's Figure 8.

    dhelix schedule show --pp P --microbatches M [--schedule w|1f1b|sequential]
                         [--forward-cost F] [--backward-cost B] [--si-speedup S]
                         [--p2p-latency D] [--png OUT] [--json OUT] [--no-compare]

The W-shaped schedule (default) is compared with Megatron's 1F1B under the same costs (both
in the text and as a second panel of the picture) unless --no-compare is given.
"""

from __future__ import annotations

import sys

SCHEDULE_FORMAT_VERSION = 1


def _fail(message: str) -> int:
    print(f"dhelix schedule: error: {message}", file=sys.stderr)
    return 2


def _build(kind: str, p: int, m: int):
    from dhelix.schedules.actions import PipelinePath
    from dhelix.schedules.one_f_one_b import build_1f1b_schedule
    from dhelix.schedules.sequential import build_sequential_schedule
    from dhelix.schedules.w_schedule import build_w_schedule

    if kind == "w":
        return build_w_schedule(p, m)
    if kind == "1f1b":
        return build_1f1b_schedule(p, m)
    return build_sequential_schedule(PipelinePath.folded(p), m)


def _formula_line(kind: str, p: int, m: int, costs) -> str:
    from dhelix.schedules.bubbles import (
        bubble_ratio_1f1b,
        bubble_ratio_dhelix,
        dhelix_formula_applies,
        max_physical_si_speedup,
    )

    if kind == "1f1b":
        return f"paper formula (p-1)/(m-1+p) = {bubble_ratio_1f1b(p, m):.4f}"
    if kind != "w":
        return ""
    value = bubble_ratio_dhelix(p, m, costs.si_speedup)
    line = f"paper formula (p-1)/(m-1+p*s) = {value:.4f}"
    if costs.p2p_latency > 0:
        return line + " (formula assumes zero p2p latency)"
    if not dhelix_formula_applies(p, m, costs.forward, costs.backward, costs.si_speedup):
        if m <= p:
            return line + " (not applicable: m <= p leaves no SI block)"
        bound = max_physical_si_speedup(costs.forward, costs.backward)
        return line + f" (not applicable: s > (f+b)/max(f,b) = {bound:.3f})"
    return line


def _span(low: float, high: float) -> str:
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


TITLES = {"w": "DHelix W-shaped schedule (folded model)", "1f1b": "Megatron 1F1B",
          "sequential": "sequential folded reference"}


def run_show(args) -> int:
    from dhelix.file_formats import write_versioned
    from dhelix.schedules.activations import peak_live_activations
    from dhelix.schedules.render import draw_schedules_png, schedule_text
    from dhelix.schedules.simulate import Costs, DeadlockError, simulate
    from dhelix.schedules.validate import ScheduleError, validate

    try:
        costs = Costs(args.forward_cost, args.backward_cost, args.si_speedup, args.p2p_latency)
        kinds = [args.schedule]
        if args.schedule != "1f1b" and not args.no_compare:
            kinds.append("1f1b")
        panels = []
        for kind in kinds:
            schedule = _build(kind, args.pp, args.microbatches)
            validate(schedule)
            result = simulate(schedule, costs)
            panels.append((kind, schedule, result))
    except (ValueError, ScheduleError, DeadlockError) as exc:
        return _fail(str(exc))
    print(f"costs per stage and micro-batch: forward {costs.forward:g}, backward "
          f"{costs.backward:g}; SI speedup s={costs.si_speedup:g}; p2p latency "
          f"{costs.p2p_latency:g}")
    for kind, schedule, result in panels:
        print()
        print(schedule_text(schedule, result))
        live = peak_live_activations(schedule)
        print("peak live activations per stage, in micro-batch stage passes: "
              + ", ".join(_span(a, b) for a, b in zip(live.low, live.high)))
        formula = _formula_line(kind, args.pp, args.microbatches, costs)
        if formula:
            print(formula)
    if args.json:
        main = panels[0][1]
        write_versioned(args.json, "schedule", SCHEDULE_FORMAT_VERSION, main.to_dict())
        print(f"wrote {args.json}")
    if args.png:
        titled = []
        for kind, schedule, result in panels:
            title = (f"{TITLES[kind]}: p={args.pp}, m={args.microbatches}; makespan "
                     f"{result.makespan:.2f}, bubble ratio {result.bubble_ratio:.3f}")
            formula = _formula_line(kind, args.pp, args.microbatches, costs)
            titled.append((title + (f"; {formula}" if formula else ""), schedule, result))
        footer = (f"costs per stage: forward {costs.forward:g}, backward {costs.backward:g} "
                  f"(a folded chunk takes half), SI block = (F+B)/s with s={costs.si_speedup:g},"
                  f" p2p latency {costs.p2p_latency:g}")
        draw_schedules_png(args.png, titled, footer=footer)
        print(f"wrote {args.png}")
    return 0


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "schedule", help="show pipeline schedules (W-shaped DHelix, 1F1B)",
        description="Pipeline schedules as per-rank action lists: validate, simulate and "
        "draw them.")
    actions = p.add_subparsers(dest="schedule_action", metavar="{show}")
    show = actions.add_parser(
        "show", help="print, simulate and draw a schedule",
        description="Build the schedule for --pp stages and --microbatches micro-batches, "
        "validate it, simulate it with the given costs and print every stage's order; "
        "--png draws it like the paper's Figure 8.")
    show.add_argument("--pp", type=_positive_int, required=True, metavar="P",
                      help="pipeline stages (--pipeline-model-parallel-size)")
    show.add_argument("--microbatches", type=_positive_int, required=True, metavar="M",
                      help="micro-batches per global batch")
    show.add_argument("--schedule", choices=["w", "1f1b", "sequential"], default="w",
                      help="w (DHelix W-shaped, default), 1f1b (Megatron) or sequential "
                      "(folded reference)")
    show.add_argument("--forward-cost", type=float, default=1.0, metavar="F",
                      help="one stage's forward of one micro-batch (default 1)")
    show.add_argument("--backward-cost", type=float, default=2.0, metavar="B",
                      help="one stage's backward of one micro-batch (default 2)")
    show.add_argument("--si-speedup", type=float, default=1.3, metavar="S",
                      help="SI block speedup s over forward+backward (default 1.3)")
    show.add_argument("--p2p-latency", type=float, default=0.0, metavar="D",
                      help="time from a send to the matching receive (default 0)")
    show.add_argument("--no-compare", action="store_true",
                      help="do not add Megatron 1F1B for comparison")
    show.add_argument("--png", metavar="OUT", help="write the timeline picture here")
    show.add_argument("--json", metavar="OUT",
                      help="write the action lists here (dhelix-schedule file)")
    show.set_defaults(func=run_show)
    p.set_defaults(func=lambda _args: p.print_help() or 0)
