"""Rank bodies of the layout, folded-model and pipeline parity matrices on the Megatron-LM
plugin (tests/test_layout_parity.py, tests/folding/test_folded_parity.py,
tests/test_dhelix_pipeline.py). Every run is `scripts/pretrain_gpt.py` with Megatron
arguments (the tiny model `TINY` of tests/megatron_lm_ranks.py), set up by
`megatron.training.pretrain` and stepped by the test through the step harness
(`megatron_patches.step_harness`); weights move between layouts through Megatron's own
checkpoints (`save_checkpoint`, `--load`, torch_dist format). Module-level so
`dhelix.harness` pickles the bodies by name; one launch runs every matrix of a world size
(`four_rank_report`), because each process pays its imports."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch.distributed as dist

from megatron_patches.step_harness import close_all_runs
from tests.megatron_lm_ranks import SCRIPT, TINY, _global_loss, many_runs_env
from tests.plugin_parity_ranks import (StreamedOutputCounter, compare_steps,
                                      counted_embedding_waits, engine_record,
                                      eval_loss, observed_step)

SGD = ["--optimizer", "sgd", "--lr", "0.05"]


# ------------------------------------------------------------------------------- runs
def tiny_run(*extra: str):
    """A step-harness run of the tiny model with `extra` Megatron arguments (collective)."""
    from megatron_patches.step_harness import build_run

    return build_run(SCRIPT, TINY + ["--train-iters", "100", *extra])


def layout_args(tp: int = 1, pp: int = 1, sp: bool = False, distopt: bool = False) -> list:
    """Megatron's parallel arguments for one layout (DP is what the world leaves)."""
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if sp:
        argv.append("--sequence-parallel")
    if distopt:
        argv.append("--use-distributed-optimizer")
    return argv


def from_checkpoint(directory) -> list:
    """Arguments that load only the model weights of the checkpoint in `directory`
    (Megatron's `--finetune`: no optimizer or RNG state, iteration 0, data from sample 0)."""
    return ["--load", str(directory), "--finetune"]


def save_megatron_checkpoint(run, directory, weights_only: bool = False) -> None:
    """Megatron's `save_checkpoint` of `run` at its iteration into `directory` (`--save`),
    with the samples `train()` would have counted by then (the harness does not advance
    `args.consumed_train_samples`; a resumed run starts its data there). `weights_only`:
    no optimizer or scheduler state (what a run that has not stepped yet can save: the
    distributed optimizer has no state before its first step); such a checkpoint is for
    `from_checkpoint`. Collective."""
    from megatron.training.checkpointing import save_checkpoint

    with run.active():
        args = run.args
        args.save = str(directory)
        args.consumed_train_samples = run.iteration * args.global_batch_size
        save_checkpoint(run.iteration, run.model,
                        None if weights_only else run.optimizer,
                        None if weights_only else run.opt_param_scheduler, 0,
                        checkpointing_context={})


def full_params(run) -> dict:
    """Every full parameter of `run` by checkpoint key (host copies, `dhelix.parity`)."""
    from dhelix.parity import gather_full_tensors

    with run.active():
        return gather_full_tensors(run.model, "param")


def untag_sequence_parallel_norms(run) -> int:
    """Negative control for the SP LayerNorm trap: drop the `sequence_parallel` tag from
    the norm parameters, as a naively built torch norm would. Returns how many."""
    count = 0
    for chunk in run.model:
        for param in chunk.module.parameters():
            if getattr(param, "sequence_parallel", False):
                del param.sequence_parallel
                count += 1
    if count == 0:
        raise AssertionError("no sequence_parallel-tagged parameters to untag")
    return count


