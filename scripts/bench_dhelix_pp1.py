#!/usr/bin/env python
"""Side-by-side step time and peak memory: Megatron's no-pipelining schedule vs `--dhelix`
(PP=1), same model, weights, data and launch, repetitions interleaved (A B A B ...) so
machine noise hits both alike. Prints one table with the ratios.

Local (spawned gloo ranks; the tiny model, `dhelix.bench.systems.tiny_model()`):
    .venv/bin/python scripts/bench_dhelix_pp1.py --world-size 2 -- --num-layers 4 \
        --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
        --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 \
        --tensor-model-parallel-size 2 --sequence-parallel
Under torchrun (e.g. inside scripts/emulated_cluster.py, so TP crosses a shaped link):
    torchrun ... scripts/bench_dhelix_pp1.py -- <the same Megatron arguments>

Each system is `scripts/pretrain_gpt.py` set up by `megatron.training.pretrain` under the
plugin (`megatron_patches.step_harness`) with `dhelix.bench.systems.RUN_ARGS` (mock data, no
dropout, ...) before the given arguments, stepped by Megatron's own `train_step`.

Memory: peak bytes of tensor storage allocated by the compute thread during one
forward/backward (`dhelix.memtrace`), for both schedules, next to the target without
pipelining: Megatron's peak x 1.05 (what the DP's memory bound, `planner.memory`, aims at;
`tests/test_dhelix_memory.py` checks x 1.10 + the tied gradient, CPU readings being noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _layer_activation_bytes(run) -> int:
    """Bytes one layer's forward program holds for its backward (its saved activations), for
    the `--dhelix` run `run` (a `PretrainedRun`), on its model's device."""
    import torch

    from dhelix.devices import model_device

    setup, args = run.dhelix, run.args
    execution = setup.runner.new_execution(0)
    tp = args.tensor_model_parallel_size
    seq = args.seq_length // tp if args.sequence_parallel else args.seq_length
    with run.active():
        x = torch.zeros(seq, args.micro_batch_size, args.hidden_size,
                        device=model_device(setup.parts.model))
        rope = None
        if args.position_embedding_type == "rope":
            rope = setup.parts.model.rotary_pos_emb(args.seq_length)
        execution.begin_forward(x, None, rope)
        for op in setup.runner.fwd_order:
            execution.run(op)
        execution.end_forward()
    total, seen = 0, set()
    for name in execution.live_values():
        value = execution.get(name)
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


DEFAULT_SYSTEMS = {"megatron": [], "dhelix": ["--dhelix"]}


def _device_clock() -> float:
    """`Timeline.block_clock` for the bench: under the GPU emulation the emulated stream's
    (`GpuEmulationMode.stream_time`: when the kernels issued so far end), else now."""
    from dhelix.gpu_emulation.regions import active_mode

    mode = active_mode()
    return mode.stream_time() if mode is not None else time.perf_counter()


