"""`dhelix.argument_error.check_readable_file`, the check every path the plugin and `dhelix
train` read before any process group exists goes through (`--dhelix-plan`,
`--dhelix-profile`, `--preset`): a file the user cannot read is refused in one line naming
the option, the path and the fix (checked as an unprivileged user: root bypasses file
modes). Missing files and directories: tests/test_megatron_lm_refusals.py and
tests/test_launch.py."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

UNPRIVILEGED_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from dhelix.argument_error import ArgumentError, check_readable_file
for path in ("secret.txt", "closed/x", "open.txt"):
    try:
        check_readable_file("--dhelix-plan", path)
        print("accepted", path)
    except ArgumentError as exc:
        print(exc)
"""


def _unprivileged_python() -> list:
    """A command that runs Python as a user without root's bypass of file modes."""
    if os.geteuid() != 0:
        return [sys.executable]
    setpriv, system_python = shutil.which("setpriv"), "/usr/bin/python3"
    if not setpriv or not os.access(system_python, os.X_OK):
        pytest.skip("running as root without setpriv or /usr/bin/python3 to drop privileges")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", system_python]


def test_unreadable_files_are_refused_in_one_line():
    work = Path(tempfile.mkdtemp(prefix="dhelix-modes-"))
    try:
        work.chmod(0o755)
        (work / "secret.txt").write_text("{}")
        (work / "secret.txt").chmod(0)
        (work / "open.txt").write_text("{}")
        (work / "open.txt").chmod(0o644)
        (work / "closed").mkdir(mode=0)
        proc = subprocess.run(_unprivileged_python() + ["-c", UNPRIVILEGED_CHECK, str(ROOT)],
                              cwd=work, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            "--dhelix-plan secret.txt: cannot be read (Permission denied); fix its "
            "permissions",
            "--dhelix-plan closed/x: cannot be read (Permission denied); fix the permissions "
            "on its path",
            "accepted open.txt",
        ]
    finally:
        (work / "closed").chmod(0o700)
        shutil.rmtree(work)
