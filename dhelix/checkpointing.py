"""Checkpoint save/load through megatron-core's distributed checkpointing.

Layout on disk follows Megatron-LM: `<dir>/iter_0000010/` (a dist-checkpoint directory) and
`<dir>/latest_checkpointed_iteration.txt`. Because tensors are stored by global keys, a
checkpoint saved with one TP/PP/DP layout loads into another (see the exception below).

Guarantees:
- A save is written to `iter_XXXXXXX.tmp` and renamed only when every rank finished and the
  checksum manifest (`dhelix.checkpoint_integrity`) is written; the tracker file is replaced
  atomically after the rename: an interrupted save never becomes "latest".
- A save starts no processes (megatron_patches.checkpoint_writer): nothing outlives a killed
  rank. Optimizer state is written to files of its own.
- A load verifies every file it reads against the manifest first and refuses a damaged,
  truncated or incomplete checkpoint with one line naming the file and what to do (an
  earlier iteration with --ckpt-step, or --no-load-optim when only optimizer state is hit);
  nothing is loaded then.
- Loading checks the saved model arguments against the current ones first and raises
  `CheckpointError` naming each mismatching argument.
- Model weights load into any TP/PP/DP layout; optimizer state too, except that of the
  distributed optimizer, which needs the saving run's TP/PP (any DP).
- RNG states are restored only when the parallel layout is the one that saved them (they
  are per-rank); otherwise they are skipped with a logged notice, as Megatron does.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from dhelix.checkpoint_integrity import (
    TRACKER,
    damage_message,
    find_damage,
    iteration_dir,
    saved_iterations,
    write_manifest,
)
from megatron_patches.checkpoint_writer import InProcessTorchDistSaveStrategy
from megatron_patches.compat import megatron_core_version, optimizer_state_loadable
from megatron_patches.optimizer_state import (
    ensure_optimizer_state,
    restore_adam_steps_after_load,
)

log = logging.getLogger(__name__)

# Arguments that define tensor shapes: a checkpoint only loads if these match.
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "max_position_embeddings", "swiglu", "normalization",
    "position_embedding_type", "untie_embeddings_and_output_weights", "disable_bias_linear",
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible with the current run."""


def latest_iteration(root: str | os.PathLike) -> int:
    """Iteration named by the tracker file; raises CheckpointError if there is none."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise CheckpointError(
            f"--load {root}: no {TRACKER}; not a dhelix/Megatron checkpoint directory"
        )
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    iteration = int(text)
    if not iteration_dir(root, iteration).is_dir():
        raise CheckpointError(f"{tracker} names iteration {iteration}, but "
                              f"{iteration_dir(root, iteration)} is missing")
    return iteration


def _layout() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def _rng_sharded_object() -> ShardedObject:
    """This rank's RNG states, keyed by its (pp, tp, dp) coordinates."""
    state = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    lay = _layout()
    return ShardedObject("rng_state", state, (lay["pp"], lay["tp"], lay["dp"]), (pp, tp, dp),
                         replica_id=0)


def _optimizer_metadata(args) -> dict:
    # Distributed-optimizer state uses Megatron-LM's default 'dp_reshardable' format: it
    # reshards across DP sizes but needs the same TP/PP. ('fully_reshardable' failed to load
    # with torch-native Adam in megatron-core 0.16.1: it copies a `step` entry it skipped,
    # and 'fully_sharded_model_space' was rejected outright; not re-tried on 0.19.2.)
    if args.use_distributed_optimizer:
        return {"distrib_optim_sharding_type": "dp_reshardable"}
    return {}


