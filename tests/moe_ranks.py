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
