"""Run a command on an emulated cluster from start to cleanup: `run_cluster(config)`.

Sequence: check the host (root, ip, tc), build the network, start one torchrun per node,
wait for success, the first failure or the timeout, then ALWAYS stop the nodes and remove
the network - on success, on failure, on an exception, and on SIGINT/SIGTERM/SIGHUP (which
are turned into an exception for the duration, and ignored while cleanup runs). The only
way to leave anything behind is to kill the launcher itself with SIGKILL (or a power cut):
`cleanup_stale()` then removes the leftovers by name.

Exit code: 0 when every node succeeded, else the first failing node's (torchrun's) exit
code, 124 on timeout, 128 + N when interrupted by signal N.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from dhelix.cluster.comm_priority import POLICIES
from dhelix.cluster.cores import AUTO, CorePlacement, host_cores, plan_cores
from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.launch import NodeGroup, NodeJob
from dhelix.cluster.naming import MAX_NODES, RunNames
from dhelix.cluster.network import EmulatedNetwork
from dhelix.cluster.shaping import LinkShape
from dhelix.cluster.signals import Interrupted, SignalGuard


@dataclass(frozen=True)
class ClusterConfig:
    """Everything one run needs (the CLI's options, see docs/emulated_cluster.md)."""

    nodes: int
    ranks_per_node: int
    shape: LinkShape
    command: list[str]
    torchrun: str
    master_port: int = 29500
    timeout_s: float | None = 3600.0
    threads_per_rank: int | None = None
    grace_s: float = 5.0
    extra_env: dict = field(default_factory=dict)
    comm_priority: str = "fifo"  # or "normal" (dhelix.cluster.comm_priority)
    comm_cores: int | None = AUTO  # per node (dhelix.cluster.cores.plan_cores); 0: shared

    def __post_init__(self):
        self.placement()  # ValueError (one line) when the cores cannot be split so
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"need nodes >= 1 and ranks per node >= 1, got {self.nodes} "
                             f"and {self.ranks_per_node}")
        if self.nodes > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes, got {self.nodes}")
        if not self.command:
            raise ValueError("nothing to run: give the command after --")
        if self.comm_priority not in POLICIES:
            raise ValueError(f"comm priority must be one of {', '.join(POLICIES)}, got "
                             f"{self.comm_priority!r}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master port {self.master_port} outside 1..65535")

    def placement(self) -> CorePlacement:
        """The nodes' computation and communication cores on this host (or shared-core)."""
        return plan_cores(host_cores(), self.nodes, self.ranks_per_node, self.comm_cores)


def _log(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


def run_cluster(config: ClusterConfig, host: Host | None = None,
                names: RunNames | None = None) -> int:
    """Run `config.command` on the emulated cluster; returns the exit code (see module)."""
    host = host or Host.check()
    names = names or RunNames.new()
    network = EmulatedNetwork(host, names, config.nodes, config.shape)
    placement = config.placement()
    job = NodeJob(config.command, config.ranks_per_node, config.nodes, config.torchrun,
                  config.master_port, config.threads_per_rank,
                  {**config.extra_env, "DHELIX_CLUSTER_LINK": config.shape.describe(),
                   "DHELIX_CLUSTER_CORES": placement.describe()},
                  placement=placement)
    nodes = NodeGroup(host, names, job, grace_s=config.grace_s, log=_log,
                      raise_comm_threads=config.comm_priority == "fifo")
    with SignalGuard() as guard:
        try:
            network.up()
            _log(f"{names.run_id}: {config.nodes} nodes x {config.ranks_per_node} ranks, "
                 f"cross-node links {config.shape.describe()}; {placement.describe()}")
            nodes.start()
            code = nodes.wait(config.timeout_s)
            if nodes.priority is not None and nodes.priority.failures:
                _log(f"{nodes.priority.failures} communication thread(s) could not be raised "
                     "to SCHED_FIFO (refused: needs root or CAP_SYS_NICE)")
            return code
        except Interrupted as exc:
            _log(f"{exc}; stopping the nodes")
            return exc.exit_code
        finally:
            guard.shield()
            try:
                nodes.stop()
            finally:
                try:
                    network.down()
                    _log(f"{names.run_id}: removed its namespaces, links and qdiscs")
                finally:
                    nodes.join_output()


def cleanup_stale(host: Host | None = None) -> list[str]:
    """Remove namespaces left behind by runs whose launcher is gone; returns their names."""
    from dhelix.cluster.stale import remove_stale_namespaces

    return remove_stale_namespaces(host or Host.check())


__all__ = ["ClusterConfig", "ClusterError", "cleanup_stale", "run_cluster"]
