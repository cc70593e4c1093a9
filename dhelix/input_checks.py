"""Checks of single argument values for the look-alike trainer's parser (`dhelix.arguments`):
number ranges and paths. Only `dhelix.arguments` uses this module; it goes with it.

Everything here runs before any process group exists and touches nothing on disk that
outlives the check (a writability probe is an unnamed temporary file, removed at once).
Each failure raises `ArgumentError` with one line naming the argument, the value and the
fix. Relations between arguments (divisibility, world size) live in `dhelix.arguments`.

`RANGES` is the one table of sign/range constraints of that parser's int and float
arguments. `ArgumentError` and the readable-file check live in `dhelix.argument_error`
(the plugin and `dhelix train` use them too).
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dhelix.argument_error import (
    ArgumentError,
    check_readable_file,
    flag,
    probe_path,
    stat_path,
)

# Bytes read at a time when checking that a --data-path file is text.
_TEXT_CHUNK = 1 << 20


@dataclass(frozen=True)
class Bound:
    """Allowed values `low <= v <= high` (`<` where the end is open); None: no limit."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value) -> bool:
        """True iff `value` is a finite number inside the bound."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open
                                      else value > self.high):
            return False
        return True

    def describe(self) -> str:
        """The bound as a user reads it: '>= 1', '> 0', 'in [0, 1)'."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


AT_LEAST_1 = Bound(1)
NON_NEGATIVE = Bound(0)
POSITIVE = Bound(0, low_open=True)
PROBABILITY = Bound(0, 1, high_open=True)  # dropout 1 or beta 1 would learn nothing

RANGES: dict[str, Bound] = {
    # model
    "num_layers": AT_LEAST_1,
    "hidden_size": AT_LEAST_1,
    "ffn_hidden_size": AT_LEAST_1,
    "num_attention_heads": AT_LEAST_1,
    "num_query_groups": AT_LEAST_1,
    "kv_channels": AT_LEAST_1,
    "seq_length": AT_LEAST_1,
    "max_position_embeddings": AT_LEAST_1,
    "vocab_size": Bound(2),  # the mock tokenizer reserves one id for end-of-document
    "make_vocab_size_divisible_by": AT_LEAST_1,
    "rotary_percent": Bound(0, 1, low_open=True),
    "rotary_base": AT_LEAST_1,
    "hidden_dropout": PROBABILITY,
    "attention_dropout": PROBABILITY,
    "init_method_std": POSITIVE,
    # parallelism
    "tensor_model_parallel_size": AT_LEAST_1,
    "pipeline_model_parallel_size": AT_LEAST_1,
    # training
    "micro_batch_size": AT_LEAST_1,
    "global_batch_size": AT_LEAST_1,
    "train_iters": AT_LEAST_1,
    "lr": NON_NEGATIVE,
    "min_lr": NON_NEGATIVE,
    "weight_decay": NON_NEGATIVE,
    "clip_grad": NON_NEGATIVE,  # 0: no clipping (Megatron's meaning)
    "adam_beta1": PROBABILITY,
    "adam_beta2": PROBABILITY,
    "adam_eps": POSITIVE,
    # numpy seeds must be < 2**32 and each pipeline stage adds 100 x its rank
    "seed": Bound(0, 2**31 - 1),
    "log_interval": AT_LEAST_1,
    # checkpointing
    "save_interval": AT_LEAST_1,
    "ckpt_step": NON_NEGATIVE,
    # fault tolerance (a million minutes: far past any run, still a finite timedelta)
    "distributed_timeout_minutes": Bound(0, 10**6, low_open=True, high_open=True),
}


def check_ranges(ns: argparse.Namespace) -> None:
    """Every argument in `RANGES` that is set (not None) lies in its bound."""
    for dest, bound in RANGES.items():
        value = getattr(ns, dest, None)
        if value is not None and not bound.holds(value):
            raise ArgumentError(f"{flag(dest)} must be {bound.describe()}, got {value}")


# ---- paths -------------------------------------------------------------------------------

def check_readable_dir(option: str, path: str, what: str = "directory") -> Path:
    """`path` is an existing directory this process can list."""
    p = Path(path)
    missing = f"no such {what}; check the path or drop {option}"
    if not stat.S_ISDIR(stat_path(option, path, missing).st_mode):
        raise ArgumentError(f"{option} {path}: is a file, not a {what}; check the path or "
                            f"drop {option}")
    probe_path(option, path, lambda: os.listdir(p), "cannot be read", "fix its permissions")
    return p


def _can_create_in(directory: Path) -> str | None:
    """None if a file can be created in `directory` (probed with an unnamed temporary file,
    gone when closed), else the reason."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_writable_dir(option: str, path: str) -> None:
    """`path` is a directory this process can write in, or can be created (its nearest
    existing ancestor is a writable directory). Creates nothing."""
    p = Path(path).absolute()
    if os.path.exists(p) and not os.path.isdir(p):
        raise ArgumentError(f"{option} {path}: is a file, not a directory; give a directory")
    existing = p  # os.path.exists is False also where a parent cannot be searched
    while not os.path.exists(existing):
        existing = existing.parent
    if not os.path.isdir(existing):
        raise ArgumentError(f"{option} {path}: {existing} is a file, so the directory cannot "
                            "be created; give another path")
    reason = _can_create_in(existing)
    if reason:
        where = "" if existing == p else f" (in {existing})"
        raise ArgumentError(f"{option} {path}: cannot write there{where}: {reason}; "
                            "give a writable directory")


def check_writable_file(option: str, path: str) -> None:
    """`path` is a regular file this process can append to, or can be created in an existing
    writable directory. Neither creates nor changes it."""
    p = Path(path)
    if os.path.exists(p):
        if not os.path.isfile(p):
            raise ArgumentError(f"{option} {path}: is a directory or special file; give a "
                                "file path")
        probe_path(option, path, lambda: open(p, "ab").close(), "cannot be written",
               "fix its permissions or give another file")
        return
    parent = p.absolute().parent
    if not os.path.isdir(parent):
        raise ArgumentError(f"{option} {path}: directory {parent} does not exist; create it "
                            "or give another file")
    reason = _can_create_in(parent)
    if reason:
        raise ArgumentError(f"{option} {path}: cannot create a file in {parent}: {reason}; "
                            "give a writable location")


def check_text_data_file(option: str, path: str, min_bytes: int, needed_for: str) -> None:
    """`path` is a readable UTF-8 text file (no NUL bytes) of at least `min_bytes` bytes."""
    p = check_readable_file(option, path)
    size = p.stat().st_size
    if size < min_bytes:
        raise ArgumentError(f"{option} {path}: {size} bytes, needs at least {min_bytes} "
                            f"({needed_for}); give a longer text file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(p, "rb") as handle:
        while chunk := handle.read(_TEXT_CHUNK):
            nul = chunk.find(b"\0")
            if nul >= 0:
                raise ArgumentError(f"{option} {path}: binary data (NUL byte at offset "
                                    f"{offset + nul}); give a UTF-8 text file")
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the last chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                bad = offset - pending + exc.start
                raise ArgumentError(f"{option} {path}: not UTF-8 text (invalid byte at offset "
                                    f"{bad}); give a UTF-8 text file") from exc
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise ArgumentError(f"{option} {path}: not UTF-8 text (cut-off character at the "
                            "end); give a UTF-8 text file") from exc