def _outcome(build) -> str:
    """'loaded' when `build()` returns; else the one-line refusal it ended with (the
    `error: ...` line rank 0 prints, without its prefix; elsewhere the exit code)."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build()
        return "loaded"
    except SystemExit as exc:
        lines = [line[len("error: "):] for line in err.getvalue().splitlines()
                 if line.startswith("error: ")]
        return lines[-1] if lines else f"exit code {exc.code}"


# --------------------------------------------------------------------- layout parity
def layout_parity_and_resume(workdir: Path, groups: dict, steps: int = 3) -> dict:
    """For each group `{name: {"extra_args": [...], "distopt": bool, "layouts": {name: spec}}}`:
    a reference TP1xPP1 (DP = world) run with the group's options saves its initial weights
    (a Megatron checkpoint), trains `steps` steps and saves again after 2; each layout loads
    the initial weights (`--finetune`) and trains on the same data, or (`spec["resume"]`)
    resumes the second checkpoint with its optimizer state (`--load`). With
    `group["try_optimizer_load"]` a reference-layout run also resumes that checkpoint with
    its optimizer state, recorded under `<group>_optimizer_load` ("loaded" or why not).

    Returns (on every rank) {layout_name: [per-step comparison rows]}."""
    report = {}
    for group_name, group in groups.items():
        root = workdir / group_name
        extra = list(group.get("extra_args", ()))
        distopt = group.get("distopt", False)
        ref = tiny_run(*layout_args(distopt=distopt), *extra)
        save_megatron_checkpoint(ref, root / "init", weights_only=True)
        ref_steps = []
        for k in range(steps):
            ref_steps.append(observed_step(ref, with_grads=not distopt))
            if k == 1:
                save_megatron_checkpoint(ref, root / "resume")
        if group.get("try_optimizer_load"):
            report[f"{group_name}_optimizer_load"] = _outcome(lambda: tiny_run(
                *layout_args(distopt=distopt), *extra, "--load", str(root / "resume")))
        close_all_runs()
        for name, spec in group["layouts"].items():
            layout = layout_args(spec["tp"], spec["pp"], spec.get("sp", False),
                                 spec.get("distopt", False))
            load = (["--load", str(root / "resume")] if spec.get("resume")
                    else from_checkpoint(root / "init"))
            run = tiny_run(*layout, *extra, *load)
            if spec.get("untag_sp_norms"):
                untag_sequence_parallel_norms(run)
            expected = ref_steps[run.iteration:]
            # With the distributed optimizer each DP rank holds only its reduce-scattered
            # grad shard, so such runs are compared through losses and updated params.
            with_grads = not spec.get("distopt", False)
            got = [observed_step(run, with_grads) for _ in expected]
            report[name] = compare_steps(expected, got)
            close_all_runs()
    return report


# --------------------------------------------------------------------- folded parity
class _Replay:
    """The first global batch of a run's data iterator, replayed for every fresh step (the
    iterator stays None on ranks that read no data)."""

    def __init__(self, run, microbatches: int):
        it = run.data_iterator
        self.batches = None if it is None else [next(it) for _ in range(microbatches)]

    def fresh(self):
        return None if self.batches is None else iter(self.batches)


def _counting_si():
    from dhelix.schedules.executor import AutogradPasses
    from dhelix.schedules.runner import chunk_forward

    class CountingSI(AutogradPasses):
        """Autograd passes that count the SI blocks they run (forward, then backward)."""

        def __init__(self, model):
            super().__init__(chunk_forward(model))
            self.blocks = 0

        def si(self, forward, backward, produced=None):
            self.blocks += 1
            return super().si(forward, backward, produced)

    return CountingSI


def _fresh_step(run, replay: _Replay, schedule=None) -> tuple[float, dict]:
    """One forward/backward of the first global batch with `schedule` (a function with
    Megatron's forward_backward_func signature; default the run's own): (global loss, full
    grads by checkpoint key)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from dhelix.parity import gather_full_tensors

    own = run.forward_backward_func
    # wrapped as pretrain() wraps its data iterators (the rerun state machine replays them)
    run.data_iterator = RerunDataIterator(replay.fresh())
    run.forward_backward_func = schedule or own
    try:
        losses = run.forward_backward()
    finally:
        run.forward_backward_func = own
    with run.active():
        return _global_loss(losses), gather_full_tensors(run.model, "grad")


