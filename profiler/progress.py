"""A one-line progress bar with an estimate of the time left (rank 0, stderr).

On a terminal the line is redrawn in place; otherwise (logs, CI, pytest) a plain line is
written at most every `interval_s` seconds and at the end. The estimate extrapolates the
rate of the work done in this run (work resumed from a partial file is counted as done but
not as rate).
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, done: int = 0, *, enabled: bool = True, stream=None,
                 interval_s: float = 2.0, label: str = "profile"):
        self.total, self.done, self.start_done = total, done, done
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.label = label
        self.started = time.monotonic()
        self._last_line = float("-inf")

    def eta_s(self) -> float | None:
        measured = self.done - self.start_done
        if measured <= 0:
            return None
        rate = (time.monotonic() - self.started) / measured
        return rate * (self.total - self.done)

    def line(self, note: str = "") -> str:
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        eta = self.eta_s()
        text = (f"{self.label} [{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total}"
                f" | elapsed {_clock(time.monotonic() - self.started)}"
                f" | ETA {_clock(eta) if eta is not None else '?'}")
        return f"{text} | {note}" if note else text

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done += steps
        self.show(note, force=self.done >= self.total)

    def show(self, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + self.line(note))
            if self.done >= self.total:
                self.stream.write("\n")
        elif force or now - self._last_line >= self.interval_s:
            self.stream.write(self.line(note) + "\n")
            self._last_line = now
        self.stream.flush()
