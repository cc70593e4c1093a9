"""Copy each node's output to the launcher's stdout/stderr, line by line, prefixed with
the node (`[n0] ...`), so interleaved output of several nodes stays readable.

Lines are copied as bytes (no decoding errors) and written whole under one lock, so lines
of different nodes never mix. A pump ends when its pipe closes (the node's processes all
exited or were killed).
"""

from __future__ import annotations

import threading
from typing import BinaryIO, TextIO

_WRITE_LOCK = threading.Lock()


class _TextSink:
    """Bytes in, text out: for a text stream without a binary buffer (e.g. StringIO)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


class LinePump(threading.Thread):
    """Daemon thread copying the binary pipe `source` to the text stream `sink` (through
    its binary buffer where it has one) with `prefix` before every line."""

    def __init__(self, source: BinaryIO, sink: TextIO, prefix: str):
        super().__init__(daemon=True, name=f"pump {prefix}")
        self.source = source
        self.sink = getattr(sink, "buffer", None) or _TextSink(sink)
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
