"""`SendsInFlight`: the pipeline executor's point-to-point sends until each has completed,
and the tensors they read, freed as soon as their send is done.

A sent tensor must stay alive until its send completed, and no longer: the W schedule
sends an activation and a gradient a block, and kept until the step's end they add up to
every micro-batch's (measured on the emulated GPU: 16 tensors of 32 MiB a rank, 1.14x
1F1B's peak memory). How completion is seen depends on where the tensor lives:

- CUDA tensors (NCCL): `Work.is_completed()` answers without blocking; `release_finished()`
  polls it on the caller's thread.
- CPU tensors (gloo): a gloo point-to-point Work reports `is_completed()` False until it
  was waited on (torch 2.13: it has no future either), and a second wait never returns. A
  watcher thread (`dhelix.waiter_thread.WaiterThread`) is the one waiter: it waits for the
  sends in the order they were posted and, as each wait returns, hands the send's tensor
  and Work back to the caller, whose next `release_finished()` (or `finish()`) drops them.
  The watcher never holds the last reference: a tensor freed on a thread other than the
  one running the model is invisible to the CPU memory reading (`dhelix.memtrace`: the
  profiler records frees only on the thread it follows), which then counted sent tensors
  long after their sends completed. It is started on the first CPU send and stopped by
  `finish()`/`abandon()`.

Guarantees: `add` never blocks. A tensor is referenced here until its send completed, then
dropped by the caller's next `release_finished()` / `finish()` (its storage freed on the
caller's thread when nobody else holds it).
`finish()` returns once every send completed and raises the first error a send's wait
raised (also raised by the `release_finished()` after it happened). `abandon()` stops
the watcher without waiting for what is in flight (the failure path: a send to a dead
peer must not hang the caller). The caller calls `add`, `release_finished`, `finish` and
`abandon` from one thread.
"""

from __future__ import annotations

import threading

import torch

from dhelix.waiter_thread import WaiterThread

WATCHER_THREAD_NAME = "dhelix-send-watcher"


class _Send:
    __slots__ = ("work", "tensor", "on_cpu", "done")

    def __init__(self, work, tensor: torch.Tensor):
        self.work = work
        self.tensor = tensor  # set to None by the watcher once the send completed
        self.on_cpu = tensor.device.type == "cpu"
        self.done = threading.Event()


class SendsInFlight:
    """The sends posted and not yet seen complete (module docstring)."""

    def __init__(self):
        self._sends: list[_Send] = []
        self._watcher = WaiterThread(WATCHER_THREAD_NAME)
        self._error: BaseException | None = None
        # (tensor, Work) of CPU sends the watcher saw complete, for the caller to drop
        self._finished: list = []
        self._finished_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sends)

    def held_bytes(self) -> int:
        """Bytes of the tensors still held: sends not seen complete, and completed ones the
        caller has not released yet."""
        with self._finished_lock:
            held = [s.tensor for s in self._sends] + [t for t, _ in self._finished]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def add(self, work, tensor: torch.Tensor) -> None:
        """Hold `tensor` until `work`, its send, completed."""
        send = _Send(work, tensor)
        self._sends.append(send)
        if send.on_cpu:
            self._watcher.submit(lambda: self._settle(send))

    def release_finished(self) -> None:
        """Forget the sends seen complete, dropping their tensors on this thread; raise a
        send's error."""
        self._raise_error()
        self._sends = [s for s in self._sends if not self._completed(s)]
        self._drop_finished()

    def finish(self) -> None:
        """Wait for every send; stop the watcher; drop every tensor on this thread; raise
        the first send error."""
        for send in self._sends:
            if send.on_cpu:
                send.done.wait()
            else:
                send.work.wait()
        self._sends = []
        self._watcher.close(join=True)
        self._drop_finished()
        self._raise_error()

    def abandon(self) -> None:
        """Stop the watcher once its current wait returns, without waiting here; drop
        this object's hold on the tensors (the watcher keeps the one it waits on)."""
        self._sends = []
        self._watcher.close(join=False)
        self._drop_finished()

    def _drop_finished(self) -> None:
        with self._finished_lock:
            finished, self._finished = self._finished, []
        del finished  # the last references, on the caller's thread

    def _completed(self, send: _Send) -> bool:
        if send.on_cpu:
            return send.done.is_set()
        return send.work.is_completed()

    def _settle(self, send: _Send) -> None:
        """The watcher thread's part for one CPU send: wait, keep the first error, hand the
        tensor and the Work to the caller, mark it done."""
        try:
            send.work.wait()
        except BaseException as error:  # reported on the caller's thread
            if self._error is None:
                self._error = error
        with self._finished_lock:  # handed to the caller, who drops them (module docstring)
            self._finished.append((send.tensor, send.work))
        send.tensor = None
        send.work = None
        send.done.set()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
