"""`dhelix profile`: measure a layer's operators alone and in pairs on this hardware and
write the profile the planner needs (plus an OEF heatmap by operator class).

    torchrun --nproc-per-node 2 -m dhelix profile [--preset NAME|FILE] <Megatron arguments>
        -o profile.json [--max-pairs N] [--repeats R] [--warmup W]
        [--heatmap PNG | --no-heatmap] [--overwrite] [--comp-only]
        [--gpu-emulation GPU_PROFILE --time-scale S [--gpu-emulation-trace TRACE]]
    dhelix profile --show profile.json [--heatmap PNG]

Model and parallel arguments are Megatron's, as for pretraining under the plugin
(`dhelix.megatron_lm`; `--preset` expands to Megatron arguments as for `dhelix train`): the
layer is the one `megatron.training.pretrain` builds for them, so the same arguments give
the same cost keys and fingerprints as `--dhelix` training checks. The profiler's own options
(above) are taken out before Megatron parses the rest. Run it on all ranks of the parallel
groups being profiled (across nodes when the tensor-parallel group spans nodes, e.g. inside
`dhelix cluster`). Without torchrun's environment it runs as one process (TP=1, e.g. the
single-GPU `--comp-only` profile). An interrupted job leaves `<output>.partial`; re-running
the same command resumes it. With `--gpu-emulation` the layer runs on the emulated GPU
(docs/gpu_emulation.md): compute kernels take GPU_PROFILE's fitted times x S, asleep, the
collectives run for real (on the emulated cluster, over a link at the GPU cluster's rate
/ S), so the profile holds the emulated cluster's times. See docs/profiler.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

STOPPED_EXIT_CODE = 3


def add_options(parser: argparse.ArgumentParser) -> None:
    from dhelix.gpu_emulation import options as emulation_options

    parser.add_argument("--preset", default=None,
                        help="model preset expanded to Megatron arguments: a name in configs/ "
                             "(e.g. tiny) or a JSON file path (as for `dhelix train`)")
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
    emulation_options.add_options(parser, "measure")
    parser.add_argument("--gpu-emulation-trace", metavar="TRACE", default=None,
                        help="with --gpu-emulation: PROFILE's layer trace (JSON, "
                        "`emulated_run.trace_profile`) when taken already; default: every "
                        "rank traces it (~10 s)")
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


# What `pretrain()` needs to reach its first step that a profiling command line may leave
# out (the profiler reads no data and takes no step): (option given when any of these
# options is, arguments added otherwise)
_RUN_DEFAULTS = (
    (("--train-iters", "--train-samples"), ["--train-iters", "1"]),
    (("--mock-data", "--data-path", "--train-data-path", "--data-args-path",
      "--per-split-data-args-path"), ["--mock-data"]),
    (("--eval-iters",), ["--eval-iters", "0"]),
    (("--eval-interval",), ["--eval-interval", "1"]),  # pretrain() divides by it
    (("--num-workers",), ["--num-workers", "0"]),  # no data-loader processes
    (("--transformer-impl",), ["--transformer-impl", "local"]),  # the spec dhelix binds
    # the optimizer pretrain() builds needs a learning rate (torch refuses None); the
    # profiler never steps it
    (("--lr",), ["--lr", "1e-4"]),
)
# the options of a --dhelix training run, which a profile is taken for, not with
_TRAINING_ONLY = ("dhelix", "dhelix_plan", "dhelix_profile")


def megatron_command(args, megatron_argv: list) -> list:
    """The argv for `megatron_patches.step_harness.build_run`, checked on this rank (by
    Megatron's parser and validation under the plugin) before any process group or model
    exists. It is the user's Megatron arguments (`--preset` expanded first, as `dhelix train`
    does), what `pretrain()` needs to start that they left out (`_RUN_DEFAULTS`), and one
    layer per pipeline stage (`--num-layers PP`). Refusals: SystemExit after Megatron's or
    the plugin's one `error:` line; `ArgumentError` (bad preset, `--dhelix` options),
    `MegatronArgumentError`, `UnsupportedLayerError` (a layer the operator programs do not
    implement), each one line."""
    from dhelix.argument_error import ArgumentError, flag
    from dhelix.launch import preset_arguments
    from dhelix.ops.describe import LayerDescription
    from megatron_patches.parsed_arguments import parse_megatron_args

    argv = list(megatron_argv)
    if args.preset:
        argv = preset_arguments(args.preset, argv) + argv
    margs = parse_megatron_args(argv, int(os.environ.get("WORLD_SIZE", "1")))
    given = [name for name in _TRAINING_ONLY if getattr(margs, name)]
    if given:
        flags = ", ".join(flag(name) for name in given)
        raise ArgumentError(f"{flags}: the profiler measures the layer for a --dhelix run, "
                            "not with one; drop them (keep --dhelix-attention)")
    LayerDescription.from_args(margs)  # the layer's refusals, before anything is launched
    words = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    for options, defaults in _RUN_DEFAULTS:
        if not words.intersection(options):
            argv += defaults
    return argv + _one_layer_arguments(margs)


def _one_layer_arguments(margs) -> list:
    """What makes the job's model one layer per pipeline stage, of the kind every layer of
    the user's stack is: `--num-layers PP`, and with MoE `--moe-layer-freq 1` (every layer
    MoE; a stack of dense and MoE layers is refused with ArgumentError)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    from dhelix.argument_error import ArgumentError
    from dhelix.ops.moe_describe import moe_layer_pattern

    layers = ["--num-layers", str(margs.pipeline_model_parallel_size)]
    if margs.num_experts is None:
        return layers
    pattern = moe_layer_pattern(core_transformer_config_from_args(margs))
    if len(set(pattern)) > 1:
        raise ArgumentError("--moe-layer-freq: dhelix profile measures one layer kind and "
                            "this stack mixes MoE and dense layers; profile an all-MoE stack "
                            "(--moe-layer-freq 1) or plan this one from the analytic costs "
                            "(no --dhelix-profile)")
    return layers + ["--moe-layer-freq", "1"]


