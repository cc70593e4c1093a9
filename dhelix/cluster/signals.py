"""Turn Ctrl-C and termination signals into an exception, so that cleanup code runs.

Inside `SignalGuard()`, the first SIGINT, SIGTERM or SIGHUP raises `Interrupted` in the
main thread (the `finally` blocks of the run then stop the nodes and remove the network).
After `shield()` (called at the start of cleanup) further signals are only recorded and
reported, never raised, so a second Ctrl-C cannot cut the cleanup short. Leaving the guard
restores the previous handlers. Signal handlers can only be installed from the main thread;
elsewhere the guard installs nothing (the caller's own handling applies).
"""

from __future__ import annotations

import signal
import sys
import threading

GUARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A guarded signal arrived. A BaseException, so `except Exception` cannot swallow it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell convention for death by this signal: 128 + signal number."""
        return 128 + self.signum


class SignalGuard:
    """Context manager; see the module docstring."""

    def __init__(self):
        self._previous: dict[int, object] = {}
        self._raised = False
        self._shielded = False
        self.received: list[int] = []

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for signum in GUARDED:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def shield(self) -> None:
        """From now on, signals are recorded but not raised (cleanup is running)."""
        self._shielded = True

    def _handle(self, signum, _frame) -> None:
        self.received.append(signum)
        if self._raised or self._shielded:
            print(f"[cluster] {signal.Signals(signum).name} received; cleaning up, "
                  "please wait", file=sys.stderr, flush=True)
            return
        self._raised = True
        raise Interrupted(signum)
