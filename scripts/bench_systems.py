#!/usr/bin/env python
"""The side-by-side benchmark (issue 8): Megatron, the communication-free bound (timing
only), the Domino-style intra-batch split, the Wavelet-style round robin and DHelix, on the
same model, weights, data and launch, across an emulated, bandwidth-shaped cluster.

    sudo .venv/bin/python scripts/bench_systems.py --configs a,b,c --out bench_out
    sudo .venv/bin/python scripts/bench_systems.py --quick --configs a --out /tmp/q  # tiny
    sudo .venv/bin/python scripts/bench_systems.py --configs a --bandwidth 400gbit \
        --gpu-emulation h100_profile.json --time-scale 50 --out emu  # emulated GPUs

For each configuration ((a) 2 nodes x 1 rank TP=2; (b) 2 x 2 TP=4; (c) 2 x 2 TP=2 PP=2) it
launches the emulated cluster once (`scripts/emulated_cluster.py`, which removes its
namespaces and qdiscs on every exit path; checked again here) with this script as the
worker: one torchrun launch builds every system (`scripts/bench_dhelix_pp1.bench_body`),
warms up, then interleaves repetitions across systems. Writes OUT/results.json,
OUT/results.md (a table per configuration) and OUT/results.png (bar chart); raw per-rank
data and each launch's log under OUT/raw/. Model arguments after `--` replace the default
model. Needs root, ip and tc. See docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dhelix.bench.systems import tiny_model  # noqa: E402 (after the path insert)

LAUNCHER = ROOT / "scripts" / "emulated_cluster.py"
# Communication measured 19% (a) and 49% (b) of Megatron's step at 800 Mbit/s (docs/benchmark.md).
# Megatron's arguments; every run adds `dhelix.bench.systems.RUN_ARGS` (mock data, no
# dropout, no evaluation) before them. The profile (`dhelix profile`) gets these alone
# (with the layout's), so they name --train-iters.
DEFAULT_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                 "--seq-length", "256", "--max-position-embeddings", "256",
                 "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "1000"]
# --quick profiles a handful of pairs once: enough to exercise the path, not to plan well.
QUICK_PROFILE_OPTIONS = ["--warmup", "0", "--repeats", "1", "--max-pairs", "8"]
# under the GPU emulation every pass takes a layer's modelled time x S: five timed passes,
# medians kept (with three, two runs' profiles of the same configuration led to plans
# simulated 439 and 457 ms a layer pair, realised 1.28x and 1.24x; with one pass, single
# outliers of the shared link and cores reached the plan: an RMSNorm next to an all-reduce
# measured 248 ms against 96 ms for the all-reduce alone at S = 50, OEF -50, and wrecked the
# plan's collective slowdowns)
EMULATED_PROFILE_OPTIONS = ["--warmup", "0", "--repeats", "5"]
# the tiny model (configs/tiny.json) with a global batch of 4
QUICK_MODEL = [*tiny_model(global_batch_size=4), "--train-iters", "1000"]
# --gpu-emulation's default, the compute-rich configuration (docs/benchmark.md, "Emulated GPU
# cluster"): one Llama-8B layer (the H100 profile's layer shape) at sequence 2048, micro-batch
# 2 (the Domino split needs an even one), global batch 16 (m = 8), on a 150 Gbit/s GPU link.
# A micro-batch's layer computes ~10 ms on one H100 at TP=2 (GEMMs 4.7, attention 4.1,
# memory-bound ~1.3) and all-reduces 4 x 32 MiB (each rank sends 128 MiB: 7.2 ms at 150
# Gbit/s): communication ~35% of Megatron's step, the link's floor ~70% of the comm-free one.
EMULATED_GPU_MODEL = [
    "--num-layers", "1", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--normalization", "RMSNorm", "--swiglu",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--bf16",
    "--untie-embeddings-and-output-weights", "--train-iters", "1000"]
EMULATED_GPU_LINK = "150gbit"  # --gpu-emulation's default --bandwidth (the GPU cluster's)


def per_config(values: list, option: str, configs: list) -> dict:
    """`VALUE` (every configuration) or `CONFIG=VALUE` entries -> {config: value or None}.
    `CONFIG` is any known configuration name (a, a2, b, c); a value whose text before the
    first `=` is not one (a path containing `=`) applies to every configuration."""
    from dhelix.bench.systems import CONFIGS

    chosen = {name: None for name in configs}
    for value in values or []:
        name, sep, rest = value.partition("=")
        if sep and name in CONFIGS:
            if name not in chosen:
                raise SystemExit(f"error: {option} {value}: configuration {name!r} is not "
                                 f"benchmarked (--configs {','.join(configs)})")
            chosen[name] = rest
        else:
            chosen = {n: value if chosen[n] is None else chosen[n] for n in chosen}
    return chosen


def _leftovers(launcher_pid: int) -> list:
    """Namespaces and /etc/netns entries of the cluster launcher with this pid."""
    from dhelix.cluster.host import find_tool
    from dhelix.cluster.nsconfig import ETC_NETNS

    prefix = f"dhxc-{launcher_pid}-"
    listed = subprocess.run([find_tool("ip"), "netns", "list"], capture_output=True,
                            text=True).stdout.split()
    found = [name for name in listed if name.startswith(prefix)]
    if ETC_NETNS.is_dir():
        found += [str(p) for p in ETC_NETNS.iterdir() if p.name.startswith(prefix)]
    return found


def _cluster_launch(config, ns, link: str) -> list:
    """The emulated cluster's command line for `config` on a link of `link`, with the
    benchmark's scheduling, core placement and timeout, up to and including `--` (the
    command torchrun runs on every node follows)."""
    return [sys.executable, str(LAUNCHER), "--nodes", str(config.nodes),
            "--ranks-per-node", str(config.ranks_per_node), "--bandwidth", link,
            "--comm-priority", ns.comm_priority, "--comm-cores", ns.comm_cores,
            "--timeout", str(ns.timeout), "--"]


def profile_config(config, model: list, ns, bandwidth: str, raw_dir: Path,
                   emulation: dict | None = None) -> str | None:
    """Take the DHelix row's profile on the same emulated cluster (same shape, link and
    model) with `dhelix profile`; returns its path, or None (with the reason printed) when
    profiling failed, in which case the DHelix row falls back to the analytic plan. Under
    the GPU emulation (`emulation`, `gpu_emulation_spec`'s) the profile runs on the
    emulated GPU too (`dhelix profile --gpu-emulation`, the launch's trace handed over in
    a file; the link at `bandwidth` / S), so the plan's costs are the emulated cluster's."""
    from dhelix.bench.systems import RUN_ARGS

    path = raw_dir / f"{config.name}.profile.json"
    options = QUICK_PROFILE_OPTIONS if ns.quick else []
    link = bandwidth
    if emulation is not None:
        trace = raw_dir / "gpu_emulation_trace.json"
        trace.write_text(json.dumps(emulation["trace"]))
        options = [*(options or EMULATED_PROFILE_OPTIONS), "--gpu-emulation",
                   emulation["profile"], "--time-scale", str(emulation["time_scale"]),
                   "--gpu-emulation-trace", str(trace)]
        link = emulated_bandwidth(bandwidth, emulation["time_scale"])
    command = [*_cluster_launch(config, ns, link), "-m", "dhelix", "profile",
               # the runs' own arguments (dropout 0, vocabulary): the profile must fit them
               *RUN_ARGS, *model, *config.parallel_args(), *options, "--no-progress",
               "--overwrite",
               "-o", str(path)]
    print(f"[bench] ({config.name}) profiling on the same cluster ({link}"
          + (", emulated GPU" if emulation else "") + ")", flush=True)
    started = time.time()
    with open(raw_dir / f"{config.name}.profile.log", "w") as log:
        code = _run_launcher(command, log).returncode
    if code != 0 or not path.is_file():
        print(f"[bench] ({config.name}) profiling failed (exit {code}, see raw/"
              f"{config.name}.profile.log): DHelix uses the analytic plan", flush=True)
        return None
    print(f"[bench] ({config.name}) profile taken in {time.time() - started:.0f} s", flush=True)
    return str(path)


def emulated_bandwidth(bandwidth: str, time_scale: float | None) -> str:
    """The rate the cluster's link gets: `bandwidth` itself, or with a time scale S (GPU
    emulation) the GPU cluster's `bandwidth` divided by S (`emulated_run.emulated_link_rate`),
    in tc's units."""
    from dhelix.cluster.units import format_rate, parse_rate
    from dhelix.gpu_emulation.emulated_run import emulated_link_rate

    rate = parse_rate(bandwidth)
    if time_scale is None or rate is None:
        return bandwidth
    return format_rate(emulated_link_rate(rate, time_scale))


