"""Run one `torchrun` per node namespace and supervise them as one job.

Node i runs, inside its namespace,

    torchrun --nnodes N --node-rank i --nproc-per-node R \
             --master-addr <node 0 address> --master-port P --log-dir <run's dir>/node<i> \
             <command...>

(pinned to the node's computation cores when the host has enough cores for a placement,
`dhelix.cluster.cores`), with gloo bound to the node's link (`GLOO_SOCKET_IFNAME=eth0,eth0`:
two gloo devices on it, so each process group holds two connections per pair of ranks, and
point-to-point transfers tagged by their sender carry each direction of an exchange on its
own, `dhelix.gpu_emulation.all_to_all_exchange`) and the topology exported to
every rank (`DHELIX_NUM_NODES`, `DHELIX_RANKS_PER_NODE`, `DHELIX_NODE_RANK`). Ranks of one
node reach each other over loopback: traffic between addresses of the same namespace never
leaves it, so only cross-node traffic crosses the shaped link.

Supervision (`NodeGroup.wait`): the first node that exits non-zero decides the exit code
(a signal death counts as 128 + signal), and the other nodes are stopped at once instead
of waiting on a collective that will never complete; if the overall timeout expires first
the exit code is 124 (as with timeout(1)). `NodeGroup.stop()` sends SIGTERM to every
torchrun still running (torchrun passes it on to its ranks), waits a grace period, then
SIGKILLs them, then removes the run's torchrun log directory (a temporary directory of
its own: without `--log-dir` torchrun leaves a /tmp/torchelastic_* directory per run).
Processes torchrun did not take down are left to `EmulatedNetwork.down()`, which kills
whatever is still inside the namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dhelix.cluster.comm_priority import CommThreadPriority
from dhelix.cluster.cores import CorePlacement, pin_prefix
from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.naming import GLOO_DEVICES_ENV, NODE_IFNAME, RunNames
from dhelix.cluster.output import LinePump

GLOO_DEVICES = 2  # gloo devices per rank, all on the node's link (module docstring)
TIMEOUT_EXIT_CODE = 124
POLL_S = 0.05
PRIORITY_SCAN_S = 0.25  # how often new communication threads are looked for
REPO_ROOT = Path(__file__).resolve().parents[2]


def find_torchrun(explicit: str | None = None) -> str:
    """`explicit` if given, else the repository's `.venv/bin/torchrun`, else the torchrun
    next to this Python, else the one on PATH. ClusterError if none is executable."""
    candidates = [explicit] if explicit else [
        str(REPO_ROOT / ".venv" / "bin" / "torchrun"),
        str(Path(sys.executable).with_name("torchrun")),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return os.path.abspath(candidate)
    if not explicit:
        from shutil import which

        found = which("torchrun")
        if found:
            return found
    raise ClusterError(f"torchrun not found (tried {', '.join(filter(None, candidates))} "
                       "and PATH); run scripts/install.sh or pass --torchrun PATH")


@dataclass(frozen=True)
class NodeJob:
    """What every node runs: the user's command under torchrun, and the rank environment."""

    command: list[str]
    ranks_per_node: int
    nodes: int
    torchrun: str
    master_port: int = 29500
    threads_per_rank: int | None = None
    extra_env: dict = field(default_factory=dict)
    placement: CorePlacement = CorePlacement(reason="no placement requested")

    def argv(self, node: int, log_dir: str | None = None) -> list[str]:
        """torchrun's command line for `node` (prefixed by the pinning to the node's
        computation cores when the placement is separate); `log_dir`: torchrun's
        `--log-dir` (where it keeps its per-rank error files; by default a new
        /tmp/torchelastic_* directory it never removes)."""
        pin = (pin_prefix(sys.executable, self.placement.nodes[node].compute)
               if self.placement.separate else [])
        logs = ["--log-dir", log_dir] if log_dir else []
        return [*pin, self.torchrun, "--nnodes", str(self.nodes), "--node-rank", str(node),
                "--nproc-per-node", str(self.ranks_per_node),
                "--master-addr", RunNames.node_address(0),
                "--master-port", str(self.master_port), *logs, *self.command]

    def environment(self, node: int, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update(self.extra_env)
        env[GLOO_DEVICES_ENV] = ",".join([NODE_IFNAME] * GLOO_DEVICES)
        env.update(
            DHELIX_NUM_NODES=str(self.nodes),
            DHELIX_RANKS_PER_NODE=str(self.ranks_per_node),
            DHELIX_NODE_RANK=str(node),
            PYTHONUNBUFFERED="1",
        )
        threads = (self.threads_per_rank
                   or self.placement.threads_per_rank(self.ranks_per_node)
                   or default_threads_per_rank(self.nodes * self.ranks_per_node))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        return env


def default_threads_per_rank(world_size: int) -> int:
    """All emulated nodes share this host's cores: split them evenly, at least one each."""
    return max(1, (os.cpu_count() or 1) // world_size)


def exit_code_of(returncode: int) -> int:
    """A Popen return code as a shell exit code (death by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class NodeGroup:
    """The torchrun processes of one run, one per node namespace (see module docstring)."""

    def __init__(self, host: Host, names: RunNames, job: NodeJob, grace_s: float = 5.0,
                 log=None, raise_comm_threads: bool = True):
        self.raise_comm_threads = raise_comm_threads
        self.priority: CommThreadPriority | None = None
        self.host = host
        self.names = names
        self.job = job
        self.grace_s = grace_s
        self.log = log or (lambda message: print(f"[cluster] {message}", file=sys.stderr,
                                                 flush=True))
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[LinePump] = []
        self.torchrun_logs: str | None = None  # removed by stop()

    def start(self) -> None:
        self.torchrun_logs = tempfile.mkdtemp(prefix=f"dhelix-{self.names.run_id}-torchrun-")
        for node in range(self.job.nodes):
            log_dir = os.path.join(self.torchrun_logs, f"node{node}")
            proc = subprocess.Popen(
                self.host.netns_exec(self.names.node_ns(node)) + self.job.argv(node, log_dir),
                env=self.job.environment(node), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # our own process group: stop() signals it whole
            )
            self.procs.append(proc)
            for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = LinePump(source, sink, f"[n{node}] ")
                pump.start()
                self.pumps.append(pump)
        placement = self.job.placement
        if self.raise_comm_threads or placement.separate:
            comm_cores = ({proc.pid: placement.nodes[node].comm
                           for node, proc in enumerate(self.procs)}
                          if placement.separate else None)
            self.priority = CommThreadPriority([proc.pid for proc in self.procs],
                                               raise_priority=self.raise_comm_threads,
                                               comm_cores=comm_cores)

    def wait(self, timeout_s: float | None) -> int:
        """Block until all nodes succeeded (0), one failed (its code) or time ran out (124).
        Does not stop the remaining nodes: call `stop()` (the runner always does). Meanwhile
        raises new communication threads every PRIORITY_SCAN_S (`raise_comm_threads`)
        and pins them to their node's communication cores (a separate placement)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_scan = time.monotonic()
        while True:
            if self.priority is not None and time.monotonic() >= next_scan:
                self.priority.scan()
                next_scan = time.monotonic() + PRIORITY_SCAN_S
            codes = [proc.poll() for proc in self.procs]
            for node, code in enumerate(codes):
                if code not in (None, 0):
                    self.log(f"node {node} exited with code {exit_code_of(code)}; "
                             "stopping the other nodes")
                    return exit_code_of(code)
            if all(code == 0 for code in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                running = [n for n, code in enumerate(codes) if code is None]
                self.log(f"timeout after {timeout_s:g} s with nodes {running} still running; "
                         "stopping them")
                return TIMEOUT_EXIT_CODE
            time.sleep(POLL_S)

    def stop(self) -> None:
        """SIGTERM every running torchrun, SIGKILL after the grace period, reap them all,
        then remove torchrun's log directory (idempotent)."""
        running = [proc for proc in self.procs if proc.poll() is None]
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self.torchrun_logs is not None:
            shutil.rmtree(self.torchrun_logs, ignore_errors=True)
            self.torchrun_logs = None

    def join_output(self, timeout_s: float = 5.0) -> None:
        """Wait for the output pumps (call after the namespaces are empty)."""
        deadline = time.monotonic() + timeout_s
        for pump in self.pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
