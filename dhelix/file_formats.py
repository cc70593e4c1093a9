"""Versioned JSON files shared by the profiler, planner and runtime.

Every file carries `"format": "dhelix-<kind>"` and `"version": N`. Readers reject a missing,
foreign or newer/older format with `FormatError`, whose message names the file, what is
wrong and the command that regenerates it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

# What regenerates each kind of file; quoted in error messages.
REGENERATE = {
    "dag": "dhelix ops --export-dag DIR",
    "profile": "dhelix profile ... (under torchrun)",
    "plan": "dhelix plan ...",
    "schedule": "dhelix schedule show --pp P --microbatches M --json FILE",
}


class FormatError(ValueError):
    """A dhelix file is unreadable, of another kind or version, or inconsistent."""


def _hint(kind: str) -> str:
    cmd = REGENERATE.get(kind)
    return f"; regenerate it with `{cmd}`" if cmd else ""


def write_versioned(path: str | os.PathLike, kind: str, version: int, payload: dict) -> Path:
    """Atomically write `payload` with its format/version header (temp file + rename, so a
    crash never leaves a truncated file behind). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"format": f"dhelix-{kind}", "version": version, **payload}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, indent=1, sort_keys=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_versioned(path: str | os.PathLike, kind: str, version: int) -> dict:
    """Load a file written by `write_versioned`, checking kind and version."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: no such file{_hint(kind)}")
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: corrupt or truncated JSON ({exc}){_hint(kind)}") from exc
    if not isinstance(document, dict):
        raise FormatError(f"{path}: not a dhelix-{kind} file{_hint(kind)}")
    found = document.get("format")
    if found != f"dhelix-{kind}":
        raise FormatError(
            f"{path}: expected format 'dhelix-{kind}', found {found!r}{_hint(kind)}"
        )
    if document.get("version") != version:
        raise FormatError(
            f"{path}: dhelix-{kind} version {document.get('version')!r} is not supported "
            f"(this dhelix reads version {version}){_hint(kind)}"
        )
    return document


def read_parsed(path: str | os.PathLike, kind: str, version: int,
                parse: Callable[[dict], object],
                regenerate: Callable[[dict], str] | None = None):
    """`read_versioned`, then `parse(document)`. A KeyError, TypeError or ValueError from
    `parse` becomes a FormatError naming the file, the problem and the command that
    regenerates it (`regenerate(document)` if given, else the kind's REGENERATE entry)."""
    document = read_versioned(path, kind, version)
    try:
        return parse(document)
    except (KeyError, TypeError, ValueError) as exc:
        command = regenerate(document) if regenerate else REGENERATE.get(kind)
        hint = f"; regenerate it with `{command}`" if command else ""
        raise FormatError(f"{path}: invalid dhelix-{kind} ({exc}){hint}") from exc
