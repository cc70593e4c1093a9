"""Where a rank's wall time went, from the kernel's own accounts (Linux).

A step's wall time on the compute thread splits into: on a CPU (`thread_run_s`), ready to
run but the core was busy with something else (`thread_runnable_s`: another thread of the
rank such as gloo's, another process, the kernel's network work), and off the CPU (blocked:
waiting on a collective, a barrier, a lock). `other_threads_s` is what the rank's other
threads (gloo's transport threads, mostly) ran; `softirq_s` is the machine's
softirq time (packet processing, qdisc timers), shared by every rank on the machine.

Sources: `/proc/thread-self/schedstat` (run and run-queue time of the calling thread, ns),
`/proc/self/task/*/schedstat` (every other thread's run time; a thread that ends between
two readings is missed), `/proc/stat`'s softirq and steal columns (clock ticks, all CPUs).
Steal is time the hypervisor gave this virtual machine's CPUs to someone else: a thread
preempted that way is neither running nor runnable in its own schedstat, so on a virtual
machine run + runnable can fall short of a busy thread's wall time by up to the machine's
steal. Where a source is missing (not Linux, schedstat off) the field is None. Taking a
reading costs one small file read per thread (~1 ms for 70 threads); nothing is started.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


def _schedstat() -> tuple[float, float] | None:
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def _other_threads_s() -> float | None:
    """Run time (s) of every thread of this process but the calling one."""
    me = str(threading.get_native_id())
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9


def _all_cpus_s(column: int) -> float | None:
    """One column of `/proc/stat`'s all-CPUs line (1 user ... 7 softirq, 8 steal), s."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) <= column or fields[0] != "cpu":
        return None
    return int(fields[column]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative readings (seconds); subtract two to get an interval's share."""

    thread_run_s: float | None
    thread_runnable_s: float | None
    other_threads_s: float | None
    softirq_s: float | None
    steal_s: float | None

    @classmethod
    def now(cls) -> "CpuTimes":
        """The calling thread's readings now (call it from the thread being accounted)."""
        sched = _schedstat()
        return cls(thread_run_s=sched and sched[0], thread_runnable_s=sched and sched[1],
                   other_threads_s=_other_threads_s(), softirq_s=_all_cpus_s(7),
                   steal_s=_all_cpus_s(8))

    def since(self, earlier: "CpuTimes") -> dict:
        """The interval from `earlier` to this reading: the thread's run and runnable time,
        the rank's other threads' CPU, and the machine's softirq and steal time (s; None
        where a source was missing)."""
        def delta(name):
            a, b = getattr(earlier, name), getattr(self, name)
            return None if a is None or b is None else b - a

        return {"thread_run": delta("thread_run_s"),
                "thread_runnable": delta("thread_runnable_s"),
                "other_threads": delta("other_threads_s"), "softirq": delta("softirq_s"),
                "steal": delta("steal_s")}