def _sharded_state_dict(trainer, with_optimizer: bool, with_rng: bool, is_loading: bool):
    (chunk,) = trainer.model  # one chunk: virtual pipelining is not supported
    model_sd = chunk.module.sharded_state_dict()
    state = {
        "model": model_sd,
        "iteration": trainer.iteration,
        "consumed_samples": trainer.consumed_samples,
        "args": {name: getattr(trainer.args, name) for name in MODEL_ARGS},
        "layout": _layout(),
        "use_distributed_optimizer": bool(trainer.args.use_distributed_optimizer),
    }
    if with_optimizer:
        ensure_optimizer_state(trainer.optimizer)
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_optimizer_metadata(trainer.args)
        )
    if with_rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def save_checkpoint(trainer, root: str | os.PathLike) -> Path:
    """Save model, optimizer, RNG, iteration and consumed samples. Collective."""
    root = Path(root)
    final = iteration_dir(root, trainer.iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    state = _sharded_state_dict(trainer, with_optimizer=True, with_rng=True, is_loading=False)
    dist_checkpointing.save(state, str(tmp), sharded_strategy=InProcessTorchDistSaveStrategy())
    dist.barrier()
    write_manifest(tmp)  # collective; ends with a barrier
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        tracker_tmp = root / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{trainer.iteration}\n")
        os.replace(tracker_tmp, root / TRACKER)
    dist.barrier()
    return final


def _check_compatible(saved_args: dict, args, where: Path) -> None:
    diffs = [
        f"--{name.replace('_', '-')} saved {saved_args.get(name)!r} vs now {getattr(args, name)!r}"
        for name in MODEL_ARGS
        if saved_args.get(name) != getattr(args, name)
    ]
    if diffs:
        raise CheckpointError(f"{where}: checkpoint does not fit this model: " + "; ".join(diffs))


def load_checkpoint(trainer, root: str | os.PathLike, load_optimizer: bool = True,
                    load_rng: bool = True, iteration: int | None = None) -> int:
    """Load the latest checkpoint under `root` (or `iteration`, Megatron's --ckpt-step) into
    the trainer. Returns its iteration.

    Collective. Every file the load reads is verified against the checkpoint's checksum
    manifest first; a problem raises CheckpointError before anything is loaded. The model's
    weights, the iteration and consumed samples are always loaded; optimizer state unless
    `load_optimizer` is False; RNG when asked and the layout matches.
    """
    if iteration is None:
        iteration = latest_iteration(root)
    elif not iteration_dir(root, iteration).is_dir():
        saved = ", ".join(map(str, saved_iterations(root))) or "none"
        raise CheckpointError(f"--ckpt-step {iteration}: no {iteration_dir(root, iteration)} "
                              f"(saved iterations under {root}: {saved})")
    where = iteration_dir(root, iteration)
    if load_optimizer and not optimizer_state_loadable(trainer.optimizer):
        raise CheckpointError(
            f"--load {root}: megatron-core {megatron_core_version()} cannot load "
            f"--optimizer {trainer.args.optimizer} state; pass --no-load-optim to load only "
            "the model (the optimizer state starts fresh)"
        )
    damage = find_damage(where, need_optimizer=load_optimizer)
    if damage is not None:
        raise CheckpointError(damage_message(root, iteration, damage, load_optimizer))
    common = dist_checkpointing.load_common_state_dict(str(where))
    _check_compatible(common.get("args", {}), trainer.args, where)
    saved_distopt = common.get("use_distributed_optimizer")
    if load_optimizer and saved_distopt != bool(trainer.args.use_distributed_optimizer):
        saved = "with" if saved_distopt else "without"
        raise CheckpointError(
            f"{where}: optimizer state was saved {saved} --use-distributed-optimizer and "
            "megatron-core stores the two differently; match that flag or pass --no-load-optim"
        )
    saved_layout = common.get("layout", {})
    now = _layout()
    if load_optimizer and saved_distopt and (saved_layout.get("tp"), saved_layout.get("pp")) != (
            now["tp"], now["pp"]):
        raise CheckpointError(
            f"{where}: distributed-optimizer state saved with TP={saved_layout.get('tp')} "
            f"PP={saved_layout.get('pp')} cannot load into TP={now['tp']} PP={now['pp']}; "
            "pass --no-load-optim to load only the model weights"
        )
    same_layout = saved_layout == now
    if load_rng and not same_layout:
        log.warning("checkpoint layout %s differs from %s: RNG states not restored",
                    common.get("layout"), _layout())
    with_rng = load_rng and same_layout
    state = _sharded_state_dict(trainer, with_optimizer=load_optimizer, with_rng=with_rng,
                                is_loading=True)
    loaded = dist_checkpointing.load(state, str(where))
    (chunk,) = trainer.model
    chunk.module.load_state_dict(loaded["model"], strict=True)
    if load_optimizer:
        # no_grad: with fp32 params the distributed optimizer's main params are views of
        # the model params, which megatron-core copies into in place.
        with torch.no_grad():
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps_after_load(trainer.optimizer)
    if hasattr(trainer.optimizer, "reload_model_params"):
        trainer.optimizer.reload_model_params()
    if with_rng:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    trainer.iteration = int(loaded["iteration"])
    trainer.consumed_samples = int(loaded["consumed_samples"])
    trainer.reset_data_iterator()
    return trainer.iteration
