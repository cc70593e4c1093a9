"""Rank body for tests/test_megatron_lm_moe.py (module-level so `dhelix.harness` can pickle
it)."""

from __future__ import annotations

from tests.megatron_lm_ranks import SCRIPT, TINY


def _uneven_gathers(group) -> dict:
    """The CPU shims' uneven all-gather / reduce-scatter along dim 0 on `group`, against
    what they must give: rank r contributes r + 2 rows of value r + 1 (all-gather), and
    every rank sends row block r of `r + 2` rows of ones (reduce-scatter: the group size in
    each of this rank's `rank + 2` rows)."""
    import torch
    from megatron.core.tensor_parallel import mappings

    rank, size = group.rank(), group.size()
    sizes = [r + 2 for r in range(size)]
    mine = torch.full((sizes[rank], 3), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, sizes)
    expected = torch.cat([torch.full((n, 3), float(r + 1)) for r, n in enumerate(sizes)])
    scattered = mappings._reduce_scatter_along_first_dim(torch.ones(sum(sizes), 3), group,
                                                         sizes)
    return {"gather_ok": torch.equal(gathered, expected),
            "scatter_ok": torch.equal(scattered, torch.full((sizes[rank], 3), float(size)))}


def stock_moe_steps(ctx, cases: dict, steps: int) -> dict:
    """For each case NAME -> extra Megatron arguments: build stock Megatron with them under
    the plugin (`megatron_patches.step_harness`) and train `steps` steps. Per case this
    rank's tensor- and expert-parallel sizes, its local experts per MoE layer (dense
    layers have none), and per step the loss, the grad norm and the load-balancing loss
    Megatron's MoE tracker recorded; with TP > 1 also the uneven-gather check on the TP
    group (`_uneven_gathers`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    from megatron_patches.step_harness import build_run, close_all_runs

    report = {}
    for name, extra in cases.items():
        run = build_run(SCRIPT, TINY + ["--train-iters", "100", *extra])
        with run.active():
            tp = parallel_state.get_tensor_model_parallel_world_size()
            entry = {"tp": tp, "ep": parallel_state.get_expert_model_parallel_world_size(),
                     "local_experts": [m.num_local_experts for m in run.model[0].modules()
                                       if isinstance(m, SequentialMLP)],
                     "steps": []}
            if tp > 1:
                entry.update(_uneven_gathers(parallel_state.get_tensor_model_parallel_group()))
        for _ in range(steps):
            tracker = get_moe_metrics_tracker()
            tracker.clear()
            outcome = run.train_step()
            balance = tracker.metrics.get("load_balancing_loss")
            entry["steps"].append({"loss": float(outcome.loss_dict["lm loss"]),
                                   "grad_norm": outcome.grad_norm,
                                   "load_balancing_loss": None if balance is None
                                   else float(balance.values.sum())})
        report[name] = entry
    close_all_runs()
    return report


def _record_routing(model) -> tuple[dict, list]:
    """Forward hooks on every router of `model` (Megatron's TopKRouter modules, which both
    Megatron's MoELayer and the DHelix router operator call): {layer number: [routing map
    of each call, in call order]}, and the hook handles."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: dict = {}
    handles = []
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                def hook(router, _inputs, output):
                    maps.setdefault(router.layer_number, []).append(output[1].detach().clone())
                handles.append(module.register_forward_hook(hook))
    return maps, handles