def check_gpu_emulation(ns) -> str | None:
    """The `error: ...` line for bad --gpu-emulation / --time-scale options, else None.
    (With --gpu-emulation the profile is taken on the emulated GPU: `profile_config`.)"""
    if ns.gpu_emulation is None:
        return ("error: --time-scale goes with --gpu-emulation PROFILE"
                if ns.time_scale is not None else None)
    if ns.time_scale is None or not ns.time_scale > 0:
        return "error: --gpu-emulation needs --time-scale S > 0 (kernel times x S, link / S)"
    if not Path(ns.gpu_emulation).is_file():
        return f"error: --gpu-emulation {ns.gpu_emulation}: no such file"
    return None


# The emulated GPU's ranks' host allocator (set where the environment does not already):
# every allocation of 1 MiB or more its own mmap, so the emulation's never-written kernel
# outputs stay untouched zero pages (with glibc's adaptive threshold they come from the heap,
# reusing written pages: a rank at Llama-8B layer shapes reached 11.7 GB resident and was
# killed); those of 2 MiB or more on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE),
# so what gloo reads and writes of a fresh buffer faults in 2 MiB at a time, not 4 KiB,
# while an untouched one still maps no memory (docs/gpu_emulation.md, "Host memory").
EMULATED_RANK_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "THP_MEM_ALLOC_ENABLE": "1"}


