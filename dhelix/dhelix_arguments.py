"""The `--dhelix*` command-line arguments: their definition (`add_dhelix_runtime_args`, on
Megatron-LM's parser under the plugin) and the check of the plan and profile files they name
(`check_dhelix_files`), both before any process group exists. The typed options built from
them and their rules: `dhelix.options` (`docs/options.md`)."""

from __future__ import annotations

import argparse
from typing import Callable

from dhelix.argument_error import ArgumentError, check_readable_file, check_writable_file, \
    flag
from dhelix.options import ATTENTION_CHOICES, PAIRERS


def _non_negative(unit: str) -> Callable[[str], float]:
    """An argparse `type`: a number of `unit` >= 0, else the one-line error naming it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be a number of {unit} >= 0, got {text!r}")
        return value

    return parse


def _off_switch(group, flag: str, dest: str, help_text: str) -> None:
    """A `--dhelix-no-X` flag: `dest` is True unless the flag is given."""
    group.add_argument(flag, dest=dest, action="store_false", default=True, help=help_text)


def add_dhelix_runtime_args(p: argparse.ArgumentParser):
    """Add the `--dhelix*` arguments of the DHelix runtime (`dhelix.runtime.setup`) to `p`
    in a group "dhelix", which is returned. Used by the Megatron-LM plugin on Megatron's own
    parser (`megatron_patches.training_hooks`)."""
    g = p.add_argument_group("dhelix")
    g.add_argument("--dhelix", action="store_true",
                   help="co-execute micro-batch pairs (one forward with another's backward)")
    g.add_argument("--dhelix-plan", type=str, default=None,
                   help="plan file (dhelix plan ...); default: build one at start-up")
    g.add_argument("--dhelix-profile", type=str, default=None,
                   help="profile to plan from (dhelix profile ...); default: analytic costs")
    g.add_argument("--dhelix-save-plan", type=str, default=None, metavar="PATH",
                   help="write the plan built at start-up to PATH (one file per pipeline "
                        "stage with PP > 1: PATH with .stage<k> before its suffix), for "
                        "`dhelix plan show PATH` and --dhelix-plan PATH on this machine; "
                        "with the memory bound it holds each block's peak and the "
                        "per-operator readings")
    g.add_argument("--dhelix-pairer", choices=PAIRERS,
                   default="dp",
                   help="how operators are paired (default dp): dp|sequential|round_robin pair "
                        "one micro-batch's forward with another's backward (DHelix and its "
                        "baselines); domino splits each micro-batch in two batch halves and "
                        "staggers them layer by layer (Domino-style baseline, no planning)")
    g.add_argument("--dhelix-block-barriers", action="store_true", default=True,
                   help="wait for every block's collectives before the next block starts, as "
                        "the planner's cost model assumes (the default)")
    _off_switch(g, "--dhelix-no-block-barriers", "dhelix_block_barriers",
                "wait only at the end of each layer pair: a block's collectives may "
                "still be in flight when the next block starts (readers wait for what "
                "they read); measured slower on the emulated cluster "
                "(docs/benchmark.md)")
    _off_switch(g, "--dhelix-no-layer-seams", "dhelix_layer_seams",
                "run the layer pairs of an SI block strictly one after the other; by "
                "default a pair's trailing backward-only blocks run together with the "
                "next pair's leading forward-only blocks (docs/runtime.md)")
    _off_switch(g, "--dhelix-no-embedding-overlap", "dhelix_embedding_overlap",
                "keep the embedding's TP all-reduce blocking, as Megatron does; by default "
                "an SI block's backward strand computes while it travels (docs/runtime.md)")
    g.add_argument("--dhelix-streamed", action="store_true", default=None,
                   help="run each SI block as one static sequence of both strands' operators, "
                        "layer after layer, with no block barriers and both strands' "
                        "collectives on one lane per channel, in the order the streamed "
                        "planner found fastest for the profile, unless the block plan is "
                        "predicted faster: also with a --dhelix-plan file, and where no "
                        "sequence fits the memory bound (the least peak, with a warning); dp "
                        "pairer only. Default: streamed where the dp plan is built at "
                        "start-up and a sequence within the memory bound is predicted faster "
                        "than the block plan (docs/runtime.md)")
    g.add_argument("--dhelix-no-streamed", dest="dhelix_streamed", action="store_false",
                   help="run SI blocks as the block plan's blocks, never streamed")
    g.add_argument("--dhelix-memory-margin", type=_non_negative("MiB"), default=None,
                   metavar="MIB",
                   help="memory bound of the dp pairer: no block of the plan may hold more "
                        "than the sequential plan (backward layer, then forward layer; "
                        "Megatron's peak) plus this many MiB, by the per-operator memory "
                        "measured at start-up; default: 5%% of the saved activations of this "
                        "stage's layers and, without pipelining, of the loss part's peak, so "
                        "the peak stays within about 1.05x Megatron's (docs/planner.md)")
    _off_switch(g, "--dhelix-no-memory-bound", "dhelix_memory_bound",
                "plan without the memory bound: the fastest plan, which may hold up "
                "to one more layer's activations than Megatron")
    g.add_argument("--dhelix-pipeline-transfer-ms", type=_non_negative("ms"), default=None,
                   metavar="MS",
                   help="with --pipeline-model-parallel-size > 1 and the dp plan built at "
                        "start-up: one activation's transfer between neighbouring stages "
                        "takes MS ms, for the start-up choice between the dp plan, the "
                        "sequential pairing and streamed SI blocks (reproducible plans); "
                        "default: timed at start-up (docs/planner.md)")
    g.add_argument("--dhelix-attention", choices=ATTENTION_CHOICES, default="megatron",
                   help="core attention of the local layer spec (default megatron): megatron "
                        "is megatron-core's unfused DotProductAttention, sdpa torch's "
                        "scaled_dot_product_attention (fused kernels on CUDA, causal masks "
                        "only); applies with and without --dhelix "
                        "(megatron_patches.sdpa_attention)")
    g.add_argument("--dhelix-commfree-timing-only", action="store_true",
                   help="BENCHMARK ONLY: replace every TP collective of the layers with a "
                        "no-op (timing only, wrong numerics: the communication-free bound)")
    return g


def check_dhelix_files(ns: argparse.Namespace) -> None:
    """--dhelix-plan / --dhelix-profile, before anything is built: each given only with
    --dhelix, an existing regular file this process can read, holding a valid dhelix plan /
    profile of the format version this dhelix reads (whether it fits this run's model,
    layout and hardware is checked once the model exists, `dhelix.runtime.setup`);
    --dhelix-save-plan only with --dhelix, a file path this process can write. Raises
    ArgumentError. Used by the plugin's argument hook (`dhelix.megatron_lm_checks`)."""
    from dhelix.file_formats import FormatError
    from planner.plan import load_plan
    from profiler.profile_file import load_profile

    for dest, load in (("dhelix_plan", load_plan), ("dhelix_profile", load_profile)):
        path = getattr(ns, dest, None)
        if path is None:
            continue
        if not ns.dhelix:
            raise ArgumentError(f"{flag(dest)} needs --dhelix (without it the file would be "
                                f"ignored); add --dhelix or drop {flag(dest)}")
        check_readable_file(flag(dest), path)
        try:
            load(path)
        except FormatError as exc:
            raise ArgumentError(f"{flag(dest)} {exc}") from None
    save = getattr(ns, "dhelix_save_plan", None)
    if save is not None:
        if not ns.dhelix:
            raise ArgumentError("--dhelix-save-plan needs --dhelix (without it no plan is "
                                "built); add --dhelix or drop --dhelix-save-plan")
        check_writable_file("--dhelix-save-plan", save)
