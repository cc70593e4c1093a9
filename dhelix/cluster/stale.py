"""Find and remove leftovers of emulated-cluster runs whose launcher died without cleaning
up (SIGKILL, power cut).

A namespace (or its /etc/netns/<name> directory) is stale when its name is one of ours (`naming.parse_namespace`) and the
launcher pid in that name no longer exists. Namespaces of live launchers - concurrent runs
and tests - are never touched. (If the dead launcher's pid has been reused by another
process, its leftovers are kept until that process exits; `ip netns del NAME` removes
them by hand.) Removing a namespace kills the processes still inside it, then deletes it,
which destroys its interfaces and qdiscs.
"""

from __future__ import annotations

import os

from dhelix.cluster import nsconfig
from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.naming import parse_namespace
from dhelix.cluster.network import remove_namespace


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces(host: Host) -> list[str]:
    """Our namespaces whose launcher is gone, node namespaces before switch namespaces."""
    stale = []
    names = set(host.list_namespaces())
    if nsconfig.ETC_NETNS.is_dir():  # files of a run killed between its two removal steps
        names.update(entry.name for entry in nsconfig.ETC_NETNS.iterdir())
    for name in sorted(names):
        parsed = parse_namespace(name)
        if parsed and not pid_alive(parsed.pid):
            stale.append(parsed)
    stale.sort(key=lambda p: (p.run_id, p.role == "sw", p.role))
    return [p.name for p in stale]


def remove_stale_namespaces(host: Host) -> list[str]:
    """Remove every stale namespace; returns the names removed. ClusterError if any
    could not be removed (after trying them all)."""
    removed, problems = [], []
    for name in stale_namespaces(host):
        problem = remove_namespace(host, name)
        if problem:
            problems.append(problem)
        else:
            removed.append(name)
    if problems:
        raise ClusterError("could not remove stale namespaces: " + "; ".join(problems))
    return removed
