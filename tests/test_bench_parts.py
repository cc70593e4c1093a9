"""The benchmark's parts that need no cluster: system planning per configuration, the
per-configuration option syntax, and the report (hidden share, n/a rows, markdown, chart)."""

import functools
import math

import pytest

from dhelix.bench.report import bar_chart, markdown, summarise_config
from dhelix.bench.systems import CONFIGS, config_systems, plan_system, tiny_model
from scripts.bench_systems import per_config

MODEL = tiny_model()


@functools.lru_cache(maxsize=None)  # each planning parses Megatron's arguments (~0.2 s)
def _runs(config, profile=None):
    return {s.name: plan_system(s, CONFIGS[config], MODEL, profile)
            for s in config_systems(CONFIGS[config])}


def test_every_system_runs_with_pp1_and_all_but_domino_with_pp2():
    for config in ("a", "b"):
        assert all(run.unavailable is None for run in _runs(config).values())
    for config in ("c", "p"):  # (p): PP=2 across the nodes without TP
        runs = _runs(config)
        for name in ("megatron", "commfree", "ops_sequential", "wavelet", "dhelix"):
            assert runs[name].unavailable is None
        assert "without pipelining" in runs["domino"].unavailable
    assert CONFIGS["p"].parallel_args() == ["--tensor-model-parallel-size", "1",
                                            "--pipeline-model-parallel-size", "2"]
    assert CONFIGS["p"].world_size == 2 and not CONFIGS["p"].oversubscribed(2)


def test_moe_configuration_rows():
    """(e): EP=2 with MoE layers; Megatron's own MoE overlap has a row there only, n/a on
    CPU ranks with the reason; the Domino-style split refuses MoE layers."""
    assert "megatron_moe_overlap" not in _runs("a")
    runs = _runs("e")
    assert "CUDA streams" in runs["megatron_moe_overlap"].unavailable
    assert "MoE" in runs["domino"].unavailable
    for name in ("megatron", "commfree", "ops_sequential", "wavelet", "dhelix"):
        assert runs[name].unavailable is None, (name, runs[name].unavailable)
    assert "--expert-model-parallel-size" in CONFIGS["e"].parallel_args()
    runs = _runs("e2")  # TP=2 with SP beside EP=2
    for name in ("megatron", "ops_sequential", "wavelet", "dhelix"):
        assert runs[name].unavailable is None, (name, runs[name].unavailable)


