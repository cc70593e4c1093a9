"""`dhelix plan`: build a strand-interleaving plan from operator DAG files and a profile, and
inspect or check plan files.

    dhelix plan --fwd-dag F --bwd-dag B [--profile P] [--pairer dp|sequential|round_robin]
                [--max-orders N] [--wgrad-move K] [--model M] [--parallel L] [--hardware H]
                [--memory-from SAVED [--memory-margin MIB]] -o PLAN
    dhelix plan show PLAN [--png OUT.png] [--trace OUT.json]
    dhelix plan check PLAN [--fwd-dag F --bwd-dag B] [--profile P] [--model M]
                [--parallel L] [--hardware H]
"""

from __future__ import annotations

import shlex
import sys

from dhelix.file_formats import FormatError

_FINGERPRINT_HELP = {
    "model": "model fingerprint recorded in the plan (e.g. the output of "
             "planner.plan.fingerprint_string on the model config)",
    "parallel": "parallel-layout fingerprint recorded in the plan (e.g. 'pp=2,sp=True,tp=2')",
    "hardware": "hardware fingerprint (default: the profile's, or 'unspecified')",
}


def _fail(message: str) -> int:
    print(f"dhelix plan: error: {message}", file=sys.stderr)
    return 2


def _command_line(args) -> str:
    words = ["dhelix", "plan", "--fwd-dag", args.fwd_dag, "--bwd-dag", args.bwd_dag]
    if args.profile:
        words += ["--profile", args.profile]
    words += ["--pairer", args.pairer, "--max-orders", str(args.max_orders),
              "--wgrad-move", str(args.wgrad_move)]
    for name in ("model", "parallel", "hardware"):
        if getattr(args, name):
            words += [f"--{name}", getattr(args, name)]
    if args.memory_from:
        words += ["--memory-from", args.memory_from]
        if args.memory_margin is not None:
            words += ["--memory-margin", f"{args.memory_margin:g}"]
    return shlex.join(words + ["-o", args.output])


def _saved_plan(args):
    """The plan of `--memory-from SAVED`, or None; with it, the model and parallel
    fingerprints not given default to SAVED's (its readings are of that run), so the plan
    is one that run accepts. `--memory-margin` without `--memory-from` is a FormatError."""
    from planner.plan import UNSPECIFIED, load_plan

    if args.memory_from is None:
        if args.memory_margin is not None:
            raise FormatError("--memory-margin needs --memory-from SAVED (the per-operator "
                              "memory a --dhelix-save-plan file holds)")
        return None
    saved = load_plan(args.memory_from)
    for name in ("model", "parallel"):
        if not getattr(args, name) and saved.fingerprint.get(name, UNSPECIFIED) != UNSPECIFIED:
            setattr(args, name, saved.fingerprint[name])
    return saved


def _memory_bound(args, saved, fwd, bwd):
    """The memory bound `saved` (the `--memory-from` plan: one that recorded its bound's
    per-operator readings, as `--dhelix-save-plan` writes for a run planning within the
    bound) recorded, for these DAGs, with `--memory-margin` MiB in place of its margin when
    given; None without a saved plan. Raises FormatError for a plan without readings or
    with readings of other operators."""
    from dhelix.dag import topological_sort
    from planner.memory import bound_from_record

    if saved is None:
        return None
    record = saved.search.get("memory") or {}
    if "ops" not in record:
        raise FormatError(f"{args.memory_from}: holds no per-operator memory readings (it was "
                          "not built within a memory bound at start-up); save one with "
                          "--dhelix-save-plan from a --dhelix run of the dp pairer")
    for dag in (fwd, bwd):
        if set(record["ops"][dag.direction]) != set(dag.by_id()):
            path = args.fwd_dag if dag.direction == "fwd" else args.bwd_dag
            raise FormatError(f"{args.memory_from}: its memory readings are for other "
                              f"{dag.direction} operators than {path}'s; save the plan of a "
                              "run of this layer")
    return bound_from_record(record, topological_sort(fwd), topological_sort(bwd),
                             args.memory_margin)


def _load_inputs(args):
    from dhelix.dag import load_dag
    from planner.costs import build_cost_model
    from profiler.profile_file import load_profile

    fwd, bwd = load_dag(args.fwd_dag), load_dag(args.bwd_dag)
    for dag, path, want in ((fwd, args.fwd_dag, "fwd"), (bwd, args.bwd_dag, "bwd")):
        if dag.direction != want:
            raise FormatError(f"{path}: is a {dag.direction} DAG, expected a {want} DAG")
    profile = None
    if args.profile:
        from profiler.fingerprint import check_profile_run

        profile = load_profile(args.profile)
        check_profile_run(profile, args.profile, args.model, args.parallel)
    return fwd, bwd, build_cost_model(fwd, bwd, profile, args.profile or "profile"), profile


