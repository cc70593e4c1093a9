"""`Arriving`: a tensor still being received (a point-to-point `irecv` posted and not yet
waited on), handed to code that can start before its values land.

The pipeline executor (`dhelix.schedules.executor`) posts the receives of a RECV action at
once and hands the buffers to a pass engine that takes them as `Arriving` (the DHelix
engine: a layer execution holds one as a pending value, so the strand executor waits for it
only when an operator reads it and runs the other strand meanwhile). Everyone else calls
`landed()` first.

`Producing` is a value not computed yet: the next micro-batch's embedding output in an SI
block, produced when the layer runner starts it at a block boundary (before the block whose
forward strand reads it first), so it is not alive while the backward strand's first layer
operators hold their activations. Its product may itself be arriving (a `Finishing` whose
all-reduce then travels).

`Finishing` is the same for a collective whose result needs a last local step before it is
the value (the embedding's TP all-reduce, `megatron_patches.deferred_reduce`, transposed
once it landed): that step runs once, right after the wait, on the waiting thread / current
stream.

Guarantees: the receive is waited on at most once, however often `wait()` / `landed()` are
called (a second wait on a gloo point-to-point Work never returns). The buffer belongs to
whoever holds the `Arriving`; it lives on the device the receiver allocated it on; waiting
blocks the host on CPU ranks and orders the current stream after the receive with NCCL.
"""

from __future__ import annotations

import torch


class Arriving:
    """The buffer `tensor` of a receive and its Work; usable wherever a collective's Work
    is (`wait()`, `is_completed()`)."""

    __slots__ = ("tensor", "_work", "_waited")

    def __init__(self, tensor: torch.Tensor, work):
        self.tensor = tensor
        self._work = work
        self._waited = False

    def wait(self) -> bool:
        """Wait for the receive (once; later calls return at once)."""
        if not self._waited:
            self._work.wait()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or self._work.is_completed()

    def landed(self) -> torch.Tensor:
        """The buffer, after waiting for the receive."""
        self.wait()
        return self.tensor


class Finishing(Arriving):
    """An `Arriving` whose value is ready only after `finish()` has run once the work
    completed: `finish` (no arguments) runs exactly once, on the first `wait()`, and leaves
    the value in `tensor` (the buffer given here, written in place). `is_completed()` says
    whether waiting would block on communication (`finish` is local computation)."""

    __slots__ = ("_finish",)

    def __init__(self, tensor: torch.Tensor, work, finish):
        super().__init__(tensor, work)
        self._finish = finish

    def wait(self) -> bool:
        if not self._waited:
            self._work.wait()
            finish, self._finish = self._finish, None
            finish()
            self._waited = True
        return True


class Producing(Arriving):
    """A value computed locally when started: `produce()` (no arguments) runs exactly once, on
    `start()` or else on the first `wait()`, and returns the tensor or an `Arriving` of it
    (then waited on by `wait()`). Before that, `tensor` is None and nothing is allocated.
    `is_completed()` is True until started (starting is local computation, never a wait on
    communication), then the product's. Whoever holds it must start it at the same point on
    every rank of a group when `produce` issues a collective (the layer runner starts it at a
    block boundary)."""

    __slots__ = ("_produce", "_product")

    def __init__(self, produce):
        super().__init__(None, None)
        self._produce = produce
        self._product = None

    @property
    def started(self) -> bool:
        return self._produce is None

    def start(self) -> "Producing":
        """Run `produce` now (once; later calls do nothing)."""
        if self._produce is not None:
            produce, self._produce = self._produce, None
            product = produce()
            if isinstance(product, Arriving):
                self._product, self.tensor = product, product.tensor
            else:
                self.tensor = product
        return self

    def wait(self) -> bool:
        if not self._waited:
            self.start()
            if self._product is not None:
                self._product.wait()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or self._product is None or self._product.is_completed()


def landed(value):
    """`value` itself, or an `Arriving`'s buffer once received."""
    return value.landed() if isinstance(value, Arriving) else value


def buffer_of(value):
    """`value` itself, or an `Arriving`'s buffer without waiting (for code that passes the
    tensor on without reading its values)."""
    return value.tensor if isinstance(value, Arriving) else value
