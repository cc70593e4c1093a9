"""Checksums of a checkpoint directory: written by a save, verified before a load.

The manifest `dhelix_checksums.json` (a versioned dhelix file, `dhelix.file_formats`) lists
every file of one `iter_XXXXXXX/` directory with its size and SHA-256, whether it holds
optimizer state only, and a SHA-256 of that list itself (so damage to the manifest is
told apart from damage to a file it lists).

Guarantees:
- `write_manifest` records exactly the files present when it runs (call it after the save's
  last write, before the directory is renamed into place).
- `find_damage` reports the first problem in a fixed order (the manifest itself, then files
  by name: missing, wrong size, wrong checksum), the same on every rank, or None when every
  file the load needs matches; it reads each file once, hashing split across ranks.
- Both work with or without a process group (one process hashes everything); with one they
  are collective: every rank must call them.
- `damage_message` and `tracker_problem` word a refusal as one line naming the file and
  what to do (an earlier iteration with --ckpt-step, --no-load-optim when only optimizer
  state is hit). They serve the plugin's hook around Megatron's own save/load
  (`megatron_patches.checkpoint_guard`): the layout (`iter_XXXXXXX/`,
  `latest_checkpointed_iteration.txt`) is Megatron-LM's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from dhelix.file_formats import FormatError, read_versioned, write_versioned
from megatron_patches.checkpoint_writer import OPTIMIZER_KEY_PREFIX

MANIFEST = "dhelix_checksums.json"
KIND, VERSION = "checkpoint-checksums", 1
METADATA = ".metadata"  # torch.distributed.checkpoint's index of tensors to files
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name for the "latest" file


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Megatron-LM's directory of one iteration's checkpoint under `root`."""
    return Path(root) / f"iter_{iteration:07d}"


def saved_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations with an `iter_XXXXXXX/` directory under `root` (dhelix's own saves rename
    it into place when finished; Megatron's write into it directly)."""
    found = (p.name[len("iter_"):] for p in Path(root).glob("iter_*") if p.is_dir())
    return sorted(int(n) for n in found if n.isdigit())


def _earlier_remedy(root, iteration: int) -> str:
    earlier = [i for i in saved_iterations(root) if i < iteration]
    if earlier:
        return (f"resume from an earlier iteration with --ckpt-step N (saved under {root}: "
                f"{', '.join(map(str, earlier))})")
    return f"no earlier iteration is saved under {root}; start without --load"


@dataclass(frozen=True)
class Damage:
    """One problem found in a checkpoint directory."""

    file: str
    problem: str            # e.g. "is missing", "has 100 bytes, 200 were saved"
    optimizer_only: bool    # the file holds optimizer state only (--no-load-optim skips it)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    rank, world = _rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj):
    """Rank 0's `obj` on every rank (identical decisions even if a rank saw other bytes)."""
    _, world = _rank_and_world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _listing_digest(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _optimizer_only_files(ckpt_dir: Path) -> set[str]:
    """Files whose every tensor/object key is optimizer state (per the `.metadata` index)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    other, optimizer = set(), set()
    for index, info in metadata.storage_data.items():
        bucket = optimizer if index.fqn.startswith(OPTIMIZER_KEY_PREFIX) else other
        bucket.add(info.relative_path)
    return optimizer - other


def write_manifest(ckpt_dir: str | Path) -> Path:
    """Hash every file in `ckpt_dir` (split across ranks) and write the manifest (rank 0).
    Collective with a process group; returns the manifest's path once it exists."""
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_and_world()
    names = _from_rank0(sorted(p.name for p in ckpt_dir.iterdir()
                               if p.is_file() and p.name != MANIFEST) if rank == 0 else None)
    mine = {name: {"bytes": (ckpt_dir / name).stat().st_size,
                   "sha256": _sha256(ckpt_dir / name)} for name in names[rank::world]}
    files: dict = {}
    for part in _all_gather(mine):
        files.update(part)
    if rank == 0:
        optimizer_only = _optimizer_only_files(ckpt_dir) if METADATA in files else set()
        for name, entry in files.items():
            entry["optimizer_only"] = name in optimizer_only
        files = dict(sorted(files.items()))
        write_versioned(ckpt_dir / MANIFEST, KIND, VERSION,
                        {"algorithm": "sha256", "files": files,
                         "files_sha256": _listing_digest(files)})
        if names:  # readable like the files it lists (the temp file it came from was 0600)
            shutil.copymode(ckpt_dir / names[0], ckpt_dir / MANIFEST)
    if world > 1:
        dist.barrier()
    return ckpt_dir / MANIFEST


def _read_manifest(ckpt_dir: Path) -> dict | Damage:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return Damage(MANIFEST, "is missing, so the checkpoint cannot be checked (a copy "
                      "that did not finish, or not saved by dhelix)", False)
    try:
        document = read_versioned(path, KIND, VERSION)
    except FormatError as exc:
        return Damage(MANIFEST, f"is damaged ({str(exc).split(': ', 1)[-1]})", False)
    files = document.get("files")
    if not isinstance(files, dict) or _listing_digest(files) != document.get("files_sha256"):
        return Damage(MANIFEST, "is damaged (its own checksum does not match)", False)
    if not all(_valid_entry(entry) for entry in files.values()):
        return Damage(MANIFEST, "is damaged (an entry lacks bytes, sha256 or optimizer_only)",
                      False)
    return files


def _valid_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("optimizer_only"), bool))


