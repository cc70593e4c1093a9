"""`dhelix.gloo_device`: with DHELIX_GLOO_SHARED_DEVICE=1 every gloo group of a process
shares one transport device, so one `gloo_tcp_loop` thread serves them all (but for a group
made inside `own_gloo_devices()`, as the lanes are), and their collectives still give the
right sums; without it torch's one device (one loop thread) per group is left alone. Each
case runs in a fresh interpreter (the patch is process-wide), on a world of one rank."""

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

def loop_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass
    return names.count("gloo_tcp_loop")

shared = share_gloo_device_if_asked()
again = share_gloo_device_if_asked()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
groups = [dist.new_group([0]) for _ in range(4)]
loops_default = loop_threads()
os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # torch's interface choice, read per group
groups += [dist.new_group([0]) for _ in range(2)]
with own_gloo_devices():  # as the lanes are made
    groups.append(dist.new_group([0]))
sums = []
for group in groups:
    tensor = torch.full((3,), 2.0)
    dist.all_reduce(tensor, group=group)
    sums.append(tensor.tolist())
print(json.dumps({"shared": shared, "again": again, "loops_default": loops_default,
                  "loops": loop_threads(), "sums": sums}))
"""


def _probe(shared: str) -> dict:
    env = {**os.environ, "DHELIX_GLOO_SHARED_DEVICE": shared}
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_loop_thread_serves_every_group_only_when_asked():
    shared, own = _probe("1"), _probe("0")
    for result in (shared, own):
        assert result["sums"] == [[2.0] * 3] * 7  # a world of one: the tensor unchanged
    assert (shared["shared"], shared["again"]) == (True, True)
    # the world and four groups on one device; the two groups bound to `lo` on a second;
    # the group made inside own_gloo_devices() on a third, its own
    assert (shared["loops_default"], shared["loops"]) == (1, 3)
    assert (own["shared"], own["again"]) == (False, False)
    assert own["loops_default"] >= 4 and own["loops"] >= own["loops_default"] + 3