def _stock_embedding_group_rejected(stock) -> list:
    """Build the folded model under the stock run's parallel state (Megatron's default
    embedding group: first and last stage): [(stage, raised FoldedModelError)] of every
    rank."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block

    from dhelix.folding import FoldedLayout
    from megatron_patches.folded_model import FoldedGPTModel, FoldedModelError

    with stock.active():
        args = stock.args
        stage = parallel_state.get_pipeline_model_parallel_rank()
        try:
            FoldedGPTModel(config=stock.config, transformer_layer_spec=get_gpt_layer_local_spec(),
                           final_norm=transformer_block.LayerNormImpl,
                           layout=FoldedLayout(args.num_layers, args.pipeline_model_parallel_size),
                           stage=stage, vocab_size=args.padded_vocab_size,
                           max_sequence_length=args.max_position_embeddings, seed=args.seed)
            raised = False
        except FoldedModelError:
            raised = True
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, raised))
    return everyone


def folded_parity(workdir: Path, cases: dict) -> dict:
    """For each case `{name: {"tp", "pp", "sp", "extra", "back": (tp, pp)}}`:

    - stock Megatron (TP x PP) saves its initial weights and runs its own 1F1B over the
      first global batch: the reference loss and gradients; the same model runs the 1F1B
      action lists through the executor;
    - the `--dhelix` run (the folded model, same TP x PP) loads the stock checkpoint
      (params compared), then runs the sequential folded schedule and the W-shaped schedule
      (SI blocks executed forward-then-backward) over the same batch, each compared with
      the reference;
    - the folded model takes an optimizer step and saves; a stock run with the `back`
      TP x PP loads that checkpoint (params compared with the folded model's);
    - building the folded model under Megatron's default embedding group (first and last
      stage) is refused on the stages in that group.

    Returns {name: {measure: value}} on every rank."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from dhelix.parity import max_abs_diff
    from dhelix.schedules.actions import PipelinePath
    from dhelix.schedules.one_f_one_b import build_1f1b_schedule
    from dhelix.schedules.runner import ScheduleEngine
    from dhelix.schedules.sequential import build_sequential_schedule
    from dhelix.schedules.w_schedule import build_w_schedule

    folded_schedules = {
        "sequential": lambda p, m: build_sequential_schedule(PipelinePath.folded(p), m),
        "w": build_w_schedule,
    }
    counting_si = _counting_si()
    report = {}
    for name, case in cases.items():
        root = workdir / name
        row = {}
        layout = layout_args(case["tp"], case["pp"], case.get("sp", False))
        extra = list(case.get("extra", ()))
        stock = tiny_run(*layout, *extra)
        with stock.active():
            m = get_num_microbatches()
        save_megatron_checkpoint(stock, root / "stock_init", weights_only=True)
        init_params = full_params(stock)
        replay = _Replay(stock, m)
        ref_loss, ref_grads = _fresh_step(stock, replay)
        row["loss_ref"] = ref_loss
        executor_1f1b = ScheduleEngine(build_1f1b_schedule, data_args=stock.args)
        loss, grads = _fresh_step(stock, replay, executor_1f1b.forward_backward)
        row["exec_1f1b_loss_diff"] = abs(loss - ref_loss)
        row["exec_1f1b_grad_diff"], _ = max_abs_diff(ref_grads, grads)
        row["stock_embedding_group"] = _stock_embedding_group_rejected(stock)
        close_all_runs()

        folded = tiny_run(*layout, *extra, "--dhelix", *from_checkpoint(root / "stock_init"))
        row["load_stock_param_diff"], _ = max_abs_diff(init_params, full_params(folded))
        replay = _Replay(folded, m)
        for sched_name, builder in folded_schedules.items():
            counter = counting_si(folded.model[0])
            engine = ScheduleEngine(builder, passes=counter, data_args=folded.args)
            loss, grads = _fresh_step(folded, replay, engine.forward_backward)
            row[f"{sched_name}_si_blocks"] = counter.blocks
            row[f"{sched_name}_loss_diff"] = abs(loss - ref_loss)
            row[f"{sched_name}_grad_diff"], row[f"{sched_name}_grad_key"] = max_abs_diff(
                ref_grads, grads)
        with folded.active():
            folded.optimizer.step()
        folded.iteration += 1
        stepped = full_params(folded)
        row["step_changed_params"], _ = max_abs_diff(init_params, stepped)
        save_megatron_checkpoint(folded, root / "folded_step")
        close_all_runs()

        back_tp, back_pp = case["back"]
        back = tiny_run(*layout_args(back_tp, back_pp), *extra,
                        *from_checkpoint(root / "folded_step"))
        row["folded_to_stock_param_diff"], _ = max_abs_diff(stepped, full_params(back))
        row["microbatches"] = m
        row["pp"] = case["pp"]
        report[name] = row
        close_all_runs()
    return report


