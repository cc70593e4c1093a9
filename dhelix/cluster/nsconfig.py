"""Per-namespace name resolution: `/etc/netns/<namespace>/{hosts,resolv.conf}`.

`ip netns exec NAME` bind-mounts every file in /etc/netns/NAME over the same file in /etc
for the command it runs. The cluster writes, for each node namespace,
- `hosts`: localhost and `node<i>` for every node address, so torch's reverse lookups of
  peer addresses are answered from the file (no "hostname cannot be retrieved" warnings);
- `resolv.conf`: a nameserver on the namespace's own loopback, so any other DNS lookup
  stays inside the namespace (nothing listens there; it fails at once) instead of being
  aimed at the host's nameserver (which the namespace has no route to anyway).

`remove()` deletes the namespace's directory again, and /etc/netns itself once it is empty
(the directory is iproute2's standard place for this; concurrent runs re-create it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ETC_NETNS = Path("/etc/netns")
RESOLV_CONF = (
    "# dhelix emulated cluster node: DNS stays on this namespace's loopback\n"
    "nameserver 127.0.0.1\n"
)


def hosts_file(addresses: list[str]) -> str:
    """localhost and `node<i>`, each also in the IPv4-mapped IPv6 form in which a
    dual-stack listener (torch's TCPStore) sees its peers."""
    lines = []
    for address, name in [("127.0.0.1", "localhost")] + [
            (address, f"node{i}") for i, address in enumerate(addresses)]:
        lines += [f"{address} {name}", f"::ffff:{address} {name}"]
    return "# dhelix emulated cluster nodes\n" + "\n".join(lines) + "\n"


def write(namespace: str, addresses: list[str], root: Path = ETC_NETNS) -> None:
    """Write the namespace's hosts and resolv.conf (retrying if a concurrent run removed
    the shared parent directory in between)."""
    for attempt in range(5):
        try:
            directory = root / namespace
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(hosts_file(addresses))
            (directory / "resolv.conf").write_text(RESOLV_CONF)
            return
        except FileNotFoundError:
            if attempt == 4:
                raise


def remove(namespace: str, root: Path = ETC_NETNS) -> None:
    """Delete the namespace's directory, and the parent once it is empty (idempotent)."""
    shutil.rmtree(root / namespace, ignore_errors=True)
    try:
        os.rmdir(root)
    except OSError:
        pass  # not empty (other runs, or the host's own entries) or already gone
