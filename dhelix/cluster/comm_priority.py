"""The emulated NIC: communication threads of a run raised to real-time priority.

On a GPU cluster the NIC (with NCCL's proxy) moves bytes whatever the compute units are
doing. On the emulated cluster gloo's threads move them (`gloo_tcp_loop` reads arriving
data, `pt_gloo_runloop` runs the collective's algorithm), on the same cores as the ranks'
computation. Under Linux's fair scheduler a gloo thread woken by arriving data waits behind
the computing thread for its share of the core, and the link idles meanwhile: every
collective in flight during computation is stretched, and a schedule that overlaps
communication with computation loses part of what it hides. `CommThreadPriority` gives
every gloo thread of the run's processes SCHED_FIFO priority, so it runs as soon as it is
runnable, as a NIC would. The emulated GPU's host threads (named by
`dhelix.cluster.host_threads`: the rank's kernel-issuing thread and its collective issue)
get the same priority, as a GPU node's host threads have cores of their own; they are never
pinned to communication cores. With a core placement (`dhelix.cluster.cores`) the same
scan also moves each node's gloo threads onto that node's communication cores, so the CPU
they use no longer comes out of the computation's cores; without one (a 2-core host) it
does.

Measured on the 2-core development machine (docs/emulated_cluster.md, "Communication
threads"): with it, steps of every system got 9-18% shorter in configurations (a) and (a2)
of the benchmark.

Guarantees: only threads whose name starts with one of `COMM_THREAD_PREFIXES` or with
`HOST_THREAD_PREFIX`, in processes descended from the given root pids, are changed (policy
when `raise_priority`; affinity to the root's cores in `comm_cores`, communication threads
only); the computing threads keep their policy and affinity;
each thread is changed at most once; threads created later are found by a later `scan()`;
a thread that ended meanwhile is skipped and a refusal (EPERM) counted in `failures`,
never raised. Nothing needs undoing: the policy dies with the thread. Linux only (reads /proc).
"""

from __future__ import annotations

import os
from pathlib import Path

from dhelix.cluster.host_threads import HOST_THREAD_PREFIX

COMM_THREAD_PREFIXES = ("gloo", "pt_gloo")
POLICIES = ("fifo", "normal")
FIFO_PRIORITY = 1  # the lowest real-time priority: above every SCHED_OTHER thread
FULL_PASS_EVERY = 20  # scans; in between, a process is looked into only when its thread
                      # count changed (one thread ending as another starts goes unseen
                      # until the next full pass)
PROC = Path("/proc")
RT_RUNTIME = PROC / "sys" / "kernel" / "sched_rt_runtime_us"


def rt_throttling_problem() -> str | None:
    """Why real-time gloo threads would be unsafe on this host, or None. Linux lets
    real-time threads use at most `sched_rt_runtime_us` of every `sched_rt_period_us`
    (default 95%), so one that never blocks cannot take a core from the computation for
    good; -1 turns that off, and then a spinning real-time thread could starve the rank it
    belongs to."""
    try:
        runtime = int(RT_RUNTIME.read_text())
    except (OSError, ValueError):
        return None  # no such knob (not Linux, or a kernel without RT group scheduling)
    if runtime < 0:
        return (f"{RT_RUNTIME} is -1 (real-time threads unthrottled); set it back with "
                "`sysctl kernel.sched_rt_runtime_us=950000` or use --comm-priority normal")
    return None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 onwards), or None."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _process_table() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, thread count)} of every living process, one stat read each."""
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                table[int(entry.name)] = (int(fields[1]), int(fields[17]))  # ppid, num_threads
    return table


def descendants(roots, table: dict | None = None) -> list[int]:
    """Pids of every living process below `roots` (the roots included when alive), from
    `table` (`_process_table()`, read now when not given)."""
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _threads) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


class CommThreadPriority:
    """Raises the communication threads of the processes below `roots` and, for a root in
    `comm_cores` ({root pid: core ids}), pins them to those cores (see module)."""

    def __init__(self, roots, priority: int = FIFO_PRIORITY, raise_priority: bool = True,
                 comm_cores: dict[int, tuple[int, ...]] | None = None):
        self.roots = list(roots)
        self.priority = priority
        self.raise_priority = raise_priority
        self.comm_cores = dict(comm_cores or {})
        self.raised: set[tuple[int, int]] = set()  # (pid, tid)
        self.failures = 0
        self._threads_seen: dict[int, int] = {}  # pid -> thread count at the last scan
        self._scans = 0

    def scan(self) -> int:
        """One pass over the processes; returns how many threads it raised now."""
        raised_now = 0
        full = self._scans % FULL_PASS_EVERY == 0
        self._scans += 1
        table = _process_table()
        for root in self.roots:
            cores = self.comm_cores.get(root)
            for pid in descendants([root], table):
                threads = table[pid][1]
                if not full and self._threads_seen.get(pid) == threads:
                    continue  # no thread started or ended since the last pass
                self._threads_seen[pid] = threads
                raised_now += self._raise_threads(pid, cores)
        return raised_now

    def _raise_threads(self, pid: int, cores: tuple[int, ...] | None) -> int:
        count = 0
        try:
            tids = [int(t) for t in os.listdir(PROC / str(pid) / "task")]
        except OSError:
            return 0
        for tid in tids:
            if (pid, tid) in self.raised:
                continue
            try:
                name = (PROC / str(pid) / "task" / str(tid) / "comm").read_text().strip()
            except OSError:
                continue
            comm = name.startswith(COMM_THREAD_PREFIXES)
            if not comm and not name.startswith(HOST_THREAD_PREFIX):
                continue
            try:
                if cores and comm:
                    os.sched_setaffinity(tid, cores)
                if self.raise_priority:
                    os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(self.priority))
            except ProcessLookupError:
                continue  # the thread ended meanwhile
            except OSError:
                self.failures += 1
                continue
            self.raised.add((pid, tid))
            count += 1
        return count