def gpu_emulation_spec(ns) -> dict | None:
    """`--gpu-emulation PROFILE --time-scale S`: the profile's layer traced once in a process
    of its own (`profile_fit.trace_profile_layer`), as the `GpuEmulation` fields every rank
    gets; None without --gpu-emulation."""
    if ns.gpu_emulation is None:
        return None
    from dhelix.gpu_emulation.emulated_run import GpuEmulation, trace_profile

    profile = str(Path(ns.gpu_emulation).resolve())
    print(f"[bench] GPU emulation: tracing the layer of {profile}", flush=True)
    trace = trace_profile(profile)
    emulation = GpuEmulation(profile=profile, trace=trace, time_scale=ns.time_scale)
    emulation.kernel_model()  # refuse a profile the model cannot be fitted to, here
    for name, value in EMULATED_RANK_ENVIRONMENT.items():  # the ranks inherit it
        os.environ.setdefault(name, value)
    return {"profile": profile, "trace": trace, "time_scale": ns.time_scale,
            "overlap_slowdown": emulation.overlap_slowdown}


def _saving_plan(args: list, base: list, path: Path) -> list:
    """A system's arguments, with `--dhelix-save-plan path` where it builds one plan at
    start-up (the DHelix runtime but the Domino split; not a stack of dense and MoE layers,
    which plans each layer pair), so raw/ keeps the plan each row ran."""
    if ("--dhelix" not in args or "domino" in args or "--dhelix-plan" in args
            or "--moe-layer-freq" in base):
        return list(args)
    return [*args, "--dhelix-save-plan", str(path)]


def run_config(config, runs: dict, model: list, ns, bandwidth: str, raw_dir: Path,
               emulation: dict | None = None) -> dict:
    """Launch the cluster for one configuration with every available system (under the GPU
    emulation `emulation`, `gpu_emulation_spec`'s, when given: the link then gets
    `bandwidth` / S); returns the configuration's entry of results.json (raw per-rank data
    included)."""
    from dhelix.bench.report import summarise_config

    base = model + config.parallel_args()
    available = {name: _saving_plan(run.args, base, raw_dir / f"{config.name}.{name}.plan.json")
                 for name, run in runs.items() if not run.unavailable}
    raw_path = raw_dir / f"{config.name}.ranks.json"
    spec = {"megatron_args": base, "systems": available, "reps": ns.reps,
            "warmup": ns.warmup, "out": str(raw_path), "gpu_emulation": emulation,
            "link_floor": not ns.no_link_floor}
    link = emulated_bandwidth(bandwidth, emulation and emulation["time_scale"])
    spec_path = raw_dir / f"{config.name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    load_before = [round(x, 2) for x in os.getloadavg()]
    status, cleanup, ranks = "not launched (no system available)", "nothing launched", []
    if available:
        command = [*_cluster_launch(config, ns, link), str(Path(__file__).resolve()),
                   "--worker", str(spec_path)]
        print(f"[bench] ({config.name}) {config.description}: {len(available)} systems, "
              f"{bandwidth}" + (f" emulated at {link} (S={emulation['time_scale']:g})"
                                if emulation else ""), flush=True)
        started = time.time()
        with open(raw_dir / f"{config.name}.log", "w") as log:
            proc = _run_launcher(command, log)
            code = proc.returncode
        left = _leftovers(proc.pid)
        cleanup = ("verified: no namespace or /etc/netns entry left" if not left
                   else f"LEFT BEHIND: {left}")
        status = f"exit {code} after {time.time() - started:.0f} s"
        if code == 0 and raw_path.is_file():
            ranks = json.loads(raw_path.read_text())["ranks"]
        print(f"[bench] ({config.name}) {status}; cleanup {cleanup}", flush=True)
    from dhelix.cluster.cores import host_cores

    raw = {"config": config.name, "ranks": ranks, "host_cores": len(host_cores()),
           "tokens_per_step": _tokens_per_step(base, config.world_size),
           "gpu_emulation": emulation,
           "runs": {name: {"label": run.label, "unavailable": run.unavailable,
                           "timing_only": run.system.timing_only, "args": run.args}
                    for name, run in runs.items()}}
    if available and not ranks:
        for name in available:
            raw["runs"][name]["unavailable"] = f"launch failed ({status}, see raw/" \
                                               f"{config.name}.log)"
    return {"config": {"name": config.name, "description": config.description,
                       "nodes": config.nodes, "ranks_per_node": config.ranks_per_node,
                       "tp": config.tp, "pp": config.pp, "world_size": config.world_size,
                       "cores": os.cpu_count(), "oversubscribed": config.oversubscribed()},
            "bandwidth": bandwidth, "link_rate": link, "comm_priority": ns.comm_priority,
            "cores": _placement(config, ns.comm_cores).describe(),
            "status": status, "cleanup": cleanup,
            "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
            "summary": summarise_config(raw), "raw": raw}


