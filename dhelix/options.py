"""The typed facts a `--dhelix` run is built from: the `--dhelix*` options (`DHelixOptions`),
the model's shape (`ModelShape`) and the parallel layout (`ParallelLayout`), bundled as
`DHelixRun`. All frozen: built once where the arguments are final and passed explicitly to
`dhelix.runtime.setup.setup_dhelix` and everything below it; nothing under it reads an
argument namespace.

Where they are built:
- Megatron-LM plugin: `megatron_patches.run_options.run_from_megatron_args`, right after
  Megatron's `validate_args` (so after `--use-checkpoint-args` loaded the checkpoint's
  arguments, and with Megatron's derived sizes). The benchmark, the profiler, `dhelix ops`
  and the parity tests go through the same function (they parse with Megatron's parser
  under the plugin).

`DHelixRun` checks the rules that tie the `--dhelix*` options to the model and layout when
it is built (`check_run`, the one place they are checked): building an unsupported run
raises `OptionError` (one line, naming the argument and the fix). The refusals of Megatron
arguments the runtime cannot honour at all live in `dhelix.megatron_lm_checks`; the checks
of a plan or profile against the run in `dhelix.runtime.setup` (they need the layer's
operator DAGs). docs/options.md lists every option and rule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dhelix.argument_error import ArgumentError

log = logging.getLogger(__name__)

# --dhelix-pairer choices: the first three pair one micro-batch's forward with another's
# backward (DHelix and its baselines); domino splits each micro-batch in two batch halves
PAIRERS = ("dp", "sequential", "round_robin", "domino")
DOMINO = "domino"
SEQUENTIAL = "sequential"
# the dp pairer's default memory margin, as a share of the saved activations of the stage's
# layers (Megatron's peak holds at least those): the plan's peak stays within ~1.05x of it
AUTO_MEMORY_MARGIN = 0.05
# --dhelix-attention: megatron-core's DotProductAttention or torch SDPA
# (megatron_patches.sdpa_attention)
ATTENTION_CHOICES = ("megatron", "sdpa")


class OptionError(ArgumentError):
    """A `--dhelix` run that cannot be built; the message is one line naming the argument
    and the fix."""


@dataclass(frozen=True)
class DHelixOptions:
    """Every `--dhelix*` option (`dhelix.dhelix_arguments.add_dhelix_runtime_args`), with its
    default. Field = option without the `--dhelix-` prefix."""

    enabled: bool = False  # --dhelix: co-execute micro-batch pairs
    plan: str | None = None  # --dhelix-plan PATH: a plan file (default: built at start-up)
    profile: str | None = None  # --dhelix-profile PATH: plan from these measured costs
    # --dhelix-save-plan PATH: write the plan built at start-up (per stage with PP > 1)
    save_plan: str | None = None
    pairer: str = "dp"  # --dhelix-pairer: dp | sequential | round_robin | domino
    block_barriers: bool = True  # --dhelix-no-block-barriers: False
    layer_seams: bool = True  # --dhelix-no-layer-seams: False
    # --dhelix-no-embedding-overlap: False (the embedding's TP all-reduce stays blocking)
    embedding_overlap: bool = True
    # SI blocks as one static operator sequence (planner.streamed) where it is predicted
    # faster than the block plan: --dhelix-streamed True (also with a plan file, and above the
    # memory bound where nothing fits), --dhelix-no-streamed False (the block plan); None
    # (default): where the dp plan is built at start-up, within the memory bound
    # (dhelix.runtime.setup.choose_streamed)
    streamed: bool | None = None
    # --dhelix-no-memory-bound: False (the DP's plan is not bounded, planner.memory)
    memory_bound: bool = True
    # --dhelix-memory-margin MIB: the DP's blocks stay within the sequential plan's peak plus
    # this; None: AUTO_MEMORY_MARGIN of the stage's layers' saved activations and, without
    # pipelining, of the loss part's peak
    memory_margin_mib: float | None = None
    # --dhelix-pipeline-transfer-ms MS: one pipeline transfer's time for the start-up
    # planning of a folded stage (dhelix.runtime.setup.choose_for_transfers and
    # choose_streamed); None: timed at start-up (dhelix.runtime.transfer_probe)
    pipeline_transfer_ms: float | None = None
    attention: str = "megatron"  # --dhelix-attention: megatron | sdpa
    commfree_timing_only: bool = False  # --dhelix-commfree-timing-only (benchmark bound)

    @classmethod
    def from_args(cls, args) -> "DHelixOptions":
        """The options from a namespace parsed with `add_dhelix_runtime_args` (Megatron's
        parser under the plugin, or the trainer's)."""
        return cls(enabled=bool(args.dhelix), plan=args.dhelix_plan,
                   profile=args.dhelix_profile, save_plan=args.dhelix_save_plan,
                   pairer=args.dhelix_pairer,
                   block_barriers=bool(args.dhelix_block_barriers),
                   layer_seams=bool(args.dhelix_layer_seams),
                   embedding_overlap=bool(args.dhelix_embedding_overlap),
                   streamed=args.dhelix_streamed, attention=args.dhelix_attention,
                   memory_bound=bool(args.dhelix_memory_bound),
                   memory_margin_mib=(None if args.dhelix_memory_margin is None
                                      else float(args.dhelix_memory_margin)),
                   pipeline_transfer_ms=(None if args.dhelix_pipeline_transfer_ms is None
                                         else float(args.dhelix_pipeline_transfer_ms)),
                   commfree_timing_only=bool(args.dhelix_commfree_timing_only))

    @property
    def defers_embedding_reduce(self) -> bool:
        """Whether SI blocks let the embedding's TP all-reduce travel while the backward
        strand computes (`megatron_patches.deferred_reduce`, where exact): on by default,
        never for the sequential pairing (the reference rows keep Megatron's blocking one)."""
        return self.embedding_overlap and self.pairer != SEQUENTIAL

    @property
    def domino(self) -> bool:
        """The Domino-style intra-batch split (no planner plan)."""
        return self.pairer == DOMINO


@dataclass(frozen=True)
class ModelShape:
    """The transformer the runtime binds and plans for (Megatron's values after its derived
    defaults: ffn size, query groups = heads without GQA)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    seq_length: int
    vocab_size: int | None
    normalization: str  # LayerNorm | RMSNorm
    position_embedding_type: str  # learned_absolute | rope
    swiglu: bool
    add_bias_linear: bool
    dtype: str  # bf16 | fp32 (the runtime refuses fp16)
    hidden_dropout: float
    attention_dropout: float

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel layout and batch split for this run."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int

    @property
    def pipelined(self) -> bool:
        return self.pipeline_model_parallel_size > 1

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step and data-parallel rank (without a batch-size ramp-up)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class DHelixRun:
    """What `setup_dhelix` builds from. Building one checks `check_run` (raises
    `OptionError`)."""

    options: DHelixOptions
    model: ModelShape
    parallel: ParallelLayout

    def __post_init__(self):
        check_run(self.options, self.model, self.parallel)


def run_from_args(args, *, add_bias_linear: bool, num_query_groups: int,
                  vocab_size: int | None) -> DHelixRun:
    """The run described by a Megatron-style namespace whose sizes are final (derived
    defaults filled). The three keyword arguments are where Megatron's parser and the
    trainer's differ. Raises `OptionError` for an unsupported `--dhelix` run."""
    model = ModelShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=num_query_groups, seq_length=args.seq_length, vocab_size=vocab_size,
        normalization=args.normalization, position_embedding_type=args.position_embedding_type,
        swiglu=bool(args.swiglu), add_bias_linear=bool(add_bias_linear),
        dtype="bf16" if args.bf16 else "fp32", hidden_dropout=float(args.hidden_dropout),
        attention_dropout=float(args.attention_dropout))
    parallel = ParallelLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size)
    return DHelixRun(DHelixOptions.from_args(args), model, parallel)


