"""The host's networking tools: checks that the cluster can be built here, and runs `ip`
and `tc` with errors that show the failing command and its message.

`Host.check()` refuses (raises `ClusterError`) before anything is created when the process
is not root, when `ip` or `tc` (iproute2) is missing, or when the kernel offers no network
namespaces. Every command the cluster runs goes through `Host.ip`/`Host.tc`; the only
commands that name no namespace of ours are `ip netns add/del/list/pids`, which manage our
own namespaces and never touch the host's interfaces, addresses, routes or qdiscs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

# iproute2 usually lives in /usr/sbin or /sbin, which a non-login root shell may lack.
_SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built, run or removed; the message says why."""


def find_tool(name: str) -> str | None:
    """Absolute path of `name` on PATH or in the sbin directories, or None."""
    found = shutil.which(name)
    if found:
        return found
    for directory in _SBIN_DIRS:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass(frozen=True)
class Host:
    """Paths of `ip` and `tc`; build with `Host.check()`."""

    ip_path: str
    tc_path: str

    @classmethod
    def check(cls) -> "Host":
        """The host's tools, or `ClusterError` saying what is missing (root, ip, tc, netns)."""
        if os.geteuid() != 0:
            raise ClusterError(
                "the emulated cluster needs root (it creates network namespaces, veth links "
                "and tc qdiscs); run it as root, e.g. with sudo"
            )
        paths = {name: find_tool(name) for name in ("ip", "tc")}
        missing = [name for name, path in paths.items() if path is None]
        if missing:
            raise ClusterError(
                f"{' and '.join(missing)} not found (looked on PATH and in "
                f"{', '.join(_SBIN_DIRS)}); install iproute2 (e.g. apt-get install iproute2)"
            )
        if not os.path.exists("/proc/self/ns/net"):
            raise ClusterError("this kernel offers no network namespaces (/proc/self/ns/net)")
        return cls(ip_path=paths["ip"], tc_path=paths["tc"])

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([self.ip_path, *args], check)

    def tc(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._run([self.tc_path, *args], check)

    def netns_exec(self, namespace: str) -> list[str]:
        """The argv prefix that runs a command inside `namespace`."""
        return [self.ip_path, "netns", "exec", namespace]

    def run_in(self, namespace: str, argv: list[str],
               check: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` inside `namespace` and wait for it."""
        return self._run([*self.netns_exec(namespace), *argv], check)

    def list_namespaces(self) -> list[str]:
        """Names of all named network namespaces (`ip netns list`)."""
        out = self.ip("netns", "list").stdout
        # Lines look like "name" or "name (id: 3)".
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def namespace_pids(self, namespace: str) -> list[int]:
        """Process ids inside `namespace` (empty if it does not exist)."""
        result = self.ip("netns", "pids", namespace, check=False)
        if result.returncode != 0:
            return []
        return [int(word) for word in result.stdout.split()]

    @staticmethod
    def _run(argv: list[str], check: bool) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            message = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
            raise ClusterError(f"`{' '.join(argv)}` failed: {message}")
        return result
