"""Build and remove the emulated network: one namespace per node, a switch namespace with a
bridge, one shaped veth link per node.

    node 0 ns             switch ns                     node 1 ns
    lo, eth0 10.77.0.1 ==veth== p0 --- br0 --- p1 ==veth== eth0 10.77.0.2, lo
         (uplink tbf[+netem])  (downlink tbf)

Guarantees:
- Nothing is created in, or changed in, the host's own (root) namespace: every veth is
  created inside the switch namespace with its peer placed straight into the node's
  namespace, and every address, route and qdisc belongs to an interface inside a namespace
  of this run. IPv6 is switched off in those namespaces, so their only addresses are the
  run's private IPv4 ones (`naming.SUBNET`).
- `up()` either completes or removes everything it created before re-raising.
- Each node namespace gets its own hosts and resolv.conf (`nsconfig`), so name lookups
  are answered locally and DNS never leaves the namespace.
- `down()` is idempotent and never stops halfway: for each namespace of the run it kills
  every process still inside (SIGKILL), waits until none is left, then deletes the
  namespace, which destroys its interfaces and their qdiscs with it, and removes its
  /etc/netns/<namespace> files. It raises `ClusterError` afterwards if anything could not
  be removed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from dhelix.cluster import nsconfig
from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.naming import BRIDGE_IFNAME, NODE_IFNAME, RunNames
from dhelix.cluster.shaping import LinkShape, downlink_commands, gso_commands, uplink_commands

KILL_WAIT_S = 10.0
_DISABLE_IPV6 = (
    "import pathlib\n"
    "root = pathlib.Path('/proc/sys/net/ipv6/conf')\n"
    "for name in ('all', 'default'):\n"
    "    if (root / name).is_dir():\n"
    "        (root / name / 'disable_ipv6').write_text('1')\n"
)


def kill_namespace_processes(host: Host, namespace: str, sig: int = signal.SIGKILL,
                             wait_s: float = KILL_WAIT_S) -> list[int]:
    """Send `sig` to every process inside `namespace` and, for SIGKILL, wait until none is
    left. Returns the pids still inside afterwards (empty on success)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = host.namespace_pids(namespace)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not pids or sig != signal.SIGKILL or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def remove_namespace(host: Host, namespace: str) -> str | None:
    """Kill every process inside `namespace`, then delete it (which destroys its interfaces
    and their qdiscs) and its /etc/netns files. Returns None on success (also when it did
    not exist), else what went wrong."""
    left = kill_namespace_processes(host, namespace)
    if left:
        return f"{namespace}: processes {left} survived SIGKILL"
    result = host.ip("netns", "del", namespace, check=False)
    nsconfig.remove(namespace)
    if result.returncode != 0 and namespace in host.list_namespaces():
        return f"{namespace}: {result.stderr.strip()}"
    return None


class EmulatedNetwork:
    """The namespaces, links and qdiscs of one run (see the module docstring)."""

    def __init__(self, host: Host, names: RunNames, nodes: int, shape: LinkShape):
        if nodes < 1:
            raise ValueError(f"need at least one node, got {nodes}")
        self.host = host
        self.names = names
        self.nodes = nodes
        self.shape = shape
        self._created: list[str] = []  # namespaces, recorded before they are created

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this run that may exist now."""
        return list(self._created)

    def node_namespace(self, node: int) -> str:
        return self.names.node_ns(node)

    def up(self) -> None:
        """Create everything; on any failure (or interrupt) remove it again and re-raise."""
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove every process, namespace, interface and qdisc of this run (idempotent)."""
        problems = []
        for namespace in reversed(self._created):
            problem = remove_namespace(self.host, namespace)
            if problem:
                problems.append(problem)
        self._created.clear()
        if problems:
            raise ClusterError("could not remove all of the run's namespaces: "
                               + "; ".join(problems))

    def _add_namespace(self, name: str) -> None:
        self._created.append(name)
        self.host.ip("netns", "add", name)
        self.host.run_in(name, [sys.executable, "-c", _DISABLE_IPV6])

    def _build(self) -> None:
        ip, names = self.host.ip, self.names
        switch = names.switch_ns
        self._add_namespace(switch)
        ip("-n", switch, "link", "add", BRIDGE_IFNAME, "type", "bridge")
        ip("-n", switch, "link", "set", BRIDGE_IFNAME, "up")
        for node in range(self.nodes):
            ns, port = names.node_ns(node), names.switch_port(node)
            self._add_namespace(ns)
            nsconfig.write(ns, [names.node_address(n) for n in range(self.nodes)])
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", switch, "link", "add", port, "type", "veth",
               "peer", "name", NODE_IFNAME, "netns", ns)
            ip("-n", switch, "link", "set", port, "master", BRIDGE_IFNAME)
            ip("-n", switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", names.node_cidr(node), "dev", NODE_IFNAME)
            ip("-n", ns, "link", "set", NODE_IFNAME, "up")
            for args in (gso_commands(ns, NODE_IFNAME, self.shape)
                         + gso_commands(switch, port, self.shape)):
                ip(*args)
            self._shape(uplink_commands(ns, NODE_IFNAME, self.shape)
                        + downlink_commands(switch, port, self.shape))

    def _shape(self, commands: list[list[str]]) -> None:
        for args in commands:
            try:
                self.host.tc(*args)
            except ClusterError as exc:
                if "netem" in args and "unknown" in str(exc).lower():
                    raise ClusterError(
                        "latency emulation needs the kernel's netem qdisc (sch_netem), which "
                        "this kernel lacks; run with --latency 0 (bandwidth shaping uses tbf "
                        "and still works)"
                    ) from exc
                raise

