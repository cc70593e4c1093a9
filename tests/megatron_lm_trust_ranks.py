"""Rank bodies for the trust tests of the plugin path (`tests/test_megatron_lm_trust.py`):
Megatron-LM's own `--save`/`--load` with the checkpoint guard
(`megatron_patches.checkpoint_guard`), run by `pretrain()` in this rank's process, one run
after another in the same job (`tests.megatron_lm_ranks.pretrain_in_process`)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import torch.distributed as dist

from dhelix.checkpoint_integrity import MANIFEST, find_damage
from tests.megatron_lm_ranks import TINY, pretrain_in_process


def _xor_bytes(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _flip_one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_a_recorded_checksum(path: Path) -> None:
    """Change one file's SHA-256 in the manifest, leaving the manifest's own digest as it
    was (an edited or bit-rotted manifest)."""
    document = json.loads(path.read_text())
    entry = next(iter(document["files"].values()))
    entry["sha256"] = ("0" if entry["sha256"][0] != "0" else "1") + entry["sha256"][1:]
    path.write_text(json.dumps(document))


# name -> (what is done to a copy of the checkpoint directory, extra load arguments)
DAMAGE = {
    "random bytes in a shard": (lambda d: _xor_bytes(d / "iter_0000004" / "__0_0.distcp", 256),
                                []),
    "one flipped bit": (lambda d: _flip_one_bit(d / "iter_0000004" / "__1_0.distcp"), []),
    "truncated shard": (lambda d: _truncate(d / "iter_0000004" / "__0_0.distcp"), []),
    "deleted shard": (lambda d: (d / "iter_0000004" / "__1_0.distcp").unlink(), []),
    "deleted .metadata": (lambda d: (d / "iter_0000004" / ".metadata").unlink(), []),
    "garbage tracker": (lambda d: (d / "latest_checkpointed_iteration.txt").write_text("x7!\n"),
                        []),
    "tracker names a missing iteration": (
        lambda d: (d / "latest_checkpointed_iteration.txt").write_text("6\n"), []),
    "ckpt-step of a missing iteration": (lambda d: None, ["--ckpt-step", "3"]),
    "damaged, loaded without --dhelix": (
        lambda d: _xor_bytes(d / "iter_0000004" / "__0_0.distcp", 256), ["--no-dhelix"]),
    "manifest checksum edited": (
        lambda d: _edit_a_recorded_checksum(d / "iter_0000004" / MANIFEST), []),
    "truncated manifest": (lambda d: _truncate(d / "iter_0000004" / MANIFEST), []),
    # what every refusal above advises: the earlier iteration, which is intact, loads
    "damaged, --ckpt-step of the earlier iteration": (
        lambda d: _xor_bytes(d / "iter_0000004" / "__0_0.distcp", 256), ["--ckpt-step", "2"]),
}


def _run(argv: list[str]) -> tuple[object, list[str]]:
    """(exit code or None, rank 0's `error:`/`warning:` lines) of one pretrain() run."""
    stderr = io.StringIO()
    code = None
    with contextlib.redirect_stderr(stderr):
        try:
            pretrain_in_process(argv)
        except SystemExit as exc:
            code = exc.code
    lines = [ln for ln in stderr.getvalue().splitlines()
             if ln.startswith(("error:", "warning:"))]
    return code, lines


def checkpoint_guard_body(ctx, workdir: str, layout: list) -> dict:
    """Save iterations 2 and 4 of a 6-iteration run with `--dhelix` on `layout`; then, for each DAMAGE case, load
    a damaged copy (rank 0 makes it) and record the exit code and rank 0's error lines; also
    load the intact checkpoint with and without `--dhelix` and a copy without manifests;
    last, train with `--lr 1e30` (NaN loss) with `--dhelix`, and stock with `--save`.
    Returns on every rank: {"files": the manifest-listed files, "cases": {name: (code,
    lines)}, "pending": leftover pending tracker files, "next_tracker"/"next_manifest": the
    stock save after the intact load, "nan_saved"/"nan_tracker"/"nan_last_good_damage": the
    NaN run's checkpoint directory, tracker and `find_damage` of its last good iteration}."""
    work = Path(workdir)
    good = work / "good"
    resume = TINY + layout + ["--train-iters", "6", "--lr-decay-style", "constant"]
    saved = _run(resume + ["--save", str(good), "--save-interval", "2", "--exit-interval", "4",
                           "--dhelix"])  # Megatron ends an --exit-interval run with exit 0
    cases = {"save": saved}
    for name, (damage, extra) in DAMAGE.items():
        copy = work / name.replace(" ", "_")
        if ctx.rank == 0:
            shutil.copytree(good, copy)
            damage(copy)
        dist.barrier()
        dhelix = [] if "--no-dhelix" in extra else ["--dhelix"]
        extra = [a for a in extra if a != "--no-dhelix"]
        cases[name] = _run(resume + ["--load", str(copy)] + extra + dhelix)
    unverified = work / "no_manifest"
    if ctx.rank == 0:
        shutil.copytree(good, unverified)
        for manifest in unverified.glob("iter_*/dhelix_checksums.json"):
            manifest.unlink()
    dist.barrier()
    cases["intact with --dhelix"] = _run(resume + ["--load", str(good), "--dhelix"])
    cases["intact, stock"] = _run(resume + ["--load", str(good), "--save", str(work / "next"),
                                            "--save-interval", "2"])
    cases["no manifest"] = _run(resume + ["--load", str(unverified), "--dhelix"])
    nan = TINY + layout + ["--train-iters", "6", "--lr", "1e30"]
    cases["nan"] = _run(nan + ["--dhelix"])
    cases["nan, stock, with --save"] = _run(nan + ["--save", str(work / "nan"),
                                                   "--save-interval", "1"])
    listed = json.loads((good / "iter_0000004" / MANIFEST).read_text())
    nan_tracker = work / "nan" / "latest_checkpointed_iteration.txt"
    return {"files": sorted(listed["files"]),
            "cases": cases,
            "pending": sorted(str(p) for p in work.rglob("*.pending")),
            "next_tracker": (work / "next" / "latest_checkpointed_iteration.txt").read_text()
            if (work / "next" / "latest_checkpointed_iteration.txt").exists() else None,
            "next_manifest": (work / "next" / "iter_0000006" / "dhelix_checksums.json").is_file(),
            "nan_saved": sorted(p.name for p in (work / "nan").iterdir())
            if (work / "nan").is_dir() else None,
            # the last good checkpoint of the NaN run: what its tracker names, and whether
            # every byte of it still matches its manifest (collective, every rank)
            "nan_tracker": nan_tracker.read_text().strip() if nan_tracker.is_file() else None,
            "nan_last_good_damage": str(find_damage(work / "nan" / "iter_0000001"))
            if (work / "nan" / "iter_0000001" / MANIFEST).is_file() else "no manifest"}
