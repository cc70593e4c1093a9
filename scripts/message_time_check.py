#!/usr/bin/env python
"""Is the emulated link faithful for single messages? Run under torchrun on the emulated
cluster, 2 nodes x 1 rank:

    scripts/emulated_cluster.py --nodes 2 --bandwidth 200mbit -- scripts/message_time_check.py

For each size (64 KiB .. 16 MiB) it times a 2-rank gloo all_reduce after an idle gap (so a
token bucket is full, as for a collective that follows computation) and prints the median
time over bytes x 8 / rate, the time the payload needs at line rate (a 2-rank ring
all_reduce moves the whole payload once in each direction). About 1 is faithful; below 1
the link lets the message through faster than its rate; above 1 latency and per-message
costs dominate (small messages).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (64 << 10, 512 << 10, 4 << 20, 16 << 20)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gap-s", type=float, default=0.2, help="idle gap before each message")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from dhelix.cluster.units import parse_rate

    link = os.environ.get("DHELIX_CLUSTER_LINK", "")
    rate = parse_rate(link.split(",")[0]) if link else None
    if rate is None:
        print("error: run on the emulated cluster with a shaped link (DHELIX_CLUSTER_LINK)",
              file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(1 << 20))
        ratios = {}
        for size in SIZES:
            payload, times = torch.ones(size // 4), []
            for _ in range(args.repeats):
                dist.barrier()
                time.sleep(args.gap_s)
                start = time.perf_counter()
                dist.all_reduce(payload)
                times.append(time.perf_counter() - start)
            ratios[size] = statistics.median(times) / (size * 8 / rate)
        if dist.get_rank() == 0:
            cells = ", ".join(f"{size >> 10} KiB {ratio:.2f}" for size, ratio in ratios.items())
            print(f"message time / line-rate time on {link}: {cells}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
