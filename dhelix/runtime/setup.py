"""Start-up of `--dhelix` training: bind every layer's operator programs, build the
communication lanes, load or build the plan, check it against this run, and return the
forward/backward function that replaces Megatron's: the PP=1 SI schedule
(`dhelix.runtime.pp1_schedule`), or with PP > 1 the W-shaped schedule over the folded model
(`dhelix.schedules.w_schedule` executed by `dhelix.schedules.executor` with the operator
pass engine `dhelix.runtime.folded_passes`).

Plan sources, in order: `--dhelix-plan PATH` (checked: model, parallel layout and operator
DAGs must match this run, and the profile too when `--dhelix-profile` is given); else a plan
built now with the DP pairer from `--dhelix-profile` (or the planner's analytic default
costs without one). `--dhelix-pairer sequential|round_robin` builds a baseline plan instead.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from typing import Callable

from megatron.core import parallel_state

from dhelix.ops.runner import BoundLayer
from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
from dhelix.runtime.folded_passes import FoldedOperatorPasses
from dhelix.runtime.lanes import Lanes, check_cuda_device_max_connections
from dhelix.runtime.layer_runner import LayerRunner
from dhelix.runtime.pp1_schedule import DHelixSchedule
from dhelix.schedules.runner import make_forward_backward_func
from dhelix.schedules.w_schedule import build_w_schedule
from megatron_patches.folded_model import FoldedGPTModel
from megatron_patches.gpt_parts import GPTParts
from planner.build import make_plan
from planner.costs import build_cost_model
from planner.plan import load_checked_plan
from profiler.profile_file import load_profile

log = logging.getLogger(__name__)


class DHelixSetupError(ValueError):
    """`--dhelix` cannot run this configuration; the message says why and what to do."""


def check_dhelix_supported(args) -> None:
    """Refuse configurations the DHelix runtime does not handle (before building)."""
    if args.hidden_dropout or args.attention_dropout:
        raise DHelixSetupError(
            "--dhelix needs --hidden-dropout 0 --attention-dropout 0 (two interleaved strands "
            "would draw dropout masks in a different order than Megatron)")
    if args.num_microbatches < 2:
        log.warning("--dhelix with one micro-batch has nothing to pair: it runs F(1) then "
                    "B(1); raise --global-batch-size for overlap")


@dataclass
class DHelixSetup:
    """What `--dhelix` built: Megatron's model split at the layers, the operator-level
    layer runner (bound layers, lanes, plan), the plan and where it came from, and the
    function that replaces Megatron's forward_backward_func."""

    parts: GPTParts
    runner: LayerRunner
    plan: object
    plan_source: str
    forward_backward_func: Callable


def _resolve_plan(args, fwd, bwd):
    expected = {"model": model_fingerprint(args), "parallel": parallel_fingerprint(args)}
    profile = load_profile(args.dhelix_profile) if args.dhelix_profile else None
    if args.dhelix_plan:
        if profile is not None:
            expected["profile_sha"] = profile.sha
        plan = load_checked_plan(args.dhelix_plan, expected, fwd, bwd)
        return plan, f"file {args.dhelix_plan}"
    costs = build_cost_model(fwd, bwd, profile,
                             profile_path=args.dhelix_profile or "profile")
    command = shlex.join(["dhelix", "plan", "(built at start-up)"])
    plan = make_plan(fwd, bwd, costs, pairer=args.dhelix_pairer, model=expected["model"],
                     parallel=expected["parallel"], command=command)
    source = f"built at start-up ({args.dhelix_pairer}, costs from {costs.source})"
    return plan, source


def setup_dhelix(args, model_chunks) -> DHelixSetup:
    """Collective over the world (creates the lane process groups). Returns the schedule
    whose `forward_backward` replaces Megatron's forward_backward_func."""
    check_dhelix_supported(args)
    check_cuda_device_max_connections()
    if len(model_chunks) != 1:
        raise DHelixSetupError("--dhelix does not support virtual pipeline chunks")
    pipelined = args.pipeline_model_parallel_size > 1
    parts = GPTParts(model_chunks[0], whole_model=not pipelined)
    if pipelined and not isinstance(parts.model, FoldedGPTModel):
        raise DHelixSetupError(
            "--dhelix with --pipeline-model-parallel-size > 1 needs the folded model: build "
            "it with dhelix.training.Trainer.build(args) (which picks "
            "megatron_patches.folded_model.build_folded_model_chunks for --dhelix) after "
            "init_megatron_parallel_state(..., folded=True)")
    rope = args.position_embedding_type == "rope"
    bound = [BoundLayer(layer, args.seq_length, args.micro_batch_size, rope=rope)
             for layer in parts.layers]
    dags = bound[0].programs.dags()
    for layer in bound[1:]:
        if layer.programs.dags() != dags:
            raise DHelixSetupError("--dhelix needs identical layers (one plan serves all)")
    lanes = None
    if args.tensor_model_parallel_size > 1:
        lanes = Lanes.build({"tp": parallel_state.get_tensor_model_parallel_group()})
    plan, source = _resolve_plan(args, dags["fwd"], dags["bwd"])
    runner = LayerRunner(bound_layers=bound, lanes=lanes, fwd_order=tuple(plan.fwd_order),
                         bwd_order=tuple(plan.bwd_order), blocks=tuple(plan.blocks))
    if pipelined:
        forward_backward = make_forward_backward_func(
            build_w_schedule, passes=FoldedOperatorPasses(parts, runner))
    else:
        forward_backward = DHelixSchedule(parts=parts, runner=runner).forward_backward
    return DHelixSetup(parts=parts, runner=runner, plan=plan, plan_source=source,
                       forward_backward_func=forward_backward)
