"""The executor's timeline recorder: spans by kind, totals, and the Chrome trace."""

import time

from dhelix.runtime.timeline import KINDS, Timeline


def test_spans_totals_and_trace():
    timeline = Timeline()
    with timeline.span("compute", "fc1"):
        time.sleep(0.01)
    with timeline.span("wait", "fc1"):
        time.sleep(0.02)
    totals = timeline.totals()
    assert 0.009 < totals["compute"] < totals["wait"]
    assert totals["issue"] == totals["barrier"] == 0.0
    assert totals["recorded"] == totals["compute"] + totals["wait"]
    trace = timeline.chrome_trace(pid=3)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["tid"]) for e in spans] == [
        ("fc1", "compute", KINDS.index("compute")), ("fc1", "wait", KINDS.index("wait"))]
    assert spans[0]["ts"] == 0.0 and spans[1]["ts"] >= spans[0]["dur"]


def test_held_longest_sums_each_operators_waits_and_leaves_computation_out():
    timeline = Timeline()
    spans = [("compute", "fc1", 0.0, 5.0), ("wait", "sort", 5.0, 6.0),
             ("issue", "dispatch", 6.0, 6.5), ("wait", "sort", 7.0, 8.5),
             ("barrier", "block end", 8.5, 8.7), ("wait", "unpermute", 9.0, 9.4)]
    timeline.spans.extend(spans)
    held = timeline.held_longest(3)
    assert [row[:2] for row in held] == [["wait", "sort"], ["issue", "dispatch"],
                                         ["wait", "unpermute"]]
    assert abs(held[0][2] - 2.5) < 1e-9 and held[0][3] == 2
    assert abs(held[1][2] - 0.5) < 1e-9 and held[1][3] == 1
    assert len(timeline.held_longest(10)) == 4  # compute is never listed
    assert Timeline().held_longest() == []


def test_idle_by_span_gives_each_gap_to_the_span_it_ended_in():
    timeline = Timeline()
    timeline.spans.extend([("compute", "sort", 1.0, 2.0), ("wait", "sort", 0.5, 1.0),
                           ("compute", "unpermute", 3.0, 3.5), ("compute", "sort", 5.0, 5.2)])
    gaps = [(0.2, 1.5),   # ended while `sort` computed (the kernel it waited for)
            (2.5, 3.1),   # ended in `unpermute`
            (4.0, 4.6),   # ended between spans: outside the layers
            (4.9, 5.1),   # `sort` again
            (6.0, 6.05)]  # after every span
    idle = timeline.idle_by_span(gaps)
    assert [row[:2] for row in idle] == [["compute", "sort"], ["outside", "the layers"],
                                         ["compute", "unpermute"]]
    assert abs(idle[0][2] - 1.5) < 1e-9 and idle[0][3] == 2
    assert abs(idle[1][2] - 0.65) < 1e-9 and idle[1][3] == 2
    assert abs(idle[2][2] - 0.6) < 1e-9 and idle[2][3] == 1
    assert timeline.idle_by_span(gaps, count=1) == idle[:1]
    assert Timeline().idle_by_span([(0.0, 1.0)]) == [["outside", "the layers", 1.0, 1]]
    assert timeline.idle_by_span([]) == []


def test_blocks_run_from_the_previous_block_s_end_on_the_block_clock():
    ticks = iter([10.0, 10.5, 12.0, 20.0, 30.0, 30.25, 31.0, 31.5])
    timeline = Timeline(block_clock=lambda: next(ticks))
    for _ in range(2):  # two layer pairs of three blocks, 10 s apart
        timeline.layer_pair_started()
        for index in range(3):
            timeline.block_ended(index)
    assert timeline.blocks == [(0, 10.0, 10.5), (1, 10.5, 12.0), (2, 12.0, 20.0),
                               (0, 30.0, 30.25), (1, 30.25, 31.0), (2, 31.0, 31.5)]
    ms = timeline.block_ms()  # median over the pairs, index order
    assert list(ms) == [0, 1, 2] and [pairs for _, pairs in ms.values()] == [2, 2, 2]
    assert [round(v, 6) for v, _ in ms.values()] == [375.0, 1125.0, 4250.0]
    assert timeline.totals()["recorded"] == 0.0  # block marks are not spans
    assert Timeline().block_ms() == {}
