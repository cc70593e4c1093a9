"""One gloo transport device for the process groups of a process, when asked for with
`DHELIX_GLOO_SHARED_DEVICE=1`.

torch builds each gloo process group with a transport device of its own, and each gloo TCP
device runs an event-loop thread that wakes every 10 ms whether or not its group is used.
Megatron makes 25-60 groups a rank (every parallel dimension, expert and embedding groups
included), so a rank's idle groups alone wake its cores thousands of times a second. With
the variable set, every gloo group made afterwards in the process shares one device (built
as torch builds a group's own: one per interface of `GLOO_SOCKET_IFNAME`, else the host's
default), so one loop thread serves the sockets of every group, but for the groups made
inside `own_gloo_devices()` (the DHelix lanes and the pipeline's transfer groups, which
carry concurrent traffic). The groups, their ranks, algorithms and bytes are unchanged.

It is a trade, measured on the 2-core machine with 4 gloo ranks: one device removes the
idle wake-ups (a 4-rank launch that builds one Megatron run after another: 121-123 s ->
73-82 s wall, its context switches 5.8 M -> 0.8 M) but a small all-reduce on a group that
shares it takes ~30% longer (4.9 -> 6.4 ms for 4 KiB on Megatron's TP group), so a launch
dominated by collectives on a few groups got slower with it (the operator parity launches:
+16 s). Unset, torch's one device per group is left alone: benchmarks and users' runs keep
it unless they choose otherwise; the tests' launches that build many runs set it
(tests/megatron_lm_ranks.py, `many_runs_env`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from datetime import timedelta

SHARED_DEVICE_ENV = "DHELIX_GLOO_SHARED_DEVICE"
# what torch's own constructor reads for the interfaces its devices bind to
SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
# torch's ProcessGroupGloo(store, rank, size) timeout when none is given
DEFAULT_TIMEOUT = timedelta(minutes=30)


def share_gloo_device_if_asked() -> bool:
    """With `DHELIX_GLOO_SHARED_DEVICE=1`, make every gloo group this process creates from
    now on use one shared transport device; True when that is (now) in effect. Idempotent;
    groups created before the call keep their own devices. Must run in the process that
    creates the groups (a rank), after any fork: the device's loop thread starts with the
    first group made."""
    if os.environ.get(SHARED_DEVICE_ENV) != "1":
        return False
    from torch.distributed import ProcessGroupGloo

    if getattr(ProcessGroupGloo.__init__, "__dhelix_shared_device__", False):
        return True
    ProcessGroupGloo.__init__ = _shared_device_init(ProcessGroupGloo.__init__)
    return True


# True inside `own_gloo_devices()`: groups made there get torch's own device each
_OWN_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("own_gloo_devices",
                                                                   default=False)


@contextlib.contextmanager
def own_gloo_devices():
    """Groups created inside get a device of their own (torch's default) even where devices
    are shared: for the groups that carry a DHelix step's collectives and transfers (the
    lanes, the pipeline's transfer groups), which should not pay the shared device's
    per-collective cost nor read their sockets on one thread."""
    token = _OWN_DEVICE.set(True)
    try:
        yield
    finally:
        _OWN_DEVICE.reset(token)


def _shared_device_init(original_init):
    """`ProcessGroupGloo.__init__` that gives the (store, rank, size[, timeout]) form, the
    one `torch.distributed` calls, the process's shared devices; the form with explicit
    options passes through unchanged."""
    from torch.distributed import ProcessGroupGloo

    devices: dict[str, list] = {}  # GLOO_SOCKET_IFNAME's value -> the devices built for it

    def shared_devices() -> list:
        ifnames = os.environ.get(SOCKET_IFNAME_ENV, "")
        if ifnames not in devices:
            if len(ifnames) > 1:  # torch's own test for a set variable
                devices[ifnames] = [ProcessGroupGloo.create_device(interface=name)
                                    for name in ifnames.split(",")]
            else:
                devices[ifnames] = [ProcessGroupGloo.create_default_device()]
        return devices[ifnames]

    def __init__(self, store, rank, size, *args, **kwargs):
        if _OWN_DEVICE.get() or (args and isinstance(args[0], ProcessGroupGloo._Options)):
            return original_init(self, store, rank, size, *args, **kwargs)
        timeout = kwargs.pop("timeout", args[0] if args else DEFAULT_TIMEOUT)
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = shared_devices()
        options._threads = 2 * len(options._devices)  # as torch's own constructor sets it
        return original_init(self, store, rank, size, options)

    __init__.__dhelix_shared_device__ = True
    return __init__
