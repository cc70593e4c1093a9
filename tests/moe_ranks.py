"""Rank body for tests/test_megatron_lm_moe.py (module-level so `dhelix.harness` can pickle
it)."""

from __future__ import annotations

from tests.megatron_lm_ranks import SCRIPT, TINY


def stock_moe_steps(ctx, moe_args: list, steps: int) -> dict:
    """Build stock Megatron with `moe_args` under the plugin (`megatron_patches.step_harness`)
    and train `steps` steps. Returns this rank's expert-parallel size, its local experts per
    MoE layer, and per step the loss, the grad norm and the load-balancing loss Megatron's
    MoE tracker recorded."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

    from megatron_patches.step_harness import build_run, close_all_runs

    run = build_run(SCRIPT, TINY + ["--train-iters", "100", *moe_args])
    with run.active():
        ep = parallel_state.get_expert_model_parallel_world_size()
        local = [m.num_local_experts for m in run.model[0].modules()
                 if isinstance(m, SequentialMLP)]
    steps_seen = []
    for _ in range(steps):
        tracker = get_moe_metrics_tracker()
        tracker.clear()
        outcome = run.train_step()
        balance = tracker.metrics.get("load_balancing_loss")
        steps_seen.append({"loss": float(outcome.loss_dict["lm loss"]),
                           "grad_norm": outcome.grad_norm,
                           "load_balancing_loss": None if balance is None
                           else float(balance.values.sum())})
    close_all_runs()
    return {"ep": ep, "local_experts": local, "steps": steps_seen}