def gpu_emulation(args):
    """The `GpuEmulation` of `--gpu-emulation PROFILE --time-scale S
    [--gpu-emulation-trace TRACE]`, or None without --gpu-emulation. Raises ArgumentError
    for a missing --time-scale or file."""
    from dhelix.argument_error import ArgumentError

    if args.gpu_emulation is None:
        if args.time_scale is not None or args.gpu_emulation_trace is not None:
            raise ArgumentError("--time-scale and --gpu-emulation-trace go with "
                                "--gpu-emulation PROFILE")
        return None
    import json

    from dhelix.gpu_emulation.emulated_run import GpuEmulation, trace_profile
    from dhelix.gpu_emulation.options import mark_process

    if args.time_scale is None or not args.time_scale > 0:
        raise ArgumentError("--gpu-emulation needs --time-scale S > 0 (kernel times x S)")
    for path in (args.gpu_emulation, args.gpu_emulation_trace):
        if path is not None and not Path(path).is_file():
            raise ArgumentError(f"{path}: no such file")
    profile = str(Path(args.gpu_emulation).resolve())
    trace = (json.loads(Path(args.gpu_emulation_trace).read_text())
             if args.gpu_emulation_trace else trace_profile(profile))
    emulation = GpuEmulation(profile=profile, trace=trace, time_scale=args.time_scale)
    mark_process(profile, args.time_scale)  # the profile's fingerprint names the emulation
    return emulation


def profile_job(args, megatron_argv: list):
    """The measuring job on this rank (collective); returns the ProfileResult. The model
    is the one `pretrain()` builds for the command line (`megatron_command`), closed (with
    Megatron's global state) before returning. With --gpu-emulation (`gpu_emulation`) the
    model is built under `GpuEmulation.building` and every pass runs on the emulated GPU
    (`EmulatedCalls`); the profile's meta says so (`gpu_emulation`), and a partial file
    of a job with other emulation settings is not resumed."""
    from datetime import timedelta

    import torch.distributed as dist

    from dhelix.gpu_emulation.emulated_run import EmulatedCalls
    from dhelix.launch import PRETRAIN_SCRIPT
    from dhelix.parallel import job_of_megatron_group
    from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
    from dhelix.topology import NodeTopology
    from megatron_patches.run_options import run_from_megatron_args
    from megatron_patches.step_harness import build_run
    from profiler.model import build_layer_under_test
    from profiler.session import ProfileOptions, run_profile

    options = ProfileOptions(warmup=args.warmup, repeats=args.repeats,
                             max_pairs=args.max_pairs, comp_only=args.comp_only)
    emulation = gpu_emulation(args)
    command = megatron_command(args, megatron_argv)
    if emulation is None:
        run, emulated, described = build_run(str(PRETRAIN_SCRIPT), command), None, {}
    else:
        model = emulation.kernel_model()
        with emulation.building(model):
            run = build_run(str(PRETRAIN_SCRIPT), command)
        emulated = EmulatedCalls(run.model, model, emulation.config())
        described = {"gpu_emulation": {"profile": emulation.profile,
                                       "time_scale": emulation.time_scale,
                                       "overlap_slowdown": emulation.overlap_slowdown}}
    try:
        with run.active():
            margs = run.args
            world = dist.get_world_size()
            typed = run_from_megatron_args(margs)  # what --dhelix start-up checks against
            run_info = {"model": model_fingerprint(typed), "parallel": parallel_fingerprint(typed),
                        "world_size": world,
                        "ranks_per_node": NodeTopology.detect().ranks_per_node or world,
                        **described}
            job = job_of_megatron_group(timedelta(minutes=margs.distributed_timeout_minutes))
            layer, timer = build_layer_under_test(run, job, emulated)
            return run_profile(layer, args.output, run=run_info, options=options,
                               overwrite=args.overwrite, stop_after=args.stop_after,
                               timer=timer, show_progress=not args.no_progress,
                               extra_meta={"layer": layer.bound.description.summary()})
    finally:
        run.close()


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
    from dhelix.file_formats import FormatError
    from dhelix.argument_error import ArgumentError
    from dhelix.ops.describe import UnsupportedLayerError

    _single_process_env()
    started = time.monotonic()
    try:
        result = profile_job(args, list(args.extra_args))
    except SystemExit as exc:  # Megatron's or the plugin's `error:` line is printed
        return exc.code if isinstance(exc.code, int) else 2
    except (ArgumentError, FormatError, UnsupportedLayerError, ValueError) as exc:
        print(f"dhelix profile: error: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        report(args, result)
        print(f"dhelix profile: job wall time {time.monotonic() - started:.1f} s")
    return 0 if result.complete else STOPPED_EXIT_CODE
