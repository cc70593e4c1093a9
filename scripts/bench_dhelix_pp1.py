#!/usr/bin/env python
"""Side-by-side step time and peak memory: Megatron's no-pipelining schedule vs `--dhelix`
(PP=1), same model, weights, data and launch, repetitions interleaved (A B A B ...) so
machine noise hits both alike. Prints one table with the ratios.

Local (spawned gloo ranks):
    .venv/bin/python scripts/bench_dhelix_pp1.py --world-size 2 -- --preset tiny \
        --tensor-model-parallel-size 2 --sequence-parallel
Under torchrun (e.g. inside scripts/emulated_cluster.py, so TP crosses a shaped link):
    torchrun ... scripts/bench_dhelix_pp1.py -- <the same Megatron arguments>

Memory: peak bytes of tensor storage allocated by the compute thread during one
forward/backward (`dhelix.memtrace`), for both schedules, next to the bound the runtime
promises: Megatron's peak x 1.03 + one layer's saved activations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _layer_activation_bytes(trainer) -> int:
    """Bytes one layer's forward program holds for its backward (its saved activations)."""
    import torch

    from dhelix.devices import model_device

    runner = trainer.dhelix.runner
    execution = runner.new_execution(0)
    args = trainer.args
    tp = args.tensor_model_parallel_size
    seq = args.seq_length // tp if args.sequence_parallel else args.seq_length
    x = torch.zeros(seq, args.micro_batch_size, args.hidden_size,
                    device=model_device(trainer.dhelix.parts.model))
    rope = None
    if args.position_embedding_type == "rope":
        rope = trainer.dhelix.parts.model.rotary_pos_emb(args.seq_length)
    execution.begin_forward(x, None, rope)
    for op in runner.fwd_order:
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


def _timeline_step(trainer) -> dict:
    """One more forward/backward with the compute thread's spans recorded
    (`dhelix.runtime.timeline`): seconds of compute, collective issue, waiting on
    collectives, block barriers, and the step's wall time."""
    import torch.distributed as dist

    from dhelix.runtime.timeline import Timeline

    runner = trainer.dhelix.runner
    runner.timeline = Timeline()
    dist.barrier()
    start = time.perf_counter()
    trainer.forward_backward()
    elapsed = time.perf_counter() - start
    totals = runner.timeline.totals()
    runner.timeline = None
    return {**totals, "step_s": elapsed}


def _plan_costs(trainer) -> dict:
    """What the plan predicts per paired layer (sequential and planned ms), and how many
    layer pairs one step pairs: (micro-batches - 1) x local layers without pipelining, None
    with it (the W schedule pairs fewer; no step prediction is made there). With the cost
    model at hand (a plan built at start-up), also `sequential_executed_ms`: the same layer's
    forward then backward as the strand executor runs each alone, its collectives in flight
    while the strand computes what does not read them (`planner.cosched.strand_alone_ms`);
    `sequential_ms` is the plain sum of the solo times. With a seam between layer pairs
    (`planner.blocks.layer_seam`): how much each seam saves by the block model (the head's
    and tail's blocks against the seam block) and how many a step has ((m - 1) x
    (layers - 1) without pipelining)."""
    from planner.cosched import simulate_block, strand_alone_ms

    setup, args = trainer.dhelix, trainer.args
    plan, seam = setup.plan, setup.runner.seam
    pairs = seams = None
    if args.pipeline_model_parallel_size == 1:
        layers = len(setup.runner.bound_layers)
        pairs = (args.num_microbatches - 1) * layers
        seams = (args.num_microbatches - 1) * (layers - 1) if seam is not None else 0
    out = {"sequential_ms": plan.sequential_ms, "planned_ms": plan.planned_ms,
           "paired_layers_per_step": pairs, "seams_per_step": seams}
    if setup.costs is None:
        return out
    dags = setup.runner.bound_layers[0].programs.dags()
    fwd, bwd = dags["fwd"].by_id(), dags["bwd"].by_id()
    out["sequential_executed_ms"] = (
        strand_alone_ms(plan.fwd_order, fwd, setup.costs, "fwd", bwd)
        + strand_alone_ms(plan.bwd_order, bwd, setup.costs, "bwd", fwd))
    if seam is not None:
        apart = sum(b.predicted_ms for b in plan.blocks[:seam.head]) + sum(
            b.predicted_ms for b in plan.blocks[len(plan.blocks) - seam.tail:])
        out["seam_saving_ms"] = apart - simulate_block(seam.block.fwd, seam.block.bwd,
                                                       setup.costs).ms
    return out


def _link_floor(trainer, repeats: int = 3) -> dict:
    """The collectives of one forward/backward of `trainer` (`dhelix.bench.link_floor`),
    replayed `repeats` times one at a time and all at once (interleaved, behind a barrier):
    their count, tensor bytes, the c10d calls not replayed, and this rank's seconds per
    replay."""
    import torch.distributed as dist

    from dhelix.bench.link_floor import record_collectives, replay

    _, collectives, skipped = record_collectives(trainer.forward_backward)
    out = {"collectives": len(collectives),
           "tensor_bytes": sum(c.tensor_bytes for c in collectives),
           "skipped": sorted(set(skipped)), "one_at_a_time_s": [], "all_at_once_s": []}
    for _ in range(repeats):
        for key, all_at_once in (("one_at_a_time_s", False), ("all_at_once_s", True)):
            dist.barrier()
            out[key].append(replay(collectives, all_at_once))
    return out


