"""Core placement of the emulated cluster: the split (pure), the pinning before exec, and
gloo-named threads moved to their node's communication cores (real processes, no root);
the emulated GPU's host threads raised with them but left on their cores, and device work
on a host thread run below them (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dhelix.cluster.comm_priority import CommThreadPriority
from dhelix.cluster.cores import plan_cores, pin_prefix
from dhelix.cluster.host_threads import below_host_threads


def test_sixteen_cores_two_nodes_get_compute_and_communication_blocks():
    placement = plan_cores(range(16), nodes=2, ranks_per_node=1)
    assert placement.separate
    assert [n.compute for n in placement.nodes] == [tuple(range(6)), tuple(range(8, 14))]
    assert [n.comm for n in placement.nodes] == [(6, 7), (14, 15)]
    assert placement.threads_per_rank(1) == 6
    assert "node 0: compute 0-5, communication 6-7" in placement.describe()


def test_two_ranks_per_node_share_the_nodes_computation_cores():
    placement = plan_cores(range(16), nodes=2, ranks_per_node=2)
    assert [len(n.compute) for n in placement.nodes] == [6, 6]
    assert placement.threads_per_rank(2) == 3


def test_too_few_cores_is_shared_core_and_says_why():
    placement = plan_cores(range(2), nodes=2, ranks_per_node=1)
    assert not placement.separate
    assert placement.threads_per_rank(1) is None
    assert placement.describe().startswith("shared-core (2 cores for 2 nodes x 1 ranks")
    assert not plan_cores(range(16), 2, 1, comm_per_node=0).separate


def test_an_explicit_count_that_does_not_fit_is_one_line():
    with pytest.raises(ValueError, match=r"^--comm-cores 4: 8 usable cores give each of 2 "
                                         r"nodes 4, fewer than its 1 rank\(s\) \+ 4"):
        plan_cores(range(8), 2, 1, comm_per_node=4)
    assert plan_cores(range(8), 2, 1, comm_per_node=3).nodes[1].comm == (5, 6, 7)


def test_cli_option_is_refused_in_one_line():
    from dhelix.cluster.cli import parse_comm_cores

    assert parse_comm_cores("auto") is None and parse_comm_cores("2") == 2
    with pytest.raises(ValueError, match="^--comm-cores x: give 'auto'"):
        parse_comm_cores("x")


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                     reason="needs 2 usable cores")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs root")
ROOT = Path(__file__).resolve().parents[2]


@needs_two_cores
def test_pin_prefix_pins_the_command_it_execs():
    core = max(os.sched_getaffinity(0))
    out = subprocess.run(
        pin_prefix(sys.executable, (core,))
        + [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"[{core}]"


# A process with one thread named like gloo's transport thread (prctl PR_SET_NAME), which
# prints its thread id and then sleeps until killed.
_GLOO_NAMED_THREAD = """
import ctypes, threading, time
def body():
    ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)
    import threading as t; print(t.get_native_id(), flush=True); time.sleep(60)
threading.Thread(target=body, daemon=True).start()
time.sleep(60)
"""


@needs_two_cores
def test_gloo_threads_move_to_the_nodes_communication_cores_and_nothing_else_does():
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", _GLOO_NAMED_THREAD], stdout=subprocess.PIPE,
                            text=True)
    try:
        tid = int(proc.stdout.readline())
        control = CommThreadPriority([proc.pid], raise_priority=False,
                                     comm_cores={proc.pid: (cores[-1],)})
        deadline = time.monotonic() + 10
        while control.scan() == 0 and not control.raised and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(tid) == {cores[-1]}
        assert os.sched_getaffinity(proc.pid) == set(cores)  # the main thread kept its cores
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER  # priority left alone
    finally:
        proc.kill()
        proc.wait()


# The gloo-named thread as above, and the main thread named as the emulated GPU's host
# thread (dhelix.cluster.host_threads), which prints "named" once it is.
_GLOO_AND_HOST_THREADS = """
import ctypes, threading, time
from dhelix.cluster.host_threads import MAIN_THREAD_NAME, name_current_thread
def body():
    ctypes.CDLL(None).prctl(15, b"gloo_tcp_loop", 0, 0, 0)
    print(threading.get_native_id(), flush=True); time.sleep(60)
threading.Thread(target=body, daemon=True).start()
time.sleep(0.2)
print("named" if name_current_thread(MAIN_THREAD_NAME) else "refused", flush=True)
time.sleep(60)
"""


@needs_two_cores
@needs_root
def test_emulated_host_threads_get_the_nics_priority_but_keep_their_cores():
    """A thread named by `host_threads` (the emulated GPU's kernel-issuing thread) is raised
    to SCHED_FIFO like gloo's threads and, unlike them, is not moved to the communication
    cores."""
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", _GLOO_AND_HOST_THREADS],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        gloo_tid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "named"
        assert open(f"/proc/{proc.pid}/task/{proc.pid}/comm").read().strip() == "emulated-host"
        control = CommThreadPriority([proc.pid], comm_cores={proc.pid: (cores[-1],)})
        assert control.scan() == 2 and control.failures == 0
        assert os.sched_getscheduler(gloo_tid) == os.SCHED_FIFO
        assert os.sched_getaffinity(gloo_tid) == {cores[-1]}
        assert os.sched_getscheduler(proc.pid) == os.SCHED_FIFO
        assert os.sched_getaffinity(proc.pid) == set(cores)  # not pinned
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_below_host_threads_drops_a_raised_thread_to_normal_and_gives_it_back():
    """The all-to-all's own-block copy runs below the raised host threads: inside
    `below_host_threads` a SCHED_FIFO thread is SCHED_OTHER, afterwards (also after an
    error) FIFO again at its priority; a normal thread stays normal throughout."""
    seen = []

    def raised_thread():
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        with below_host_threads():
            seen.append(os.sched_getscheduler(0))
        seen.append((os.sched_getscheduler(0), os.sched_getparam(0).sched_priority))
        try:
            with below_host_threads():
                raise KeyError("body")
        except KeyError:
            seen.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=raised_thread)
    thread.start()
    thread.join()
    assert seen == [os.SCHED_OTHER, (os.SCHED_FIFO, 1), os.SCHED_FIFO]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    with below_host_threads():
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
