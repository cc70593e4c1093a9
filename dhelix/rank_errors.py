"""A rank's one-line error, reported once per job (`report_error`, `exit_with_error`):
under `dhelix train` through the launcher's error file, else printed by rank 0, and always
into torchrun's own error file. Used by every part that stops a run on a clear error (the
plugin's hooks and `dhelix.megatron_lm`); the launcher (`dhelix.launch`) reads the file."""

from __future__ import annotations

import json
import os
import sys
import time

ERROR_FILE_ENV = "DHELIX_ERROR_FILE"
ERROR_EXIT_CODE = 2
RANK0_GRACE_S = 2.0


def report_error(message: str) -> None:
    """Report a rank's one-line error so that the user sees it once per job, whichever rank
    fails first:

    - under `dhelix train`: append it to `$DHELIX_ERROR_FILE`; the launcher prints the
      first one as the last line;
    - otherwise rank 0 prints `error: MESSAGE` to stderr. Under plain torchrun the other
      ranks first wait up to `RANK0_GRACE_S` (torchrun stops them as soon as rank 0 exits),
      so that rank 0 is not stopped before it prints.

    Under torchrun the line also goes to this rank's `$TORCHELASTIC_ERROR_FILE`, so
    torchrun's failure report shows it as the root cause's `traceback`."""
    line = " ".join(str(message).splitlines())
    _write_torchelastic_error(f"error: {line}")
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (line + "\n").encode())  # one append: lines never interleave
            finally:
                os.close(fd)
            return
        except OSError:
            pass  # the launcher is gone or its directory too: print instead
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    elif os.environ.get("TORCHELASTIC_ERROR_FILE"):
        time.sleep(RANK0_GRACE_S)


def exit_with_error(message: str):
    """`report_error(message)`, then end this rank with `ERROR_EXIT_CODE` (SystemExit)."""
    report_error(message)
    sys.exit(ERROR_EXIT_CODE)


def _write_torchelastic_error(text: str) -> None:
    """torchrun's error-file format (what `torch.distributed.elastic`'s `@record` writes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    payload = {"message": {"message": text, "extraInfo": {
        "py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(payload, handle)
    except OSError:
        pass  # the report then says "To enable traceback see ..."; the line is printed anyway