def build_trainers(megatron_args: list, systems: dict) -> dict:
    """Every rank (joins the torchrun-style process group first): one `Trainer` per system
    (name -> extra arguments added to `megatron_args`), each from the same seed, so the same
    initial weights and data.

    Systems with the same layout share Megatron's groups (only the folded model's embedding
    group differs, and a layout change rebuilds them): every idle gloo group costs the
    running one (its transport thread wakes every 10 ms; 60 idle groups made Megatron's step
    5-17% longer), and each init creates ~20. Every trainer keeps references to its own model
    and groups, its finalize_model_grads included (dhelix.training.Trainer.build). For the
    same reason the DHelix-runtime systems share their lane groups (`LanePool`)."""
    from dhelix.arguments import parse_args
    from dhelix.folding import uses_folded_model
    from dhelix.parallel import ParallelSizes, init_megatron_parallel_state, \
        init_process_group_from_env
    from dhelix.runtime.lanes import LanePool
    from dhelix.training import Trainer
    from megatron.core import parallel_state
    from megatron_patches.stage_rng import seed_pipeline_stage

    job = init_process_group_from_env()
    trainers, layout, lane_pool = {}, None, LanePool()
    for name, extra in systems.items():
        args = parse_args(megatron_args + list(extra))
        sizes = ParallelSizes(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        folded = uses_folded_model(args)
        if (sizes, folded) != layout:
            init_megatron_parallel_state(sizes, args.seed, job, folded=folded)
            layout = (sizes, folded)
        else:
            seed_pipeline_stage(args.seed, parallel_state.get_pipeline_model_parallel_rank())
        trainers[name] = Trainer.build(args, job, lane_pool=lane_pool)
    return trainers


def bench_body(ctx, megatron_args: list, repeats: int, warmup: int,
               systems: dict | None = None) -> dict:
    """Every rank: build one trainer per system (`systems`: name -> extra arguments added
    to `megatron_args`; default Megatron and `--dhelix`) from the same seed, so the same
    initial weights and data; then `warmup` + `repeats` rounds, each one training step of
    every system in turn (interleaved, behind a barrier), then one measured forward/backward
    per system for peak memory, then Megatron's communication alone (`_link_floor`), then
    one recorded forward/backward per DHelix-runtime system (`_timeline_step`). Returns
    this rank's step times (measured rounds only), peak bytes, the link floor readings and,
    per system using the DHelix runtime, its plan description and timeline totals."""
    import torch.distributed as dist

    from dhelix.bench.cpu_time import CpuTimes
    from dhelix.memtrace import measure_peak

    trainers = build_trainers(megatron_args, systems or DEFAULT_SYSTEMS)
    times = {name: [] for name in trainers}
    first_loss = {}  # every system's first step (same weights and data: equal losses)
    # where a measured step went: forward/backward (what a recorded step covers), the
    # optimizer step, and the rest (loss reduction across ranks, memory reading)
    # and how the compute thread spent the step (`dhelix.bench.cpu_time`)
    parts = {name: {"forward_backward": [], "optimizer": [], "rest": []} for name in trainers}
    for i in range(warmup + repeats):
        for name, trainer in trainers.items():
            dist.barrier()
            cpu_before = CpuTimes.now()
            start = time.perf_counter()
            result = trainer.train_step()
            elapsed = time.perf_counter() - start
            cpu = CpuTimes.now().since(cpu_before)
            if i == 0:
                first_loss[name] = result.loss
            if i >= warmup:
                times[name].append(elapsed)
                fb = result.forward_backward_s
                parts[name]["forward_backward"].append(fb)
                parts[name]["optimizer"].append(result.step_time_s - fb)
                parts[name]["rest"].append(elapsed - result.step_time_s)
                for key, value in cpu.items():
                    if value is not None:
                        parts[name].setdefault(key, []).append(value)
    memory = {}
    for name, trainer in trainers.items():
        dist.barrier()
        _, reading = measure_peak(trainer.forward_backward)
        memory[name] = reading.compute_peak_bytes
    megatron = trainers.get("megatron")
    link_floor = _link_floor(megatron) if megatron is not None else None
    result = {"rank": ctx.rank, "times": times, "step_parts": parts, "memory": memory,
              "link_floor": link_floor,
              "first_loss": first_loss,
              "plans": {name: t.dhelix.describe() for name, t in trainers.items()
                        if t.dhelix is not None},
              "plan_costs": {name: _plan_costs(t) for name, t in trainers.items()
                             if t.dhelix is not None and t.dhelix.plan is not None},
              "timelines": {name: _timeline_step(t) for name, t in trainers.items()
                            if t.dhelix is not None}}
    dhelix = trainers.get("dhelix")
    if dhelix is not None and dhelix.dhelix is not None and dhelix.dhelix.plan is not None:
        plan = dhelix.dhelix.plan
        result.update(layer_activation_bytes=_layer_activation_bytes(dhelix),
                      predicted_speedup=plan.speedup, plan_blocks=len(plan.blocks),
                      plan_source=dhelix.dhelix.plan_source)
    return result


def report(results: list) -> dict:
    """Slowest rank's median per system (collectives finish together), memory of rank 0."""
    med = {name: max(statistics.median(r["times"][name]) for r in results)
           for name in results[0]["times"]}
    r0 = results[0]
    bound = r0["memory"]["megatron"] * 1.03 + r0["layer_activation_bytes"]
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
    print(f"memory: dhelix/megatron {summary['memory_ratio']:.3f}; bound megatron x 1.03 + one "
          f"layer ({r0['layer_activation_bytes'] / 2**20:.2f} MiB) = {bound / 2**20:.2f} MiB: "
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
