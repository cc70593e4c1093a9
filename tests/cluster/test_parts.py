"""The emulated cluster's parts without a network (no root needed, but for raising a real
process's threads to real-time priority): option parsing, names, the tc commands,
per-namespace files, the refusals, torchrun's command line and environment, exit codes,
signal handling, stale detection, the overlap summary and the communication threads'
priority."""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from dhelix.cluster import cli, host as host_module, nsconfig, stale
from dhelix.cluster.host import ClusterError, Host
from dhelix.cluster.launch import NodeJob, exit_code_of
from dhelix.cluster.naming import RunNames, parse_namespace
from dhelix.cluster.runner import ClusterConfig
from dhelix.cluster.shaping import LinkShape, downlink_commands, gso_commands, uplink_commands
from dhelix.cluster.signals import Interrupted, SignalGuard
from dhelix.cluster.units import format_rate, format_time, parse_rate, parse_time
from tests.cluster.support import ROOT


@pytest.mark.parametrize("text,bits", [("800mbit", 800_000_000), ("1.5gbit", 1_500_000_000),
                                       ("64kbit", 64_000), ("100Mbit", 100_000_000),
                                       ("unlimited", None)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits
    if bits:
        assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["800", "fast", "0mbit", "-1mbit", "800mbps", "1kbit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError, match=r"--bandwidth .*(unit|at least)"):
        parse_rate(text)


@pytest.mark.parametrize("text,seconds", [("1ms", 1e-3), ("250us", 250e-6), ("0ms", 0.0),
                                          ("2s", 2.0)])
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)
    assert parse_time(format_time(seconds)) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "1h", "-1ms", "soon"])
def test_parse_time_rejects(text):
    with pytest.raises(ValueError, match="--latency"):
        parse_time(text)


def test_names_are_unique_parseable_and_addresses_private():
    first, second = RunNames.new(), RunNames.new()
    assert first.run_id != second.run_id and first.pid == second.pid == os.getpid()
    for name, role in [(first.switch_ns, "sw"), (first.node_ns(3), "n3")]:
        parsed = parse_namespace(name)
        assert (parsed.pid, parsed.tag, parsed.role, parsed.run_id) == (
            first.pid, first.tag, role, first.run_id)
    for foreign in ["dhxc", "dhxc-12-zz-sw", "dhxc-12-ab-x0", "other-1-ab-sw", "docker0"]:
        assert parse_namespace(foreign) is None
    assert [RunNames.node_address(i) for i in (0, 1, 249)] == [
        "10.77.0.1", "10.77.0.2", "10.77.0.250"]
    with pytest.raises(ValueError):
        RunNames.node_address(250)


def test_uplink_bandwidth_only_is_a_root_tbf():
    shape = LinkShape(800_000_000)
    (command,) = uplink_commands("ns", "eth0", shape)
    assert command[:8] == ["-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle"]
    assert command[9:13] == ["tbf", "rate", "800000000bit", "burst"]
    assert shape.burst_bytes == 200_000  # 2 ms at 800 Mbit/s
    assert shape.queue_bytes == 5_000_000  # 50 ms
    assert downlink_commands("sw", "p0", shape) == [
        ["-n", "sw", "qdisc", "add", "dev", "p0", "root", "handle", "1:"] + command[9:]]


def test_gso_packets_fit_the_bucket():
    # tbf splits a GSO packet larger than its bucket, which makes TCP retransmit under load
    for rate in (1_000_000, 8_000_000, 100_000_000, 200_000_000, 800_000_000, 10**10):
        shape = LinkShape(rate)
        assert 0 < shape.gso_max_bytes <= min(65536, shape.burst_bytes - 1500)
    assert LinkShape(800_000_000).gso_max_bytes == 65536
    assert LinkShape(200_000_000).gso_max_bytes == 50_000 - 1500
    assert gso_commands("ns", "eth0", LinkShape(200_000_000)) == [
        ["-n", "ns", "link", "set", "dev", "eth0", "gso_max_size", "48500"]]
    assert gso_commands("ns", "eth0", LinkShape(None)) == []


def test_uplink_latency_is_netem_with_tbf_child_and_minimums_hold():
    shape = LinkShape(8_000_000, latency=0.0015)
    netem, tbf = uplink_commands("ns", "eth0", shape)
    assert netem[6:] == ["root", "handle", "1:", "netem", "delay", "1500us", "limit", "100000"]
    assert tbf[6:10] == ["parent", "1:1", "handle", "10:"]
    assert shape.burst_bytes == 16384 and shape.queue_bytes == 256 * 1024
    assert uplink_commands("ns", "eth0", LinkShape(None, 0.0015)) == [netem]
    assert uplink_commands("ns", "eth0", LinkShape(None)) == []
    assert downlink_commands("sw", "p0", LinkShape(None, 0.001)) == []
    with pytest.raises(ValueError):
        LinkShape(0)
    with pytest.raises(ValueError):
        LinkShape(None, -1)