def _whole_pipeline(run, maps: dict, balance):
    """This rank's routing maps ({layer number: calls}) and load-balancing losses (one
    value per layer, None when none was recorded) joined with those of the other stages of
    its pipeline (Megatron's pipeline group: the same data-parallel and expert-parallel
    position), so stock Megatron's stages and the folded model's, which hold different
    layers, compare layer by layer. Each layer lives on one stage; its values are summed
    over the stages as Megatron's MoE logging reduces them. Collective over the pipeline
    group (the values unchanged without pipelining)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    with run.active():
        group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return maps, balance
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (maps, balance), group=group)
    joined, total = {}, None
    for stage_maps, stage_balance in everyone:
        for layer, calls in stage_maps.items():
            if layer in joined:
                raise AssertionError(f"layer {layer} routed on two pipeline stages")
            joined[layer] = calls
        if stage_balance is not None:
            total = stage_balance.clone() if total is None else total + stage_balance
    return joined, total


def _moe_steps(run, steps: int, poison_aux_scale: bool = False) -> dict:
    """`steps` observed steps (`tests.plugin_parity_ranks.observed_step`) with, per step,
    the routing maps of every router call and the load-balancing loss Megatron's MoE
    tracker recorded per layer, each over the whole pipeline (`_whole_pipeline`).
    `poison_aux_scale`: before each step set Megatron's aux-loss gradient scale
    (`MoEAuxLossAutoScaler`, process-wide) to a wrong value, so a stage whose schedule does
    not set it as Megatron's does back-propagates wrong load-balancing gradients."""
    import torch
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from tests.plugin_parity_ranks import observed_step

    out = {"steps": [], "routing": [], "aux": []}
    for _ in range(steps):
        tracker = get_moe_metrics_tracker()
        tracker.clear()
        if poison_aux_scale:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor([123.0])
        with run.active():
            maps, handles = _record_routing(run.model)
        try:
            out["steps"].append(observed_step(run, with_grads=True))
        finally:
            for handle in handles:
                handle.remove()
        balance = tracker.metrics.get("load_balancing_loss")
        maps, balance = _whole_pipeline(
            run, maps, None if balance is None else balance.values.clone())
        out["routing"].append(maps)
        out["aux"].append(balance)
    return out


def _routing_report(ref: list, got: list) -> dict:
    """Per step: are the routing maps equal call by call on every layer; how many router
    calls and routed (token, expert) pairs were compared."""
    import torch

    equal, calls, routed = True, 0, 0
    for ref_maps, got_maps in zip(ref, got):
        if sorted(ref_maps) != sorted(got_maps):
            equal = False
            continue
        for layer, ref_calls in ref_maps.items():
            got_calls = got_maps[layer]
            equal &= len(ref_calls) == len(got_calls)
            for a, b in zip(ref_calls, got_calls):
                equal &= torch.equal(a, b)
                calls += 1
                routed += int(a.sum())
    return {"routing_equal": bool(equal), "router_calls": calls, "routed_pairs": routed,
            "moe_layers": sorted(ref[0]) if ref else []}


PROFILE = "@profile"  # in a case's --dhelix arguments: the profile `moe_parity` made


def _profile(case, output: str) -> dict:
    """`dhelix profile` of `case`'s model in this launch (collective; `profiler.cli`'s
    job, a short one: 1 warm-up pass, 2 repeats, 12 pairs): the profile's cost keys."""
    import argparse

    from profiler.cli import add_options, profile_job

    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["-o", output, "--no-progress", "--warmup", "1", "--repeats", "2",
                              "--max-pairs", "12"])
    result = profile_job(args, case.stock_argv())
    return {"complete": result.complete, "solo_keys": sorted(result.solo),
            "pairs": len(result.pairs)}


