"""`dhelix profile`: measure a layer's operators alone and in pairs on this hardware and
write the profile the planner needs (plus an OEF heatmap by operator class).

    torchrun --nproc-per-node 2 -m dhelix profile --preset tiny \
        --tensor-model-parallel-size 2 -o profile.json [--max-pairs N] [--repeats R]
        [--warmup W] [--heatmap PNG | --no-heatmap] [--overwrite] [--comp-only]
    dhelix profile --show profile.json [--heatmap PNG]

Model and parallel arguments are Megatron's, as for pretraining (the same arguments give
the same cost keys as `--dhelix` training looks up). Run it on all ranks of the parallel
groups being profiled (across nodes when the tensor-parallel group spans nodes, e.g. inside
`dhelix cluster`). Without torchrun's environment it runs as one process (TP=1, e.g. the
single-GPU `--comp-only` profile). An interrupted job leaves `<output>.partial`; re-running
the same command resumes it. See docs/profiler.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

STOPPED_EXIT_CODE = 3


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="PROFILE",
                        help="profile JSON to write (progress goes to PROFILE.partial)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed passes before the timed ones (default 1)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed passes; the median is kept (default 5)")
    parser.add_argument("--max-pairs", type=int, default=None, metavar="N",
                        help="measure at most N operator pairs, those with the largest "
                        "potential gain min(Ti, Tj) first (default: all legal pairs)")
    parser.add_argument("--comp-only", action="store_true",
                        help="computation operators and computation pairs only (e.g. one GPU, "
                        "no communication)")
    parser.add_argument("--heatmap", metavar="PNG", default=None,
                        help="OEF heatmap by operator class (default: PROFILE with .png)")
    parser.add_argument("--no-heatmap", action="store_true", help="do not draw the heatmap")
    parser.add_argument("--overwrite", action="store_true",
                        help="discard a partial file of another job instead of refusing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--stop-after", type=int, default=None, metavar="N",
                        help="(testing) stop after measuring N pairs, keeping the partial file "
                        f"(exit code {STOPPED_EXIT_CODE}); re-running resumes")
    parser.add_argument("--show", metavar="PROFILE", default=None,
                        help="print the OEF class table of an existing profile (and draw "
                        "--heatmap); measures nothing")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile", help="time a layer's operators alone and in pairs (under torchrun)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser)
    parser.set_defaults(func=run, pass_through=True)


def _single_process_env() -> None:
    """Outside torchrun: a world of one process."""
    if "RANK" in os.environ:
        return
    from dhelix.harness import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def heatmap_path(args) -> Path | None:
    if args.no_heatmap:
        return None
    if args.heatmap:
        return Path(args.heatmap)
    return Path(args.show or args.output).with_suffix(".png")


def show(args) -> int:
    from dhelix.file_formats import FormatError
    from profiler.fingerprint import describe_hardware
    from profiler.heatmap import class_table, render_heatmap
    from profiler.profile_file import load_profile

    try:
        profile = load_profile(args.show)
    except FormatError as exc:
        print(f"dhelix profile: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.show}: {len(profile.solo)} operators, {len(profile.pairs)} pairs, measured "
          f"on {describe_hardware(profile.hardware)}")
    print(class_table(profile))
    png = heatmap_path(args)
    if png is not None:
        print(f"wrote heatmap {render_heatmap(profile, png)}")
    return 0


def profile_job(args, megatron_argv: list):
    """The measuring job on this rank (collective); returns the ProfileResult."""
    from dhelix.arguments import parse_args, trainer_run
    from dhelix.parallel import destroy_parallel_state, init_process_group_from_env
    from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
    from dhelix.topology import NodeTopology
    from profiler.model import build_layer_under_test
    from profiler.session import ProfileOptions, run_profile

    margs = parse_args(megatron_argv)
    options = ProfileOptions(warmup=args.warmup, repeats=args.repeats,
                             max_pairs=args.max_pairs, comp_only=args.comp_only)
    job = init_process_group_from_env(backend=margs.distributed_backend)
    import torch.distributed as dist

    world = dist.get_world_size()
    run = trainer_run(margs)
    run_info = {"model": model_fingerprint(run), "parallel": parallel_fingerprint(run),
                "world_size": world,
                "ranks_per_node": NodeTopology.detect().ranks_per_node or world}
    layer, timer = build_layer_under_test(margs, job)
    try:
        return run_profile(layer, args.output, run=run_info, options=options,
                           overwrite=args.overwrite, stop_after=args.stop_after, timer=timer,
                           show_progress=not args.no_progress,
                           extra_meta={"layer": layer.bound.description.summary()})
    finally:
        destroy_parallel_state()


def report(args, result) -> None:
    """Rank 0's summary: counts, wall time, OEF class table, heatmap."""
    from profiler.fingerprint import describe_hardware
    from profiler.heatmap import class_table, render_heatmap

    print(f"dhelix profile: {len(result.solo)} operators alone, {len(result.pairs)} pairs "
          f"({result.measured_pairs} measured now, {result.resumed_pairs} resumed; "
          f"{result.skipped_same_channel} same-channel pairs skipped, {result.capped} beyond "
          f"--max-pairs) in {result.wall_s:.1f} s")
    if not result.complete:
        print(f"stopped early (--stop-after); progress kept in {result.output}.partial: "
              "re-run the same command to resume")
        return
    profile = result.profile
    print(f"wrote {result.output} (measured on {describe_hardware(profile.hardware)})")
    print(class_table(profile))
    png = heatmap_path(args)
    if png is not None and profile.pairs:
        print(f"wrote heatmap {render_heatmap(profile, png)}")


def main(argv=None) -> int:
    """Standalone entry (same as `dhelix profile`)."""
    parser = argparse.ArgumentParser(prog="dhelix profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser)
    args, extra = parser.parse_known_args(argv)
    args.extra_args = extra
    return run(args)


def run(args) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if args.show:
        return show(args)
    if not args.output:
        print("dhelix profile: error: give -o PROFILE (or --show PROFILE)", file=sys.stderr)
        return 2
    from dhelix.arguments import ArgumentError
    from dhelix.file_formats import FormatError
    from dhelix.ops.describe import UnsupportedLayerError

    _single_process_env()
    started = time.monotonic()
    try:
        result = profile_job(args, list(args.extra_args))
    except (ArgumentError, FormatError, UnsupportedLayerError, ValueError) as exc:
        print(f"dhelix profile: error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        report(args, result)
        print(f"dhelix profile: job wall time {time.monotonic() - started:.1f} s")
    return 0 if result.complete else STOPPED_EXIT_CODE
