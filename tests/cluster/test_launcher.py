"""The emulated cluster end to end (needs root, ip, tc and network namespaces; skipped
otherwise): a 2x2 run with the topology, loopback inside a node and shaped links across
nodes, then the failure paths - a failing node, the timeout, Ctrl-C, stale leftovers - each
checked to leave no namespace, veth, qdisc, /etc/netns entry or process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.cluster.support import (
    HERE,
    LAUNCHER,
    ROOT,
    host_network_state,
    launch,
    leftovers,
    netem_unavailable_reason,
    processes_with,
    run_id_of,
    unavailable_reason,
)

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=str(unavailable_reason()))

BANDWIDTH_BIT = 50_000_000  # 50mbit: a 2 MB transfer takes >= 0.34 s across nodes
PROBE = str(HERE / "probe_ranks.py")
NODE_PROGRAM = str(HERE / "node_program.py")


def _assert_clean(run_id: str, before: tuple[str, str], token: str | None = None) -> None:
    assert leftovers(run_id) == []
    assert host_network_state() == before, "the host's interfaces or qdiscs changed"
    if token:
        assert processes_with(token) == [], "node processes survived the run"


@pytest.mark.slow
def test_two_nodes_two_ranks_topology_shaping_and_cleanup(tmp_path):
    before = host_network_state()
    temp = tmp_path / "tmp"  # the launcher's and torchrun's temporary files go here
    temp.mkdir()
    result = launch(["--nodes", "2", "--ranks-per-node", "2", "--bandwidth", "50mbit",
                     "--", PROBE], env=dict(os.environ, TMPDIR=str(temp)))
    assert result.returncode == 0, result.stderr[-4000:]
    assert list(temp.iterdir()) == []  # torchrun's log directories (--log-dir) removed
    records = sorted((json.loads(line.split("PROBE ", 1)[1])
                      for line in result.stdout.splitlines() if "PROBE " in line),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    for record in records:
        node = record["rank"] // 2
        assert record["world"] == 4 and record["all_reduce"] == 10.0
        assert (record["num_nodes"], record["ranks_per_node"]) == (2, 2)
        assert record["node_rank"] == record["group_rank"] == node
        assert record["local_rank"] == record["rank"] % 2
        assert record["gloo_ifname"] == "eth0,eth0" and record["master_addr"] == "10.77.0.1"
        # the launcher raised the gloo threads (the emulated NIC), not the computing thread
        policies = record["policies"]
        assert policies["comm"] == [policies["fifo"]], policies
        assert policies["main"] == policies["other"], policies
    # Every node's output is prefixed with its node; ranks report where they ran.
    assert any(line.startswith("[n0] PROBE ") for line in result.stdout.splitlines())
    assert any(line.startswith("[n1] PROBE ") for line in result.stdout.splitlines())
    # Inside its namespace each node saw a veth with its own address and a tbf at the rate.
    for node in (0, 1):
        facts = records[2 * node]
        assert "veth" in facts["link"]
        assert f"inet 10.77.0.{node + 1}/24" in facts["addr"]
        assert "tbf" in facts["qdisc"] and "rate 50Mbit" in facts["qdisc"]
    # Across nodes the link's bandwidth is enforced; inside a node traffic takes loopback.
    cross, intra = records[2]["cross_s"], records[1]["intra_s"]
    floor = (2 << 20) * 8 / BANDWIDTH_BIT
    assert cross >= 0.8 * floor, f"cross-node 2 MB in {cross:.3f} s: not shaped"
    assert intra < cross / 5, f"intra-node {intra:.3f} s vs cross-node {cross:.3f} s"
    _assert_clean(run_id_of(result), before)


@pytest.mark.slow
def test_failing_node_stops_the_others_and_its_exit_code_propagates():
    before, token = host_network_state(), uuid.uuid4().hex
    start = time.monotonic()
    result = launch(["--nodes", "2", "--grace", "2", "--", NODE_PROGRAM, "fail", token])
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-4000:]  # torchrun's code for a failed rank
    assert "node 1 exited with code 1; stopping the other nodes" in result.stderr
    assert elapsed < 60, f"the surviving node was not stopped promptly ({elapsed:.0f} s)"
    _assert_clean(run_id_of(result), before, token)


@pytest.mark.slow
def test_timeout_stops_every_node_with_exit_code_124():
    before, token = host_network_state(), uuid.uuid4().hex
    result = launch(["--nodes", "2", "--timeout", "8", "--grace", "2", "--",
                     NODE_PROGRAM, "sleep", token])
    assert result.returncode == 124, result.stderr[-4000:]
    assert "timeout after 8 s with nodes [0, 1] still running" in result.stderr
    assert "node 0 started" in result.stdout and "node 1 started" in result.stdout
    _assert_clean(run_id_of(result), before, token)


@pytest.mark.slow
def test_overlap_check_hides_communication_on_a_shaped_link(tmp_path):
    # 1 MB at 50mbit: the all_reduce waits on the link, so the matmuls run meanwhile.
    before, out = host_network_state(), tmp_path / "overlap.json"
    result = launch(["--nodes", "2", "--bandwidth", "50mbit", "--",
                     str(ROOT / "scripts" / "overlap_check.py"), "--size-mb", "1",
                     "--repeats", "3", "--warmup", "1", "--json", str(out)])
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert (report["nodes"], report["ranks_per_node"], report["world_size"]) == (2, 1, 2)
    assert report["link"] == "50mbit, 0ms one-way"
    assert all(len(report["samples_s"][mode]) == 3 for mode in report["median_ms"])
    # Any 2-rank all_reduce sends at least half the payload each way over the link.
    floor_ms = 0.5 * (1 << 20) * 8 / BANDWIDTH_BIT * 1e3
    assert report["median_ms"]["comm"] >= 0.9 * floor_ms
    # Overlap shows in the best of the samples: noise on a loaded 2-core machine only adds
    # time (under load the report's median-based speedup fell to 1.18x where the best
    # samples gave 1.71x).
    best = {mode: min(samples) for mode, samples in report["samples_s"].items()}
    assert best["back_to_back"] / best["overlapped"] >= 1.2, result.stdout
    assert "[n0]   speedup back-to-back / overlapped" in result.stdout
    _assert_clean(run_id_of(result), before)


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_cleans_up():
    signum = signal.SIGINT  # SIGTERM/SIGHUP take the same path (tests/cluster/test_parts.py)
    before, token = host_network_state(), uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nodes", "2", "--grace", "2",
                             "--", NODE_PROGRAM, "sleep", token], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(processes_with(token)) < 2 + 2:
            time.sleep(0.1)  # two torchruns and two node programs are up
        prefix = f"dhxc-{proc.pid}-"
        run_id = next(n for n in leftovers(prefix)).rsplit("-", 1)[0]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signum, err[-4000:]
    assert f"interrupted by {signal.Signals(signum).name}" in err
    _assert_clean(run_id, before, token)


def test_cleanup_stale_removes_dead_runs_only():
    from dhelix.cluster.host import find_tool
    from dhelix.cluster.naming import RunNames
    from dhelix.cluster.nsconfig import ETC_NETNS

    ip = find_tool("ip")
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone: a launcher that died without cleaning up
    stale = RunNames(pid=dead.pid, tag=uuid.uuid4().hex[:6])
    alive = RunNames(pid=os.getpid(), tag=uuid.uuid4().hex[:6])  # a run in progress
    created = [stale.switch_ns, stale.node_ns(0), alive.node_ns(0)]
    token = uuid.uuid4().hex
    try:
        for name in created:
            subprocess.run([ip, "netns", "add", name], check=True)
        subprocess.run([ip, "-n", stale.switch_ns, "link", "add", "p0", "type", "veth",
                        "peer", "name", "eth0", "netns", stale.node_ns(0)], check=True)
        (ETC_NETNS / stale.node_ns(0)).mkdir(parents=True, exist_ok=True)
        sleeper = subprocess.Popen([ip, "netns", "exec", stale.node_ns(0), "sleep", "600",
                                    token])
        result = launch(["--cleanup-stale"])
        sleeper.wait(timeout=10)
        assert result.returncode == 0, result.stderr
        assert "removed 2 stale namespace(s)" in result.stderr
        assert leftovers(stale.run_id) == []
        assert processes_with(token) == []
        assert leftovers(alive.run_id) == [alive.node_ns(0)], "a live run's namespace was removed"
    finally:
        for name in created:
            subprocess.run([ip, "netns", "del", name], capture_output=True)
        subprocess.run(["rm", "-rf", str(ETC_NETNS / stale.node_ns(0))])


@pytest.mark.skipif(netem_unavailable_reason() is not None,
                    reason=str(netem_unavailable_reason()))
@pytest.mark.slow
def test_latency_is_applied_one_way_per_direction():
    # A one-float ping-pong across nodes crosses each direction's delay once: >= 2 x 20 ms.
    before = host_network_state()
    result = launch(["--nodes", "2", "--bandwidth", "1gbit", "--latency", "20ms", "--",
                     PROBE])
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line.split("PROBE ", 1)[1])
               for line in result.stdout.splitlines() if "PROBE " in line]
    assert all("netem" in r["qdisc"] and "delay 20ms" in r["qdisc"] for r in records)
    round_trip = next(r["round_trip_s"] for r in records if r["rank"] == 0)
    assert round_trip >= 0.9 * 2 * 0.020, f"round trip {round_trip * 1e3:.1f} ms"
    _assert_clean(run_id_of(result), before)


def test_nonzero_latency_without_netem_is_refused_and_cleaned_up():
    if netem_unavailable_reason() is None:
        pytest.skip("this kernel has netem; the refusal path cannot be reached")
    before = host_network_state()
    result = launch(["--nodes", "2", "--latency", "1ms", "--", PROBE])
    assert result.returncode == 1
    assert "latency emulation needs the kernel's netem qdisc" in result.stderr
    _assert_clean(run_id_of(result), before)
