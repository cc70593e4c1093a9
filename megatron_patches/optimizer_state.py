"""Optimizer-state shim for loading distributed-optimizer checkpoints without Apex/TE, and
the refusal of optimizer state megatron-core cannot load (`optimizer_load_refusal`); both
run around Megatron-LM's `load_checkpoint` under the plugin (`megatron_patches.checkpoint_guard`).

Replaces nothing in Megatron's files; wraps the `init_state_fn` that megatron-core attaches
to each optimizer. Why: without Apex or Transformer Engine, `DistributedOptimizer.state_dict`
(distrib_optimizer.py, megatron-core 0.19.2 as 0.16.1) reads torch Adam's per-parameter
`step`, which exists only after a first `step()`. Loading a checkpoint into a fresh optimizer calls
`init_state_fn` (which creates exp_avg/exp_avg_sq but no `step`) and then `state_dict()`,
which fails. The wrapper also creates `step = 0` for parameters that lack it, matching
torch Adam's own state layout; the loaded checkpoint then overwrites it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def _with_step_state(init_state_fn):
    def init_state_with_step(opt, config=None):
        init_state_fn(opt, config)
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state[param]
                if state and "step" not in state:
                    # on the CPU, as torch's Adam keeps a step that is not `capturable`
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")

    init_state_with_step.__dhelix_wrapped__ = init_state_fn
    return init_state_with_step


def make_optimizer_state_loadable(optimizer) -> None:
    """Wrap every inner optimizer's `init_state_fn` (idempotent; no-op where there is none)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        fn = getattr(opt, "init_state_fn", None)
        if fn is not None and not hasattr(fn, "__dhelix_wrapped__"):
            opt.init_state_fn = _with_step_state(fn)


def ensure_optimizer_state(optimizer) -> None:
    """Create empty per-parameter state (zeros, step 0) in every inner optimizer that has
    none, so a never-stepped optimizer can be saved or loaded. Megatron's float/FP32
    optimizers do this inside `sharded_state_dict(is_loading=True)`; its DistributedOptimizer
    does not (0.19.2). Adam with zero moments and step 0 updates exactly like a fresh one.
    Parameters that already have state are left untouched."""
    make_optimizer_state_loadable(optimizer)
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        fn = getattr(opt, "init_state_fn", None)
        if fn is not None:
            fn(opt.optimizer, opt.config)


def restore_adam_steps_after_load(optimizer) -> None:
    """After `load_state_dict`, set torch Adam's per-parameter `step` from the loaded param
    group's `step`, where megatron-core's DistributedOptimizer (no Apex/TE) keeps it.

    Why: the distributed optimizer's sharded state does not carry `step`; loading copies the
    template's value (0, from `ensure_optimizer_state`) into every parameter's state, which
    would silently restart Adam's bias correction. No-op for optimizers without group steps.
    """
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for group in torch_opt.param_groups:
            step = group.get("step")
            if step is None:
                continue
            for param in group["params"]:
                state = torch_opt.state.get(param)
                if state and "step" in state:
                    # on the CPU on purpose: torch's (non-capturable, non-fused) Adam keeps
                    # its `step` there, whatever the parameters' device
                    state["step"] = torch.tensor(float(step), device="cpu",
                                                 dtype=torch.float32)


def _loads_optimizer_state(args, load_arg: str, optimizer) -> bool:
    """Whether Megatron-LM's `load_checkpoint(..., load_arg)` will read optimizer state: an
    optimizer, a checkpoint directory, neither `--no-load-optim` nor `--finetune`."""
    root = getattr(args, load_arg, None)
    return (optimizer is not None and bool(root) and Path(root).is_dir()
            and not getattr(args, "no_load_optim", False) and not getattr(args, "finetune", False))


def optimizer_load_refusal(args, load_arg: str, optimizer) -> str | None:
    """The one-line reason Megatron-LM's load of optimizer state into `optimizer` cannot
    work, or None: megatron-core 0.19.2 (as 0.16.1) builds SGD without a state initialiser
    (`megatron_patches.compat.optimizer_state_loadable`), and its
    `sharded_state_dict(is_loading=True)` then raises a bare TypeError."""
    from megatron_patches.compat import megatron_core_version, optimizer_state_loadable

    if not _loads_optimizer_state(args, load_arg, optimizer) or optimizer_state_loadable(
            optimizer):
        return None
    return (f"--{load_arg.replace('_', '-')} {getattr(args, load_arg)}: megatron-core "
            f"{megatron_core_version()} cannot load --optimizer {args.optimizer} state; pass "
            "--no-load-optim to load only the model (the optimizer state starts fresh)")


@contextlib.contextmanager
def loadable_optimizer_state(args, load_arg: str, optimizer):
    """Around Megatron-LM's `load_checkpoint`: when it reads optimizer state, the fresh
    optimizer gets its empty state first (`ensure_optimizer_state`: without Apex/TE the
    distributed optimizer's `state_dict()` needs torch Adam's `step`), the load runs without
    autograd (the distributed optimizer copies its loaded main params in place into the
    model's parameters, leaves that require grad), and torch Adam's per-parameter `step` is
    set from the loaded one after (`restore_adam_steps_after_load`)."""
    if not _loads_optimizer_state(args, load_arg, optimizer):
        yield
        return
    ensure_optimizer_state(optimizer)
    with torch.no_grad():
        yield
    restore_adam_steps_after_load(optimizer)
