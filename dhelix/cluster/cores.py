"""Which host cores each emulated node computes on, and which carry its communication.

On a GPU node the SMs compute while the NIC (and NCCL's proxy thread) moves bytes: the two
never compete for the same units. On the emulated cluster gloo's threads move the bytes and
the veth's softirq runs on the core that sent the packet, so communication and computation
compete for cores unless they are given different ones. `plan_cores` splits the host's
cores into one block per node, and each block into computation cores (the ranks' main and
OpenMP threads) and communication cores (the node's gloo threads, and with them the veth's
softirq work of the packets they send). A host with too few cores for that gets no
placement: the run is **shared-core**, and every table says so.

Pure: nothing here touches a process (`launch.NodeGroup` pins the node's torchrun to its
computation cores before exec, `comm_priority.CommThreadPriority` moves gloo threads to the
communication cores as they appear).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

AUTO = None  # comm_per_node: decide from the host's cores
COMM_SHARE = 4  # auto: one communication core per this many cores of a node


@dataclass(frozen=True)
class NodeCores:
    """The cores of one node: `compute` for its ranks' threads, `comm` for its gloo threads."""

    compute: tuple[int, ...]
    comm: tuple[int, ...]


@dataclass(frozen=True)
class CorePlacement:
    """Per-node core sets (`nodes[i]` for node i); empty `nodes`: shared-core (no pinning)."""

    nodes: tuple[NodeCores, ...] = ()
    reason: str = ""  # why shared-core, when it is

    @property
    def separate(self) -> bool:
        return bool(self.nodes)

    def threads_per_rank(self, ranks_per_node: int) -> int | None:
        """OpenMP threads per rank that fill the node's computation cores, or None when
        shared-core (the launcher's own default applies)."""
        if not self.separate:
            return None
        return max(1, len(self.nodes[0].compute) // ranks_per_node)

    def describe(self) -> str:
        """One line for logs and report headers."""
        if not self.separate:
            return f"shared-core ({self.reason})"
        parts = [f"node {i}: compute {_ranges(n.compute)}, communication {_ranges(n.comm)}"
                 for i, n in enumerate(self.nodes)]
        return "separate cores (" + "; ".join(parts) + ")"


def plan_cores(available, nodes: int, ranks_per_node: int,
               comm_per_node: int | None = AUTO) -> CorePlacement:
    """Split `available` (core ids, e.g. `os.sched_getaffinity(0)`) into `nodes` equal blocks
    in ascending order; in each block the last `comm_per_node` cores carry communication and
    the rest compute. `comm_per_node`: AUTO (one per COMM_SHARE cores of a node, at least
    one, when each rank still gets a computation core; else shared-core), 0 (shared-core),
    or a count (ValueError, one line, when a node's block cannot give every rank a
    computation core beside that many communication cores)."""
    cores = sorted(available)
    per_node = len(cores) // max(1, nodes)
    if comm_per_node == 0:
        return CorePlacement(reason="placement turned off (--comm-cores 0)")
    if comm_per_node is AUTO:
        if per_node < ranks_per_node + 1:
            return CorePlacement(reason=f"{len(cores)} cores for {nodes} nodes x "
                                        f"{ranks_per_node} ranks: computation, gloo threads "
                                        "and softirq share cores")
        comm_per_node = max(1, per_node // COMM_SHARE)
        comm_per_node = min(comm_per_node, per_node - ranks_per_node)
    elif comm_per_node < 0 or per_node < ranks_per_node + comm_per_node:
        raise ValueError(
            f"--comm-cores {comm_per_node}: {len(cores)} usable cores give each of {nodes} "
            f"nodes {per_node}, fewer than its {ranks_per_node} rank(s) + {comm_per_node} "
            "communication core(s); use fewer, or 0 for shared-core")
    blocks = []
    for node in range(nodes):
        block = cores[node * per_node:(node + 1) * per_node]
        blocks.append(NodeCores(compute=tuple(block[:per_node - comm_per_node]),
                                comm=tuple(block[per_node - comm_per_node:])))
    return CorePlacement(nodes=tuple(blocks))


def host_cores() -> set[int]:
    """The cores this process may run on (its affinity mask)."""
    return set(os.sched_getaffinity(0))


def pin_prefix(python: str, cores: tuple[int, ...]) -> list[str]:
    """argv prefix that runs the rest of the command pinned to `cores` (set before exec, so
    every process and thread the command starts inherits it); no dhelix import needed."""
    return [python, "-c", "import os, sys; os.sched_setaffinity(0, "
            f"{sorted(cores)}); os.execvp(sys.argv[1], sys.argv[1:])"]


def _ranges(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    out, start, prev = [], None, None
    for core in cores:
        if start is None:
            start = prev = core
        elif core == prev + 1:
            prev = core
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = core
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)
