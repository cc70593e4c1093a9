"""`dhelix.gloo_device`: without DHELIX_GLOO_SHARED_DEVICE=1 torch's one transport device
(one loop thread, `gloo_tcp_loop`) per gloo group is left alone; with it every group made
afterwards shares one device, one loop thread for them all (a second for groups bound to
another GLOO_SOCKET_IFNAME; a group made inside `own_gloo_devices()`, as the lanes are,
its own), and every group's collectives still give the right sums. Run in a fresh
interpreter (the patch is process-wide), on a world of one rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, os
from dhelix.gloo_device import own_gloo_devices, share_gloo_device_if_asked
import torch
import torch.distributed as dist

def threads():
    # made synchronously: a group's two worker threads by its constructor, a device's loop
    # thread by the device's (a loop thread's name, gloo_tcp_loop, comes later, from itself)
    return len(os.listdir("/proc/self/task"))

seen = {"asked_unset": share_gloo_device_if_asked()}
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
seen["world"] = threads()
groups = [dist.new_group([0]) for _ in range(3)]
seen["own_devices"] = threads()
os.environ["DHELIX_GLOO_SHARED_DEVICE"] = "1"
seen["asked_set"] = share_gloo_device_if_asked(), share_gloo_device_if_asked()
groups += [dist.new_group([0]) for _ in range(4)]
seen["shared"] = threads()
os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # torch's interface choice, read per group
groups += [dist.new_group([0]) for _ in range(2)]
seen["shared_lo"] = threads()
with own_gloo_devices():  # as the lanes are made
    groups.append(dist.new_group([0]))
seen["own_lane"] = threads()
seen["sums"] = []
for group in groups:
    tensor = torch.full((3,), 2.0)
    dist.all_reduce(tensor, group=group)
    seen["sums"].append(tensor.tolist())
print(json.dumps(seen))
"""


def test_one_loop_thread_serves_the_groups_made_once_asked():
    env = {k: v for k, v in os.environ.items()
           if k not in ("DHELIX_GLOO_SHARED_DEVICE", "GLOO_SOCKET_IFNAME")}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["sums"] == [[2.0] * 3] * 10  # a world of one: every tensor unchanged
    assert seen["asked_unset"] is False and seen["asked_set"] == [True, True]
    # each group brings two worker threads, each device one loop thread. Unasked: three
    # groups, three devices
    assert seen["own_devices"] == seen["world"] + 3 * (2 + 1)
    # asked: four groups on one new device; two bound to `lo` on a second
    assert seen["shared"] == seen["own_devices"] + 4 * 2 + 1
    assert seen["shared_lo"] == seen["shared"] + 2 * 2 + 1
    # a group made inside own_gloo_devices() gets a device of its own
    assert seen["own_lane"] == seen["shared_lo"] + 2 + 1