def _placement(config, comm_cores: str):
    """The cluster's core placement for `config` on this host (what the launcher applies)."""
    from dhelix.cluster.cli import parse_comm_cores
    from dhelix.cluster.cores import host_cores, plan_cores

    return plan_cores(host_cores(), config.nodes, config.ranks_per_node,
                      parse_comm_cores(comm_cores))


def _tokens_per_step(base: list, world_size: int) -> int:
    from dhelix.bench.systems import RUN_ARGS, parse_megatron_args

    args = parse_megatron_args([*RUN_ARGS, *base], world_size)
    return args.global_batch_size * args.seq_length


def orchestrate(ns) -> int:
    from dhelix.bench.report import bar_chart, markdown
    from dhelix.bench.systems import CONFIGS, SYSTEM_NAMES, SYSTEMS, config_systems, plan_system

    if os.geteuid() != 0:
        print("error: the benchmark runs on the emulated cluster, which needs root",
              file=sys.stderr)
        return 2
    configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"error: --configs: unknown {unknown} (known: {', '.join(CONFIGS)})",
              file=sys.stderr)
        return 2
    named = None if ns.systems is None else ns.systems.split(",")
    unknown = sorted(set(named or ()) - set(SYSTEM_NAMES))
    if unknown:
        print(f"error: --systems: unknown {unknown} (known: {', '.join(SYSTEM_NAMES)})",
              file=sys.stderr)
        return 2
    systems = [s for s in SYSTEMS if named is None or s.name in named]
    if not any(s.name == "megatron" for s in systems):
        print("error: --systems must include megatron (the baseline)", file=sys.stderr)
        return 2
    try:
        for config in configs:
            _placement(CONFIGS[config], ns.comm_cores)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = ns.model_args or (QUICK_MODEL if ns.quick else EMULATED_GPU_MODEL
                              if ns.gpu_emulation else DEFAULT_MODEL)
    bandwidths = per_config(ns.bandwidth, "--bandwidth", configs)
    profiles = per_config(ns.dhelix_profile, "--dhelix-profile", configs)
    for name, path in profiles.items():
        if path is not None:
            if not Path(path).is_file():
                print(f"error: --dhelix-profile {path} (configuration {name}): no such file",
                      file=sys.stderr)
                return 2
            profiles[name] = str(Path(path).resolve())  # the worker runs in the repository
    out = Path(ns.out).resolve()
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    emulation = gpu_emulation_spec(ns)
    results = {"megatron_args": model, "reps": ns.reps, "warmup": ns.warmup,
               "systems": [s.name for s in systems], "configs": [],
               "gpu_emulation": emulation and {k: v for k, v in emulation.items()
                                               if k != "trace"}}
    failed = False
    for name in configs:
        config = CONFIGS[name]
        bandwidth = bandwidths[name] or (EMULATED_GPU_LINK if emulation else config.bandwidth)
        if profiles[name] is None and not ns.no_profile and any(s.uses_profile
                                                                 for s in systems):
            profiles[name] = profile_config(config, model, ns, bandwidth, raw_dir, emulation)
        runs = {s.name: plan_system(s, config, model, profiles[name])
                for s in config_systems(config, systems)}
        entry = run_config(config, runs, model, ns, bandwidth, raw_dir, emulation)
        failed |= not entry["status"].startswith("exit 0") or "LEFT" in entry["cleanup"]
        results["configs"].append(entry)
        _write(out, results, markdown, bar_chart)  # partial results survive a later failure
    print((out / "results.md").read_text())
    return 1 if failed else 0


