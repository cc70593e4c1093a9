"""Start-up of `--dhelix` training: bind every layer's operator programs, build the
communication lanes, load or build the plan, check it against this run, and return the
schedule engine whose forward/backward function replaces Megatron's
(`dhelix.schedules.runner.ScheduleEngine`, one engine for every layout): the one-stage SI
schedule (`dhelix.schedules.si_schedule`) with PP=1, the W-shaped schedule over the folded
model (`dhelix.schedules.w_schedule`) with PP > 1, both run by the action-list executor
with the operator pass engine `dhelix.runtime.operator_passes`.

Everything here reads the typed run (`dhelix.options.DHelixRun`: the `--dhelix*` options,
the model shape and the parallel layout), built once and already checked where the
arguments are final (docs/options.md); nothing reads an argument namespace.

Plan sources, in order: `--dhelix-plan PATH` (checked: model, parallel layout and operator
DAGs must match this run, and the profile too when `--dhelix-profile` is given; a refused
plan's error quotes a `dhelix plan` command that builds one this run accepts, reading this
run's DAGs, which the refusal writes beside the plan, see `run_dag_dir`); else a plan
built now with the DP pairer from `--dhelix-profile` (or the planner's analytic default
costs without one). `--dhelix-pairer sequential|round_robin` builds a baseline plan instead.

Benchmark baselines built from the same machinery:
- `--dhelix-pairer domino`: Domino-style intra-batch split (no micro-batch pairs; each
  micro-batch's two batch halves co-executed layer by layer with a staggered pairing: the
  no-pipelining action list with the pass engine of `runtime.intra_batch_passes`); needs an
  even `--micro-batch-size`. (The Wavelet-style row is `--dhelix-pairer round_robin`: a
  plan, run like any other.)
- `--dhelix-commfree-timing-only`: every TP collective of the layers becomes a no-op with the
  right output shape (`dhelix.ops.collectives.NoOpCollectives`). TIMING ONLY, WRONG
  NUMERICS: the communication-free bound of the benchmark, never a training mode.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from dhelix.dag import save_dag, topological_sort
from dhelix.devices import model_device
from dhelix.runtime.memory_profile import (boundary_bytes, measure_loss_part_peak,
                                          measure_op_memory)
from dhelix.ops.runner import BoundLayer
from dhelix.options import AUTO_MEMORY_MARGIN, SEQUENTIAL, DHelixOptions, DHelixRun
from dhelix.parallel import Job
from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
from dhelix.runtime.intra_batch_passes import IntraBatchPasses
from dhelix.runtime.lanes import LanePool, check_cuda_device_max_connections, layer_lanes, \
    pipeline_transfer_groups
from dhelix.runtime.layer_runner import LayerRunner
from dhelix.runtime.operator_passes import OperatorPasses
from dhelix.runtime.transfer_probe import measure_transfer_ms
from dhelix.schedules.actions import BACKWARD, FORWARD
from dhelix.schedules.runner import ScheduleEngine, pipeline_dtype, pipeline_shape
from dhelix.schedules.sequential import build_no_pipelining_schedule
from dhelix.schedules.si_schedule import build_si_schedule
from dhelix.schedules.w_schedule import build_w_schedule
from megatron_patches.folded_model import FoldedGPTModel
from megatron_patches.gpt_parts import GPTParts
from planner.baselines import staggered_pairing
from planner.blocks import Seam, check_pairing, layer_seam
from planner.build import make_plan
from planner.costs import build_cost_model, pair_source_counts
from planner.memory import (MIB, early_input_block, layer_activation_bytes, make_bound,
                            seam_peak)
from planner.pipeline_transfers import si_block_ms, transfer_exposure
from planner.streamed import StreamedPlanner
from planner.plan import PlanMismatch, load_checked_plan, save_plan
from dhelix.file_formats import REGENERATE
from profiler.fingerprint import (
    check_profile_hardware,
    check_profile_run,
    hardware_fingerprint,
    plan_hardware_differences,
)
from profiler.profile_file import load_profile

log = logging.getLogger(__name__)

COMMFREE_WARNING = ("--dhelix-commfree-timing-only: every TP collective of the layers is a "
                    "no-op - timing only, wrong numerics (the benchmark's communication-free "
                    "bound; never use it to train)")


class DHelixSetupError(ValueError):
    """`--dhelix` cannot run this configuration; the message says why and what to do."""


@dataclass
class DHelixSetup:
    """What `--dhelix` built: Megatron's model split at the layers, the operator-level
    layer runner (bound layers, lanes, plan orders and blocks), the plan and where it came
    from, and the schedule engine whose `forward_backward` replaces Megatron's
    forward_backward_func (`forward_backward_func`). `plan` is None
    for the Domino-style split (no planner plan); `timing_only` is True for the
    communication-free bound."""

    parts: GPTParts
    runner: LayerRunner
    plan: object
    plan_source: str
    engine: ScheduleEngine
    timing_only: bool = False
    # the cost model the plan was built with at start-up (None for a plan file or the
    # Domino split): what the benchmark's predicted step reads besides the plan
    costs: object = None
    # a mixed dense/MoE stack: the plan of every (forward programs, backward programs) pair
    # (`LayerRunner.pair_plans`); `plan` is then the first pair's. None: one plan.
    pair_plans: dict | None = None
    # a folded stage's pipeline transfer time (ms) the start-up choice counted
    # (`choose_for_transfers`, `choose_streamed`); None where none was counted
    transfer_ms: float | None = None

    @property
    def forward_backward_func(self) -> Callable:
        """Megatron's forward_backward_func signature: `engine.forward_backward`."""
        return self.engine.forward_backward

    @property
    def predicted_speedup(self):
        """The plan's predicted layer speedup, None without a plan; with streamed SI
        blocks, the sequential plan's time over the streamed schedule's time a pair."""
        if self.plan is None:
            return None
        streamed = self.runner.streamed
        if streamed is not None:
            return self.plan.sequential_ms / streamed.for_pairs(
                max(si_block_pairs(self.parts))).pair_ms
        return self.plan.speedup

    def describe(self) -> str:
        """One line for logs: plan source, block count, the seam between layer pairs,
        predicted speedup, timing-only mark."""
        blocks = len(self.plan.blocks) if self.plan is not None else len(self.runner.blocks)
        line = (f"plan {self.plan_source}: {blocks} blocks" if self.runner.streamed is None
                # the blocks' orders and barriers are unused
                else f"plan {self.plan_source}: SI blocks run streamed, not in blocks")
        seam = self.runner.seam
        if seam is not None:
            line += (f", layer pairs overlap at a seam (the first {seam.head} and last "
                     f"{seam.tail} blocks)")
        if self.predicted_speedup is not None:
            line += f", predicted layer speedup {self.predicted_speedup:.3f}x"
        if self.timing_only:
            line += " [TIMING ONLY, WRONG NUMERICS: collectives are no-ops]"
        return line


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def check_profile_fits(profile, path, model: str, parallel: str) -> None:
    """Refuse a profile measured on other hardware/software than this machine, or for
    another model / parallel layout (FormatError naming the file and `dhelix profile`)."""
    check_profile_hardware(profile, path, hardware_fingerprint(_world_size()))
    check_profile_run(profile, path, model, parallel)


