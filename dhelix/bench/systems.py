"""The systems and configurations the benchmark compares.

Every system is the same `pretrain_gpt` training (same model, seed, so same initial weights,
same data) with a few extra arguments; all but Megatron run on dhelix's operator programs
and strand executor (`dhelix.runtime`) through the one schedule engine
(`dhelix.schedules.runner.ScheduleEngine`: the SI action list, or Megatron's no-pipelining
list for the Domino-style pairing), so the baselines are options of one code path:

- megatron: no extra arguments; megatron-core's own schedule (no pipelining, or 1F1B with
  PP>1).
- commfree: `--dhelix --dhelix-pairer sequential --dhelix-commfree-timing-only`; the
  operator programs in sequence, every layer collective a no-op. TIMING ONLY.
- ops_sequential: `--dhelix --dhelix-pairer sequential`; the same with real collectives (a
  reference: how close the programs' compute is to Megatron's).
- domino: `--dhelix --dhelix-pairer domino`; Domino-style intra-batch split, two batch halves
  per layer, staggered.
- wavelet: `--dhelix --dhelix-pairer round_robin`; micro-batch pairs, round-robin operator
  interleaving, no planning.
- dhelix: `--dhelix --dhelix-pairer dp [--dhelix-profile P]`, the runtime's default:
  micro-batch pairs with the DP plan from the profile (or from analytic costs, labelled so),
  each SI block run as the streamed sequence (`planner.streamed`: one static operator
  sequence of both strands, no block barriers, both strands' collectives on one lane per
  channel) where that is predicted faster than the block plan within the memory bound, else
  in the plan's blocks.
- dhelix_blocks: the same with `--dhelix-no-streamed`: the block plan always; every block
  waits for its collectives, as the planner's cost model assumes.
- dhelix_no_barriers: the block plan with `--dhelix-no-block-barriers` (only each layer
  pair's last block waits; a block's collectives may still fly while the next block runs):
  what dropping the barriers gains or costs.
- dhelix_no_seams: the block plan with `--dhelix-no-layer-seams` (the layer pairs of an SI
  block strictly one after the other): what overlapping them at their seams gains.
- dhelix_no_embedding_overlap: the default with `--dhelix-no-embedding-overlap` (the
  embedding's TP all-reduce blocking, as Megatron's): what letting it travel beside every
  SI block's backward strand gains.
- dhelix_streamed: `--dhelix --dhelix-pairer dp --dhelix-streamed`; streamed wherever the
  sequence is predicted faster, even above the memory bound when no sequence fits it.
- dhelix_streamed_no_memory_bound: the same with `--dhelix-no-memory-bound`.
- dhelix_no_memory_bound: the default with `--dhelix-no-memory-bound`: the speed the
  default memory bound gives up, and the memory it saves.
- megatron_moe_overlap: Megatron with `--overlap-moe-expert-parallel-comm
  --delay-wgrad-compute` (megatron-core's own inter-micro-batch all-to-all overlap,
  `pipeline_parallel/combined_1f1b.py`), in MoE configurations; it runs on CUDA streams and
  events only, so on the benchmark's CPU ranks (the CPU cluster and the emulated GPU cluster
  alike) its row is "n/a" with that reason.

With PP > 1 every `--dhelix` system runs on the folded model with the W-shaped schedule
(the pairer decides how each SI block's layer pairs are interleaved); Megatron runs 1F1B.
A system is "n/a" in a configuration when the runtime refuses it there
(`dhelix.options.check_run`, when the arguments are parsed), with its reason: the
Domino-style split runs without pipelining only. Adding a system is one `System` entry.

Every system is one `megatron.training.pretrain` set-up of `scripts/pretrain_gpt.py` under the
plugin (`megatron_patches.step_harness.build_run`) with Megatron's arguments: `RUN_ARGS`, then
the model's, then the layout's, then the system's.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field

# What every benchmark run adds before its model's Megatron arguments (so a model argument
# wins): Megatron's mock data with the null tokenizer, megatron-core's local layer spec, no
# dropout (`--dhelix` needs it), no evaluation, data loading in the rank's own process.
RUN_ARGS = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
            "--transformer-impl", "local", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--eval-iters", "0", "--eval-interval", "1000000", "--num-workers", "0",
            "--lr", "3e-4", "--train-iters", "1000")


def tiny_model(num_layers: int = 4, global_batch_size: int = 8) -> list:
    """The tiny model (configs/tiny.json: hidden 128, 4 heads, sequence 64, micro-batch 2)
    as Megatron arguments, with `num_layers` layers and a global batch of
    `global_batch_size`."""
    return ["--num-layers", str(num_layers), "--hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", str(global_batch_size)]


class ArgumentsRefused(ValueError):
    """Megatron's parser or the plugin refused a command line; the message is its one
    `error:` line without the prefix."""


def parse_megatron_args(argv: list, world_size: int):
    """Megatron's arguments for `argv` as each of `world_size` ranks gets them from
    `scripts/pretrain_gpt.py` under the plugin (`megatron_patches.parsed_arguments`:
    Megatron's parser with the plugin's hooks, then Megatron's `validate_args` with the
    plugin's `--dhelix` rules). In this process, no process group; what they print is
    swallowed. Raises `ArgumentsRefused` with the refusal (the row's "n/a" reason).
    `padded_vocab_size` is not set (the tokenizer sets it when a run starts)."""
    from megatron_patches.parsed_arguments import MegatronArgumentError
    from megatron_patches.parsed_arguments import parse_megatron_args as parse

    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            return parse(list(argv), world_size)
    except SystemExit:
        lines = [line for line in printed.getvalue().splitlines() if line.startswith("error: ")]
        raise ArgumentsRefused(lines[-1][len("error: "):] if lines else printed.getvalue())
    except MegatronArgumentError as exc:
        raise ArgumentsRefused(str(exc)) from None


@dataclass(frozen=True)
class System:
    name: str
    label: str
    args: tuple = ()
    timing_only: bool = False
    uses_profile: bool = False
    moe_only: bool = False  # runs in MoE configurations only
    cuda_only: str = ""  # why it cannot run on CPU ranks (then always n/a here)


SYSTEMS = (
    System("megatron", "Megatron-core"),
    System("commfree", "comm-free bound (timing only)",
           ("--dhelix", "--dhelix-pairer", "sequential", "--dhelix-commfree-timing-only"),
           timing_only=True),
    System("ops_sequential", "operator programs, sequential",
           ("--dhelix", "--dhelix-pairer", "sequential")),
    System("domino", "Domino-style (intra-batch split)",
           ("--dhelix", "--dhelix-pairer", "domino")),
    System("wavelet", "Wavelet-style (round robin)",
           ("--dhelix", "--dhelix-pairer", "round_robin")),
    System("dhelix", "DHelix", ("--dhelix", "--dhelix-pairer", "dp"), uses_profile=True),
    System("dhelix_blocks", "DHelix, block plan",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-no-streamed"), uses_profile=True),
    System("dhelix_no_barriers", "DHelix, block plan, barrier only after each layer pair",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-no-streamed",
            "--dhelix-no-block-barriers"), uses_profile=True),
    System("dhelix_no_seams", "DHelix, block plan, layer pairs without seams",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-no-streamed",
            "--dhelix-no-layer-seams"), uses_profile=True),
    System("dhelix_no_embedding_overlap", "DHelix, the embedding's all-reduce blocking",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-no-embedding-overlap"),
           uses_profile=True),
    System("dhelix_streamed", "DHelix, streamed SI blocks",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-streamed"), uses_profile=True),
    System("dhelix_streamed_no_memory_bound", "DHelix, streamed, no memory bound",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-streamed",
            "--dhelix-no-memory-bound"), uses_profile=True),
    System("dhelix_no_memory_bound", "DHelix, no memory bound",
           ("--dhelix", "--dhelix-pairer", "dp", "--dhelix-no-memory-bound"),
           uses_profile=True),
    System("megatron_moe_overlap", "Megatron, its own MoE all-to-all overlap",
           ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"), moe_only=True,
           cuda_only="megatron-core's --overlap-moe-expert-parallel-comm runs on CUDA streams "
                     "and events (torch.cuda.Event in models/common/model_chunk_schedule_plan.py"
                     "); the benchmark's ranks are CPU processes"),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: cluster shape and parallel layout."""

    name: str
    nodes: int
    ranks_per_node: int
    tp: int
    pp: int
    description: str
    bandwidth: str = "800mbit"  # default cross-node link (`--bandwidth CONFIG=RATE` wins)
    extra_args: tuple = ()  # Megatron arguments of the layout beyond TP/PP (EP, MoE layers)

    @property
    def moe(self) -> bool:
        return "--num-experts" in self.extra_args

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def oversubscribed(self, cores: int | None = None) -> bool:
        """More ranks than this machine has cores: the ranks' computation time-shares, so
        its figures are not headline results."""
        import os

        return self.world_size > (cores or os.cpu_count() or 1)

    def parallel_args(self) -> list:
        """The layout's Megatron arguments (added after the model's, so they win)."""
        return ["--tensor-model-parallel-size", str(self.tp),
                "--pipeline-model-parallel-size", str(self.pp), *self.extra_args]


# Configuration (e)'s MoE MLP: every layer's MLP becomes megatron-core's MoE layer, top-2 of
# 4 experts (FFN size from the model), alltoall dispatcher, auxiliary load-balancing loss
MOE_ARGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
            "alltoall", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff",
            "1e-2")


CONFIGS = {
    "a": Config("a", 2, 1, tp=2, pp=1, description="2 nodes x 1 rank, TP=2 across nodes"),
    # (a) on a slower link: communication 40-50% of Megatron's step on the default model
    # (measured 45% at 500 Mbit/s; 400 Mbit/s, used before, gave 51-53%)
    "a2": Config("a2", 2, 1, tp=2, pp=1, bandwidth="500mbit",
                 description="2 nodes x 1 rank, TP=2 across nodes, communication-heavy link"),
    "b": Config("b", 2, 2, tp=4, pp=1, description="2 nodes x 2 ranks, TP=4"),
    "c": Config("c", 2, 2, tp=2, pp=2,
                description="2 nodes x 2 ranks, TP=2 within nodes, PP=2 across nodes"),
    # PP=2 where every collective crosses a shaped link (the emulated GPU cluster's PP row:
    # its intra-node links are not emulated, so (c)'s TP traffic would cost next to nothing)
    "d": Config("d", 4, 1, tp=2, pp=2,
                description="4 nodes x 1 rank, TP=2 and PP=2 across nodes"),
    # the pipeline alone: PP=2 across the nodes, no TP (the W schedule against 1F1B with no
    # intra-layer collective to hide: what the schedules themselves cost)
    "p": Config("p", 2, 1, tp=1, pp=2, description="2 nodes x 1 rank, PP=2 across nodes"),
    # MoE: the dispatch and combine all-to-alls cross the shaped link (DP=2 = EP=2)
    "e": Config("e", 2, 1, tp=1, pp=1,
                description="2 nodes x 1 rank, EP=2 across nodes, MoE top-2 of 4 experts",
                extra_args=(*MOE_ARGS, "--expert-model-parallel-size", "2")),
    # (e) with TP=2 (sequence parallel, expert TP 1) beside EP=2: 4 nodes x 1 rank so the TP
    # collectives and the all-to-alls both cross shaped links (Megatron puts an EP group's
    # ranks next to each other when expert TP is 1, so on 2 x 2 both would stay in a node)
    "e2": Config("e2", 4, 1, tp=2, pp=1,
                 description="4 nodes x 1 rank, TP=2 (SP) and EP=2 across nodes, MoE top-2 of "
                             "4 experts",
                 extra_args=(*MOE_ARGS, "--expert-model-parallel-size", "2",
                             "--sequence-parallel", "--expert-tensor-parallel-size", "1")),
}


@dataclass
class SystemRun:
    """A system as run in one configuration: its full extra arguments and its label, or the
    reason it cannot run there."""

    system: System
    args: list = field(default_factory=list)
    label: str = ""
    unavailable: str | None = None


def config_systems(config: Config, systems=SYSTEMS) -> list:
    """The systems of `systems` that have a row in `config`: MoE-only ones in MoE
    configurations only."""
    return [s for s in systems if config.moe or not s.moe_only]


def plan_system(system: System, config: Config, base_args: list,
                profile: str | None) -> SystemRun:
    """The arguments `system` runs with in `config` (adding `--dhelix-profile` to the DHelix
    system when a profile is given, marking the analytic fallback otherwise), or why it
    cannot run there. Pure argument checks (`parse_megatron_args` of `RUN_ARGS`, the model,
    the layout and the system's arguments): no process group needed."""
    args = list(system.args)
    label = system.label
    if system.uses_profile:
        if profile:
            args += ["--dhelix-profile", profile]
            label += " (plan from profile)"
        else:
            label += " (analytic-cost plan, no profile)"
    run = SystemRun(system, args, label)
    if system.cuda_only:
        run.unavailable = system.cuda_only
        return run
    try:
        parse_megatron_args([*RUN_ARGS, *base_args, *config.parallel_args(), *args],
                            config.world_size)
    except ArgumentsRefused as exc:
        run.unavailable = str(exc)
    return run
