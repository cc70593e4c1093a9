"""Collectives issued when the emulated compute stream reaches them, not when the host does.

On a GPU, `dist.all_reduce(x, async_op=True)` returns at once: NCCL's kernel is queued
behind an event on the compute stream, so it starts when the kernels issued before it end,
while the host goes on issuing more kernels. `GpuEmulationMode` keeps a stream clock; a
collective whose inputs are still being "computed" on it (the clock ahead of the host) is
handed to a `StreamOrderedIssuer`: one thread per mode that sleeps until the clock time the
collective was issued at and then issues it for real (gloo moves the bytes), while the host
gets a `StreamOrderedWork` back at once and keeps issuing kernels. Without it the host would
sleep until the stream drained before every collective and the stream would sit empty while
the host then dispatched the next kernel: an idle gap a GPU does not have.

Guarantees:
- Order: collectives are issued in the order the host issued them (one FIFO thread; their
  start times are non-decreasing, since the stream clock is), so every process group sees
  the same order on every rank as without the issuer.
- One process group, one collective at a time: a collective is issued only after the
  previous one on its process group (issued here or noted by `note_issued`) has completed,
  as NCCL runs one communicator's kernels one after another on its stream. Two strands
  sharing a group (`dhelix.runtime.streamed_executor`) thus take the link in turn instead of
  sharing it; groups of their own still overlap each other.
- Only the collectives whose result is their in-place tensor argument and a Work
  (`deferrable`): the caller's tensors are what the operator returns, so the host can be
  given them before the collective ran. Others (point-to-point, functional collectives)
  drain the stream and run on the host, after `flush()`.
- Errors: an exception the real collective raises is raised by the handle's `wait()`, and
  by `flush()` if nobody waited.
- Ownership: the issuer holds the operator's arguments (the caller's tensors) until the
  collective is issued and no longer; the handle holds the real Work (which holds the
  tensors until the handle is dropped, as a Work of a collective issued directly does);
  the issuer keeps a handle only after its collective failed, until `flush()` reports it.
- Device: the tensors stay where the caller made them; nothing is copied.
"""

from __future__ import annotations

import queue
import threading
import time

from torch._C._distributed_c10d import Work

from dhelix.c10d_ops import process_group_of, unboxed_work
from dhelix.cluster.host_threads import ISSUE_THREAD_NAME, name_current_thread
from dhelix.gpu_emulation.aten_costs import namespace, op_name
from dhelix.gpu_emulation.link_record import LinkRecord

# c10d operators whose results are (their first argument, Work) or a Work alone
_DEFERRABLE = frozenset({
    "allreduce_", "allreduce_coalesced_", "_allgather_base_", "allgather_",
    "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_", "broadcast_"})


def deferrable(func) -> bool:
    """A c10d collective `StreamOrderedIssuer` may issue later (module docstring)."""
    return namespace(func) == "c10d" and op_name(func) in _DEFERRABLE


class StreamOrderedWork(Work):
    """The handle the host gets for a collective not yet issued: `wait()` blocks until the
    issuer issued it and then waits on the real Work (what a CPU rank's wait does);
    `is_completed()` is False until then."""

    def __init__(self):
        super().__init__()
        self._issued = threading.Event()
        self._real: Work | None = None
        self._error: BaseException | None = None
        self._waited = False

    def _set(self, real: Work | None, error: BaseException | None = None) -> None:
        self._real, self._error = real, error
        self._issued.set()

    def wait(self, timeout=None):
        self._waited = True
        self._issued.wait()
        if self._error is not None:
            raise self._error
        return self._real.wait() if timeout is None else self._real.wait(timeout)

    def is_completed(self) -> bool:
        if not self._issued.is_set():
            return False
        return self._error is not None or self._real.is_completed()

    def is_success(self) -> bool:
        return self._issued.is_set() and self._error is None and self._real.is_success()

    def exception(self):
        return self._error

    def get_future(self):
        self._issued.wait()
        if self._error is not None:
            raise self._error
        return self._real.get_future()


class StreamOrderedIssuer:
    """Issues deferred collectives at their stream times, in order, on one thread of its own
    (started on first use, stopped by `close()`). Every collective on a process group, issued
    here or noted by `note_issued`, is also noted in `link` when given
    (`link_record.LinkRecord`: when it was issued and completed)."""

    def __init__(self, link: LinkRecord | None = None):
        self.link = link
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failed: list = []  # handles whose collective raised
        # process group -> an Event set when its last collective completes (not the Work:
        # a Work holds its tensors until dropped)
        self._last: dict = {}

    @property
    def pending(self) -> bool:
        return self._queue.unfinished_tasks > 0

    def busy(self, group) -> bool:
        """True while the last collective issued on `group` has not completed."""
        done = self._last.get(group)
        return done is not None and not done.is_set()

    def note_issued(self, group, work) -> None:
        """Record `work` (a real Work), issued just now, as `group`'s last collective; keeps
        only an Event its future sets on completion (or failure), and notes it in `link`."""
        if group is None:
            return
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        self._last[group] = done
        if self.link is not None:
            self.link.note(work)

    def submit(self, start_at: float, func, args: tuple, kwargs: dict):
        """Queue `func(*args, **kwargs)` to be issued at `time.perf_counter()` >= `start_at`;
        returns what the operator returns, with a `StreamOrderedWork` (boxed, as the
        dispatcher hands it back) in place of its Work."""
        work = StreamOrderedWork()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="emulated-stream-issue",
                                            daemon=True)
            self._thread.start()
        self._queue.put((start_at, func, args, kwargs, work))
        boxed = work.boxed()
        return boxed if len(func._schema.returns) == 1 else (args[0], boxed)

    def _run(self) -> None:
        name_current_thread(ISSUE_THREAD_NAME)  # an emulated GPU host thread (host_threads)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                start_at, func, args, kwargs, work = item
                while (left := start_at - time.perf_counter()) > 0:
                    time.sleep(left)
                group = process_group_of(args)
                previous = self._last.get(group)
                try:
                    if previous is not None:
                        previous.wait()  # the group's stream runs one collective at a time
                    result = func(*args, **kwargs)
                except BaseException as error:  # raised by the handle's wait()
                    self._failed.append(work)
                    work._set(None, error)
                    continue
                real = unboxed_work(result if len(func._schema.returns) == 1 else result[-1])
                self.note_issued(group, real)
                work._set(real)
            finally:
                # drop this thread's references to the caller's tensors and the handle now,
                # not when the next collective arrives
                item = args = kwargs = result = work = real = previous = None
                self._queue.task_done()

    def flush(self) -> None:
        """Block until every queued collective has been issued; raise the first error one
        of them raised."""
        self._queue.join()
        errors = [w._error for w in self._failed if not w._waited]
        self._failed = []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """`flush()`, then stop the thread."""
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