def run_dag_dir(plan_path) -> Path:
    """Where a refused `--dhelix-plan PLAN` leaves this run's operator DAGs (fwd.json,
    bwd.json) for the advised `dhelix plan` command: `<PLAN without suffix>-dags` beside
    the plan (plan.json -> plan-dags/)."""
    plan_path = Path(plan_path)
    return plan_path.parent / f"{plan_path.stem}-dags"


def _load_run_plan(options: DHelixOptions, expected: dict, fwd, bwd):
    """`--dhelix-plan`, checked against this run. On a mismatch the error's `dhelix plan`
    command reads this run's DAGs (written to `run_dag_dir` now, by every rank: identical
    files, atomic writes, and no rank waits for another), this run's fingerprints and
    `--dhelix-profile`, and writes the plan file this run reads: running it, then the same
    training command again, passes this check."""
    dag_dir = run_dag_dir(options.plan)
    inputs = {"--fwd-dag": str(dag_dir / "fwd.json"), "--bwd-dag": str(dag_dir / "bwd.json"),
              "-o": str(options.plan)}
    if options.profile:
        inputs["--profile"] = str(options.profile)
    try:
        return load_checked_plan(options.plan, expected, fwd, bwd, inputs=inputs)
    except PlanMismatch as exc:
        try:
            save_dag(fwd, dag_dir / "fwd.json")
            save_dag(bwd, dag_dir / "bwd.json")
            note = f"this run's operator DAGs were written to {dag_dir}/"
        except OSError as err:
            note = (f"writing this run's operator DAGs to {dag_dir}/ failed ({err}): write "
                    f"them with `dhelix ops <this run's Megatron arguments> --export-dag "
                    f"{dag_dir}`")
        raise PlanMismatch(f"{exc} ({note})") from None


def _layer_kinds(bound_layers) -> list:
    """The distinct programs of the stack's layers, in first-appearance order."""
    kinds = []
    for layer in bound_layers:
        if not any(layer.programs is k for k in kinds):
            kinds.append(layer.programs)
    return kinds