def _timeline_step(run, calls, name: str) -> dict:
    """One more forward/backward of the `--dhelix` run `run` (system `name`, run through
    `calls`, a `_Calls`) with the compute thread's spans recorded (`dhelix.runtime.timeline`):
    seconds of compute, collective issue, waiting on collectives, block barriers, the
    step's wall time, where the thread was held longest (`Timeline.held_longest`), under the
    GPU emulation where its stream sat empty longest (`idle_longest`: `Timeline.idle_by_span`
    of the call's `GpuEmulationMode.idle_gaps`; None without the emulation) and where the
    link carried no collective (`link_idle`: `link_record.LinkIdle` as a dict of ms over
    the step's wall time; None without the emulation), and per
    block of the plan its median ms over the step's layer pairs on the device's clock
    (`block_ms`: [index, ms, pairs] rows; `_device_clock`) beside what the plan's cost model
    gives it (`planned_block_ms`, `planner.cosched.simulate_block`; None without a cost
    model); no blocks for a mixed dense/MoE stack, whose layer pairs follow plans of their
    own."""
    import torch.distributed as dist

    from dhelix.gpu_emulation.link_record import link_idle
    from dhelix.runtime.timeline import Timeline
    from planner.cosched import simulate_block

    runner = run.dhelix.runner
    runner.timeline = Timeline(block_clock=_device_clock)
    dist.barrier()
    start = time.perf_counter()
    calls(f"{name}.timeline", run, run.forward_backward)
    elapsed = time.perf_counter() - start
    totals = runner.timeline.totals()
    held = runner.timeline.held_longest()
    # under the emulation: where its stream sat empty, by the span the host was in
    idle = (runner.timeline.idle_by_span(calls.last_idle_gaps)
            if calls.emulation is not None else None)
    # under the emulation: where the link carried none of the step's collectives
    link = (dataclasses.asdict(link_idle(calls.last_link_spans, start, start + elapsed))
            if calls.emulation is not None else None)
    setup = run.dhelix
    # a mixed dense/MoE stack's layer pairs follow different plans: no blocks by index
    mixed = setup.pair_plans is not None and len(setup.pair_plans) > 1
    blocks = [] if mixed else [[index, ms, pairs] for index, (ms, pairs)
                               in runner.timeline.block_ms().items()]
    runner.timeline = None
    planned = None
    if not mixed and setup.costs is not None and setup.plan is not None:
        planned = [simulate_block(b.fwd, b.bwd, setup.costs).ms for b in setup.plan.blocks]
    return {**totals, "step_s": elapsed, "held_longest": held, "idle_longest": idle,
            "link_idle": link, "block_ms": blocks, "planned_block_ms": planned}


def _w_si_blocks(run, microbatches: int) -> list:
    """The SI actions of this rank's stage in the training schedule the run's engine runs
    for `microbatches` (the W schedule: `ScheduleEngine.schedule`, built once), in the
    order the stage runs them."""
    from megatron.core import parallel_state

    with run.active():
        stage = parallel_state.get_pipeline_model_parallel_rank()
    schedule = run.dhelix.engine.schedule(run.args.pipeline_model_parallel_size,
                                          microbatches, forward_only=False)
    return [action for action in schedule.ranks[stage] if action.kind == "SI"]


