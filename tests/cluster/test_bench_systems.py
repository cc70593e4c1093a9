"""The side-by-side benchmark end to end on the emulated cluster (needs root, ip, tc; skipped
otherwise): a tiny case of the documented command for configuration (a) writes the JSON,
markdown and PNG with every system, finite numbers for each, and leaves no namespace,
/etc/netns entry or host qdisc behind. (Which systems run with PP=2, and the "n/a" rows, are
checked without a cluster in tests/test_bench_parts.py; the W schedule every PP=2 system
runs, by the parity tests. Configuration (c) was launched here too until the suite neared
15 minutes on Python 3.12.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dhelix.bench.systems import CONFIGS, config_systems
from planner.plan import load_plan
from tests.cluster.support import ROOT, host_network_state, unavailable_reason

pytestmark = [pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason())),
              pytest.mark.slow]  # multi-process: not in the fast tier


def _namespaces() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_quick_benchmark_writes_every_system_and_cleans_up(tmp_path):
    before_ns, before_host = _namespaces(), host_network_state()
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_systems.py"), "--quick",
         "--configs", "a", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["config"]["name"] for c in results["configs"]] == ["a"]
    for entry in results["configs"]:
        assert entry["cleanup"].startswith("verified"), entry["cleanup"]
        rows = {row["system"]: row for row in entry["summary"]["rows"]}
        assert set(rows) == {s.name for s in config_systems(CONFIGS[entry['config']['name']])}
        for name, row in rows.items():
            if row["unavailable"]:
                assert entry["config"]["pp"] > 1 and name == "domino", row
                continue
            for key in ("step_s", "tokens_per_s", "speedup"):
                assert math.isfinite(row[key]) and row[key] > 0, (name, key, row)
            assert all(b > 0 for b in row["peak_bytes_per_rank"])
            assert len(row["peak_bytes_per_rank"]) == (entry["config"]["nodes"]
                                                       * entry["config"]["ranks_per_node"])
    a = {row["system"]: row for row in results["configs"][0]["summary"]["rows"]}
    assert not any(row["unavailable"] for row in a.values())  # PP=1: every system runs
    assert a["megatron"]["timeline"] is None  # Megatron's own schedule is not recorded
    # the DHelix row planned from a profile taken first on the same cluster
    assert "plan from profile" in a["dhelix"]["label"]
    assert (tmp_path / "raw" / "a.profile.json").is_file()
    for name in ("ops_sequential", "domino", "wavelet", "dhelix"):
        timeline = a[name]["timeline"]
        assert timeline["compute"] > 0 and timeline["issue"] > 0, (name, timeline)
        assert timeline["recorded"] <= timeline["step_s"]
        assert timeline["idle_longest"] is None  # no emulated GPU stream to leave empty
        assert timeline["link_idle"] is None  # nor its record of the link
        held = timeline["held_longest"]  # the compute thread's longest holds, longest first
        assert held and [h[2] for h in held] == sorted((h[2] for h in held), reverse=True)
        assert sum(h[2] for h in held) <= (timeline["issue"] + timeline["wait"]
                                           + timeline["barrier"]) + 1e-9
    ranks = json.loads((tmp_path / "raw" / "a.ranks.json").read_text())["ranks"]
    # raw/ keeps the plan each row built at start-up (--dhelix-save-plan); none for Domino
    saved = load_plan(tmp_path / "raw" / "a.dhelix.plan.json")
    assert [[list(b.fwd), list(b.bwd)] for b in saved.blocks] == ranks[0]["plan_block_ops"]
    assert saved.search["memory"]["block_peak_mib"]
    assert load_plan(tmp_path / "raw" / "a.ops_sequential.plan.json").pairer == "sequential"
    assert not (tmp_path / "raw" / "a.domino.plan.json").exists()
    # the DP's plan is never predicted slower than running the strands one after the other
    # (whether it pairs at all depends on the profile this machine measured: on CI it once
    # built a plan with no paired block); Wavelet's round robin pairs the strands whatever
    # the costs, so paired blocks run in every quick benchmark
    assert saved.planned_ms <= saved.sequential_ms * (1 + 1e-9), (
        saved.planned_ms, saved.sequential_ms)
    wavelet = load_plan(tmp_path / "raw" / "a.wavelet.plan.json")
    assert wavelet.pairer == "round_robin" and any(b.fwd and b.bwd for b in wavelet.blocks)
    for rank in ranks:  # Wavelet's recorded blocks; the DHelix row's plan, block by block
        assert [row[0] for row in rank["timelines"]["wavelet"]["block_ms"]] == list(
            range(len(wavelet.blocks)))
        blocks = rank["plan_block_ops"]
        assert len(blocks) == rank["plan_blocks"] and all(f or b for f, b in blocks)
        # the recorded step's layer pairs block by block, beside the cost model's times
        # (none where the start-up choice streams the SI blocks: they run no blocks)
        recorded = rank["timelines"]["dhelix"]
        streamed = "SI blocks run streamed" in rank["plans"]["dhelix"]
        assert [row[0] for row in recorded["block_ms"]] == (
            [] if streamed else list(range(len(blocks))))
        assert all(ms >= 0 and pairs >= 1 for _, ms, pairs in recorded["block_ms"])
        assert len(recorded["planned_block_ms"]) == len(blocks)
    text = (tmp_path / "results.md").read_text()
    assert "## (a)" in text and "CPU work per rank" in text
    assert "held the compute thread longest" in text
    assert (tmp_path / "results.png").stat().st_size > 10_000
    # nothing of ours left: no new namespace (other runs may start their own meanwhile,
    # so only names carrying this benchmark's launcher pids count), no host qdisc change
    assert host_network_state() == before_host
    new = _namespaces() - before_ns
    launched = [line for line in (tmp_path / "raw" / "a.log").read_text().splitlines()
                if "[cluster]" in line and "removed its namespaces" in line]
    assert launched, "the cluster launcher did not report its cleanup"
    run_id = launched[0].split("[cluster] ")[1].split(":")[0]
    assert not [n for n in new if n.startswith(run_id)]
