"""Names that mark the emulated GPU's host threads, so the emulated cluster can raise them
(`comm_priority`).

On a GPU node the thread that launches kernels, and NCCL's issue of a collective when the
stream reaches it, run on host cores nothing else needs: the GPU computes, the NIC moves
bytes. Under the emulation both are threads of the rank process (the rank's main thread,
which dispatches every kernel and sleeps for their modelled time, and the thread of
`dhelix.gpu_emulation.stream_ordered_issue.StreamOrderedIssuer`), and on a shared-core
host they wait behind gloo's real-time threads (the emulated NIC, `comm_priority`) for a
core: measured on the 2-core machine at (a), the streamed row's compute thread waited
2.5 s of a 20.2 s step for its core (Megatron's 0.5 s), the emulated stream idling
meanwhile, an artefact of the host, not of the schedule. Each names itself with
`HOST_THREAD_PREFIX` (`name_current_thread`); the cluster's priority scan raises threads so
named to the NIC's real-time priority (never pins them to communication cores).

Device work the emulation does on a host thread (the all-to-all's copy of the rank's own
block, `dhelix.gpu_emulation.all_to_all_exchange`) runs under `below_host_threads()`: at
the fair scheduler's priority, so a raised host thread issuing kernels is not held behind
it (measured on the 2-core machine, MoE benchmark (e): with the copy at the NIC's priority
the forward operators co-executed with a backward all-to-all read 15-25 ms more than alone,
5-10 ms with it below; docs/gpu_emulation.md, "All-to-all").

Guarantees: renames only the calling thread, through Linux's /proc/self/task/<tid>/comm
(15 bytes at most); where that does not exist or is refused
nothing happens and False is returned. The name stays until the thread renames itself
again; the priority the scan gives it stays with the thread (a rank's main thread keeps it
outside the emulated calls too).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

HOST_THREAD_PREFIX = "emulated-"
MAIN_THREAD_NAME = HOST_THREAD_PREFIX + "host"
ISSUE_THREAD_NAME = HOST_THREAD_PREFIX + "issue"


def name_current_thread(name: str) -> bool:
    """Give the calling thread the kernel-visible name `name` (at most 15 bytes); True
    when done."""
    if len(name.encode()) > 15:
        raise ValueError(f"a thread name has at most 15 bytes, got {name!r}")
    comm = Path("/proc/self/task") / str(threading.get_native_id()) / "comm"
    try:
        comm.write_text(name)
    except OSError:
        return False
    return True


@contextmanager
def below_host_threads():
    """Run the body with the calling thread at normal priority (SCHED_OTHER) when it was
    raised to a real-time one (`comm_priority`), and give it back its policy afterwards,
    also when the body raises. A thread already at normal priority, or a host without
    these calls, runs the body unchanged; if the kernel refuses the restore the thread
    stays at normal priority (never raised above what it had)."""
    get = getattr(os, "sched_getscheduler", None)
    try:
        policy = get(0) if get is not None else None
        param = os.sched_getparam(0) if policy is not None else None
    except OSError:
        policy = None
    real_time = policy is not None and policy in (os.SCHED_FIFO, os.SCHED_RR)
    if real_time:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            real_time = False
    try:
        yield
    finally:
        if real_time:
            try:
                os.sched_setscheduler(0, policy, param)
            except OSError:
                pass
