"""`ReceivesInFlight`: the pipeline executor's CPU (gloo) receives, their completion seen
without blocking.

The DHelix engine takes a received tensor before it landed (`dhelix.arriving.Arriving`)
and asks whether it landed (`is_completed()`) to decide which strand runs next: a strand
whose input has not landed gives way to the other one. gloo's point-to-point Works report
`is_completed()` False until waited on (torch 2.13; they have no future either), so every
received input looked in flight until its reader blocked on it: the strand reading it
always gave way first, even when its input had long landed, and the other strand could
reach its collective's wait with nothing left to run beside it. A CUDA (NCCL) Work answers
without blocking and is handed back untouched.

For each CPU receive, a watcher thread (`dhelix.waiter_thread.WaiterThread`, one per
channel: the group and the peer it receives from) is its one waiter: it waits for the
receives in the order they were posted, which on a gloo channel is the order they complete
in (its sends and receives match first-in first-out), so no receive's completion is seen
later than the ones before it allow. `watch` returns a `WatchedReceive`, used wherever the
Work was (`wait()`, `is_completed()`).

Guarantees: `watch` never blocks. `WatchedReceive.wait()` returns once the watcher's wait
returned and raises the error that wait raised (a dead peer, the group's timeout), on the
caller's thread. `finish()` stops the watchers once they have waited for what was
submitted; `abandon()` stops them without waiting (the failure path: a receive from a dead
peer must not hang the caller). The caller calls `watch`, `finish` and `abandon` from one
thread; `WatchedReceive.wait()` and `is_completed()` from any.
"""

from __future__ import annotations

import threading

import torch

from dhelix.waiter_thread import WaiterThread

WATCHER_THREAD_NAME = "dhelix-receive-watcher"


class WatchedReceive:
    """A CPU receive's Work as its watcher thread sees it (module docstring)."""

    __slots__ = ("_work", "_done", "_error")

    def __init__(self, work):
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """True once the receive landed (or failed); never blocks."""
        return self._done.is_set()

    def wait(self) -> bool:
        """Block until the watcher's wait returned; raise its error if it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def settle(self) -> None:
        """The watcher thread's part: wait for the receive, keep its error, drop the Work,
        mark it done."""
        try:
            self._work.wait()
        except BaseException as error:  # raised on the caller's thread by wait()
            self._error = error
        self._work = None
        self._done.set()


class ReceivesInFlight:
    """Watchers of the CPU receives posted and not yet waited for (module docstring)."""

    def __init__(self):
        self._watchers: dict = {}  # (group, source rank) -> WaiterThread

    def watch(self, work, buffer: torch.Tensor, group, source: int):
        """The receive `work` into `buffer` from global rank `source` on `group` (None:
        the default group): a `WatchedReceive` if `buffer` is on the CPU, else `work`."""
        if buffer.device.type != "cpu":
            return work
        watched = WatchedReceive(work)
        channel = (group, source)
        watcher = self._watchers.get(channel)
        if watcher is None:
            watcher = self._watchers[channel] = WaiterThread(WATCHER_THREAD_NAME)
        watcher.submit(watched.settle)
        return watched

    def finish(self) -> None:
        """Stop every watcher once it has waited for what was submitted (every receive
        must have been posted to a peer that sends it)."""
        self._close(join=True)

    def abandon(self) -> None:
        """Stop every watcher once its current wait returns, without waiting here."""
        self._close(join=False)

    def _close(self, join: bool) -> None:
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher.close(join=join)