def test_nsconfig_writes_and_removes(tmp_path):
    root = tmp_path / "netns"
    nsconfig.write("dhxc-1-ab-n0", ["10.77.0.1", "10.77.0.2"], root=root)
    hosts = (root / "dhxc-1-ab-n0" / "hosts").read_text()
    for line in ["127.0.0.1 localhost", "10.77.0.2 node1", "::ffff:10.77.0.2 node1"]:
        assert line in hosts.splitlines()
    assert "nameserver 127.0.0.1" in (root / "dhxc-1-ab-n0" / "resolv.conf").read_text()
    nsconfig.write("dhxc-1-ab-n1", ["10.77.0.1"], root=root)
    nsconfig.remove("dhxc-1-ab-n0", root=root)
    assert [p.name for p in root.iterdir()] == ["dhxc-1-ab-n1"]  # parent kept: not empty
    nsconfig.remove("dhxc-1-ab-n1", root=root)
    nsconfig.remove("dhxc-1-ab-n1", root=root)  # idempotent
    assert not root.exists()


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(host_module.os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="needs root"):
        Host.check()
    assert cli.main(["--", "scripts/overlap_check.py"]) == 2
    assert "error: the emulated cluster needs root" in capsys.readouterr().err


def test_refuses_without_ip_or_tc(monkeypatch, capsys):
    monkeypatch.setattr(host_module.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host_module, "find_tool", lambda name: None if name == "tc" else "/x/ip")
    with pytest.raises(ClusterError, match="^tc not found .*install iproute2"):
        Host.check()
    monkeypatch.setattr(host_module, "find_tool", lambda name: None)
    assert cli.main(["--", "scripts/overlap_check.py"]) == 2
    assert "error: ip and tc not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    ([], "nothing to run: give the command after --"),
    (["--bandwidth", "fast", "--", "x.py"], "--bandwidth 'fast'"),
    (["--latency", "1", "--", "x.py"], "--latency '1'"),
    (["--timeout", "-1", "--", "x.py"], "--timeout and --grace must be >= 0"),
    (["--threads-per-rank", "0", "--", "x.py"], "--threads-per-rank 0: must be >= 1"),
])
def test_cli_rejects_bad_options_before_touching_anything(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(Host, "check", classmethod(lambda cls: pytest.fail("host touched")))
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_fifo_refused_when_real_time_threads_are_unthrottled(tmp_path, capsys, monkeypatch):
    from dhelix.cluster import comm_priority

    knob = tmp_path / "sched_rt_runtime_us"
    monkeypatch.setattr(comm_priority, "RT_RUNTIME", knob)
    monkeypatch.setattr(Host, "check", classmethod(lambda cls: pytest.fail("host touched")))
    knob.write_text("950000\n")
    assert comm_priority.rt_throttling_problem() is None
    knob.write_text("-1\n")
    assert cli.main(["--", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--comm-priority fifo" in err and "sched_rt_runtime_us" in err and "normal" in err
    # the fair scheduler needs no throttling: gets past the check (to the host check)
    monkeypatch.setattr(Host, "check", classmethod(lambda cls: (_ for _ in ()).throw(
        ClusterError("host checked"))))
    assert cli.main(["--comm-priority", "normal", "--", "x.py"]) == 2
    assert "host checked" in capsys.readouterr().err


def test_cluster_config_validates():
    shape = LinkShape(None)
    for nodes, per_node, command in [(0, 1, ["x"]), (1, 0, ["x"]), (251, 1, ["x"]),
                                     (2, 1, [])]:
        with pytest.raises(ValueError):
            ClusterConfig(nodes, per_node, shape, command, torchrun="torchrun")
    with pytest.raises(ValueError, match="comm priority"):
        ClusterConfig(2, 1, shape, ["x"], torchrun="torchrun", comm_priority="high")


def test_torchrun_command_line_and_rank_environment():
    job = NodeJob(["train.py", "--tp", "2"], ranks_per_node=2, nodes=3, torchrun="/v/torchrun",
                  master_port=1234, extra_env={"DHELIX_CLUSTER_LINK": "1gbit, 0ms one-way"})
    assert job.argv(2) == ["/v/torchrun", "--nnodes", "3", "--node-rank", "2",
                           "--nproc-per-node", "2", "--master-addr", "10.77.0.1",
                           "--master-port", "1234", "train.py", "--tp", "2"]
    assert job.argv(0, "/t/logs/node0")[-5:] == ["--log-dir", "/t/logs/node0", "train.py",
                                                 "--tp", "2"]
    env = job.environment(1, base={"PATH": "/bin", "GLOO_SOCKET_IFNAME": "wrong"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth0,eth0" and env["PATH"] == "/bin"
    assert (env["DHELIX_NUM_NODES"], env["DHELIX_RANKS_PER_NODE"],
            env["DHELIX_NODE_RANK"]) == ("3", "2", "1")
    assert env["DHELIX_CLUSTER_LINK"] == "1gbit, 0ms one-way"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 6))
    assert job.environment(0, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_exit_codes():
    assert [exit_code_of(c) for c in (0, 1, 3, -signal.SIGKILL, -signal.SIGTERM)] == [
        0, 1, 3, 137, 143]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_guard_raises_once_then_shields(signum, capsys):
    previous = signal.getsignal(signum)
    with SignalGuard() as guard:
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signum)
        assert info.value.signum == signum and info.value.exit_code == 128 + signum
        guard.shield()
        os.kill(os.getpid(), signum)  # recorded, not raised: cleanup must finish
        assert guard.received == [signum, signum]
    assert "cleaning up, please wait" in capsys.readouterr().err
    assert signal.getsignal(signum) == previous


def test_stale_detection_spares_live_launchers(monkeypatch, tmp_path):
    live, gone = os.getpid(), 2**22 + 12345  # above pid_max: no such process
    names = [f"dhxc-{gone}-ab12-sw", f"dhxc-{gone}-ab12-n0", f"dhxc-{live}-cd34-n0",
             "unrelated", "dhxc-nope"]

    class FakeHost:
        def list_namespaces(self):
            return names

    (tmp_path / f"dhxc-{gone}-ef56-n1").mkdir()  # only its /etc/netns files survived
    (tmp_path / "someone-else").mkdir()
    monkeypatch.setattr(nsconfig, "ETC_NETNS", tmp_path)
    assert stale.stale_namespaces(FakeHost()) == [
        f"dhxc-{gone}-ab12-n0", f"dhxc-{gone}-ab12-sw", f"dhxc-{gone}-ef56-n1"]


def _overlap_check_module():
    spec = importlib.util.spec_from_file_location("overlap_check",
                                                  ROOT / "scripts" / "overlap_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_summary():
    samples = {"comm": [0.10, 0.12, 0.11], "compute": [0.09, 0.10, 0.08],
               "back_to_back": [0.20, 0.21, 0.22], "overlapped": [0.14, 0.13, 0.12]}
    summary = _overlap_check_module().summarize(samples)
    assert summary["median_ms"]["overlapped"] == pytest.approx(130)
    assert summary["speedup"] == pytest.approx(210 / 130)
    assert summary["ideal_speedup"] == pytest.approx(210 / 110)
    assert summary["hidden_fraction"] == pytest.approx((210 - 130) / 90)


def test_line_pump_prefixes_whole_lines_into_text_or_binary_sinks():
    import io

    from dhelix.cluster.output import LinePump

    for sink in (io.StringIO(), io.TextIOWrapper(io.BytesIO(), write_through=True)):
        pump = LinePump(io.BytesIO(b"one\ntwo \xff\nlast"), sink, "[n1] ")
        pump.start()
        pump.join(timeout=5)
        text = (sink.getvalue() if isinstance(sink, io.StringIO)
                else sink.buffer.getvalue().decode(errors="replace"))
        assert text == "[n1] one\n[n1] two \ufffd\n[n1] last\n"


_GLOO_CHILD = """
import sys, time, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs root")
def test_comm_threads_of_descendants_get_fifo_and_nothing_else_does():
    """A real grandchild with a gloo process group: its gloo threads, and only those, become
    SCHED_FIFO; a second scan finds nothing new; the test process is left alone."""
    import subprocess
    import sys as _sys

    from dhelix.cluster.comm_priority import CommThreadPriority, descendants

    # a shell in between, as `ip netns exec` + torchrun put the ranks below the node process
    parent = subprocess.Popen(["sh", "-c", f'exec "$0" -c \'{_GLOO_CHILD}\' & wait',
                               _sys.executable], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        pids = descendants([parent.pid])
        assert parent.pid in pids and len(pids) == 2
        child = next(p for p in pids if p != parent.pid)
        keeper = CommThreadPriority([parent.pid])
        assert keeper.scan() >= 2 and keeper.failures == 0
        assert keeper.scan() == 0  # nothing new: each thread is raised once
        policies = {}
        for tid in os.listdir(f"/proc/{child}/task"):
            name = open(f"/proc/{child}/task/{tid}/comm").read().strip()
            policies.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
        gloo = {n: p for n, p in policies.items() if n.startswith(("gloo", "pt_gloo"))}
        assert gloo and all(p == {os.SCHED_FIFO} for p in gloo.values()), policies
        others = {n: p for n, p in policies.items() if n not in gloo}
        assert others and all(os.SCHED_FIFO not in p for p in others.values()), policies
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