def moe_parity(ctx, cases: dict, steps: int, workdir: str | None = None) -> dict:
    """For each case NAME -> `tests.plugin_parity_ranks.ParityCase` (MoE Megatron
    arguments): stock Megatron, then `--dhelix`, from the same seed and data, each stepped
    `steps` times by Megatron's `train_step`. Per case: the step comparison rows (loss,
    every gradient, parameters after the step), the load-balancing loss per layer on both
    sides, whether every router call routed the same tokens to the same experts (routing
    maps recorded by hooks on Megatron's routers on both sides), what the engine ran
    (`engine_record`, training and one evaluation batch) and the evaluation loss
    difference, the gradient keys, the plan's description, the operator ids of this rank's
    MoE layer programs and the roles of the communication lanes."""
    from megatron_patches.step_harness import build_run, close_all_runs
    from tests.plugin_parity_ranks import compare_steps, engine_record, eval_loss

    import dataclasses
    from pathlib import Path

    report = {}
    try:
        for name, case in cases.items():
            profiled = None
            if PROFILE in case.dhelix:
                output = str(Path(workdir) / f"{name}.json")
                profiled = _profile(case, output)
                case = dataclasses.replace(case, dhelix=tuple(
                    output if word == PROFILE else word for word in case.dhelix))
            stock = build_run(SCRIPT, case.stock_argv())
            ref = _moe_steps(stock, steps)
            run = build_run(SCRIPT, case.dhelix_argv())
            setup = run.dhelix
            moe_programs = [b.programs for b in setup.runner.bound_layers
                            if b.description.moe is not None]
            got = _moe_steps(run, steps, poison_aux_scale=True)
            trained = engine_record(run)
            eval_diff = abs(eval_loss(stock) - eval_loss(run))
            report[name] = {
                "profile": profiled,
                "plan_source": setup.plan_source,
                "executed": {"train": trained, "eval": engine_record(run)},
                "eval_loss_diff": eval_diff,
                "grad_keys": sorted(ref["steps"][0]["grads"]),
                "rows": compare_steps(ref["steps"], got["steps"]),
                "aux_ref": [None if a is None else a.tolist() for a in ref["aux"]],
                "aux": [None if a is None else a.tolist() for a in got["aux"]],
                **_routing_report(ref["routing"], got["routing"]),
                "describe": setup.describe(),
                "pair_plans": len(setup.pair_plans or {}),
                "moe_fwd_ops": list(moe_programs[0].forward.ids) if moe_programs else [],
                "moe_bwd_ops": list(moe_programs[0].backward.ids) if moe_programs else [],
                "moe_bias": bool(moe_programs and moe_programs[0].description.add_bias_linear),
                "lanes": sorted({(role, channel) for role, channel, _ in
                                 setup.runner.lanes.groups})
                if setup.runner.lanes is not None else [],
            }
            run.close()
    finally:
        close_all_runs()
    return report


def stock_moe_and_parity(ctx, cases: dict, steps: int, parity_cases: dict,
                         parity_steps: int) -> dict:
    """One launch for both: `stock_moe_steps` of `cases`, then `moe_parity` of
    `parity_cases` (the rank start-up, most of a small launch's time, is paid once)."""
    report = stock_moe_steps(ctx, cases, steps)
    report.update(moe_parity(ctx, parity_cases, parity_steps))
    return report


def assert_moe_parity(entry: dict, steps: int, moe_pattern: list, tolerance: dict) -> None:
    """A `moe_parity` case report against Megatron's own schedule: the compared gradients
    include the router and the experts' FC1 of every MoE layer (`moe_pattern`: True per
    MoE layer); per step the loss, every gradient and the parameters after the step, and
    the load-balancing loss each layer recorded (positive exactly on the MoE layers) within
    `tolerance` ({'loss', 'grad', 'param', 'eval'}); the evaluation loss too."""
    keys = entry["grad_keys"]
    assert sum(".router.weight" in k for k in keys) == sum(moe_pattern), keys
    assert sum(".experts." in k and "linear_fc1.weight" in k for k in keys) == sum(
        moe_pattern), keys
    assert entry["eval_loss_diff"] <= tolerance["eval"]
    assert len(entry["rows"]) == steps and len(entry["aux"]) == steps
    for row in entry["rows"]:
        assert row["loss_diff"] <= tolerance["loss"], row
        assert row["grad_diff"] <= tolerance["grad"], row
        assert row["param_diff"] <= tolerance["param"], row
    for ref, got in zip(entry["aux_ref"], entry["aux"]):
        assert ref is not None and got is not None
        assert [v > 0 for v in ref] == list(moe_pattern), ref
        assert max(abs(a - b) for a, b in zip(ref, got)) <= tolerance["loss"], (ref, got)


def launch_moe_parity(world_size: int, cases: dict, steps: int, workdir: str) -> list:
    """One launch of `moe_parity` on `world_size` gloo ranks, one rank per emulated node
    (every expert-parallel group spans nodes), one thread per rank: every rank's report."""
    from dhelix.harness import run_on_ranks

    return run_on_ranks(moe_parity, world_size, cases, steps, workdir, timeout_s=400,
                        env={"OMP_NUM_THREADS": "1", "DHELIX_RANKS_PER_NODE": "1"})