def profile_notes(costs, profile, profile_path, fwd, bwd) -> list[str]:
    """What the plan's costs rest on: the profile's hardware (and whether it is this
    machine) and how many operator pairs were measured or estimated."""
    from planner.costs import pair_source_counts
    from profiler.fingerprint import (describe_hardware, hardware_fingerprint,
                                      plan_hardware_differences)
    notes = [f"profile {profile_path}: measured on {describe_hardware(profile.hardware)}"]
    differences = plan_hardware_differences(costs.hardware, hardware_fingerprint(1))
    if differences:
        notes.append("note: the profile's hardware is not this machine's ("
                     + "; ".join(differences) + "); `--dhelix` training refuses this plan "
                     "on any machine but the profiled one")
    counts = pair_source_counts(costs, fwd, bwd)
    total = sum(counts.values())
    estimated = total - counts["measured"]
    detail = ", ".join(f"{name} {counts[name]}" for name in ("class", "kind", "default")
                       if counts[name])
    notes.append(f"co-runnable operator pairs: {counts['measured']} of {total} measured, "
                 f"{estimated} "
                 f"estimated" + (f" ({detail})" if detail else "")
                 + "; solo times: all measured")
    return notes


def run_build(args) -> int:
    from planner.build import make_plan
    from planner.plan import UNSPECIFIED, save_plan

    missing = [flag for flag, value in (("--fwd-dag", args.fwd_dag), ("--bwd-dag", args.bwd_dag),
                                        ("-o", args.output)) if not value]
    if missing:
        return _fail(f"building a plan needs {', '.join(missing)} "
                     f"(or use `dhelix plan show PLAN`)")
    try:
        saved = _saved_plan(args)
        fwd, bwd, costs, profile = _load_inputs(args)
        memory = _memory_bound(args, saved, fwd, bwd)
        plan = make_plan(fwd, bwd, costs, args.pairer, args.max_orders, args.wgrad_move,
                         model=args.model or UNSPECIFIED, parallel=args.parallel or UNSPECIFIED,
                         hardware=args.hardware, command=_command_line(args), memory=memory)
        save_plan(plan, args.output)
    except (FormatError, ValueError) as exc:
        return _fail(str(exc))
    print(f"wrote {args.output}: {len(plan.blocks)} blocks, sequential "
          f"{plan.sequential_ms:.3f} ms -> planned {plan.planned_ms:.3f} ms "
          f"(speedup {plan.speedup:.3f}x), searched {plan.search['fwd_orders']} x "
          f"{plan.search['bwd_orders']} orders in {plan.search['seconds']} s")
    if memory is not None:
        recorded = plan.search["memory"]
        print(f"memory bound: {recorded['budget_mib']:.1f} MiB above a layer pair's start "
              f"(reference {recorded['reference_mib']:.1f}, margin {recorded['margin_mib']:.1f}"
              f"); planned peak {recorded['plan_peak_mib']:.1f} MiB")
    if costs.source != "profile":
        print("note: no --profile given, so every time is the analytic default (estimated)")
    else:
        for line in profile_notes(costs, profile, args.profile, fwd, bwd):
            print(line)
        if plan.estimated:
            print("note: some blocks use pair times estimated from measured OEFs (marked *)")
    for name in ("model", "parallel"):
        if not getattr(args, name):
            print(f"note: no --{name} given; the plan's {name} fingerprint is 'unspecified'")
    print(f"inspect it with `dhelix plan show {shlex.quote(args.output)} --png PLAN.png`")
    return 0


