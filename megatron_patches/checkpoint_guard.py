"""Checksummed checkpoints for Megatron-LM's own `--save`/`--load` under the plugin
(`dhelix.megatron_lm`, with and without `--dhelix`; megatron-core 0.19.2 tested).

Wraps `megatron.training.checkpointing.save_checkpoint` and `load_checkpoint` (also the
names `megatron.training.training` imported from it, which `pretrain()` calls):

- Save (synchronous `torch_dist` saves, the plugin's format; other formats, `--async-save`
  and non-persistent saves pass through unchanged and get no manifest): megatron-core's
  results queue is an in-process one first (`megatron_patches.checkpoint_writer`), so the
  save starts no Manager/resource_tracker process that would outlive a killed rank. While
  Megatron saves, its tracker file is written to `latest_checkpointed_iteration.txt.pending`
  instead; after its last barrier every rank hashes its share of `iter_XXXXXXX/` into the
  checksum manifest (`dhelix.checkpoint_integrity.write_manifest`), then rank 0 renames the
  pending tracker into place (atomic). A save interrupted before its manifest exists never
  becomes "latest".
- Load: before Megatron reads anything, the iteration it would load (`--ckpt-step`, else the
  tracker) is checked: a tracker holding no iteration number, a missing iteration
  directory, or any file the load reads (skipping optimizer-only files with
  `--no-load-optim`/`--finetune`) that is missing, resized or has other bytes than the
  manifest records, ends every rank with one `error: ...` line naming the file and what to
  do (exit code 2); nothing is loaded. A checkpoint with no manifest (saved by stock
  Megatron-LM, not through the plugin) loads unverified, with one `warning:` line on rank 0.
  Optimizer state megatron-core cannot load (SGD's) is refused the same way, naming
  `--no-load-optim`; optimizer state that loads gets the shim of
  `megatron_patches.optimizer_state.loadable_optimizer_state` around the load (without
  Apex/TE Megatron cannot otherwise load distributed-optimizer state into a fresh optimizer).

Collective like the calls they wrap: every rank must call them.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path

TRACKER_PENDING_SUFFIX = ".pending"


class _Saving:
    """Set while a checksummed save runs: Megatron's tracker goes to the pending file."""

    active = False


class _Checkpoints:
    """The newest checkpoint directory this process saved or loaded (`last_checkpoint`)."""

    last: Path | None = None


def last_checkpoint() -> Path | None:
    """The `iter_XXXXXXX/` directory the current `pretrain()` of this process last saved
    (checksummed) or verified before loading, or None."""
    return _Checkpoints.last


def forget_last_checkpoint() -> None:
    """Start a new `pretrain()` in this process: no checkpoint saved or loaded yet."""
    _Checkpoints.last = None


def _checksummed_save(args, non_persistent_ckpt: bool) -> bool:
    return (bool(args.save) and args.use_dist_ckpt and args.ckpt_format == "torch_dist"
            and not args.async_save and not non_persistent_ckpt)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _hook_tracker_filename(checkpointing) -> None:
    original = checkpointing.get_checkpoint_tracker_filename

    @functools.wraps(original)
    def get_checkpoint_tracker_filename(checkpoints_path):
        name = original(checkpoints_path)
        return name + TRACKER_PENDING_SUFFIX if _Saving.active else name

    checkpointing.get_checkpoint_tracker_filename = get_checkpoint_tracker_filename


def _wrap_save(checkpointing, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*args, **kwargs):
        from megatron.training import get_args

        from dhelix.checkpoint_integrity import write_manifest
        from megatron_patches.checkpoint_writer import use_in_process_results_queue

        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        margs = get_args()
        if not margs.async_save:
            use_in_process_results_queue()
        if not _checksummed_save(margs, call.arguments["non_persistent_ckpt"]):
            return original(*args, **kwargs)
        _Saving.active = True
        try:
            result = original(*args, **kwargs)
        finally:
            _Saving.active = False
        iteration, release = call.arguments["iteration"], call.arguments["release"]
        where = Path(checkpointing.get_checkpoint_name(margs.save, iteration, release=release,
                                                       return_base_dir=True))
        write_manifest(where)  # ends in a barrier
        if _rank() == 0:
            tracker = checkpointing.get_checkpoint_tracker_filename(margs.save)
            os.replace(tracker + TRACKER_PENDING_SUFFIX, tracker)
        _barrier()
        _Checkpoints.last = where
        return result

    return save_checkpoint


def load_refusal(args, load_arg: str) -> str | None:
    """The one-line reason the Megatron load of `getattr(args, load_arg)` must not run, or
    None (also when there is nothing to load or nothing to check). Collective: hashes the
    files split across ranks; every rank returns the same answer. Prints one `warning:`
    line on rank 0 for a checkpoint without a checksum manifest."""
    from dhelix.checkpoint_integrity import (
        MANIFEST,
        damage_message,
        find_damage,
        iteration_dir,
        tracker_problem,
    )

    root = getattr(args, load_arg, None)
    if not root or getattr(args, "non_persistent_ckpt_type", None) == "local":
        return None
    if not Path(root).is_dir():
        return None  # Megatron's own handling: a warning, training from scratch
    # Megatron reads --ckpt-step only when truthy (0 means the tracker)
    iteration, problem = tracker_problem(root, getattr(args, "ckpt_step", None) or None)
    if problem is not None or iteration is None:
        return problem
    where = iteration_dir(root, iteration)
    if not (where / MANIFEST).is_file():
        if _rank() == 0:
            print(f"warning: --{load_arg.replace('_', '-')} {root}: {where.name} has no "
                  f"{MANIFEST} (not saved through dhelix.megatron_lm); loading it unverified",
                  file=sys.stderr, flush=True)
        _Checkpoints.last = where
        return None
    need_optimizer = not (getattr(args, "no_load_optim", False) or getattr(args, "finetune",
                                                                            False))
    damage = find_damage(where, need_optimizer=need_optimizer)
    if damage is None:
        _Checkpoints.last = where
        return None
    return damage_message(root, iteration, damage, need_optimizer)


def _wrap_load(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import get_args

        from dhelix.rank_errors import exit_with_error
        from megatron_patches.optimizer_state import (
            loadable_optimizer_state,
            optimizer_load_refusal,
        )

        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        megatron_args, load_arg = get_args(), call.arguments["load_arg"]
        optimizer = call.arguments["optimizer"]
        refusal = load_refusal(megatron_args, load_arg)
        if refusal is None:
            refusal = optimizer_load_refusal(megatron_args, load_arg, optimizer)
        if refusal is not None:
            exit_with_error(refusal)
        with loadable_optimizer_state(megatron_args, load_arg, optimizer):
            return original(*args, **kwargs)

    return load_checkpoint


def install_checkpoint_guard() -> None:
    """Wrap Megatron-LM's save_checkpoint/load_checkpoint as described above (idempotent)."""
    from megatron.training import checkpointing, training

    if hasattr(checkpointing.save_checkpoint, "__dhelix_original__"):
        return
    _hook_tracker_filename(checkpointing)
    for name, wrap in (("save_checkpoint", functools.partial(_wrap_save, checkpointing)),
                       ("load_checkpoint", _wrap_load)):
        original = getattr(checkpointing, name)
        wrapped = wrap(original)
        wrapped.__dhelix_original__ = original
        setattr(checkpointing, name, wrapped)
        if getattr(training, name, None) is original:
            setattr(training, name, wrapped)
