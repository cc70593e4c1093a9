"""An emulated multi-node cluster on one Linux host, for measuring communication overlap.

N "nodes" of R ranks: one network namespace per node, joined by veth links through a
switch namespace (a bridge), the cross-node links shaped with tc (bandwidth, optionally
latency); ranks of one node talk over loopback. One torchrun per node, gloo bound to the
node's link. Everything a run creates is removed when it ends, however it ends (short of
SIGKILL of the launcher, which `--cleanup-stale` repairs).

Modules, one job each:
- `units`: parse `800mbit` / `1ms`;      - `naming`: namespace names, node addresses;
- `host`: root/ip/tc checks, running ip and tc;  - `shaping`: the tc commands of a link;
- `network`: build/remove namespaces, bridge, veths, qdiscs;
- `launch`: torchrun per node, supervision, exit codes;  - `output`: prefixed node output;
- `signals`: Ctrl-C/SIGTERM to an exception;  - `stale`: leftovers of crashed runs;
- `runner`: `run_cluster(ClusterConfig)` composes them;  - `cli`: the command line.
See docs/emulated_cluster.md.
"""

from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.runner import ClusterConfig, cleanup_stale, run_cluster
from dhelix.cluster.shaping import LinkShape

__all__ = ["ClusterConfig", "ClusterError", "Host", "LinkShape", "cleanup_stale",
           "run_cluster"]
