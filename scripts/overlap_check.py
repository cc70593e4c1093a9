#!/usr/bin/env python
"""Does communication overlap with computation here? Run under torchrun, usually on the
emulated cluster (2 nodes x 1 rank):

    scripts/emulated_cluster.py --nodes 2 -- scripts/overlap_check.py

Every rank times, side by side in one run with the repetitions interleaved:
- comm alone:   a gloo all_reduce of `--size-mb` MB (float32);
- compute alone: N square matmuls, N calibrated so compute alone ~ comm alone;
- back-to-back: the all_reduce, then the matmuls;
- overlapped:   the all_reduce started asynchronously, the matmuls, then its wait.
Each repetition's time is the slowest rank's (a step ends when its last rank does); the
report gives medians, the speedup back-to-back / overlapped, its ideal
back-to-back / max(comm, compute), and the share of the shorter part that was hidden,
(back-to-back - overlapped) / min(comm, compute).

Rank 0 prints a table and one line `OVERLAP_CHECK {json}` (also written to `--json FILE`).
This is the evidence the benchmarks rest on: without a real link between the ranks (one
namespace, loopback) the copies are CPU-bound and overlap gains little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

MODES = ("comm", "compute", "back_to_back", "overlapped")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=16.0,
                        help="all_reduce payload in MB (default 16: ~0.18 s at the cluster's "
                        "default 800mbit)")
    parser.add_argument("--matrix", type=int, default=256,
                        help="side of the square matmuls (default 256)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved repetitions of every mode (default 5)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed all_reduces and matmul blocks first (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per rank (default 1: the emulated nodes "
                        "share this host's cores)")
    parser.add_argument("--json", default=None, help="also write the result here (rank 0)")
    args = parser.parse_args(argv)
    for name in ("size_mb", "matrix", "repeats", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def _median_time(fn, repeats: int, before=None) -> float:
    """Median wall time of `fn` over `repeats` calls; `before` (untimed) runs ahead of each."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        payload = torch.ones(max(1, int(args.size_mb * 2**20) // 4))
        a = torch.randn(args.matrix, args.matrix)
        b = torch.randn(args.matrix, args.matrix)

        def comm():
            dist.all_reduce(payload)

        def matmuls(count):
            for _ in range(count):
                torch.mm(a, b)

        for _ in range(args.warmup):
            comm()
            matmuls(4)
        # Calibrate: as many matmuls as take about as long as the all_reduce, timed with
        # every rank computing at once (as in the measurement), refined once at full
        # length; the same count on every rank (the largest any rank asked for).
        # (the barrier untimed: a rank that waits there for a late peer would count the
        # wait as communication and ask for several times too many matmuls)
        comm_s = _median_time(comm, 3, before=dist.barrier)
        count = 8
        for _ in range(2):
            dist.barrier()
            per_matmul = _median_time(lambda: matmuls(count), 3) / count
            count = torch.tensor([max(1, round(comm_s / per_matmul))])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            count = int(count.item())

        def overlapped():
            handle = dist.all_reduce(payload, async_op=True)
            matmuls(count)
            handle.wait()

        runs = {"comm": comm, "compute": lambda: matmuls(count),
                "back_to_back": lambda: (comm(), matmuls(count)), "overlapped": overlapped}
        times = torch.zeros(len(MODES), args.repeats, dtype=torch.float64)
        for rep in range(args.repeats):
            for index, mode in enumerate(MODES):
                dist.barrier()
                start = time.perf_counter()
                runs[mode]()
                times[index, rep] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank of each repetition
    finally:
        dist.destroy_process_group()
    if rank == 0:
        report(args, world, count, {mode: times[i].tolist() for i, mode in enumerate(MODES)})
    return 0


def summarize(samples: dict[str, list[float]]) -> dict:
    """Medians (ms) and the derived ratios from per-mode repetition times (s)."""
    med = {mode: statistics.median(values) * 1e3 for mode, values in samples.items()}
    shorter = min(med["comm"], med["compute"])
    return {
        "median_ms": med,
        "speedup": med["back_to_back"] / med["overlapped"],
        "ideal_speedup": med["back_to_back"] / max(med["comm"], med["compute"]),
        "hidden_fraction": (med["back_to_back"] - med["overlapped"]) / shorter,
    }


def report(args, world: int, count: int, samples: dict[str, list[float]]) -> None:
    summary = summarize(samples)
    med = summary["median_ms"]
    result = {
        "world_size": world,
        "nodes": int(os.environ.get("DHELIX_NUM_NODES", "1")),
        "ranks_per_node": int(os.environ.get("DHELIX_RANKS_PER_NODE", world)),
        "link": os.environ.get("DHELIX_CLUSTER_LINK", "none (not on the emulated cluster)"),
        "size_mb": args.size_mb, "matrix": args.matrix, "matmuls": count,
        "threads": args.threads, "repeats": args.repeats,
        "samples_s": samples, **summary,
    }
    print(f"overlap check: {world} ranks ({result['nodes']} nodes x "
          f"{result['ranks_per_node']}), link {result['link']}")
    print(f"  all_reduce {args.size_mb:g} MB float32 (gloo); compute {count} matmuls "
          f"{args.matrix}x{args.matrix}; {args.threads} thread(s)/rank; "
          f"median of {args.repeats}, slowest rank")
    for mode in MODES:
        print(f"  {mode.replace('_', '-'):<14}{med[mode]:9.1f} ms")
    print(f"  speedup back-to-back / overlapped: {summary['speedup']:.2f}x "
          f"(ideal {summary['ideal_speedup']:.2f}x); hidden "
          f"{100 * summary['hidden_fraction']:.0f}% of the shorter part")
    print("OVERLAP_CHECK " + json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
