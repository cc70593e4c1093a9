"""Start-up of `--dhelix` training: bind every layer's operator programs, build the
communication lanes, load or build the plan, check it against this run, and return the
forward/backward function that replaces Megatron's.

Plan sources, in order: `--dhelix-plan PATH` (checked: model, parallel layout and operator
DAGs must match this run, and the profile too when `--dhelix-profile` is given); else a plan
built now with the DP pairer from `--dhelix-profile` (or the planner's analytic default
costs without one). `--dhelix-pairer sequential|round_robin` builds a baseline plan instead.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from dhelix.ops.runner import BoundLayer
from dhelix.run_fingerprint import model_fingerprint, parallel_fingerprint
from dhelix.runtime.lanes import Lanes, check_cuda_device_max_connections
from dhelix.runtime.pp1_schedule import DHelixSchedule
from megatron_patches.gpt_parts import GPTParts
from planner.build import make_plan
from planner.costs import build_cost_model, pair_source_counts
from planner.plan import PlanMismatch, load_checked_plan
from dhelix.file_formats import REGENERATE
from profiler.fingerprint import (
    check_profile_hardware,
    check_profile_run,
    hardware_fingerprint,
    plan_hardware_differences,
)
from profiler.profile_file import load_profile

log = logging.getLogger(__name__)


class DHelixSetupError(ValueError):
    """`--dhelix` cannot run this configuration; the message says why and what to do."""


def check_dhelix_supported(args) -> None:
    """Refuse configurations the PP=1 DHelix runtime does not handle (before building)."""
    if args.pipeline_model_parallel_size != 1:
        raise DHelixSetupError(
            "--dhelix with --pipeline-model-parallel-size > 1 needs the folded W-shaped "
            "schedule, which is not available yet; use --pipeline-model-parallel-size 1")
    if args.hidden_dropout or args.attention_dropout:
        raise DHelixSetupError(
            "--dhelix needs --hidden-dropout 0 --attention-dropout 0 (two interleaved strands "
            "would draw dropout masks in a different order than Megatron)")
    if args.num_microbatches < 2:
        log.warning("--dhelix with one micro-batch has nothing to pair: it runs F(1) then "
                    "B(1); raise --global-batch-size for overlap")


@dataclass
class DHelixSetup:
    schedule: DHelixSchedule
    plan: object
    plan_source: str

    @property
    def forward_backward_func(self):
        return self.schedule.forward_backward


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def check_profile_fits(profile, path, model: str, parallel: str) -> None:
    """Refuse a profile measured on other hardware/software than this machine, or for
    another model / parallel layout (FormatError naming the file and `dhelix profile`)."""
    check_profile_hardware(profile, path, hardware_fingerprint(_world_size()))
    check_profile_run(profile, path, model, parallel)


def _resolve_plan(args, fwd, bwd):
    expected = {"model": model_fingerprint(args), "parallel": parallel_fingerprint(args)}
    profile = None
    if args.dhelix_profile:
        profile = load_profile(args.dhelix_profile)
        check_profile_fits(profile, args.dhelix_profile, expected["model"],
                           expected["parallel"])
    if args.dhelix_plan:
        if profile is not None:
            expected["profile_sha"] = profile.sha
        plan = load_checked_plan(args.dhelix_plan, expected, fwd, bwd)
        differences = plan_hardware_differences(plan.fingerprint["hardware"],
                                                hardware_fingerprint(_world_size()))
        if differences:
            raise PlanMismatch(
                f"{args.dhelix_plan}: plan was made from a profile of other hardware or "
                f"software than this machine ({'; '.join(differences)}); profile this machine "
                f"with `{REGENERATE['profile']}` and re-plan with `dhelix plan --profile`")
        return plan, f"file {args.dhelix_plan}"
    costs = build_cost_model(fwd, bwd, profile,
                             profile_path=args.dhelix_profile or "profile")
    command = shlex.join(["dhelix", "plan", "(built at start-up)"])
    plan = make_plan(fwd, bwd, costs, pairer=args.dhelix_pairer, model=expected["model"],
                     parallel=expected["parallel"], command=command)
    source = f"built at start-up ({args.dhelix_pairer}, costs from {costs.source}"
    if costs.source == "profile":
        counts = pair_source_counts(costs, fwd, bwd)
        estimated = sum(n for name, n in counts.items() if name != "measured")
        source += f", {estimated} of {sum(counts.values())} pairs estimated"
    source += ")"
    return plan, source


def setup_dhelix(args, model_chunks) -> DHelixSetup:
    """Collective over the world (creates the lane process groups). Returns the schedule
    whose `forward_backward` replaces Megatron's forward_backward_func."""
    check_dhelix_supported(args)
    check_cuda_device_max_connections()
    if len(model_chunks) != 1:
        raise DHelixSetupError("--dhelix does not support virtual pipeline chunks")
    parts = GPTParts(model_chunks[0])
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
    schedule = DHelixSchedule(parts=parts, bound_layers=bound, lanes=lanes,
                              fwd_order=tuple(plan.fwd_order), bwd_order=tuple(plan.bwd_order),
                              blocks=tuple(plan.blocks))
    return DHelixSetup(schedule=schedule, plan=plan, plan_source=source)
