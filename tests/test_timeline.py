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
