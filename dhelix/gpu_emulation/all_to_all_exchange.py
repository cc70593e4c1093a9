"""The emulated GPU cluster's all-to-all: every receive posted before any send, each
sender's bytes on a gloo connection of their own.

A GPU cluster's all-to-all (NCCL) sends and receives at once: at EP = 2 it takes what one
direction's bytes take on the link. gloo's (`alltoallv`) posts each send before the
matching receive, and a receiver announces that it is ready on the TCP connection that
also carries its own outgoing bytes; when one rank starts a little after the other, its
announcement queues behind the bytes it already sends and the two directions take turns.
Measured on the emulated cluster (2 nodes, a 3 Gbit/s link, 67 MB each way; docs/
gpu_emulation.md, "All-to-all"): gloo's all-to-all took 372-402 ms in most exchanges and
195 ms in the rest, decided by the ranks' relative timing, not by the program (in the MoE
benchmark Megatron's dispatcher and the operator path's all-to-alls of equal bytes drew
the fast case at different rates). Point-to-point transfers with the receives posted first
run both directions at once, but on one connection, under the real-time gloo threads of
the emulated NIC (`dhelix.cluster.comm_priority`), they stalled ~1 s in most exchanges
(TCP retransmissions); with each direction on its own connection they took 187 ms every
time, the link's rate (gloo's all-reduce moving the same bytes each way: 186 ms).

`AllToAllExchanges.stand_in(func, args)` gives what to issue in place of c10d's
`alltoall_base_`: a callable with the operator's arguments and result that posts the
receives, then the sends (rank r's tagged r: gloo picks a connection by tag modulo its
devices, and the emulated cluster gives every process group two devices on the node's
link, `dhelix.cluster.launch`, so at a group size of 2 each direction has its connection),
and leaves the rank's own block to the group's watcher thread, which copies it before it
waits for the transfers: the issuing thread returns once the transfers are posted, as a
GPU's host returns from NCCL's launch (the copy is a device copy there). Done on the
issuing thread, the copy of a freshly allocated output (its pages first touched then) held
that thread, and so every kernel issued after the all-to-all, for tens of ms at the MoE
benchmark's shapes (docs/gpu_emulation.md, "All-to-all"); the watcher copies at normal
priority (`host_threads.below_host_threads`), below the raised host threads, and waits for
the transfers at the priority the cluster gave it. Elsewhere (another operator,
another backend, a group larger than the devices, a tensor not contiguous) `func` itself.

Guarantees: the output holds what `alltoall_base_` would put there (rows of the input split
by `input_split_sizes` to the group's ranks in order; `output_split_sizes[r]` rows from rank
r; empty split lists mean equal splits); nothing is copied besides the rank's own block
(output[own rows] = input[own rows], on the tensors' device). The handle's `wait()`,
`is_completed()` and `get_future()` are answered by the group's watcher thread, which
copies the own block and is the only waiter of the point-to-point Works (one thread per
group, named as an emulated GPU host thread so the cluster raises it like the issue
thread): done once the own block is copied and every receive and send completed, the first
error raised by `wait()`. The handle holds the own block's two views and those Works (which
hold the tensors) until then and drops them before its waiters wake. The exchanges object
keeps every handle it issued until `close()`, which stops the watchers once their exchanges
completed: wait on a handle before closing. Every rank of the group must issue the same
exchanges in the same order, as for any collective.
"""

from __future__ import annotations

import os
import threading

import torch
from torch._C._distributed_c10d import Work

from dhelix.c10d_ops import process_group_of
from dhelix.cluster.host_threads import (
    HOST_THREAD_PREFIX, below_host_threads, name_current_thread)
from dhelix.cluster.naming import GLOO_DEVICES_ENV
from dhelix.gpu_emulation.aten_costs import op_name
from dhelix.waiter_thread import WaiterThread

WATCHER_THREAD_NAME = HOST_THREAD_PREFIX + "a2a"


def gloo_devices(environ=os.environ) -> int:
    """How many devices gloo gives each process group here (one per name in
    GLOO_SOCKET_IFNAME; one when unset)."""
    names = [n for n in environ.get(GLOO_DEVICES_ENV, "").split(",") if n.strip()]
    return max(1, len(names))


