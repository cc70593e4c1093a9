"""`WaiterThread`: one thread that runs the waits handed to it, one after another, in the
order they were handed over.

Made for c10d handles that must have exactly one waiter: gloo's point-to-point Works
report `is_completed()` False until waited on and never return from a second wait, so
code that must learn of their completion without blocking (the pipeline executor's sends,
`dhelix.schedules.sends_in_flight`; the emulated GPU's all-to-all,
`dhelix.gpu_emulation.all_to_all_exchange`) hands each wait to this thread and reads the
result it records.

Guarantees: the thread starts on the first `submit` (named `name`; `on_start()` runs on it
first), runs each submitted callable once, in submission order, and drops it before taking
the next (whatever it holds is released then). A callable must not raise (it records its
own errors). `close()` stops the thread after what was submitted before it; with
`join=False` it does not wait for that (the failure path: a wait on a dead peer must not
hang the caller). `submit` after `close` starts a new thread. Callers use one
`WaiterThread` from one thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable


class WaiterThread:
    def __init__(self, name: str, on_start: Callable[[], object] | None = None):
        self.name = name
        self.on_start = on_start
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None

    def submit(self, wait: Callable[[], None]) -> None:
        """Run `wait()` on the thread after everything submitted before it."""
        if self._thread is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._queue,),
                                            name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(wait)

    def close(self, join: bool = True) -> None:
        """Stop the thread once it has run what was submitted (waiting for that with
        `join`); a no-op when it was never started."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        if join:
            thread.join()

    def _run(self, waits: queue.Queue) -> None:
        if self.on_start is not None:
            self.on_start()
        while (wait := waits.get()) is not None:
            wait()
            wait = None  # drop it (and what it holds) before blocking on the next
