"""Rank body of tests/test_checkpoint_integrity.py (spawned by dhelix.harness): save a
TP=2 checkpoint at iterations 1 and 2, then for each way of damaging a copy of it try to
load it, all in one launch. Module-level so it pickles by name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from dhelix.checkpoint_integrity import MANIFEST
from dhelix.checkpointing import CheckpointError, iteration_dir, load_checkpoint, save_checkpoint
from dhelix.parallel import init_process_group_from_env
from tests.foundation_ranks import build_trainer, observed_step, tiny_args


def _overwrite(path: Path, data: bytes, at: float = 0.5) -> None:
    with open(path, "r+b") as handle:
        handle.seek(int(path.stat().st_size * at))
        handle.write(data)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_a_recorded_checksum(path: Path) -> None:
    document = json.loads(path.read_text())
    entry = document["files"]["metadata.json"]
    entry["sha256"] = ("0" if entry["sha256"][0] != "0" else "1") + entry["sha256"][1:]
    path.write_text(json.dumps(document))


# name -> (damage applied to the copy's newest iteration directory, load_optimizer)
DAMAGE = {
    "intact": (lambda d: None, True),
    "random_bytes_in_weight_shard": (lambda d: _overwrite(d / "__0_0.distcp", os.urandom(4096)),
                                     True),
    "zeros_in_weight_shard": (lambda d: _overwrite(d / "__1_0.distcp", bytes(256)), True),
    "truncated_weight_shard": (lambda d: _truncate(d / "__1_0.distcp"), True),
    "missing_weight_shard": (lambda d: (d / "__1_0.distcp").unlink(), True),
    # megatron-core 0.19 keeps the common state (iteration, args) in rank 0's first shard
    "truncated_common_state_shard": (lambda d: _truncate(d / "__0_0.distcp"), True),
    "missing_metadata": (lambda d: (d / ".metadata").unlink(), True),
    "zeros_in_metadata": (lambda d: _overwrite(d / ".metadata", bytes(256)), True),
    "manifest_checksum_edited": (lambda d: _flip_a_recorded_checksum(d / MANIFEST), True),
    "truncated_manifest": (lambda d: _truncate(d / MANIFEST), True),
    "missing_manifest": (lambda d: (d / MANIFEST).unlink(), True),
    "damaged_optimizer_file": (lambda d: _overwrite(d / "optimizer.__0_1.distcp",
                                                    os.urandom(4096)), True),
    "damaged_optimizer_file_no_load_optim": (lambda d: _overwrite(
        d / "optimizer.__0_1.distcp", os.urandom(4096)), False),
}


def _params(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in trainer.model for p in chunk.module.parameters()]


def damaged_loads(ctx, workdir: str) -> dict:
    """Returns (on every rank) {case: {"outcome": "loaded"|"refused", "message", "iteration",
    "params_unchanged"}} plus "files" (the saved iteration's file names) and
    "manifest_optimizer_only" (files the manifest marks as optimizer state only)."""
    job = init_process_group_from_env()
    root = Path(workdir)
    trainer = build_trainer(tiny_args(tp=2), job)
    for _ in range(2):
        observed_step(trainer, with_grads=False)
        save_checkpoint(trainer, root / "good")
    newest = iteration_dir(root / "good", 2)
    manifest = json.loads((newest / MANIFEST).read_text())
    report = {"files": sorted(p.name for p in newest.iterdir()),
              "manifest_optimizer_only": sorted(n for n, e in manifest["files"].items()
                                                if e["optimizer_only"])}
    for case, (damage, load_optimizer) in DAMAGE.items():
        copy = root / case
        if dist.get_rank() == 0:
            shutil.copytree(root / "good", copy)
            damage(iteration_dir(copy, 2))
        dist.barrier()
        before = _params(trainer)
        trainer.iteration = -1
        try:
            iteration = load_checkpoint(trainer, copy, load_optimizer=load_optimizer)
            row = {"outcome": "loaded", "iteration": iteration, "message": ""}
        except CheckpointError as exc:
            row = {"outcome": "refused", "iteration": trainer.iteration, "message": str(exc)}
        after = _params(trainer)
        row["params_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after))
        report[case] = row
    # the earlier iteration the refusals point to loads (Megatron's --ckpt-step)
    report["ckpt_step_1"] = {"outcome": "loaded", "iteration": load_checkpoint(
        trainer, root / "random_bytes_in_weight_shard", iteration=1)}
    try:
        load_checkpoint(trainer, root / "good", iteration=7)
    except CheckpointError as exc:
        report["ckpt_step_7"] = {"outcome": "refused", "message": str(exc)}
    dist.barrier()
    return report