def _setup_mixed_stack(run: DHelixRun, parts: GPTParts, bound, lanes, timing_only: bool,
                       transfer_groups=None) -> DHelixSetup:
    """A stack of different layers on this rank (a `--moe-layer-freq` stack of dense and
    MoE layers): one plan, built at start-up, per (forward layer, backward layer) pair an SI
    block meets, each bounded by the memory of its two layers' operators; no seams between
    layer pairs (`transfer_groups`: the pipeline's, `lanes.pipeline_transfer_groups`). Local
    layer i meets local layer n-1-i (`bound` lists the rank's n layers
    chunk by chunk): without pipelining the SI schedule pairs forward layer l with backward
    layer L-1-l; on a folded stage (the W schedule) the i-th layer of one chunk meets the
    i-th layer of the other chunk in backward order, the same local pairs."""
    options = run.options
    if options.streamed is True:  # by default such a stack runs its plans in blocks
        raise DHelixSetupError("--dhelix-streamed serves a stack of identical layers; drop it "
                               "for a stack of dense and MoE layers")
    for flag, given in (("--dhelix-plan", options.plan), ("--dhelix-save-plan",
                                                           options.save_plan)):
        if given:
            raise DHelixSetupError(f"{flag} serves a stack of identical layers (one plan); a "
                                   "stack of dense and MoE layers plans each layer pair at "
                                   f"start-up: drop {flag}")
    kinds = _layer_kinds(bound)
    memory = {}
    if options.memory_bound and options.pairer == "dp":
        rope = parts.model.rotary_pos_emb(run.model.seq_length) if run.model.rope else None
        device = model_device(parts.model)
        for programs in kinds:  # collective: every rank measures its kinds in stack order
            first = next(layer for layer in bound if layer.programs is programs)
            memory[id(programs)] = measure_op_memory(first, device, rope, _stage_group())
    count = len(bound)
    pairs = []
    for index in range(count):
        key = (bound[index].programs, bound[count - 1 - index].programs)
        if not any(key[0] is f and key[1] is b for f, b in pairs):
            pairs.append(key)
    pair_plans, sources, first_plan, first_costs = {}, [], None, None
    for fwd_programs, bwd_programs in pairs:
        fwd, bwd = fwd_programs.forward.dag(), bwd_programs.backward.dag()
        bound_memory = None
        if memory:
            mem_f = memory[id(fwd_programs)][0]
            mem_b = memory[id(bwd_programs)][1]
            margin = _memory_margin(options, count, fwd, mem_f)
            bound_memory = make_bound(
                topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, margin,
                input_bytes=_next_embedding_bytes(run, parts, bound[0].description))
        plan, source, costs = _resolve_plan(run, fwd, bwd, bound_memory)
        pair_plans[(fwd_programs, bwd_programs)] = plan
        sources.append(f"{_kind_name(fwd_programs)} fwd x {_kind_name(bwd_programs)} bwd: "
                       f"{source}")
        if first_plan is None:
            first_plan, first_costs = plan, costs
    # a deferred embedding starts with the SI block here (the first pair's plan is not
    # checked against its buffer: `_early_embedding` does that for a stack of one kind)
    early = (0 if options.defers_embedding_reduce and parts.embedding_reduce_deferrable
             else None)
    runner = LayerRunner(bound_layers=bound, lanes=lanes, fwd_order=tuple(first_plan.fwd_order),
                         bwd_order=tuple(first_plan.bwd_order), blocks=tuple(first_plan.blocks),
                         block_barriers=options.block_barriers, pair_plans=pair_plans,
                         early_input_block=early)
    pipelined = run.parallel.pipelined
    engine = ScheduleEngine(build_w_schedule if pipelined else build_si_schedule,
                            OperatorPasses(parts, runner, loss_at_forward=pipelined,
                                           defer_embedding_reduce=(
                                               options.defers_embedding_reduce)),
                            transfer_groups=transfer_groups)
    return DHelixSetup(parts=parts, runner=runner, plan=first_plan,
                       plan_source=f"{len(pair_plans)} layer-pair plans ({'; '.join(sources)})",
                       engine=engine, timing_only=timing_only, costs=first_costs,
                       pair_plans=pair_plans)


def stage_plan_path(path: str, stage: int | None) -> Path:
    """Where `--dhelix-save-plan PATH` puts the plan of pipeline stage `stage`: PATH itself
    without pipelining (`stage` None), else PATH with `.stage<k>` before its suffix
    (plan.json -> plan.stage1.json)."""
    p = Path(path)
    return p if stage is None else p.with_name(f"{p.stem}.stage{stage}{p.suffix}")