# ------------------------------------------------------------------- pipeline parity
class PairCounter:
    """Wraps a `LayerRunner.run_paired` to count the layer pairs co-executed on this rank."""

    def __init__(self, runner):
        self.pairs = 0
        self._run_paired = runner.run_paired
        runner.run_paired = self

    def __call__(self, fwd_layers, *args, **kwargs):
        self.pairs += len(fwd_layers)
        return self._run_paired(fwd_layers, *args, **kwargs)


def dhelix_pipeline_parity(cases: dict, steps: int = 3) -> dict:
    """For each case {name: {"tp", "pp", "sp", "pairer", "extra", "dhelix_extra" (the
    `--dhelix` run's own arguments)}}: stock Megatron (TP x PP,
    Megatron's own 1F1B schedule) and `--dhelix` (folded model, W-shaped schedule,
    operator-level SI blocks) are each built from the same --seed (no checkpoint passes
    weights between them) and train `steps` SGD steps on the same data. `init_param_diff`
    compares every initial parameter by checkpoint key; per-step rows compare the loss,
    every gradient and every updated parameter; then one forward-only global batch each.

    Returns {name: {"init_param_diff", "init_param_key", "rows", "pairs" (co-executed layer
    pairs per rank), "m", "p", "steps", "embedding_waits" (per rank: deferred embedding
    all-reduces waited on, `counted_embedding_waits`), "streamed" (per rank: (SI blocks run
    streamed, outputs they reported early), `StreamedOutputCounter`), "plan_costs" (per
    rank: what the benchmark's predicted step reads, `scripts.bench_dhelix_pp1._plan_costs`),
    "describe" (the plan line, of this rank), "executed", "eval_loss_diff"}}."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from dhelix.parity import max_abs_diff
    from scripts.bench_dhelix_pp1 import _plan_costs

    report = {}
    for name, spec in cases.items():
        argv = [*layout_args(spec["tp"], spec["pp"], spec.get("sp", False)), *SGD,
                *spec.get("extra", ())]
        ref = tiny_run(*argv)
        ref_init = full_params(ref)
        ref_steps = [observed_step(ref, with_grads=True) for _ in range(steps)]
        ref_eval = eval_loss(ref)
        close_all_runs()
        run = tiny_run(*argv, "--dhelix", "--dhelix-pairer", spec.get("pairer", "dp"),
                       *spec.get("dhelix_extra", ()))
        init_diff, init_key = max_abs_diff(ref_init, full_params(run))
        counter = PairCounter(run.dhelix.runner)
        streamed = StreamedOutputCounter(run.dhelix.runner)
        deferred = {}
        with counted_embedding_waits(deferred):
            got = [observed_step(run, with_grads=True) for _ in range(steps)]
        trained = engine_record(run)
        eval_diff = abs(ref_eval - eval_loss(run))
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, counter.pairs)
        embedding_waits = [None] * dist.get_world_size()
        dist.all_gather_object(embedding_waits, deferred.get("embedding", 0))
        streamed_counts = [None] * dist.get_world_size()
        dist.all_gather_object(streamed_counts, (streamed.blocks, streamed.early_outputs))
        plan_costs = [None] * dist.get_world_size()  # what the benchmark's prediction reads
        dist.all_gather_object(plan_costs, _plan_costs(run))
        with run.active():
            m = get_num_microbatches()
        report[name] = {"init_param_diff": init_diff, "init_param_key": init_key,
                        "rows": compare_steps(ref_steps, got), "pairs": pairs,
                        "m": m, "p": spec["pp"], "steps": steps,
                        "embedding_waits": embedding_waits, "streamed": streamed_counts,
                        "plan_costs": plan_costs, "describe": run.dhelix.describe(),
                        "executed": {"train": trained, "eval": engine_record(run)},
                        "eval_loss_diff": eval_diff}
        close_all_runs()
    return report


# ------------------------------------------------------------------------ launches
def pipeline_matrices(ctx, workdir: str, layout_groups: dict, folded_cases: dict,
                      pipeline_cases: dict) -> dict:
    """Every matrix of one launch, in turn (an empty dict skips one): {"layout": ...,
    "folded": ..., "pipeline": ...} on every rank. Each matrix closes every run (and its
    process groups, `close_all_runs`) as soon as it has what it needs from it."""

    root = Path(workdir)
    report = {}
    try:
        if layout_groups:
            report["layout"] = layout_parity_and_resume(root / "layout", layout_groups)
        if folded_cases:
            report["folded"] = folded_parity(root / "folded", folded_cases)
        if pipeline_cases:
            report["pipeline"] = dhelix_pipeline_parity(pipeline_cases)
    finally:
        close_all_runs()
    dist.barrier()
    return report


_FOUR_RANK: dict = {}  # "report" or "error": the one 4-rank launch's outcome in this process


def four_rank_report() -> dict:
    """The one 4-rank launch of the layout, folded and pipeline matrices (the cases of
    tests/test_layout_parity.py, tests/folding/test_folded_parity.py and
    tests/test_dhelix_pipeline.py), run once per pytest process whichever of them asks
    first; rank 0's report. A failed launch is not retried: its error is raised again."""
    from dhelix.harness import run_on_ranks
    from tests.folding.test_folded_parity import CASES as FOLDED
    from tests.test_dhelix_pipeline import CASES_4 as PIPELINE
    from tests.test_layout_parity import GROUPS as LAYOUT

    if "error" in _FOUR_RANK:
        raise _FOUR_RANK["error"]
    if "report" not in _FOUR_RANK:
        try:
            with tempfile.TemporaryDirectory(prefix="dhelix-pipeline-matrices-") as workdir:
                _FOUR_RANK["report"] = run_on_ranks(
                    pipeline_matrices, 4, workdir, LAYOUT, FOLDED, PIPELINE, timeout_s=600,
                    env={"OMP_NUM_THREADS": "1", **many_runs_env()})[0]
        except Exception as exc:
            _FOUR_RANK["error"] = exc
            raise
    return _FOUR_RANK["report"]


def peak_memory(ctx, argv: list) -> dict:
    """Stock Megatron and `--dhelix` built from `argv` (TINY plus `argv`): this rank's peak
    tensor bytes of one forward/backward each (`dhelix.memtrace.measure_peak`), and the
    bytes one layer's forward holds for its backward in the `--dhelix` run."""
    from dhelix.memtrace import measure_peak
    from scripts.bench_dhelix_pp1 import _layer_activation_bytes

    try:
        memory = {}
        runs = {"megatron": tiny_run(*argv), "dhelix": tiny_run(*argv, "--dhelix")}
        for name, run in runs.items():
            dist.barrier()
            with run.active():
                _, reading = measure_peak(run.forward_backward)
            memory[name] = reading.compute_peak_bytes
        with runs["dhelix"].active():
            layer = _layer_activation_bytes(runs["dhelix"])
    finally:
        close_all_runs()
    dist.barrier()
    return {"rank": ctx.rank, "memory": memory, "layer_activation_bytes": layer}