def _plan_costs(run) -> dict:
    """What the plan of the `--dhelix` run `run` predicts per paired layer (sequential and
    planned ms), and how many layer pairs one step pairs on this rank: (micro-batches - 1) x
    local layers without pipelining; with it, the SI blocks of this stage's W list
    (`si_blocks_per_step`) x the layers of a model chunk (the lone passes of the W's ramps
    pair nothing). With the cost model at hand (a plan built at start-up), also
    `sequential_executed_ms`: the same layer's forward then backward in the sequential
    row's orders (program orders) as the strand executor runs each alone, its collectives in
    flight while the strand computes what does not read them
    (`planner.cosched.strand_alone_ms`); `sequential_ms` is the plain sum of the solo
    times. With streamed SI blocks (`--dhelix-streamed`), `planned_ms` is the streamed
    schedule's simulated time a layer pair (`planner.streamed`) and there are no seams. With a
    seam between layer pairs (`planner.blocks.layer_seam`): how much each seam
    saves by the block model (the head's and tail's blocks against the seam block) and how
    many a step has ((m - 1) x (layers - 1) without pipelining). With the cost model and
    without pipelining, also `layer_comm_ms` (the solo times of one layer's forward and
    backward collectives, summed), `layers_per_step` (m x layers) and `costs_source`
    ("profile" or "analytic"): the layers' communication a step carries, which the
    report's overlap floor charges where the times were measured; and
    `first_forward_unhidden_ms` / `first_forward_comm_ms`: what the collectives of the
    step's first forward (this rank's layers, run with no partner) keep it waiting at
    least, and their solo times, for the SI schedule's floor beside it."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from dhelix.runtime.setup import si_block_pairs
    from planner.baselines import sequential_pairing
    from planner.cosched import simulate_block, strand_alone_ms, unhidden_alone_ms
    from planner.pipeline_transfers import exposed_ms, transfer_exposure

    setup, args = run.dhelix, run.args
    plan, seam = setup.plan, setup.runner.seam
    layer_runs = si_blocks = None
    with run.active():
        microbatches = get_num_microbatches()
    if args.pipeline_model_parallel_size == 1:
        layers = len(setup.runner.bound_layers)
        pairs = (microbatches - 1) * layers
        layer_runs = microbatches * layers
        seams = (microbatches - 1) * (layers - 1) if seam is not None else 0
        # every SI block's forward strand starts with the embedding
        embedding_blocks = microbatches - 1
    else:  # the W schedule: each SI block pairs one model chunk's layers
        si_blocks = _w_si_blocks(run, microbatches)
        layers = max(si_block_pairs(setup.parts))
        pairs = len(si_blocks) * layers
        seams = len(si_blocks) * (layers - 1) if seam is not None else 0
        # only the first hop's forward (stage 0) starts with the embedding
        embedding_blocks = sum(action.forward.hop == 0 for action in si_blocks)
    planned = plan.planned_ms
    streamed = setup.runner.streamed
    if streamed is not None:  # the streamed schedule's time a pair, no seams
        planned = streamed.for_pairs(max(si_block_pairs(setup.parts))).pair_ms
        seams = 0
    out = {"sequential_ms": plan.sequential_ms, "planned_ms": planned,
           "paired_layers_per_step": pairs, "seams_per_step": seams}
    if setup.costs is None:
        return out
    dags = setup.runner.bound_layers[0].programs.dags()
    fwd, bwd = dags["fwd"].by_id(), dags["bwd"].by_id()
    # the orders the sequential row runs (`planner.baselines.sequential_pairing`), not the
    # plan's: a plan's reordered strand (a wgrad moved away from its all-reduce) takes
    # longer alone, which made the saving look larger than the sequential row would see
    sequential = sequential_pairing(dags["fwd"], dags["bwd"])
    out["sequential_executed_ms"] = (
        strand_alone_ms(sequential.fwd_order, fwd, setup.costs, "fwd", bwd)
        + strand_alone_ms(sequential.bwd_order, bwd, setup.costs, "bwd", fwd))
    same_layers = all(set(layer.programs.dags()["fwd"].by_id()) == set(fwd)
                      for layer in setup.runner.bound_layers)
    comm_f = [o for o, node in fwd.items() if node.kind == "comm"]
    fwd_comm_ms = sum(setup.costs.solo_f[o] for o in comm_f)
    # the solo times of one layer's forward and backward collectives, summed
    layer_comm_ms = fwd_comm_ms + sum(setup.costs.solo_b[o] for o, node in bwd.items()
                                      if node.kind == "comm")
    if layer_runs is not None and same_layers:  # a mixed stack's layers differ: not summed
        out["layers_per_step"] = layer_runs
        out["costs_source"] = setup.costs.source
        out["layer_comm_ms"] = layer_comm_ms
        # the step's first forward runs alone: what its layers' collectives keep it waiting
        # at least (`planner.cosched.unhidden_alone_ms`), and their solo times
        out["first_forward_unhidden_ms"] = layers * unhidden_alone_ms(dags["fwd"],
                                                                      setup.costs.solo_f)
        out["first_forward_comm_ms"] = layers * fwd_comm_ms
    if si_blocks and setup.transfer_ms is not None:
        # the pipeline transfers' exposure a W SI block leaves (`planner.pipeline_transfers`):
        # the sequential pairing (the sequential row's orders: the whole backward strand,
        # then the whole forward) against this run's plan or streamed sequence
        sequential_exposed = exposed_ms(
            setup.transfer_ms,
            tail_ms=layers * strand_alone_ms(sequential.fwd_order, fwd, setup.costs, "fwd", bwd),
            head_ms=layers * strand_alone_ms(sequential.bwd_order, bwd, setup.costs, "bwd", fwd))
        exposed = (streamed.for_pairs(layers).exposed_ms if streamed is not None
                   else transfer_exposure(plan, setup.transfer_ms).exposed_ms)
        out["si_blocks_per_step"] = len(si_blocks)
        out["transfer_saving_ms"] = sequential_exposed - exposed
    if getattr(setup.engine.passes, "defer_embedding_reduce", False):
        # the embedding's all-reduce travels while the SI block's backward strand computes
        # (`megatron_patches.deferred_reduce`): it takes the solo time of a layer's forward
        # all-reduce (the same [s, b, h] tensor on the same group) off the SI block, at most
        # the time the link idles in the block (the planned layer pairs less their
        # collectives' solo times): where the link is busy all along, the all-reduce only
        # moves, it saves nothing. Started at a later block (`early_input_block`, the memory
        # bound's), it misses the share of that idle time in the blocks before; streamed,
        # it travels only beside the backward entries from its start (`input_step`) to the
        # first forward entry, which waits for it (their solo times)
        if comm_f:
            idle = layers * max(0.0, planned - layer_comm_ms)  # in one SI block
            start = setup.runner.early_input_block or 0
            if start and streamed is None and planned > 0:
                before = sum(block.predicted_ms for block in plan.blocks[:start])
                idle *= max(0.0, 1.0 - before / (layers * planned))
            if streamed is not None:
                sequence = streamed.for_pairs(max(si_block_pairs(setup.parts)))
                idle = min(idle, sum(setup.costs.solo_b[step.op]
                                     for step in sequence.sequence[
                                         sequence.input_step:sequence.first_forward_step]
                                     if bwd[step.op].kind != "comm"))
            out["embedding_reduces_hidden_per_step"] = embedding_blocks
            out["embedding_reduce_saving_ms"] = min(setup.costs.solo_f[comm_f[0]], idle)
    if seam is not None:
        apart = sum(b.predicted_ms for b in plan.blocks[:seam.head]) + sum(
            b.predicted_ms for b in plan.blocks[len(plan.blocks) - seam.tail:])
        out["seam_saving_ms"] = apart - simulate_block(seam.block.fwd, seam.block.bwd,
                                                       setup.costs).ms
    return out


def _link_floor(run, calls, repeats: int = 3) -> dict:
    """The collectives of one forward/backward of `run` (a `PretrainedRun`: Megatron's
    schedule for the megatron system, run through `calls`, a `_Calls`;
    `dhelix.bench.link_floor`), replayed `repeats` times
    one at a time and all at once (interleaved, behind a barrier): their count, tensor bytes,
    the c10d calls not replayed, this rank's seconds per replay and the bytes the replay's
    buffers held (`ReplayBuffers.nbytes`)."""
    import torch.distributed as dist

    from dhelix.bench.link_floor import ReplayBuffers, record_collectives, replay

    _, collectives, skipped = record_collectives(
        lambda: calls("megatron.link_floor", run, run.forward_backward))
    out = {"collectives": len(collectives),
           "tensor_bytes": sum(c.tensor_bytes for c in collectives),
           "skipped": sorted(set(skipped)), "one_at_a_time_s": [], "all_at_once_s": []}
    buffers = ReplayBuffers()  # one set for every replay, freed on return
    for _ in range(repeats):
        for key, all_at_once in (("one_at_a_time_s", False), ("all_at_once_s", True)):
            dist.barrier()
            out[key].append(replay(collectives, all_at_once, buffers))
    out["buffer_bytes"] = buffers.nbytes()
    return out


def build_runs(megatron_args: list, systems: dict) -> dict:
    """Every rank of the job (torchrun's environment or `dhelix.harness` ranks; the process
    group is Megatron's, created by the first run): one `PretrainedRun` per system (name ->
    extra Megatron arguments after `RUN_ARGS + megatron_args`), each set up by
    `megatron.training.pretrain` for `scripts/pretrain_gpt.py` under the plugin
    (`megatron_patches.step_harness.build_run`) with the same seed, so the same initial
    weights and data.

    Systems with the same layout share Megatron's process groups (only the folded model's
    embedding group differs, and a layout change builds new ones) and the `--dhelix` systems
    their lane groups (the harness's `LanePool`): every idle gloo group costs the running one
    (its transport thread wakes every 10 ms; 60 idle groups made Megatron's step 5-17%
    longer). Close the runs with `close_all_runs()` when done."""
    from dhelix.bench.systems import RUN_ARGS
    from dhelix.launch import PRETRAIN_SCRIPT
    from megatron_patches.step_harness import build_run

    return {name: build_run(str(PRETRAIN_SCRIPT), [*RUN_ARGS, *megatron_args, *extra])
            for name, extra in systems.items()}


def _loss(outcome):
    """The global batch's mean 'lm loss' of a `StepOutcome`, None on a stage without it."""
    value = outcome.loss_dict.get("lm loss")
    return None if value is None else float(value)


class _Calls:
    """How bench_body runs a call that runs a model: as it is, or (`emulation`, a
    `dhelix.gpu_emulation.emulated_run.GpuEmulation`'s fields) under the GPU emulation
    (`emulated_run.emulated_call` on the run's model chunks), recording each call's
    modelled kernel ms and the ms its emulated stream sat empty between kernels
    (`EmulationReport.stream_idle_s`) per system. The calls share one record of the
    collectives' durations (`collective_clock.CollectiveDurations`)."""

    def __init__(self, emulation: dict | None):
        self.emulation = self.model = self.durations = None
        self.modelled_ms: dict = {}
        self.stream_idle_ms: dict = {}
        self.step_terms: dict = {}
        self.last_idle_gaps: list = []  # the last emulated call's `idle_gaps`
        self.last_link_spans: list = []  # and its `link.spans()`
        if emulation is not None:
            from dhelix.gpu_emulation.emulated_run import GpuEmulation
            from dhelix.gpu_emulation.options import mark_process

            from dhelix.gpu_emulation.collective_clock import CollectiveDurations

            self.emulation = GpuEmulation(**emulation)
            self.model = self.emulation.kernel_model()
            self.durations = CollectiveDurations()
            # a --dhelix-profile taken on the emulated GPU fits these ranks, not a real run
            mark_process(self.emulation.profile, self.emulation.time_scale)

    def megatron_args(self, args: list) -> list:
        """`args`, under the emulation with what reads tensor values left out (kernel
        outputs are garbage under the mode): the data loader's attention mask
        (`--no-create-attention-mask-in-dataloader`: the attention builds its causal mask
        itself; `--dhelix`'s causal-mask check would refuse a garbage one) and Megatron's
        NaN check of the loss and gradients (`--no-check-for-nan-in-loss-and-grad`)."""
        if self.emulation is None:
            return args
        return [*args, "--no-create-attention-mask-in-dataloader",
                "--no-check-for-nan-in-loss-and-grad"]

    def building(self):
        """The context to build the runs in: none, or under the emulation
        `GpuEmulation.building` (nothing computed or touched)."""
        if self.emulation is None:
            return contextlib.nullcontext()
        return self.emulation.building(self.model)

    def __call__(self, name: str, run, fn):
        if self.emulation is None:
            return fn()
        from dhelix.gpu_emulation.emulated_run import emulated_call

        with emulated_call(run.model, self.model, self.emulation.config(),
                           self.durations) as mode:
            out = fn()
        report = mode.report()
        self.last_idle_gaps = mode.idle_gaps()
        self.last_link_spans = mode.link.spans()
        self.modelled_ms.setdefault(name, []).append(report.modelled_ms)
        self.stream_idle_ms.setdefault(name, []).append(report.stream_idle_s * 1e3)
        if name not in self.step_terms:  # the first call of a system: its first step
            self.step_terms[name] = {term: [t.count, round(t.modelled_ms, 3)]
                                     for term, t in report.by_term.items()}
        return out

    def describe(self) -> dict | None:
        """What the report states: the profile, S, the overlap slowdown and the modelled ms
        and stream-idle ms of every emulated call per system (steps first, in order), each
        system's first step by term ([kernels, modelled ms]), or None."""
        if self.emulation is None:
            return None
        return {"profile": self.emulation.profile, "time_scale": self.emulation.time_scale,
                "overlap_slowdown": self.emulation.overlap_slowdown,
                "host_latency_ms": self.model.host_latency_ms,
                "modelled_ms": self.modelled_ms, "stream_idle_ms": self.stream_idle_ms,
                "step_terms": self.step_terms}


def bench_body(ctx, megatron_args: list, repeats: int, warmup: int,
               systems: dict | None = None, emulation: dict | None = None,
               measure_link_floor: bool = True) -> dict:
    """Every rank: build one run per system (`build_runs`; `systems`: name -> extra
    arguments added to `megatron_args`; default Megatron and `--dhelix`) from the same seed,
    so the same initial weights and data; then `warmup` + `repeats` rounds, each one
    training step (`PretrainedRun.train_step`, Megatron's `train_step`) of every system in
    turn (interleaved, behind a barrier), then one measured forward/backward per system for
    peak memory, then Megatron's communication alone (`_link_floor`; not with
    `measure_link_floor` False: "link_floor" None), then one recorded
    forward/backward per DHelix-runtime system (`_timeline_step`). Returns this rank's step
    times (measured rounds only), peak bytes, the link floor readings and, per system using
    the DHelix runtime, its plan description and timeline totals; for the `dhelix` system
    also its plan's blocks (`plan_block_ops`: each block's forward and backward operator
    ids; the block plan, which a run choosing streamed SI blocks does not follow; a mixed
    dense/MoE stack's first layer pair's). Closes every run.

    `emulation` (`dhelix.gpu_emulation.emulated_run.GpuEmulation`'s fields): every call
    that runs a model (steps, the memory and recorded forward/backwards, the link floor's
    recording, the activation count) runs under the GPU emulation (`_Calls`); the result's
    "gpu_emulation" says so, with each call's modelled kernel ms."""
    import torch.distributed as dist

    from dhelix.bench.cpu_time import CpuTimes
    from dhelix.memtrace import measure_peak
    from megatron_patches.step_harness import close_all_runs

    calls = _Calls(emulation)
    with calls.building():
        runs = build_runs(calls.megatron_args(megatron_args), systems or DEFAULT_SYSTEMS)
    times = {name: [] for name in runs}
    first_loss = {}  # every system's first step (same weights and data: equal losses)
    # where a measured step went: forward/backward (what a recorded step covers), the
    # optimizer step, and the rest (loss reduction across ranks, memory reading)
    # and how the compute thread spent the step (`dhelix.bench.cpu_time`)
    parts = {name: {"forward_backward": [], "optimizer": [], "rest": []} for name in runs}
    for i in range(warmup + repeats):
        for name, run in runs.items():
            dist.barrier()
            cpu_before = CpuTimes.now()
            start = time.perf_counter()
            outcome = calls(name, run, run.train_step)
            elapsed = time.perf_counter() - start
            cpu = CpuTimes.now().since(cpu_before)
            if i == 0:
                first_loss[name] = _loss(outcome)
            if i >= warmup:
                times[name].append(elapsed)
                fb = outcome.forward_backward_s
                parts[name]["forward_backward"].append(fb)
                parts[name]["optimizer"].append(outcome.step_s - fb)
                parts[name]["rest"].append(elapsed - outcome.step_s)
                for key, value in cpu.items():
                    if value is not None:
                        parts[name].setdefault(key, []).append(value)
    memory = {}
    for name, run in runs.items():
        dist.barrier()
        with run.active():
            _, reading = measure_peak(lambda: calls(f"{name}.memory", run,
                                                    run.forward_backward))
        memory[name] = reading.compute_peak_bytes
    megatron = runs.get("megatron")
    link_floor = (_link_floor(megatron, calls) if megatron is not None and measure_link_floor
                  else None)
    first = next(iter(runs.values()))
    result = {"rank": ctx.rank, "times": times, "step_parts": parts, "memory": memory,
              "link_floor": link_floor,
              "first_loss": first_loss, "padded_vocab_size": first.args.padded_vocab_size,
              "plans": {name: r.dhelix.describe() for name, r in runs.items()
                        if r.dhelix is not None},
              "plan_costs": {name: _plan_costs(r) for name, r in runs.items()
                             if r.dhelix is not None and r.dhelix.plan is not None},
              "timelines": {name: _timeline_step(r, calls, name) for name, r in runs.items()
                            if r.dhelix is not None}}
    dhelix = runs.get("dhelix")
    if dhelix is not None and dhelix.dhelix is not None and dhelix.dhelix.plan is not None:
        plan = dhelix.dhelix.plan
        result.update(layer_activation_bytes=calls("dhelix.activations", dhelix,
                                                   lambda: _layer_activation_bytes(dhelix)),
                      predicted_speedup=plan.speedup, plan_blocks=len(plan.blocks),
                      plan_block_ops=[[list(b.fwd), list(b.bwd)] for b in plan.blocks],
                      plan_source=dhelix.dhelix.plan_source)
    result["gpu_emulation"] = calls.describe()
    close_all_runs()
    return result


def report(results: list) -> dict:
    """Slowest rank's median per system (collectives finish together), memory of rank 0."""
    med = {name: max(statistics.median(r["times"][name]) for r in results)
           for name in results[0]["times"]}
    r0 = results[0]
    bound = r0["memory"]["megatron"] * 1.05
    summary = {
        "step_s": med,
        "speedup": med["megatron"] / med["dhelix"],
        "peak_bytes": r0["memory"],
        "layer_activation_bytes": r0["layer_activation_bytes"],
        "memory_bound_bytes": bound,
        "memory_within_bound": r0["memory"]["dhelix"] <= bound,
        "memory_ratio": r0["memory"]["dhelix"] / r0["memory"]["megatron"],
        "predicted_speedup": r0["predicted_speedup"],
        "plan": f"{r0['plan_blocks']} blocks, {r0['plan_source']}",
    }
    print(f"{'system':<10} {'median step (ms)':>18} {'peak mem (MiB)':>16}")
    for name in ("megatron", "dhelix"):
        print(f"{name:<10} {med[name] * 1e3:>18.1f} {r0['memory'][name] / 2**20:>16.2f}")
    print(f"speedup dhelix/megatron: {summary['speedup']:.3f}x (plan predicts "
          f"{summary['predicted_speedup']:.3f}x; {summary['plan']})")
    print(f"memory: dhelix/megatron {summary['memory_ratio']:.3f}; bound megatron x 1.05 = "
          f"{bound / 2**20:.2f} MiB: "
          f"{'within' if summary['memory_within_bound'] else 'EXCEEDED'}")
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=str, default=None, help="write the summary here")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    margs = ns.megatron_args[1:] if ns.megatron_args[:1] == ["--"] else ns.megatron_args
    if "RANK" in os.environ:  # under torchrun: every rank runs the body
        from dhelix.harness import RankContext

        result = bench_body(RankContext(int(os.environ["RANK"]),
                                        int(os.environ["WORLD_SIZE"])),
                            margs, ns.repeats, ns.warmup)
        import torch.distributed as dist

        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result)
        if dist.get_rank() != 0:
            return 0
        results = everyone
    else:
        from dhelix.harness import run_on_ranks

        results = run_on_ranks(bench_body, ns.world_size, margs, ns.repeats, ns.warmup,
                               timeout_s=1800, env={"OMP_NUM_THREADS": "1"})
    summary = report(results)
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
