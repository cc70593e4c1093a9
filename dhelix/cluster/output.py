"""Copy each node's output to the launcher's stdout/stderr, line by line, prefixed with
the node (`[n0] ...`), so interleaved output of several nodes stays readable.

Lines are copied as bytes (no decoding errors) and written whole under one lock, so lines
of different nodes never mix. A pump ends when its pipe closes (the node's processes all
exited or were killed).
"""

from __future__ import annotations

import threading
from typing import BinaryIO

_WRITE_LOCK = threading.Lock()


class LinePump(threading.Thread):
    """Daemon thread copying `source` to `sink` with `prefix` before every line."""

    def __init__(self, source: BinaryIO, sink: BinaryIO, prefix: str):
        super().__init__(daemon=True, name=f"pump {prefix}")
        self.source = source
        self.sink = sink
        self.prefix = prefix.encode()

    def run(self) -> None:
        try:
            for line in iter(self.source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with _WRITE_LOCK:
                    try:
                        self.sink.write(self.prefix + line)
                        self.sink.flush()
                    except (BrokenPipeError, ValueError):
                        pass  # our own stdout went away; keep draining the child's pipe
        finally:
            self.source.close()