class ExchangeWork(Work):
    """The handle of one exchange: the group's watcher copies the rank's own block
    (`own`: (destination, source) views, or None) and is the only thread that waits on its
    point-to-point Works (gloo's cannot be waited twice: a second wait blocks for good),
    then drops them and marks this handle done."""

    def __init__(self, works: list, own: tuple | None = None):
        super().__init__()
        self._works = works
        self._own = own
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future = torch.futures.Future()

    def _settle(self) -> None:
        """The watcher's part: copy the own block, wait for every Work, keep the first
        error, drop them."""
        works, self._works = self._works, []
        own, self._own = self._own, None
        try:
            if own is not None:
                with below_host_threads():  # a device copy on a GPU: not the host's time
                    own[0].copy_(own[1])
                own = None
            while works:
                works.pop(0).wait()  # no name keeps the Work (and its tensor) past its wait
        except BaseException as error:
            self._error = error
        works.clear()
        # the tensors are released before the waiters wake: a waiter's next allocations
        # must not see them alive (the benchmark's peak memory); the future is settled
        # before the event, so a waiter that woke sees it done too
        if self._error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(self._error)
        self._done.set()

    def wait(self, timeout=None):
        # c10d's Work.wait: a timedelta, zero (its default through the binding) = none
        seconds = timeout.total_seconds() if timeout else None
        if not self._done.wait(seconds):
            raise RuntimeError(f"error: an emulated all-to-all did not complete within "
                               f"{seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def get_future(self):
        return self._future


def _rows(splits: list, rows: int, size: int) -> list:
    if splits:
        return list(splits)
    if rows % size:
        raise ValueError(f"error: {rows} rows do not split evenly over {size} ranks")
    return [rows // size] * size


def _blocks(tensor: torch.Tensor, splits: list) -> list:
    starts = [sum(splits[:i]) for i in range(len(splits))]
    return [tensor.narrow(0, start, count) for start, count in zip(starts, splits)]


class AllToAllExchanges:
    """Issues all-to-alls as full-duplex exchanges (module docstring); one per emulated
    call or replay. `devices`: gloo's devices per group (default: `gloo_devices()`)."""

    def __init__(self, devices: int | None = None):
        self.devices = gloo_devices() if devices is None else devices
        self._watchers: dict = {}
        # every handle issued, until close(): c10d hands a Python Work subclass around
        # boxed, which does not keep the Python object alive, and once it is gone the
        # unboxed handle is c10d's base Work (get_future() raised "not implemented" in the
        # benchmark: tests/gpu_emulation/test_all_to_all_exchange.py issues that case)
        self._issued: list = []

    def stand_in(self, func, args: tuple):
        """What to call in place of `func(*args)`: the exchange for a gloo
        `alltoall_base_` it can carry, else `func`."""
        if op_name(func) != "alltoall_base_":
            return func
        output, tensor = args[0], args[1]
        group = process_group_of(args)
        if (group is None or group._get_backend_name() != "gloo"
                or not 2 <= group.size() <= self.devices
                or not (output.is_contiguous() and tensor.is_contiguous())):
            return func
        return _ExchangeCall(func._schema, self)

    def exchange(self, output: torch.Tensor, tensor: torch.Tensor, group,
                 output_splits: list, input_splits: list) -> ExchangeWork:
        """Post the receives, then the sends; the exchange's handle (the group's watcher
        copies the own block, then waits for the transfers)."""
        size, me = group.size(), group.rank()
        received = _blocks(output, _rows(output_splits, output.shape[0], size))
        sent = _blocks(tensor, _rows(input_splits, tensor.shape[0], size))
        peers = [p for p in range(size) if p != me]
        works = [group.recv([received[p]], p, p) for p in peers if received[p].numel()]
        works += [group.send([sent[p]], p, me) for p in peers if sent[p].numel()]
        # the own block: copied by the watcher (module docstring), not on this thread
        own = (received[me], sent[me]) if received[me].numel() else None
        work = ExchangeWork(works, own)
        self._issued.append(work)
        watcher = self._watchers.get(group)
        if watcher is None:
            # one group's watcher: its exchanges settle in issue order (a group runs one
            # collective at a time), on an emulated GPU host thread
            watcher = self._watchers[group] = WaiterThread(
                WATCHER_THREAD_NAME, on_start=lambda: name_current_thread(WATCHER_THREAD_NAME))
        watcher.submit(work._settle)
        return work

    def close(self) -> None:
        """Stop the watchers once they have seen their exchanges complete; the handles
        issued are answered until then (wait on them before closing)."""
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher.close()
        self._issued = []


class _ExchangeCall:
    """`alltoall_base_`'s stand-in: its schema, arguments and result (a boxed Work)."""

    def __init__(self, schema, exchanges: AllToAllExchanges):
        self._schema = schema
        self._exchanges = exchanges

    def __call__(self, output, tensor, process_group, output_split_sizes, input_split_sizes,
                 async_op=True, timeout=-1):
        group = process_group_of((process_group,))
        return self._exchanges.exchange(output, tensor, group, list(output_split_sizes),
                                        list(input_split_sizes)).boxed()