def _write(out: Path, results: dict, markdown, bar_chart) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))
    bar_chart(results, out / "results.png")


def worker(spec_path: str) -> int:
    """Under torchrun on the cluster: every rank runs bench_body; rank 0 writes the
    per-rank results to the spec's `out`."""
    import torch.distributed as dist

    from dhelix.harness import RankContext
    from scripts.bench_dhelix_pp1 import bench_body

    spec = json.loads(Path(spec_path).read_text())
    result = bench_body(RankContext(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])),
                        spec["megatron_args"], spec["reps"], spec["warmup"], spec["systems"],
                        spec.get("gpu_emulation"), spec.get("link_floor", True))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"ranks": everyone}))
    dist.barrier()
    return 0


def _run_launcher(command: list, log) -> subprocess.Popen:
    """Run the cluster launcher `command` (output to `log`) to its end and return it,
    finished. A SIGINT, SIGTERM or SIGHUP to this process is passed on to the launcher as
    SIGTERM (it stops its nodes and removes the network), waited for, and raised here as
    `Interrupted`, so no rank or namespace outlives the benchmark."""
    from dhelix.cluster.signals import Interrupted, SignalGuard

    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    with SignalGuard() as guard:
        try:
            proc.wait()
        except Interrupted:
            guard.shield()
            proc.terminate()
            proc.wait()
            raise
    return proc


def main(argv=None) -> int:
    from dhelix.bench.systems import SYSTEM_NAMES
    from dhelix.cluster.comm_priority import POLICIES
    from dhelix.gpu_emulation import options as emulation_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="a,a2,b,c",
                        help="comma-separated: a, a2, b, c, d, e, e2 (default a,a2,b,c)")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated subset (default all: "
                             f"{', '.join(SYSTEM_NAMES)})")
    parser.add_argument("--reps", type=int, default=None,
                        help="measured repetitions (default 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured repetitions first (default 1; 0 with --quick)")
    parser.add_argument("--bandwidth", action="append", default=None,
                        help="link rate, e.g. 800mbit (default; (a2) 500mbit), or CONFIG=RATE; "
                             "repeatable; with --gpu-emulation the GPU cluster's (default "
                             "150gbit), the link gets it / S")
    parser.add_argument("--comm-priority", choices=POLICIES, default="fifo",
                        help="the emulated cluster's --comm-priority for every launch "
                             "(default fifo: gloo's threads at real-time priority)")
    parser.add_argument("--comm-cores", default="auto",
                        help="the emulated cluster's --comm-cores for every launch (default "
                             "auto: separate computation and communication cores where the "
                             "host has enough, else shared-core, stated in every table)")
    parser.add_argument("--dhelix-profile", action="append", default=None,
                        help="profile for the DHelix plan (taken on the same emulated "
                             "cluster): PATH for every configuration or CONFIG=PATH; "
                             "repeatable. Without one the DHelix row uses analytic costs")
    parser.add_argument("--no-profile", action="store_true",
                        help="do not profile first: configurations without --dhelix-profile "
                             "give DHelix the analytic-cost plan")
    parser.add_argument("--no-link-floor", action="store_true",
                        help="do not replay Megatron's collectives alone (the link floor): "
                             "T_bound is then the larger of the comm-free step and the "
                             "CPU-work floor, which can only lower the reported shares")
    parser.add_argument("--out", default="bench_out", help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny case (for the test): 4-layer tiny model, 1 repetition")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds per configuration before the cluster is stopped")
    # the default model becomes a Llama-8B layer and the default link 150gbit (the
    # compute-rich configuration); DHelix's profile is taken on the emulated GPU too
    emulation_options.add_options(parser, "run every system's steps and DHelix's profile")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("model_args", nargs=argparse.REMAINDER,
                        help="after --: Megatron model arguments replacing the default model")
    ns = parser.parse_args(argv)
    if ns.worker:
        return worker(ns.worker)
    ns.model_args = ns.model_args[1:] if ns.model_args[:1] == ["--"] else ns.model_args
    refusal = check_gpu_emulation(ns)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if ns.reps is None:
        ns.reps = 1 if ns.quick else 5
    if ns.warmup is None:
        ns.warmup = 0 if ns.quick else 1
    from dhelix.cluster.signals import Interrupted

    try:
        return orchestrate(ns)
    except Interrupted as stop:
        print(f"[bench] {stop}: the cluster was stopped and cleaned up", file=sys.stderr)
        return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
