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
  sends in the order they were posted and drops each one's tensor as soon as its wait
  returns. It is started on the first CPU send and stopped by `finish()`/`abandon()`.

Guarantees: `add` never blocks. A tensor is referenced here until its send completed, then
dropped (its storage freed when nobody else holds it; on CPU by the watcher thread).
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

    def __len__(self) -> int:
        return len(self._sends)

    def held_bytes(self) -> int:
        """Bytes of the tensors still held for sends not seen complete."""
        held = [s.tensor for s in self._sends]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def add(self, work, tensor: torch.Tensor) -> None:
        """Hold `tensor` until `work`, its send, completed."""
        send = _Send(work, tensor)
        self._sends.append(send)
        if send.on_cpu:
            self._watcher.submit(lambda: self._settle(send))

    def release_finished(self) -> None:
        """Forget the sends seen complete (their tensors are dropped); raise a send's error."""
        self._raise_error()
        self._sends = [s for s in self._sends if not self._completed(s)]

    def finish(self) -> None:
        """Wait for every send; stop the watcher; raise the first send error."""
        for send in self._sends:
            if send.on_cpu:
                send.done.wait()
            else:
                send.work.wait()
        self._sends = []
        self._watcher.close(join=True)
        self._raise_error()

    def abandon(self) -> None:
        """Stop the watcher once its current wait returns, without waiting here; drop
        this object's hold on the tensors (the watcher keeps the one it waits on)."""
        self._sends = []
        self._watcher.close(join=False)

    def _completed(self, send: _Send) -> bool:
        if send.on_cpu:
            return send.done.is_set()
        return send.work.is_completed()

    def _settle(self, send: _Send) -> None:
        """The watcher thread's part for one CPU send: wait, keep the first error, drop the
        tensor and the Work, mark it done."""
        try:
            send.work.wait()
        except BaseException as error:  # reported on the caller's thread
            if self._error is None:
                self._error = error
        send.tensor = None
        send.work = None
        send.done.set()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
