"""`ArgumentError`, the one-line error for bad command-line input, and the checks that a path
argument names a file this process can read (`check_readable_file`) or can write
(`check_writable_file`).

Shared by the plugin's `--dhelix*` file checks (`dhelix.dhelix_arguments`), the presets of
`dhelix train` (`dhelix.presets`) and the typed options (`dhelix.options.OptionError`).
Everything here runs before any
process group exists and creates nothing on disk.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class ArgumentError(ValueError):
    """Bad command-line input; the message is one line that names the argument and the fix."""


def flag(dest: str) -> str:
    """The command-line spelling of an argparse dest: 'micro_batch_size' -> '--micro-batch-size'."""
    return "--" + dest.replace("_", "-")


def stat_path(option: str, path: str, missing: str) -> os.stat_result:
    """os.stat(path); ArgumentError `missing` when it does not exist, or when it cannot be
    reached."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise ArgumentError(f"{option} {path}: {missing}") from exc
    except OSError as exc:
        raise ArgumentError(f"{option} {path}: cannot be read ({exc.strerror}); "
                            "fix the permissions on its path") from exc


def probe_path(option: str, path: str, attempt, problem: str, fix: str) -> None:
    """Run `attempt()`; an OSError becomes ArgumentError '{option} {path}: {problem}
    (reason); {fix}'."""
    try:
        attempt()
    except OSError as exc:
        raise ArgumentError(f"{option} {path}: {problem} ({exc.strerror}); {fix}") from exc


def check_readable_file(option: str, path: str) -> Path:
    """`path` is an existing regular file this process can open for reading; returns it as
    a Path. Raises ArgumentError naming `option` otherwise."""
    p = Path(path)
    if not stat.S_ISREG(stat_path(option, path, "no such file; check the path").st_mode):
        raise ArgumentError(f"{option} {path}: is a directory or special file; give a file")
    probe_path(option, path, lambda: open(p, "rb").close(), "cannot be read",
               "fix its permissions")
    return p


def check_writable_file(option: str, path: str) -> Path:
    """`path` names a file this process can create or overwrite: not a directory or special
    file, in an existing directory it may write to. Returns it as a Path; creates nothing.
    Raises ArgumentError naming `option` otherwise."""
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ArgumentError(f"{option} {path}: is a directory or special file; give a file "
                            "path")
    parent = p.parent
    if not parent.is_dir():
        raise ArgumentError(f"{option} {path}: its directory {parent} does not exist; create "
                            "it first or choose another path")
    target = p if p.exists() else parent
    if not os.access(target, os.W_OK):
        raise ArgumentError(f"{option} {path}: cannot be written (no write permission on "
                            f"{target}); fix its permissions or choose another path")
    return p