def folding_problem(num_layers: int, pipeline_model_parallel_size: int) -> str | None:
    """The one-line refusal when `--dhelix` cannot fold NUM_LAYERS over the pipeline stages
    (PP > 1: two chunks per stage, so a multiple of 2 x PP), else None. The one statement of
    the rule: the typed run's check (`check_run`) and the plugin's parse-time check
    (`dhelix.megatron_lm_checks.check_plugin_args`, which must refuse before Megatron's own
    layer assertions) both call it."""
    pp = pipeline_model_parallel_size
    if pp <= 1 or num_layers % (2 * pp) == 0:
        return None
    return (f"--dhelix with --pipeline-model-parallel-size {pp} folds the layers into a U "
            f"(two chunks per stage): --num-layers {num_layers} must be a multiple of "
            f"2 x {pp} = {2 * pp}")


def _rules(options: DHelixOptions, model: ModelShape, parallel: ParallelLayout):
    """(refused, message) for every rule tying the `--dhelix*` options to the run."""
    pp = parallel.pipeline_model_parallel_size
    for option, value in (("--dhelix-plan", options.plan), ("--dhelix-profile", options.profile),
                          ("--dhelix-save-plan", options.save_plan),
                          ("--dhelix-commfree-timing-only", options.commfree_timing_only),
                          ("--dhelix-streamed", options.streamed is True),
                          ("--dhelix-pipeline-transfer-ms",
                           options.pipeline_transfer_ms is not None)):
        yield (bool(value) and not options.enabled, f"{option} needs --dhelix")
    if not options.enabled:
        return
    yield (model.hidden_dropout != 0 or model.attention_dropout != 0,
           f"--dhelix needs --hidden-dropout 0 --attention-dropout 0 (this run has "
           f"{model.hidden_dropout:g} and {model.attention_dropout:g}; two interleaved strands "
           "would draw dropout masks in a different order than Megatron, whose default is "
           "0.1)")
    problem = folding_problem(model.num_layers, pp)
    yield (problem is not None, problem)
    yield (options.domino and pp != 1,
           "--dhelix-pairer domino (intra-batch split) runs without pipelining; use "
           "--pipeline-model-parallel-size 1")
    yield (options.domino and parallel.micro_batch_size % 2 != 0,
           f"--dhelix-pairer domino splits each micro-batch in two halves along the batch "
           f"dimension: --micro-batch-size must be even (got {parallel.micro_batch_size})")
    yield (options.domino and bool(options.plan or options.profile or options.save_plan),
           "--dhelix-pairer domino does no planning: drop --dhelix-plan, --dhelix-profile "
           "and --dhelix-save-plan")
    yield (bool(options.plan and options.save_plan),
           "--dhelix-save-plan writes the plan built at start-up, and --dhelix-plan gives "
           "one: drop --dhelix-save-plan (the plan is that file)")
    if options.pipeline_transfer_ms is not None:
        yield (pp == 1, "--dhelix-pipeline-transfer-ms times the transfers between pipeline "
                        "stages: drop it with --pipeline-model-parallel-size 1")
        yield (options.pairer != "dp" or bool(options.plan),
               "--dhelix-pipeline-transfer-ms serves the dp plan built at start-up: drop it "
               "with --dhelix-plan or a --dhelix-pairer other than dp")
    yield (options.streamed is True and options.pairer != "dp",
           f"--dhelix-streamed plans its own operator sequence from the profile: use it with "
           f"--dhelix-pairer dp (got {options.pairer})")


def check_run(options: DHelixOptions, model: ModelShape, parallel: ParallelLayout) -> None:
    """Raise `OptionError` for the first rule the run breaks: `--dhelix-plan`,
    `--dhelix-profile` and `--dhelix-commfree-timing-only` need `--dhelix`; with `--dhelix`:
    dropout 0, with PP > 1 a layer count that folds (a multiple of 2 x PP), and the Domino
    split only with PP 1, an even micro-batch and no plan/profile,
    `--dhelix-pipeline-transfer-ms` only with PP > 1 and the dp plan built at start-up.
    Warns (does not refuse) when one micro-batch leaves nothing to pair."""
    for refused, message in _rules(options, model, parallel):
        if refused:
            raise OptionError(message)
    if options.enabled and not options.domino and parallel.num_microbatches < 2:
        log.warning("--dhelix with one micro-batch has nothing to pair: it runs F(1) then "
                    "B(1); raise --global-batch-size for overlap")
