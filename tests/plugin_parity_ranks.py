"""Rank bodies of the PP=1 parity matrices on the Megatron-LM plugin (tests/test_dhelix_pp1.py,
tests/test_runtime_cuda.py, tests/profiler/profile_ranks.py; spawned by `dhelix.harness`,
module-level so they can be pickled by name).

Every run is `scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` under the plugin
(`megatron_patches.step_harness.build_run`) from Megatron arguments: the tiny model `TINY`
(tests/megatron_lm_ranks.py) with `--optimizer sgd --lr 0.05`; stock Megatron (its
no-pipelining schedule) is the reference, and the same command line with `--dhelix ...` the
run under test, from the same seed (identical initial weights) and the same mock data. Both
are stepped by Megatron's own `train_step` (`PretrainedRun.train_step`); the loss and every
gradient are observed right after the forward/backward function (the schedule, then
Megatron's `finalize_model_grads`), before the optimizer step. One launch batches every case
of a world size, because every rank pays ~6 s of imports on a 2-core machine."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from dataclasses import dataclass

import torch.distributed as dist

from dhelix.parity import gather_full_tensors, max_abs_diff
from tests.megatron_lm_ranks import SCRIPT, TINY, _global_loss

# The old trainer's parity runs: SGD with a large step, so a wrong gradient moves parameters.
SGD = ["--optimizer", "sgd", "--lr", "0.05"]
TRAIN_ITERS = ["--train-iters", "100"]  # pretrain() must reach train_step; the harness steps


@dataclass(frozen=True)
class ParityCase:
    """One row of a parity matrix. `megatron`: Megatron arguments both runs add to
    `TINY + SGD` (layout, model options); `dhelix`: what the run under test adds (`--dhelix`
    and its options); `seam`: give that run's layer runner a plan whose layer pairs meet at
    a seam (`plan_with_a_seam`) before it steps."""

    megatron: tuple = ()
    dhelix: tuple = ("--dhelix",)
    seam: bool = False

    def __post_init__(self):
        # tuples: hashable (cases of one stock command line share its run) and immutable
        object.__setattr__(self, "megatron", tuple(self.megatron))
        object.__setattr__(self, "dhelix", tuple(self.dhelix))

    def stock_argv(self) -> list[str]:
        return [*TINY, *TRAIN_ITERS, *SGD, *self.megatron]

    def dhelix_argv(self) -> list[str]:
        return self.stock_argv() + list(self.dhelix)


def observed_step(run, with_grads: bool) -> dict:
    """One iteration through Megatron's `train_step` (`run.train_step()`): the global mean
    token loss and (with `with_grads`) the full gradients observed when the forward/backward
    function returns, before the optimizer step; the full parameters after the step.
    Gradients and parameters are layout-independent host copies (`dhelix.parity`) the
    caller owns, on every rank. Collective over the world."""
    schedule = run.forward_backward_func
    seen = {}

    def observing(**step):
        losses = schedule(**step)
        seen["loss"] = _global_loss(losses)
        seen["grads"] = gather_full_tensors(step["model"], "grad") if with_grads else None
        return losses

    run.forward_backward_func = observing
    try:
        run.train_step()
    finally:
        run.forward_backward_func = schedule
    if "loss" not in seen:
        raise AssertionError("train_step did not call the forward/backward function")
    with run.active():
        seen["params"] = gather_full_tensors(run.model, "param")
    return seen


def eval_loss(run) -> float:
    """The global mean token loss of one forward-only global batch (what Megatron's
    `evaluate()` asks of the forward/backward function), from the run's next samples.
    Collective over the world."""
    losses = run.forward_backward(forward_only=True)
    return _global_loss(losses)


def engine_record(run) -> list[dict]:
    """Every rank's record of what the `--dhelix` run's last forward/backward call ran
    (`ScheduleEngine.last_step`, counted by the executor while it ran), with the engine's
    type, the pass engine, the length of that rank's listed actions and its SI blocks.
    Collective over the world."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from dhelix.schedules.runner import ScheduleEngine

    # the function train() got is the bound `forward_backward` of the engine the plugin
    # made for Megatron (`ScheduleEngine.for_megatron`), which records its calls
    engine = getattr(run.forward_backward_func, "__self__", None)
    if not isinstance(engine, ScheduleEngine) or engine.last_step is None:
        raise AssertionError(f"not a --dhelix run that has stepped: {run.forward_backward_func}")
    step = engine.last_step
    with run.active():
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        num_microbatches = get_num_microbatches()
    actions = engine.schedule(pp, num_microbatches, step.forward_only).ranks[step.stage]
    mine = {**dataclasses.asdict(step), "engine": type(engine).__name__,
            "listed": len(actions), "si_blocks": sum(a.kind == "SI" for a in actions)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def compare_steps(ref: list[dict], got: list[dict]) -> list[dict]:
    """Per step: |loss diff|, max abs grad diff (if both have grads), max abs param diff."""
    report = []
    for r, g in zip(ref, got):
        row = {"loss_ref": r["loss"], "loss": g["loss"], "loss_diff": abs(r["loss"] - g["loss"])}
        if r["grads"] is not None and g["grads"] is not None:
            row["grad_diff"], row["grad_key"] = max_abs_diff(r["grads"], g["grads"])
        row["param_diff"], row["param_key"] = max_abs_diff(r["params"], g["params"])
        report.append(row)
    return report


def plan_with_a_seam(runner) -> None:
    """Give a `--dhelix` layer runner (`run.dhelix.runner`) a legal plan whose layer pairs
    meet at a seam (`planner.blocks.layer_seam`), from its own strand orders: the forward up
    to its first collective alone; the rest of the forward with the backward up to its first
    collective; the backward up to its last collective alone; the rest alone. (The
    analytic-cost plans of the tiny model have no seam; profiled plans on the emulated
    cluster do.)"""
    from planner.blocks import Block, Pairing, check_pairing, layer_seam

    dags = runner.bound_layers[0].programs.dags()
    ops_f, ops_b = dags["fwd"].by_id(), dags["bwd"].by_id()
    f, b = list(runner.fwd_order), list(runner.bwd_order)
    first_f = next(i for i, o in enumerate(f) if ops_f[o].kind == "comm")
    first_b = next(i for i, o in enumerate(b) if ops_b[o].kind == "comm")
    last_b = max(i for i, o in enumerate(b) if ops_b[o].kind == "comm")
    blocks = [Block(f[:first_f], ()), Block(f[first_f:], b[:first_b]),
              Block((), b[first_b:last_b]), Block((), b[last_b:])]
    check_pairing(dags["fwd"], dags["bwd"], Pairing(f, b, blocks))
    runner.blocks = tuple(blocks)
    runner.seam = layer_seam(blocks, ops_f, ops_b)
    assert runner.seam is not None and (runner.seam.head, runner.seam.tail) == (1, 2)


class StreamedOutputCounter:
    """Wraps a `LayerRunner._run_streamed` (where the runner streams) to count the SI
    blocks run streamed on this rank and the outputs they reported early (`on_output`:
    what the executor may send while the other strand runs)."""

    def __init__(self, runner):
        self.blocks, self.early_outputs = 0, 0
        if runner.streamed is not None:
            self._run_streamed = runner._run_streamed
            runner._run_streamed = self

    def __call__(self, fwd_layers, inputs, rotary_pos_emb, bwd_executions, grads,
                 on_output=None):
        self.blocks += 1

        def counted(direction, tensor):
            self.early_outputs += 1
            on_output(direction, tensor)

        return self._run_streamed(fwd_layers, inputs, rotary_pos_emb, bwd_executions, grads,
                                  counted if on_output is not None else None)


@contextlib.contextmanager
def counted_embedding_waits(counts: dict):
    """Within: every `dhelix.arriving.Finishing` (the embedding's deferred all-reduce,
    `megatron_patches.deferred_reduce`) waited on for the first time adds one to
    `counts["embedding"]`."""
    from dhelix.arriving import Finishing

    original = Finishing.wait

    def counted(self):
        if not self._waited:
            counts["embedding"] = counts.get("embedding", 0) + 1
        return original(self)

    Finishing.wait = counted
    try:
        yield
    finally:
        Finishing.wait = original


def _reference(run, steps: int) -> dict:
    """Stock Megatron's observed steps (`observed_step`) and next evaluation loss."""
    return {"steps": [observed_step(run, with_grads=True) for _ in range(steps)],
            "eval": eval_loss(run)}


def _dhelix_case(case: ParityCase, ref: dict, steps: int) -> dict:
    """The `--dhelix` run of `case` against its stock reference `ref` (`_reference`)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from megatron_patches.step_harness import build_run

    run = build_run(SCRIPT, case.dhelix_argv())
    try:
        setup = run.dhelix
        if case.seam:
            plan_with_a_seam(setup.runner)
        streamed = StreamedOutputCounter(setup.runner)
        deferred = {}
        with counted_embedding_waits(deferred):
            got = [observed_step(run, with_grads=True) for _ in range(steps)]
        trained = engine_record(run)
        eval_diff = abs(ref["eval"] - eval_loss(run))
        with run.active():
            num_microbatches = get_num_microbatches()
        return {"rows": compare_steps(ref["steps"], got),
                "executed": {"train": trained, "eval": engine_record(run)},
                "eval_loss_diff": eval_diff,
                "blocks": len(setup.runner.blocks),
                "plan_source": setup.plan_source,
                "num_microbatches": num_microbatches,
                "seam": setup.runner.seam is not None,
                "streamed_si_blocks": streamed.blocks,
                "deferred_reduces": deferred,
                "describe": setup.describe()}
    finally:
        run.close()


def refused_run(argv: list[str]) -> dict:
    """`build_run(SCRIPT, argv)` for a command line the plugin must refuse (every rank
    refuses alike): its exit code and the stderr lines it printed (rank 0 prints the
    `error:` line). Megatron's global state is torn down after."""
    from megatron_patches.step_harness import build_run, close_all_runs

    err = io.StringIO()
    code = "no refusal: the run was built"
    try:
        with contextlib.redirect_stderr(err):
            build_run(SCRIPT, argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        close_all_runs()
    return {"code": code, "stderr": err.getvalue().strip().splitlines()}


def pp1_parity(ctx, cases: dict, steps: int = 2, refusals: dict | None = None) -> dict:
    """For each case NAME -> `ParityCase`: stock Megatron and `--dhelix` from the same
    initial weights (same seed, same layout) and data; per-step comparison rows, the
    executor's records of training and evaluation (`engine_record`), the evaluation loss
    difference, the plan's block count and source, the micro-batch count, whether layer
    pairs met at a seam, and the plugin's one-line description of the plan. Cases with the
    same `megatron` arguments share one stock run (its steps do not depend on the case),
    built once and stepped `steps` times.
    Then each of `refusals` NAME -> DHelix arguments (added to `TINY + SGD`) is built and
    must be refused: report[NAME] = `refused_run`. Returns the report on every rank."""
    from megatron_patches.step_harness import build_run, close_all_runs

    shared = {}  # the cases of one stock command line, in order
    for name, case in cases.items():
        shared.setdefault(case.megatron, []).append(name)
    report = {}
    try:
        for names in shared.values():
            # stock runs stay alive to the end: every later run of their layout reuses
            # Megatron's process groups instead of creating them again
            stock = build_run(SCRIPT, cases[names[0]].stock_argv())
            ref = _reference(stock, steps)
            for name in names:
                report[name] = _dhelix_case(cases[name], ref, steps)
    finally:
        close_all_runs()
    for name, extra in (refusals or {}).items():
        report[name] = refused_run([*TINY, *TRAIN_ITERS, *SGD, *extra])
    dist.barrier()
    return report