def _save_start_up_plan(path: str, plan, streamed: bool) -> str:
    """Write the plan this stage runs (built at start-up) for `--dhelix-save-plan`: the
    stage's first rank writes it (every rank of a stage holds the same plan), to
    `stage_plan_path`; returns the phrase for the plan line. Collective over nothing; a
    failed write is a `DHelixSetupError` (one line) on the writing rank."""
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else None
    target = stage_plan_path(path, stage)
    if dist.get_rank() == min(dist.get_process_group_ranks(_stage_group())):
        try:
            save_plan(plan, target)
        except OSError as exc:
            raise DHelixSetupError(f"--dhelix-save-plan {target}: cannot be written "
                                   f"({exc.strerror}); free space or fix the permissions "
                                   "there, or choose another path") from exc
    note = " (the block plan: this run's SI blocks run streamed)" if streamed else ""
    if stage is not None:
        note += (f" (stage {stage}'s; each stage's in {stage_plan_path(path, 0).name} .. "
                 f"{stage_plan_path(path, stages - 1).name})")
    return f"saved to {target}{note}; `dhelix plan show {shlex.quote(str(target))}`"


def _stage_group():
    """The ranks of this rank's pipeline stage (Megatron's tensor-and-data-parallel group
    with context parallelism; the world without pipelining): the ranks whose layers are the
    same and whose plans must agree (their collectives pair up), so their operator memory
    is measured together. Ranks of other stages may hold other layers."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)


def _kind_name(programs) -> str:
    return "MoE" if programs.description.moe is not None else "dense"


def _memory_margin(options: DHelixOptions, layers: int, fwd, mem_f,
                   outside_bytes: float = 0.0) -> float:
    """`--dhelix-memory-margin`, else AUTO_MEMORY_MARGIN of what the bound sees of
    Megatron's peak: the saved activations of `layers` layers like the one `fwd` / `mem_f`
    describe, plus `outside_bytes` (the loss part on top of them, where measured)."""
    if options.memory_margin_mib is not None:
        return options.memory_margin_mib * MIB
    activations = layers * layer_activation_bytes(topological_sort(fwd), mem_f)
    return AUTO_MEMORY_MARGIN * (activations + outside_bytes)


def _memory_bound(run: DHelixRun, parts: GPTParts, bound_layers, fwd, bwd):
    """The DP's memory bound for this run (`planner.memory`), from one layer's operators
    measured now (`dhelix.runtime.memory_profile`, collective over the world); None with
    `--dhelix-no-memory-bound` or for a pairer other than dp (the baselines are not
    searched). The margin is `--dhelix-memory-margin`, else AUTO_MEMORY_MARGIN of the saved
    activations of this chunk's layers (one layer's forward leaves `layer_activation_bytes`
    live; Megatron's peak holds them all at once at the end of a forward) and of the loss
    part's reading where there is one (Megatron's peak holds it on top). Without
    pipelining a layer pair may also reach what the loss part holds on top of the layers'
    activations (`measure_loss_part_peak`, `planner.memory`'s `outside_bytes`): the SI
    schedule and Megatron's both peak there, at a backward's start, where the two
    micro-batches' live layers number L as at every layer pair's start; where the SI
    block pairs one layer, less the two boundary tensors its pair starts with besides (the
    embedding's output and the loss part's gradient, `pair_start_bytes`; with more layers
    the step's measured peak is the plan's less the loss part's reading, `planner.memory`).
    Without pipelining the first layer pair's forward also reads an input its start does
    not hold, the next micro-batch's embedding output, made in the SI block
    (`input_bytes`)."""
    options = run.options
    if not options.memory_bound or options.pairer != "dp":
        return None
    rope = parts.model.rotary_pos_emb(run.model.seq_length) if run.model.rope else None
    device = model_device(parts.model)
    mem_f, mem_b = measure_op_memory(bound_layers[0], device, rope, _stage_group())
    outside = pair_start = 0.0
    desc = bound_layers[0].description
    if not run.parallel.pipelined and parts.model.post_process:
        outside = measure_loss_part_peak(parts, desc, device, rope, _stage_group())
        if len(bound_layers) == 1:  # the embedding's output, the loss part's gradient
            pair_start = 2 * boundary_bytes(desc)
    margin = _memory_margin(options, len(bound_layers), fwd, mem_f, outside)
    return make_bound(topological_sort(fwd), topological_sort(bwd), mem_f, mem_b, margin,
                      outside, pair_start, _next_embedding_bytes(run, parts, desc))


def _next_embedding_bytes(run: DHelixRun, parts: GPTParts, desc) -> float:
    """The memory bound's `input_bytes`: without pipelining, on the chunk that embeds, an SI
    block's first layer pair reads the next micro-batch's embedding output (one boundary
    tensor of the layer `desc`), made in the block; 0.0 otherwise."""
    if run.parallel.pipelined or not parts.model.pre_process:
        return 0.0
    return boundary_bytes(desc)


def _resolve_plan(run: DHelixRun, fwd, bwd, memory=None):
    """(plan, where it came from, the cost model it was built with or None) for this run:
    the plan/profile compatibility checks (fingerprints, hardware) all happen here. A plan
    built here is bounded by `memory` (`planner.memory.MemoryBound`) when given."""
    options = run.options
    expected = {"model": model_fingerprint(run), "parallel": parallel_fingerprint(run)}
    profile = None
    if options.profile:
        profile = load_profile(options.profile)
        check_profile_fits(profile, options.profile, expected["model"],
                           expected["parallel"])
    if options.plan:
        if profile is not None:
            expected["profile_sha"] = profile.sha
        plan = _load_run_plan(options, expected, fwd, bwd)
        differences = plan_hardware_differences(plan.fingerprint["hardware"],
                                                hardware_fingerprint(_world_size()))
        if differences:
            raise PlanMismatch(
                f"{options.plan}: plan was made from a profile of other hardware or "
                f"software than this machine ({'; '.join(differences)}); profile this machine "
                f"with `{REGENERATE['profile']}` and re-plan with `dhelix plan --profile`")
        return plan, f"file {options.plan}", None
    costs = build_cost_model(fwd, bwd, profile,
                             profile_path=options.profile or "profile")
    command = shlex.join(["dhelix", "plan", "(built at start-up)"])
    plan = planned_once(lambda: make_plan(fwd, bwd, costs, pairer=options.pairer,
                                          model=expected["model"],
                                          parallel=expected["parallel"], command=command,
                                          memory=memory))
    source = f"built at start-up ({options.pairer}, costs from {costs.source}"
    if memory is not None:
        recorded = plan.search["memory"]
        source += (f", memory bound {recorded['budget_mib']:.2f} MiB above a layer pair's "
                   f"start (reference {recorded['reference_mib']:.2f}, loss part "
                   f"{recorded['outside_mib']:.2f} less {recorded['pair_start_mib']:.2f}, "
                   f"margin {recorded['margin_mib']:.2f}), planned peak "
                   f"{recorded['plan_peak_mib']:.2f} MiB")
    if costs.source == "profile":
        counts = pair_source_counts(costs, fwd, bwd)
        estimated = sum(n for name, n in counts.items() if name != "measured")
        source += f", {estimated} of {sum(counts.values())} pairs estimated"
    source += ")"
    return plan, source, costs


def si_block_pairs(parts: GPTParts) -> list:
    """The sizes (layer pairs) of the SI blocks this rank runs, ascending: an SI block pairs
    one model chunk's layers (all of them without pipelining)."""
    return sorted({len(parts.chunk_layers(c)) for c in range(parts.num_chunks)})


def _streamed_planner(run: DHelixRun, fwd, bwd, costs, memory=None,
                      transfer_ms: float | None = None) -> StreamedPlanner:
    """The planner of the run's streamed SI blocks (`planner.streamed`; `choose_streamed`
    decides whether they run), from the cost model the plan was built with, else (a plan file)
    from `--dhelix-profile` or the analytic default costs, bounded by `memory` (the dp
    plan's `planner.memory.MemoryBound`, None without one), with a folded stage's pipeline
    transfers of `transfer_ms` counted (None: none). Deterministic given the costs, the
    bound and the transfer time, so every rank of a stage derives the same sequence."""
    if costs is None:
        profile = load_profile(run.options.profile) if run.options.profile else None
        costs = build_cost_model(fwd, bwd, profile,
                                 profile_path=run.options.profile or "profile")
    return StreamedPlanner(fwd, bwd, costs, memory=memory, transfer_ms=transfer_ms)


def planned_once(plan: Callable[[], object]):
    """`plan()` run on the first rank of this rank's pipeline stage only, its result (or the
    error it raised, raised again on every rank) handed to every rank of the stage
    (`broadcast_object_list` over `_stage_group()`): the planners' inputs (the layer's
    DAGs, the profile or analytic costs, the memory readings reduced over the stage) are
    the same on every rank of a stage, and their plans must be (the stage's collectives pair
    up: two ranks issuing a streamed block's collectives in different orders would pair one
    strand's all-reduce with the other's), so one rank searches instead of each, and every
    rank gets the same plan by construction. Collective over the stage's group; `plan()`
    alone where no process group exists."""
    if not dist.is_initialized():
        return plan()
    group = _stage_group()
    first = dist.get_global_rank(group, 0)
    box = [None]
    if dist.get_rank() == first:
        try:
            box[0] = (True, plan())
        except Exception as exc:  # raised on every rank of the stage below
            box[0] = (False, exc)
    dist.broadcast_object_list(box, src=first, group=group)
    planned, value = box[0]
    if not planned:
        raise value
    return value


def _streamed_summary(schedule) -> str:
    """One phrase for the plan line: the streamed schedule's size, time and memory (and its
    pipeline transfers' exposure, where counted)."""
    text = (f"streamed SI blocks ({schedule.pairs} layer pairs: {schedule.pair_ms:.2f} ms a "
            f"pair, lane order {'/'.join(schedule.lane_pattern)}")
    if schedule.transfer_ms is not None:
        text += (f", the forward held {schedule.fwd_hold_ms:.2f} ms, pipeline transfers "
                 f"exposed {schedule.exposed_ms:.2f} ms a block")
    if schedule.budget_bytes is not None:
        verdict = "within" if schedule.within_budget else "ABOVE"
        text += (f", peak {schedule.peak_bytes / MIB:.2f} MiB {verdict} the memory bound "
                 f"{schedule.budget_bytes / MIB:.2f} MiB")
        if schedule.unbounded_ms < schedule.total_ms:
            text += (f"; without the bound {schedule.unbounded_ms / schedule.pairs:.2f} ms a "
                     f"pair at {schedule.unbounded_peak_bytes / MIB:.2f} MiB"
                     + (" (transfers counted)" if schedule.transfer_ms is not None else ""))
    return text + ")"


def choose_streamed(run: DHelixRun, parts: GPTParts, dags: dict, plan, costs, memory=None,
                    transfers: tuple[float, float] | None = None
                    ) -> tuple[StreamedPlanner | None, str]:
    """Whether this stage's SI blocks run streamed (`planner.streamed`): (the planner the
    runner streams from, or None for the block plan; the phrase for the plan line, "" where
    streaming was not considered). Considered with `--dhelix-streamed`, and by default
    (`options.streamed` None) where the dp plan was built at start-up (no `--dhelix-plan`
    file; not the baselines' pairers); `--dhelix-no-streamed` never. Streams where the
    sequence is predicted faster than the block plan a layer pair and, by default, within
    the memory bound (`--dhelix-streamed` runs the least peak where none fits, with a
    warning). On a folded stage, `transfers` = (one pipeline transfer's ms, `plan`'s SI
    block ms with the transfers counted: `choose_for_transfers`): the sequence is searched
    with the transfers counted and compared by the whole SI block. Collective over the
    stage's group where considered (`planned_once`), on every rank alike."""
    options = run.options
    forced = options.streamed is True
    if not (forced or (options.streamed is None and options.pairer == "dp"
                       and not options.plan and not options.commfree_timing_only)):
        return None, ""
    transfer_ms, plan_block_ms = transfers if transfers is not None else (None, None)
    streamed = _streamed_planner(run, dags["fwd"], dags["bwd"], costs, memory, transfer_ms)
    sizes = si_block_pairs(parts)
    streamed.adopt(planned_once(lambda: {size: streamed.for_pairs(size) for size in sizes}))
    schedule = streamed.for_pairs(max(sizes))
    if transfers is None:
        summary = _streamed_summary(schedule) + (f" against the block plan's "
                                                 f"{plan.planned_ms:.2f} ms a pair")
        slower = schedule.pair_ms >= plan.planned_ms
    else:
        summary = _streamed_summary(schedule) + (
            f": an SI block {schedule.block_ms:.2f} ms with the transfers against "
            f"{plan_block_ms:.2f} ms in blocks")
        slower = schedule.block_ms >= plan_block_ms
    if slower:
        # e.g. one layer: nothing to stream, and one lane serialises what the block
        # plan's two strand lanes overlap
        return None, summary + ": not faster, SI blocks run in blocks"
    if schedule.within_budget is False:
        if not forced:
            return None, summary + ": above the memory bound, SI blocks run in blocks"
        log.warning("--dhelix-streamed: no streamed sequence fits the memory bound; running "
                    "the one with the least peak (%s): raise --dhelix-memory-margin, or "
                    "drop --dhelix-streamed for the bounded block plan", summary)
    return streamed, summary


def _transfer_ms(run: DHelixRun, parts: GPTParts, transfer_groups) -> float | None:
    """One pipeline transfer's time on this cluster, where `choose_for_transfers` will use
    it: on a folded stage (`transfer_groups`) whose dp plan is built at start-up (no
    `--dhelix-plan` file; not the baselines' pairers); else None. `--dhelix-pipeline-
    transfer-ms` where given, else timed (`transfer_probe.measure_transfer_ms`). Decided
    from the run's options alone, the same on every rank, since the probe is collective
    over the world (a rank holding a mixed dense/MoE stack probes too and does not use
    it)."""
    options = run.options
    if transfer_groups is None or options.pairer != "dp" or options.plan:
        return None
    if options.pipeline_transfer_ms is not None:
        return options.pipeline_transfer_ms
    from megatron.core import parallel_state

    config = parts.model.config
    return measure_transfer_ms(
        pipeline_shape(config, run.model.seq_length, run.parallel.micro_batch_size),
        pipeline_dtype(config), model_device(parts.model),
        parallel_state.get_pipeline_model_parallel_group(), transfer_groups)


def choose_for_transfers(parts: GPTParts, dags: dict, plan, costs, memory,
                         transfer_ms: float, given: bool = False) -> tuple:
    """On a folded stage, the dp plan or the sequential pairing, whichever gives the shorter
    SI block with the pipeline's transfers of `transfer_ms` each (`planner.pipeline_
    transfers`: the dp plan may end both strands together, so both outputs wait for the
    block's end): (the plan to run, the phrase for the plan line, its SI block's ms with
    the transfers). Deterministic given the costs, the bound and the transfer time (the
    same on every rank). `given`: the time came from `--dhelix-pipeline-transfer-ms`, not
    the start-up probe (the phrase says which)."""
    sequential = make_plan(dags["fwd"], dags["bwd"], costs, pairer=SEQUENTIAL,
                           model=plan.fingerprint["model"], parallel=plan.fingerprint["parallel"],
                           command=plan.command, memory=memory)
    pairs = max(si_block_pairs(parts))
    dp_ms, seq_ms = (si_block_ms(p, pairs, transfer_ms) for p in (plan, sequential))
    chosen = sequential if seq_ms < dp_ms else plan
    origin = "--dhelix-pipeline-transfer-ms" if given else "timed at start-up"
    phrase = (f"pipeline transfers of {transfer_ms:.2f} ms ({origin}): an SI block of "
              f"{pairs} layer pairs {dp_ms:.2f} ms with the dp plan, {seq_ms:.2f} ms with the "
              f"sequential pairing (both outputs' transfers counted): runs the "
              f"{'sequential pairing' if chosen is sequential else 'dp plan'}")
    return chosen, phrase, min(dp_ms, seq_ms)


def _early_direction(parts: GPTParts, plan, streamed, pipelined: bool) -> str | None:
    """On a pipeline stage, the direction of the SI block output the stage's plan ends
    first (`StageExecutor.early_direction`: only its receives are posted a whole SI block
    ahead, the others once the block's first strand has ended): the streamed sequence's
    first strand, else the block plan's (which strand ends first does not depend on the
    transfer time: `transfer_exposure` of 0 ms). None without pipelining."""
    if not pipelined:
        return None
    if streamed is not None:
        strand = streamed.for_pairs(max(si_block_pairs(parts))).first_strand
    else:
        strand = transfer_exposure(plan, 0.0).first_strand
    return FORWARD if strand == "fwd" else BACKWARD


def plan_seam(options: DHelixOptions, plan, dags, memory=None) -> Seam | None:
    """Where consecutive layer pairs of an SI block overlap (`planner.blocks.layer_seam`),
    or None: with `--dhelix-no-layer-seams`, for a plan of the sequential pairer (the
    reference row co-executes nothing), where the plan has no seam, or where the seam
    block could exceed `memory`'s budget (`planner.memory.seam_peak`)."""
    if not options.layer_seams or plan.pairer == SEQUENTIAL:
        return None
    seam = layer_seam(plan.blocks, dags["fwd"].by_id(), dags["bwd"].by_id())
    if seam is not None and memory is not None and seam_peak(
            plan.fwd_order, plan.bwd_order, len(seam.block.fwd), len(seam.block.bwd),
            memory.fwd, memory.bwd) > memory.budget_bytes:
        return None
    return seam


def _early_embedding(run: DHelixRun, parts: GPTParts, plan, memory, streamed
                     ) -> tuple[int | None, str]:
    """(the runner's `early_input_block`, what the plan line says of it): where the
    embedding's all-reduce is deferred, the block an SI block embeds its forward's
    micro-batch before. With a memory bound, the earliest from which the output
    (`memory.input_bytes`) fits beside the backward-only blocks left before the first block
    with forward operators (`planner.memory.early_input_block`; streamed, the schedule's
    `input_step`, the same per entry); without one, the SI block's start. (None, "") where
    nothing is deferred."""
    if not (run.options.defers_embedding_reduce and parts.embedding_reduce_deferrable):
        return None, ""
    if memory is None:
        return 0, ""
    if streamed is not None:
        schedule = streamed.for_pairs(max(si_block_pairs(parts)))
        return 0, (f"the next micro-batch's embedding starts before entry "
                   f"{schedule.input_step + 1} of {len(schedule.sequence)} (its output within "
                   f"the memory bound)")
    block = early_input_block(plan, memory.fwd, memory.bwd, memory.budget_bytes,
                              memory.input_bytes)
    return block, (f"the next micro-batch's embedding starts before block {block + 1} of "
                   f"{len(plan.blocks)} (its output within the memory bound)")


def setup_dhelix(run: DHelixRun, model_chunks, job: Job, lane_pool: LanePool | None = None
                 ) -> DHelixSetup:
    """Collective over the world (creates the lane process groups, with `job`'s timeout,
    for the channels the layers' collectives use; reusing `lane_pool`'s, when given).
    `run` was checked when it was built (`dhelix.options.check_run`). Returns the set-up
    whose `forward_backward_func` (its engine's) replaces Megatron's."""
    check_cuda_device_max_connections()
    if len(model_chunks) != 1:
        raise DHelixSetupError("--dhelix does not support virtual pipeline chunks")
    options, parallel = run.options, run.parallel
    timing_only = options.commfree_timing_only
    if timing_only:
        log.warning(COMMFREE_WARNING)
    pipelined = parallel.pipelined
    parts = GPTParts(model_chunks[0], whole_model=not pipelined)
    if pipelined and not isinstance(parts.model, FoldedGPTModel):
        raise DHelixSetupError(
            "--dhelix with --pipeline-model-parallel-size > 1 needs the folded model: run "
            "the pretrain script under the plugin (python -m dhelix.megatron_lm SCRIPT ... "
            "--dhelix), whose hooks build megatron_patches.folded_model.FoldedGPTModel")
    domino = options.domino
    layer_batch = parallel.micro_batch_size // 2 if domino else parallel.micro_batch_size
    bound = [BoundLayer(layer, run.model.seq_length, layer_batch, rope=run.model.rope)
             for layer in parts.layers]
    dags = bound[0].programs.dags()
    mixed = any(layer.programs.dags() != dags for layer in bound[1:])
    if mixed and domino:
        raise DHelixSetupError("--dhelix runs a stack of different layers (dense and MoE) "
                               "only without the Domino split")
    lanes = layer_lanes(bound, parallel.tensor_model_parallel_size, job,
                        no_comm_timing_only=timing_only, pool=lane_pool)
    transfer_groups = pipeline_transfer_groups(job, lane_pool) if pipelined else None
    transfer_ms = _transfer_ms(run, parts, transfer_groups)
    if domino:
        fwd = check_pairing(dags["fwd"], dags["fwd"], staggered_pairing(dags["fwd"], dags["fwd"]))
        bwd = check_pairing(dags["bwd"], dags["bwd"], staggered_pairing(dags["bwd"], dags["bwd"]))
        runner = LayerRunner(bound_layers=bound, lanes=lanes, fwd_order=tuple(fwd.fwd_order),
                             bwd_order=tuple(bwd.fwd_order), blocks=tuple(fwd.blocks),
                             block_barriers=options.block_barriers)
        engine = ScheduleEngine(build_no_pipelining_schedule,
                                IntraBatchPasses(parts, runner, bwd_blocks=bwd.blocks))
        source = "domino: intra-batch split, staggered halves, no planning"
        return DHelixSetup(parts=parts, runner=runner, plan=None, plan_source=source,
                           engine=engine, timing_only=timing_only)
    if mixed:
        return _setup_mixed_stack(run, parts, bound, lanes, timing_only, transfer_groups)
    memory = None if options.plan else _memory_bound(run, parts, bound, dags["fwd"],
                                                      dags["bwd"])
    plan, source, costs = _resolve_plan(run, dags["fwd"], dags["bwd"], memory)
    transfers = None
    if transfer_ms is not None:
        plan, verdict, block_ms = choose_for_transfers(
            parts, dags, plan, costs, memory, transfer_ms,
            given=options.pipeline_transfer_ms is not None)
        source += "; " + verdict
        transfers = (transfer_ms, block_ms)
    streamed, verdict = choose_streamed(run, parts, dags, plan, costs, memory, transfers)
    if verdict:
        source += "; " + verdict
    early, verdict = _early_embedding(run, parts, plan, memory, streamed)
    if verdict:
        source += "; " + verdict
    if options.save_plan:
        source += "; " + _save_start_up_plan(options.save_plan, plan, streamed is not None)
    runner = LayerRunner(bound_layers=bound, lanes=lanes, fwd_order=tuple(plan.fwd_order),
                         bwd_order=tuple(plan.bwd_order), blocks=tuple(plan.blocks),
                         block_barriers=options.block_barriers,
                         seam=None if streamed else plan_seam(options, plan, dags, memory),
                         streamed=streamed, early_input_block=early)
    engine = ScheduleEngine(build_w_schedule if pipelined else build_si_schedule,
                            OperatorPasses(parts, runner, loss_at_forward=pipelined,
                                           defer_embedding_reduce=(
                                               options.defers_embedding_reduce)),
                            transfer_groups=transfer_groups,
                            early_direction=_early_direction(parts, plan, streamed, pipelined))
    return DHelixSetup(parts=parts, runner=runner, plan=plan, plan_source=source,
                       engine=engine, timing_only=timing_only, costs=costs,
                       transfer_ms=transfer_ms)
