"""Names and addresses of one emulated-cluster run.

Every network namespace a run creates is named `dhxc-<pid>-<tag>-<role>`: `<pid>` is the
launcher's process id, `<tag>` a random hex string (so two runs from one process, or a
reused pid, still differ), `<role>` is `sw` for the switch or `n<i>` for node i. This is
what keeps concurrent runs (and concurrent tests) apart, and what lets `--cleanup-stale`
recognise leftovers of a crashed run: a name with our prefix whose launcher pid is gone.

Interfaces live only inside those namespaces, so their names need not be unique across
runs: each node's uplink is `eth0` (the address gloo binds to), the switch side of node
i's link is `p<i>`, the switch's bridge is `br0`.

Addresses: node i is 10.77.0.(i+1)/24 on its `eth0`. They exist only inside the run's own
namespaces, which are joined to nothing but each other, so a run can never send a packet
to the host or beyond, and concurrent runs reusing the same addresses never meet.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from dataclasses import dataclass

PREFIX = "dhxc"
NODE_IFNAME = "eth0"
GLOO_DEVICES_ENV = "GLOO_SOCKET_IFNAME"  # gloo opens one device per comma-separated name
BRIDGE_IFNAME = "br0"
SUBNET = ipaddress.IPv4Network("10.77.0.0/24")
MAX_NODES = 250  # host addresses .1 .. .250 of SUBNET

_NAME = re.compile(rf"^{PREFIX}-(?P<pid>\d+)-(?P<tag>[0-9a-f]+)-(?P<role>sw|n\d+)$")


@dataclass(frozen=True)
class RunNames:
    """The namespace names and node addresses of one run."""

    pid: int
    tag: str

    @classmethod
    def new(cls) -> "RunNames":
        """Fresh names owned by this process."""
        return cls(pid=os.getpid(), tag=secrets.token_hex(3))

    @property
    def run_id(self) -> str:
        return f"{PREFIX}-{self.pid}-{self.tag}"

    @property
    def switch_ns(self) -> str:
        return f"{self.run_id}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self.run_id}-n{node}"

    @staticmethod
    def switch_port(node: int) -> str:
        return f"p{node}"

    @staticmethod
    def node_address(node: int) -> str:
        if not 0 <= node < MAX_NODES:
            raise ValueError(f"node index {node} outside 0..{MAX_NODES - 1}")
        return str(SUBNET.network_address + node + 1)

    @staticmethod
    def node_cidr(node: int) -> str:
        return f"{RunNames.node_address(node)}/{SUBNET.prefixlen}"


@dataclass(frozen=True)
class ParsedName:
    """A namespace name of ours, split into its parts."""

    name: str
    pid: int
    tag: str
    role: str

    @property
    def run_id(self) -> str:
        return f"{PREFIX}-{self.pid}-{self.tag}"


def parse_namespace(name: str) -> ParsedName | None:
    """The parts of `name` if it is one of our namespace names, else None."""
    match = _NAME.match(name)
    if not match:
        return None
    return ParsedName(name, int(match["pid"]), match["tag"], match["role"])
