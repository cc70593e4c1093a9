"""Rank program for tests/cluster/test_launcher.py (runs under torchrun on the emulated
cluster): checks the topology environment, an all_reduce, times a transfer inside a node
and one across nodes, and a small round trip across nodes, and the scheduling policy of its gloo threads and of its
main thread. Local rank 0 of every node also reports its interface and
qdiscs as seen from inside its namespace. Prints one `PROBE {json}` line per rank."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dhelix.cluster.host import find_tool  # noqa: E402

NBYTES = int(os.environ.get("PROBE_NBYTES", 2 << 20))


def best_time_s(action, repeats: int) -> float:
    """Shortest of `repeats` runs of `action`, each started right after a barrier."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def transfer_s(src: int, dst: int, rank: int) -> float | None:
    """Best of three blocking send/recv of NBYTES after one untimed (the pair's connection
    is set up lazily; in one clean-clone CI run both of two timed loopback transfers took
    ~1 s while other ranks started), timed at the receiver."""
    buf = torch.zeros(NBYTES // 4)

    def action():
        if rank == src:
            dist.send(buf, dst)
        elif rank == dst:
            dist.recv(buf, src)

    action()
    best = best_time_s(action, 3)
    return best if rank == dst else None


def round_trip_s(peer_a: int, peer_b: int, rank: int) -> float | None:
    """Best of three one-float ping-pongs between two ranks, timed at `peer_a`."""
    buf = torch.zeros(1)

    def action():
        if rank == peer_a:
            dist.send(buf, peer_b)
            dist.recv(buf, peer_b)
        elif rank == peer_b:
            dist.recv(buf, peer_a)
            dist.send(buf, peer_a)

    best = best_time_s(action, 3)
    return best if rank == peer_a else None


def thread_policies(wait_s: float = 5.0) -> dict:
    """{"comm": set of the gloo threads' policies, "main": this thread's policy}, read once
    every gloo thread is SCHED_FIFO (the launcher raises them every 0.25 s) or after
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        comm = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
                if name.startswith(("gloo", "pt_gloo")):
                    comm.add(os.sched_getscheduler(int(tid)))
            except OSError:
                continue
        if comm == {os.SCHED_FIFO} or time.monotonic() > deadline:
            return {"comm": sorted(comm), "main": os.sched_getscheduler(0),
                    "fifo": os.SCHED_FIFO, "other": os.SCHED_OTHER}
        time.sleep(0.1)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["DHELIX_RANKS_PER_NODE"])
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    record = {
        "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "node_rank": int(os.environ["DHELIX_NODE_RANK"]),
        "num_nodes": int(os.environ["DHELIX_NUM_NODES"]), "ranks_per_node": per_node,
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "master_addr": os.environ["MASTER_ADDR"], "all_reduce": total.item(),
        "policies": thread_policies(),
    }
    if world > per_node >= 2:
        record["intra_s"] = transfer_s(0, 1, rank)
        record["cross_s"] = transfer_s(0, per_node, rank)
    if world > per_node:
        record["round_trip_s"] = round_trip_s(0, per_node, rank)
    if record["local_rank"] == 0:
        ip, tc = find_tool("ip"), find_tool("tc")
        record["link"] = subprocess.run([ip, "-d", "-o", "link", "show", "eth0"],
                                        capture_output=True, text=True).stdout
        record["addr"] = subprocess.run([ip, "-o", "-4", "addr", "show", "eth0"],
                                        capture_output=True, text=True).stdout
        record["qdisc"] = subprocess.run([tc, "qdisc", "show", "dev", "eth0"],
                                         capture_output=True, text=True).stdout
    dist.barrier()
    dist.destroy_process_group()
    # One write call: ranks of a node share torchrun's stdout, and under PYTHONUNBUFFERED
    # print() writes the text and its newline separately, so two ranks' lines could merge.
    sys.stdout.write("PROBE " + json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