def run_show(args) -> int:
    from planner.plan import load_plan
    from planner.render import plan_table, render_png, write_trace

    try:
        plan = load_plan(args.plan)
    except FormatError as exc:
        return _fail(str(exc))
    print(plan_table(plan))
    if args.png:
        print(f"wrote timeline picture {render_png(plan, args.png)}")
    if args.trace:
        print(f"wrote Chrome trace {write_trace(plan, args.trace)} "
              f"(open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def run_check(args) -> int:
    from dhelix.dag import load_dag
    from planner.plan import check_fingerprint, check_plan_dags, load_plan
    from profiler.profile_file import canonical_hardware, load_profile

    if bool(args.fwd_dag) != bool(args.bwd_dag):
        return _fail("give both --fwd-dag and --bwd-dag, or neither")
    try:
        plan = load_plan(args.plan)
        expected = {name: getattr(args, name) for name in ("model", "parallel", "hardware")
                    if getattr(args, name)}
        if args.profile:
            profile = load_profile(args.profile)
            expected["profile_sha"] = profile.sha
            expected.setdefault("hardware", canonical_hardware(profile.hardware))
        # The advice on a mismatch re-plans from the files given here, into PLAN.
        inputs = {"--fwd-dag": args.fwd_dag, "--bwd-dag": args.bwd_dag,
                  "--profile": args.profile, "-o": args.plan}
        inputs = {flag: value for flag, value in inputs.items() if value}
        check_fingerprint(plan, expected, args.plan, inputs)
        if args.fwd_dag:
            check_plan_dags(plan, load_dag(args.fwd_dag), load_dag(args.bwd_dag), args.plan,
                            inputs)
    except FormatError as exc:
        return _fail(str(exc))
    print(f"{args.plan}: matches ({', '.join(sorted(expected)) or 'nothing to compare'}"
          f"{', DAGs' if args.fwd_dag else ''})")
    return 0


def _fingerprint_options(parser) -> None:
    for name, text in _FINGERPRINT_HELP.items():
        parser.add_argument(f"--{name}", metavar=name.upper(), help=text)


def register(subparsers) -> None:
    from planner.build import DEFAULT_MAX_ORDERS, DEFAULT_WGRAD_MOVE, PAIRERS

    p = subparsers.add_parser(
        "plan", help="build, show or check a strand-interleaving plan",
        description="Build a plan from a layer's operator DAGs (`dhelix plan --fwd-dag F "
        "--bwd-dag B --profile P -o PLAN`), or inspect one (`dhelix plan show PLAN`) or check "
        "it against a run (`dhelix plan check PLAN ...`).")
    p.add_argument("--fwd-dag", metavar="FILE", help="forward operator DAG (dhelix-dag file)")
    p.add_argument("--bwd-dag", metavar="FILE", help="backward operator DAG (dhelix-dag file)")
    p.add_argument("--profile", metavar="FILE",
                   help="operator profile (dhelix-profile file); without it the analytic "
                   "default costs are used and the plan is marked estimated")
    p.add_argument("--pairer", choices=PAIRERS, default="dp",
                   help="dp (search; default), sequential or round_robin (baselines)")
    p.add_argument("--max-orders", type=int, default=DEFAULT_MAX_ORDERS, metavar="N",
                   help=f"candidate orders per direction (default {DEFAULT_MAX_ORDERS})")
    p.add_argument("--wgrad-move", type=int, default=DEFAULT_WGRAD_MOVE, metavar="K",
                   help="how many slots a movable (wgrad) op may move from its program "
                   f"position (default {DEFAULT_WGRAD_MOVE})")
    _fingerprint_options(p)
    p.add_argument("--memory-from", metavar="SAVED",
                   help="plan within the memory bound recorded in SAVED (a plan file "
                   "--dhelix-save-plan wrote: its per-operator readings), as the run did")
    p.add_argument("--memory-margin", type=float, default=None, metavar="MIB",
                   help="with --memory-from: this margin (MiB above the sequential plan's "
                   "peak) instead of SAVED's, to see what more or less memory buys")
    p.add_argument("-o", "--output", metavar="PLAN", help="plan file to write")
    p.set_defaults(func=run_build)

    actions = p.add_subparsers(dest="plan_action", metavar="{show,check}")
    show = actions.add_parser("show", help="print a plan's blocks; draw its timeline",
                              description="Print the plan's block table and optionally write "
                              "a timeline PNG and a Chrome/Perfetto trace.")
    show.add_argument("plan", metavar="PLAN")
    show.add_argument("--png", metavar="OUT", help="write the timeline picture here")
    show.add_argument("--trace", metavar="OUT", help="write a Chrome trace JSON here")
    show.set_defaults(func=run_show)

    check = actions.add_parser("check", help="check a plan against a run's fingerprint/DAGs",
                               description="Exit 0 if the plan fits the given run, else name "
                               "every difference and the command that regenerates the plan.")
    check.add_argument("plan", metavar="PLAN")
    check.add_argument("--fwd-dag", metavar="FILE")
    check.add_argument("--bwd-dag", metavar="FILE")
    check.add_argument("--profile", metavar="FILE")
    _fingerprint_options(check)
    check.set_defaults(func=run_check)
