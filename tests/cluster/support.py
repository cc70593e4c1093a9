"""Shared helpers of the cluster tests: why the emulated cluster cannot run here (for
pytest.skip), launching it, and finding anything a run left behind."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from dhelix.cluster.host import find_tool
from dhelix.cluster.naming import RunNames
from dhelix.cluster.nsconfig import ETC_NETNS

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "emulated_cluster.py"
HERE = Path(__file__).resolve().parent
RUN_ID = re.compile(r"\[cluster\] (dhxc-\d+-[0-9a-f]+):")


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """None when namespaces, veth links and tbf qdiscs can be created here, else why not."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root"
    ip, tc = find_tool("ip"), find_tool("tc")
    if not ip or not tc:
        return "ip/tc (iproute2) not installed"
    from dhelix.cluster.launch import find_torchrun
    from dhelix.cluster.host import ClusterError

    try:
        find_torchrun()
    except ClusterError as exc:
        return str(exc)
    namespace = RunNames.new().switch_ns
    try:
        steps = [[ip, "netns", "add", namespace],
                 [ip, "-n", namespace, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
                 [tc, "-n", namespace, "qdisc", "add", "dev", "pa", "root", "tbf", "rate",
                  "1mbit", "burst", "65536", "limit", "262144"]]
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True)
            if result.returncode:
                return f"`{' '.join(step)}` failed: {result.stderr.strip()}"
    finally:
        subprocess.run([ip, "netns", "del", namespace], capture_output=True)
    return None


@functools.lru_cache(maxsize=None)
def netem_unavailable_reason() -> str | None:
    """None when the kernel offers the netem qdisc (latency emulation), else why not."""
    ip, tc = find_tool("ip"), find_tool("tc")
    namespace = RunNames.new().switch_ns
    try:
        subprocess.run([ip, "netns", "add", namespace], check=True, capture_output=True)
        subprocess.run([ip, "-n", namespace, "link", "add", "pa", "type", "veth", "peer",
                        "name", "pb"], check=True, capture_output=True)
        result = subprocess.run([tc, "-n", namespace, "qdisc", "add", "dev", "pa", "root",
                                 "netem", "delay", "1ms"], capture_output=True, text=True)
        return f"no netem qdisc: {result.stderr.strip()}" if result.returncode else None
    finally:
        subprocess.run([ip, "netns", "del", namespace], capture_output=True)


def launch(args: list[str], timeout_s: float = 90,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the launcher to completion (`env`: its environment, default this one's);
    stdout/stderr captured as text."""
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT, env=env)


def run_id_of(result: subprocess.CompletedProcess) -> str:
    match = RUN_ID.search(result.stderr)
    assert match, f"no run id in the launcher's output:\n{result.stderr[-3000:]}"
    return match.group(1)


def host_network_state() -> tuple[str, str]:
    """The host (root namespace) interfaces and qdiscs, to compare before/after a run."""
    ip, tc = find_tool("ip"), find_tool("tc")
    links = subprocess.run([ip, "-o", "link", "show"], capture_output=True, text=True).stdout
    # Drop the per-interface counters that change with traffic; keep names, kinds, flags.
    names = "\n".join(sorted(line.split("link/")[0] for line in links.splitlines()))
    qdiscs = subprocess.run([tc, "qdisc", "show"], capture_output=True, text=True).stdout
    return names, "\n".join(sorted(qdiscs.splitlines()))


def processes_with(token: str) -> list[int]:
    """Pids of processes whose command line contains `token`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass  # exited while we looked
    return pids


def leftovers(run_id: str) -> list[str]:
    """Namespaces and /etc/netns entries of `run_id` that still exist."""
    ip = find_tool("ip")
    namespaces = subprocess.run([ip, "netns", "list"], capture_output=True,
                                text=True).stdout.split()
    found = [name for name in namespaces if name.startswith(run_id)]
    if ETC_NETNS.is_dir():
        found += [str(p) for p in ETC_NETNS.iterdir() if p.name.startswith(run_id)]
    return found