def test_dhelix_row_takes_the_profile_or_says_it_is_analytic(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    with_profile = _runs("a", str(profile))["dhelix"]
    assert with_profile.args[-2:] == ["--dhelix-profile", str(profile)]
    assert "plan from profile" in with_profile.label
    assert "analytic" in _runs("a")["dhelix"].label
    assert _runs("a")["commfree"].system.timing_only


def test_per_config_values():
    assert per_config(["800mbit", "b=200mbit"], "--bandwidth", ["a", "b"]) == {
        "a": "800mbit", "b": "200mbit"}
    assert per_config(None, "--bandwidth", ["a"]) == {"a": None}
    with pytest.raises(SystemExit, match="not benchmarked"):
        per_config(["c=1mbit"], "--bandwidth", ["a"])
    # two-letter configuration names, and paths with "=" in them
    assert per_config(["a2=/p/a2.json", "/q=r/all.json"], "--dhelix-profile", ["a", "a2"]) == {
        "a": "/q=r/all.json", "a2": "/p/a2.json"}
    with pytest.raises(SystemExit, match="not benchmarked"):
        per_config(["a2=400mbit"], "--bandwidth", ["a"])


def _raw():
    runs = _runs("a")
    times = {"megatron": [4.0, 4.2, 4.1], "commfree": [3.0, 3.0, 3.1],
             "ops_sequential": [4.0, 4.1, 4.0], "domino": [3.8, 3.8, 3.9],
             "wavelet": [3.6, 3.7, 3.6], "dhelix": [3.2, 3.2, 3.3]}
    ranks = [{"times": {k: [t * f for t in v] for k, v in times.items()},
              "memory": {k: 2**20 for k in times}, "plans": {},
              "timelines": {"dhelix": {"compute": 2.0, "issue": 0.1, "wait": 0.3 * f,
                                       "barrier": 0.2, "recorded": 2.3 + 0.3 * f,
                                       "step_s": 3.2,
                                       "held_longest": [["wait", "unpermute", 0.2 * f, 4],
                                                        ["issue", "dispatch.a2a", 0.1, 4]],
                                       "idle_longest": [["outside", "the layers", 0.5, 3],
                                                        ["compute", "unpermute", 0.04 * f, 4]],
                                       "link_idle": {"busy": 2500.0 * f, "idle": 700.0,
                                                     "head": 200.0, "between": 300.0,
                                                     "tail": 150.0, "after": 50.0,
                                                     "collectives": 40},
                                       "block_ms": [[0, 30.0 * f, 7], [1, 120.0, 7]],
                                       "planned_block_ms": [25.0, 110.0]}},
              "link_floor": {"collectives": 170, "tensor_bytes": 85 * 2**20, "skipped": [],
                             "one_at_a_time_s": [2.0 * f, 2.2, 2.1],
                             "all_at_once_s": [2.5, 2.4 * f, 2.6]}} for f in (1.0, 1.01)]
    return {"config": "a", "ranks": ranks, "tokens_per_step": 2048,
            "runs": {n: {"label": r.label, "unavailable": r.unavailable,
                         "timing_only": r.system.timing_only} for n, r in runs.items()}}


def test_summary_speedup_and_hidden_share():
    summary = summarise_config(_raw())
    rows = {r["system"]: r for r in summary["rows"]}
    t_meg, t_free, t_dh = 4.1 * 1.01, 3.0 * 1.01, 3.2 * 1.01  # slowest rank's medians
    assert rows["dhelix"]["step_s"] == pytest.approx(t_dh)
    assert rows["dhelix"]["speedup"] == pytest.approx(t_meg / t_dh)
    assert rows["dhelix"]["hidden_share"] == pytest.approx((t_meg - t_dh) / (t_meg - t_free))
    assert rows["commfree"]["hidden_share"] == pytest.approx(1.0)
    assert rows["dhelix"]["tokens_per_s"] == pytest.approx(2048 / t_dh)
    assert summary["comm_share_of_megatron"] == pytest.approx((t_meg - t_free) / t_meg)
    # the link floor: per replay the slowest rank, then the median; the faster mode wins
    floor = summary["link_floor"]
    assert floor["one_at_a_time_s"] == pytest.approx((2.02, 2.1, 2.2))
    assert floor["all_at_once_s"] == pytest.approx((2.424, 2.5, 2.6))
    assert floor["floor_s"] == pytest.approx(2.1)
    assert floor["best_speedup"] == pytest.approx(t_meg / 2.1)
    assert floor["best_hidden_share"] == pytest.approx((t_meg - 2.1) / (t_meg - t_free))
    # the achievable gain: the comm-free step (3.03 s) is the largest floor measured here
    bound = summary["achievable_bound"]
    assert (bound["by"], bound["bound_s"]) == ("comm-free step", pytest.approx(t_free))
    assert bound["cpu_work_floor_s"] is None  # no CPU accounting in this raw
    assert rows["dhelix"]["achievable_share"] == pytest.approx((t_meg - t_dh) / (t_meg - t_free))
    # with a CPU-work floor above it (2 ranks of 2.5 s CPU work on 1 core: 5 s) Megatron is
    # not slower than the bound, and the share is undefined
    raw = _raw()
    for rank in raw["ranks"]:
        rank["step_parts"] = {"megatron": {"thread_run": [2.0] * 3, "thread_runnable": [0.1] * 3,
                                           "other_threads": [0.5] * 3}}
    summary = summarise_config({**raw, "host_cores": 1})
    assert summary["achievable_bound"]["by"] == "CPU-work floor"
    assert summary["achievable_bound"]["bound_s"] == pytest.approx(5.0)
    assert all(r.get("achievable_share") is None for r in summary["rows"])


def test_markdown_and_chart_with_na_rows(tmp_path):
    c_raw = {"config": "c", "ranks": [], "tokens_per_step": 2048,
             "runs": {n: {"label": r.label, "unavailable": r.unavailable,
                          "timing_only": r.system.timing_only}
                      for n, r in _runs("c").items()}}
    entries = []
    for name, raw in (("a", _raw()), ("c", c_raw)):
        cfg = CONFIGS[name]
        entries.append({"config": {"name": name, "description": cfg.description,
                                   "world_size": cfg.world_size, "cores": 2,
                                   "oversubscribed": cfg.oversubscribed(2)},
                        "bandwidth": "800mbit", "load_before": [1, 1, 1],
                        "load_after": [1, 1, 1], "cleanup": "verified",
                        "summary": summarise_config(raw)})
    results = {"megatron_args": MODEL, "reps": 3, "warmup": 1, "configs": entries}
    text = markdown(results)
    # the recorded step of the rank that waited longest: 3200 ms step, 303 ms waiting,
    # 3200 - 2603 = 597 ms outside the layers
    assert "| DHelix (analytic-cost plan, no profile) | 3200 | 2000 | 100 | 303 | 200 | 597 |" \
        in text
    # and where that rank's step held the compute thread longest
    assert ("- DHelix (analytic-cost plan, no profile): wait `unpermute` 202 (4), issue "
            "`dispatch.a2a` 100 (4)") in text
    # where the emulated stream sat empty, by the operator it waited for or outside them
    assert ("- DHelix (analytic-cost plan, no profile): outside the layers 500 (3), compute "
            "`unpermute` 40 (4)") in text
    # where the link carried none of its collectives, by where in their sequence
    assert ("- DHelix (analytic-cost plan, no profile): idle 700 of 3200 (first tenth 200, "
            "between 300, last tenth 150, after the last 50); in flight 2525 (40 collectives)"
            ) in text
    # and that step's layer pairs block by block: planned / measured (the slower rank's)
    assert ("- DHelix (analytic-cost plan, no profile) (7 layer pairs): 1: 25 / 30, 2: 110 / "
            "120; a pair 135 / 150") in text
    assert "## (a)" in text and "## (c)" in text
    assert text.count("Oversubscribed: 4 ranks on 2 cores") == 1  # (c) only
    assert "n/a (--dhelix-pairer domino (intra-batch split) runs without" in text
    assert "(bound)" in text
    assert ("170 collectives of one Megatron forward/backward (85 MiB of tensors per rank) "
            "replayed on the same groups with nothing else running take 2100 ms (2020-2200) "
            "one at a time and 2500 ms (2424-2600) all issued at once") in text
    assert "the link does not bind here" in text  # the floor (2.1 s) is below the bound (3.0 s)
    # DHelix's row: share of the achievable gain (4141 - 3232) / (4141 - 3030) = 81.8%, no plan
    assert "| 1.281x | 81.8% | - | 81.8% |" in text
    assert "Achievable gain: T_bound = 3030 ms (the comm-free step; link floor 2100 ms; " \
           "comm-free step 3030 ms; CPU-work floor not measured)" in text
    # a floor left out can only have made T_bound smaller: the shares are lower bounds
    assert "; a floor not measured could only raise T_bound, and with it the shares." in text
    assert not math.isnan(entries[0]["summary"]["comm_share_of_megatron"])
    bar_chart(results, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_configurations_oversubscribed_and_a2_on_a_slower_link():
    assert [CONFIGS[n].oversubscribed(2) for n in ("a", "a2", "b", "c")] == [
        False, False, True, True]
    assert not CONFIGS["b"].oversubscribed(16)
    assert CONFIGS["a2"].bandwidth == "500mbit" and CONFIGS["a"].bandwidth == "800mbit"


def test_spread_and_predicted_step_speedup():
    raw = _raw()
    for rank in raw["ranks"]:  # 3 layers x (8 - 1) paired layers, each saving 10 ms
        rank["plan_costs"] = {"dhelix": {"sequential_ms": 50.0, "planned_ms": 40.0,
                                         "paired_layers_per_step": 21}}
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    per_rep = [max(t, t * 1.01) for t in (3.2, 3.2, 3.3)]
    assert rows["dhelix"]["step_s_min_median_max"] == pytest.approx(
        (min(per_rep), sorted(per_rep)[1], max(per_rep)))
    t_meg, t_seq = 4.1 * 1.01, 4.0 * 1.01
    assert rows["dhelix"]["predicted_speedup"] == pytest.approx(t_meg / (t_seq - 0.21))
    assert rows["dhelix"]["predicted_step_s"] == pytest.approx(t_seq - 0.21)
    assert rows["wavelet"]["predicted_speedup"] is None  # no plan costs recorded
    assert rows["wavelet"]["predicted_step_s"] is None
    # with the cost model's executed sequential layer (collectives in flight while the
    # strand computes), the saving is taken against it: 21 x (46 - 40) ms
    for rank in raw["ranks"]:
        rank["plan_costs"]["dhelix"]["sequential_executed_ms"] = 46.0
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    assert rows["dhelix"]["predicted_speedup"] == pytest.approx(t_meg / (t_seq - 0.126))
    # and each seam between layer pairs saves its own: 7 x 2 seams x 4 ms more
    for rank in raw["ranks"]:
        rank["plan_costs"]["dhelix"].update(seams_per_step=14, seam_saving_ms=4.0)
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    assert rows["dhelix"]["predicted_speedup"] == pytest.approx(t_meg / (t_seq - 0.182))


def test_pipelined_prediction_counts_transfers_and_takes_the_stage_saving_least():
    """With pipelining each stage records its own W SI blocks: the transfers' exposure each
    block's plan saves against the sequential pairing counts with its layer pairs, and the
    stage predicted to save least gives the row's prediction."""
    raw = _raw()
    stage_costs = [  # stage 0: 12 blocks x 1 pair x 10 ms + 12 x 5 ms of transfers = 180 ms
        {"sequential_ms": 50.0, "planned_ms": 40.0, "paired_layers_per_step": 12,
         "si_blocks_per_step": 12, "transfer_saving_ms": 5.0},
        # stage 1: its plan exposes the transfers more than the sequential pairing: 96 ms
        {"sequential_ms": 50.0, "planned_ms": 41.0, "paired_layers_per_step": 12,
         "si_blocks_per_step": 12, "transfer_saving_ms": -1.0}]
    for rank, costs in zip(raw["ranks"], stage_costs):
        rank["plan_costs"] = {"dhelix": costs}
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    t_meg, t_seq = 4.1 * 1.01, 4.0 * 1.01
    assert rows["dhelix"]["predicted_step_s"] == pytest.approx(t_seq - 0.096)
    assert rows["dhelix"]["predicted_speedup"] == pytest.approx(t_meg / (t_seq - 0.096))
    raw["ranks"][1]["plan_costs"] = {}  # one stage's prediction alone
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    assert rows["dhelix"]["predicted_step_s"] == pytest.approx(t_seq - 0.180)


def test_cpu_readings_split_a_busy_interval_from_a_sleeping_one():
    import os
    import time

    from dhelix.bench.cpu_time import CpuTimes

    outer = time.perf_counter()
    before = CpuTimes.now()
    start = time.perf_counter()
    while time.perf_counter() < start + 0.2:  # on CPU
        pass
    inner = time.perf_counter() - start  # >= 0.2: the loop ends when it next gets the core
    busy = CpuTimes.now().since(before)
    outer = time.perf_counter() - outer
    before = CpuTimes.now()
    time.sleep(0.2)  # blocked
    idle = CpuTimes.now().since(before)
    if busy["thread_run"] is None:
        pytest.skip("no /proc/thread-self/schedstat here")
    # run + runnable covers the busy loop's wall time (the core may have been shared) but
    # for what the hypervisor stole from the machine's CPUs meanwhile (a tick's rounding
    # each way), and no more than the wall time around the two readings (a preemption
    # between a reading and the clock falls in one of the two, however loaded the host)
    covered = busy["thread_run"] + busy["thread_runnable"]
    tick = 1 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit: a delta may read a tick short
    steal = 0.0 if busy["steal"] is None else busy["steal"] + tick
    assert busy["steal"] is None or busy["steal"] >= 0
    assert inner - 0.01 - steal <= covered <= outer + 0.01, (inner, covered, steal, outer)
    assert busy["thread_run"] > 0.05
    assert idle["thread_run"] < 0.02  # (waking up may wait for the core on a busy machine)
    assert idle["other_threads"] >= 0 and busy["softirq"] >= 0


def test_cpu_accounting_table_is_the_ranks_mean_of_their_medians():
    raw = _raw()
    for f, rank in zip((1.0, 1.01), raw["ranks"]):
        rank["step_parts"] = {"dhelix": {"thread_run": [2.0 * f, 2.2 * f, 2.1 * f],
                                         "thread_runnable": [0.3, 0.3, 0.3],
                                         "other_threads": [0.2, 0.2, 0.2],
                                         "softirq": [0.1, 0.1, 0.1]}}
    rows = {r["system"]: r for r in summarise_config(raw)["rows"]}
    cpu = rows["dhelix"]["cpu_accounting"]
    assert cpu["thread_run"] == pytest.approx((2.1 + 2.1 * 1.01) / 2)
    step = (3.2 + 3.2 * 1.01) / 2
    assert cpu["blocked"] == pytest.approx(step - cpu["thread_run"] - 0.3)
    assert cpu["cpu_work"] == pytest.approx(cpu["thread_run"] + 0.2 + 0.1 / 2)
    assert rows["megatron"]["cpu_accounting"] is None  # no readings recorded
    text = markdown({"megatron_args": MODEL, "reps": 3, "warmup": 1, "configs": [
        {"config": {"name": "a", "description": "d", "world_size": 2, "cores": 2},
         "bandwidth": "800mbit", "load_before": [0], "load_after": [0], "cleanup": "ok",
         "summary": summarise_config(raw)}]})
    assert "waiting for the core" in text
    line = next(l for l in text.splitlines() if l.startswith("| DHelix") and "| 2" in l
                and l.count("|") == 9)
    assert f"| {step * 1e3:.0f} | {cpu['thread_run'] * 1e3:.0f} | 300 |" in line


def test_cpu_readings_count_another_threads_work():
    import threading
    import time

    from dhelix.bench.cpu_time import CpuTimes

    busy, done = threading.Event(), threading.Event()

    def spin():  # until measured; says when it has used 30 ms of CPU (however loaded the host)
        start = time.thread_time()
        while not done.is_set():
            if time.thread_time() - start > 0.03:
                busy.set()

    before = CpuTimes.now()
    worker = threading.Thread(target=spin)
    worker.start()
    assert busy.wait(60)
    during = CpuTimes.now().since(before)  # measured while the worker runs (an ended
    done.set()                             # thread is not counted)
    worker.join()
    if during["other_threads"] is None:
        pytest.skip("no /proc/self/task/*/schedstat here")
    assert during["other_threads"] > 0.01
    assert during["thread_run"] < during["other_threads"]


def test_unknown_system_is_refused_before_anything_runs(tmp_path, capsys):
    import os

    from scripts.bench_systems import main

    if os.geteuid() != 0:
        pytest.skip("the benchmark refuses to start without root first")
    assert main(["--configs", "a", "--systems", "megatron,dhelix_turbo",
                 "--out", str(tmp_path)]) == 2
    assert "--systems: unknown ['dhelix_turbo']" in capsys.readouterr().err
    assert not (tmp_path / "raw").exists()  # nothing launched, nothing written


def test_overlap_floor_under_the_gpu_emulation():
    """With the emulation's overlap slowdown s, no schedule gets under the comm-free step +
    C x s / (1 + s), C the layers' collectives' solo time a step; without the emulation or
    without the plan's layer costs there is no such floor."""
    from dhelix.bench.report import _overlap_floor_lines

    raw = _raw()
    assert summarise_config(raw)["overlap_floor"] is None  # not emulated
    emulated = {**raw, "gpu_emulation": {"overlap_slowdown": 0.25, "time_scale": 50}}
    assert summarise_config(emulated)["overlap_floor"] is None  # no plan costs
    for rank in raw["ranks"]:  # 8 micro-batches x 3 layers, 20 ms of collectives each
        rank["plan_costs"] = {"wavelet": None,
                              "dhelix": {"sequential_ms": 50.0, "planned_ms": 40.0,
                                         "paired_layers_per_step": 21, "layers_per_step": 24,
                                         "layer_comm_ms": 20.0, "costs_source": "analytic"}}
    assert summarise_config(emulated)["overlap_floor"] is None  # analytic: not the cluster's
    for rank in raw["ranks"]:
        rank["plan_costs"]["dhelix"]["costs_source"] = "profile"
    summary = summarise_config(emulated)
    t_meg, t_free = 4.1 * 1.01, 3.0 * 1.01
    floor = summary["overlap_floor"]
    assert floor["layer_comm_s"] == pytest.approx(0.48)
    assert floor["floor_s"] == pytest.approx(t_free + 0.48 * 0.2)  # s / (1 + s) = 0.2
    assert floor["best_share"] == pytest.approx((t_meg - floor["floor_s"]) / (t_meg - t_free))
    assert summarise_config(raw)["overlap_floor"] is None  # the costs alone: not emulated
    # a floor under T_bound (here the link floor, 3.5 s, binds) leaves no share to report
    for rank in raw["ranks"]:
        rank["link_floor"]["one_at_a_time_s"] = rank["link_floor"]["all_at_once_s"] = [3.5] * 3
    link_bound = summarise_config(emulated)["overlap_floor"]
    assert link_bound["floor_s"] == pytest.approx(floor["floor_s"])
    assert link_bound["best_share"] is None
    assert "not above T_bound" in _overlap_floor_lines(link_bound)[0]

    line = _overlap_floor_lines(floor)[0]
    assert "take 480 ms a step alone" in line and "25% slower" in line
    assert f"0.200 x that = {floor['floor_s'] * 1e3:.0f} ms" in line
    assert f"at most {floor['best_share']:.1%} of the achievable gain" in line
    assert floor["si_floor_s"] is None and "SI schedule" not in line  # not recorded


def test_si_floor_counts_the_unpaired_first_forward():
    """Where the run recorded what the step's first forward keeps waiting on its
    collectives (`first_forward_unhidden_ms`: it runs alone in an SI schedule), the SI
    floor charges that in full for its collectives instead of the slowdown's share."""
    from dhelix.bench.report import _overlap_floor_lines

    raw = _raw()
    emulated = {**raw, "gpu_emulation": {"overlap_slowdown": 0.25, "time_scale": 50}}
    for rank in raw["ranks"]:  # the first forward: 3 layers, 6 ms of collectives each,
        rank["plan_costs"] = {"dhelix": {  # all on their chains
            "sequential_ms": 50.0, "planned_ms": 40.0, "paired_layers_per_step": 21,
            "layers_per_step": 24, "layer_comm_ms": 20.0, "costs_source": "profile",
            "first_forward_unhidden_ms": 18.0, "first_forward_comm_ms": 18.0}}
    floor = summarise_config(emulated)["overlap_floor"]
    t_meg, t_free = 4.1 * 1.01, 3.0 * 1.01
    assert floor["si_floor_s"] == pytest.approx(floor["floor_s"] + (18.0 - 0.2 * 18.0) / 1e3)
    assert floor["si_best_share"] == pytest.approx(
        (t_meg - floor["si_floor_s"]) / (t_meg - t_free))
    line = _overlap_floor_lines(floor)[0]
    assert "keep it waiting at least 18 ms" in line
    assert f"none gets under {floor['si_floor_s'] * 1e3:.0f} ms" in line
    assert f"at most {t_meg / floor['si_floor_s']:.3f}x and {floor['si_best_share']:.1%}" in line
    # a first forward whose collectives hide behind its own computation adds nothing
    for rank in raw["ranks"]:
        rank["plan_costs"]["dhelix"]["first_forward_unhidden_ms"] = 0.0
    assert summarise_config(emulated)["overlap_floor"]["si_floor_s"] == pytest.approx(
        floor["floor_s"])