def find_damage(ckpt_dir: str | Path, need_optimizer: bool = True) -> Damage | None:
    """The first problem with the files a load of `ckpt_dir` reads, or None if they all
    match the manifest. `need_optimizer=False` skips files holding optimizer state only.
    Collective with a process group; every rank returns the same answer."""
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_and_world()
    files = _from_rank0(_read_manifest(ckpt_dir) if rank == 0 else None)
    if isinstance(files, Damage):
        return files
    needed = [name for name, entry in files.items()
              if need_optimizer or not entry["optimizer_only"]]
    found = []
    for name in needed[rank::world]:
        entry, path = files[name], ckpt_dir / name
        if not path.is_file():
            problem = "is missing"
        elif path.stat().st_size != entry["bytes"]:
            problem = (f"has {path.stat().st_size} bytes, {entry['bytes']} were saved "
                       "(truncated or overwritten)")
        elif _sha256(path) != entry["sha256"]:
            problem = "does not match its saved SHA-256 (its bytes changed since the save)"
        else:
            continue
        found.append(Damage(name, problem, entry["optimizer_only"]))
    damage = sorted((d for part in _all_gather(found) for d in part),
                    key=lambda d: (d.problem != "is missing", d.file))
    return damage[0] if damage else None


def damage_message(root, iteration: int, damage: Damage, load_optimizer: bool) -> str:
    """One line for a load refused because of `damage` in `root`'s iteration `iteration`."""
    where = iteration_dir(root, iteration)
    remedy = _earlier_remedy(root, iteration)
    if damage.optimizer_only and load_optimizer:
        remedy = ("it holds optimizer state only: pass --no-load-optim to load the weights "
                  f"with a fresh optimizer, or {remedy}")
    return (f"--load {root}: {where.name}/{damage.file} {damage.problem}; nothing was "
            f"loaded; {remedy}")


def tracker_problem(root: str | os.PathLike, ckpt_step: int | None) -> tuple[int | None, str | None]:
    """The iteration a Megatron-LM load of `root` reads (`ckpt_step`, Megatron's
    --ckpt-step, else the number in `latest_checkpointed_iteration.txt`), and a one-line
    problem or None: a tracker that holds no iteration number, or an iteration directory
    that is missing. (None, None) when `root` has no tracker and no --ckpt-step (Megatron
    then starts from scratch) or the tracker says `release` (no iteration directory)."""
    root = Path(root)
    tracker = root / TRACKER
    saved = ", ".join(map(str, saved_iterations(root))) or "none"
    if ckpt_step is None:
        if not tracker.is_file():
            return None, None
        try:
            text = tracker.read_text(errors="replace").strip()
        except OSError as exc:
            return None, f"--load {root}: cannot read {TRACKER} ({exc.strerror})"
        if text == "release":
            return None, None
        if not text.isdigit():
            shown = text if len(text) <= 40 else text[:40] + "..."
            return None, (f"--load {root}: {TRACKER} holds {shown!r}, not an iteration "
                          f"number; write the iteration to resume from into it or pass "
                          f"--ckpt-step N (saved iterations: {saved})")
        iteration, named_by = int(text), f"{TRACKER} names iteration {int(text)}"
    else:
        iteration, named_by = ckpt_step, f"--ckpt-step {ckpt_step}"
    if not iteration_dir(root, iteration).is_dir():
        return iteration, (f"--load {root}: {named_by}, but {iteration_dir(root, iteration).name}"
                           f" is missing; nothing was loaded; pass --ckpt-step N for a saved "
                           f"iteration (saved iterations: {saved})")
    return iteration, None
