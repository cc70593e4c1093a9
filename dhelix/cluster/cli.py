"""Command line of the emulated cluster: `scripts/emulated_cluster.py` and `dhelix cluster`.

    emulated_cluster.py --nodes 2 --ranks-per-node 1 --bandwidth 800mbit --latency 0ms \
        -- -m dhelix.megatron_lm scripts/pretrain_gpt.py --tensor-model-parallel-size 2 ...

Everything after `--` is handed to torchrun in every node namespace (a script and its
arguments, or `-m module ...`). Exit codes: the run's (see `runner.run_cluster`), or 2 when
the cluster is refused before anything is created (bad option, not root, ip/tc missing,
torchrun missing), or 1 when building or removing the network failed.
"""

from __future__ import annotations

import argparse
import sys

from dhelix.cluster.comm_priority import POLICIES, rt_throttling_problem

DEFAULT_BANDWIDTH = "800mbit"
DEFAULT_LATENCY = "0ms"
DEFAULT_TIMEOUT_S = 3600.0
DESCRIPTION = (
    "Run a torchrun command on N emulated nodes (network namespaces joined by shaped veth "
    "links through a switch namespace). Needs root, ip and tc. Always removes what it "
    "created, also on failure or Ctrl-C. See docs/emulated_cluster.md.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="torchrun ranks in each node (default 1)")
    parser.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH,
                        help="cross-node bandwidth per node and direction, tc units "
                        f"(kbit, mbit, gbit) or 'unlimited' (default {DEFAULT_BANDWIDTH})")
    parser.add_argument("--latency", default=DEFAULT_LATENCY,
                        help="one-way cross-node latency (us, ms, s); needs the kernel's netem "
                        f"qdisc when non-zero (default {DEFAULT_LATENCY})")
    parser.add_argument("--master-port", type=int, default=29500,
                        help="torchrun rendezvous port on node 0 (default 29500; private to "
                        "the run's namespaces, so concurrent runs do not collide)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="stop every node after this many seconds, exit code 124 "
                        f"(default {DEFAULT_TIMEOUT_S:g}; 0 = no limit)")
    parser.add_argument("--threads-per-rank", type=int, default=None,
                        help="OMP_NUM_THREADS for every rank unless already set (default: "
                        "host cores / total ranks, at least 1)")
    parser.add_argument("--comm-priority", choices=POLICIES, default="fifo",
                        help="scheduling of the ranks' gloo threads: fifo (default) raises "
                        "them to real-time priority as they appear, so communication "
                        "progresses while the cores compute, as a NIC's would; normal "
                        "leaves them to the fair scheduler (see docs/emulated_cluster.md)")
    parser.add_argument("--comm-cores", default="auto",
                        help="cores per node reserved for its communication (gloo threads "
                        "and the softirq of the packets they send), the rest computing "
                        "(OMP_NUM_THREADS fills them): 'auto' (default) one per 4 cores of "
                        "a node where every rank keeps a computation core, else shared-core; "
                        "0 shares every core (see docs/emulated_cluster.md)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping nodes (default 5)")
    parser.add_argument("--torchrun", default=None,
                        help="torchrun to use (default: the repository's .venv/bin/torchrun)")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="first remove namespaces left by earlier runs whose launcher died "
                        "(never those of running launchers); without a command, only that")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the script (and its arguments) torchrun runs on each node")


def run(args: argparse.Namespace) -> int:
    from dhelix.cluster.host import ClusterError, Host
    from dhelix.cluster.launch import find_torchrun
    from dhelix.cluster.runner import ClusterConfig, cleanup_stale, run_cluster
    from dhelix.cluster.shaping import LinkShape
    from dhelix.cluster.units import parse_rate, parse_time

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        if not command and not args.cleanup_stale:
            raise ValueError("nothing to run: give the command after --, e.g. "
                             "-- scripts/overlap_check.py")
        shape = LinkShape(parse_rate(args.bandwidth), parse_time(args.latency))
        if args.timeout < 0 or args.grace < 0:
            raise ValueError("--timeout and --grace must be >= 0")
        if args.comm_priority == "fifo" and command:
            problem = rt_throttling_problem()
            if problem:
                raise ValueError(f"--comm-priority fifo: {problem}")
        comm_cores = parse_comm_cores(args.comm_cores)
        if args.threads_per_rank is not None and args.threads_per_rank < 1:
            raise ValueError(f"--threads-per-rank {args.threads_per_rank}: must be >= 1")
        host = Host.check()
        config = None
        if command:
            config = ClusterConfig(
                nodes=args.nodes, ranks_per_node=args.ranks_per_node, shape=shape,
                command=command, torchrun=find_torchrun(args.torchrun),
                master_port=args.master_port, timeout_s=args.timeout or None,
                threads_per_rank=args.threads_per_rank, grace_s=args.grace,
                comm_priority=args.comm_priority, comm_cores=comm_cores)
    except (ValueError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.cleanup_stale:
            removed = cleanup_stale(host)
            print(f"[cluster] removed {len(removed)} stale namespace(s)"
                  + (f": {' '.join(removed)}" if removed else ""), file=sys.stderr)
        return run_cluster(config, host) if config else 0
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def parse_comm_cores(text: str) -> int | None:
    """--comm-cores: 'auto' -> None (dhelix.cluster.cores.AUTO), else a count >= 0."""
    if text == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"--comm-cores {text}: give 'auto' or a number of cores >= 0")
    return count


def register(subparsers) -> None:
    """`dhelix cluster ...` (same options as scripts/emulated_cluster.py)."""
    parser = subparsers.add_parser(
        "cluster", help="run a torchrun command on an emulated multi-node cluster",
        description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="emulated_cluster.py", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
