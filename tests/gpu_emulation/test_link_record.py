"""`link_record`: when collectives were in flight, and where the link sat idle (pure)."""

import pytest
import torch

from dhelix.gpu_emulation.link_record import LinkRecord, LinkSpan, link_idle


class _Work:
    """What `LinkRecord.note` reads of a c10d Work: its future."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


def test_note_takes_the_issue_time_now_and_the_completion_from_the_future():
    record = LinkRecord()
    first, second = _Work(), _Work()
    record.note(first)
    record.note(second)
    spans = record.spans()
    assert len(spans) == 2 and spans[0] is not spans[1]  # one span a note, in issue order
    assert spans[0].issued_s <= spans[1].issued_s
    assert all(s.done_s is None for s in spans)  # nothing completed yet
    second.future.set_result(None)
    assert spans[1].done_s >= spans[1].issued_s and spans[0].done_s is None
    record.spans().clear()  # a copy: the record keeps its own
    assert len(record.spans()) == 2


def test_link_idle_splits_the_window_into_busy_and_idle_by_position():
    # 20 collectives of 1 s each, 0.5 s apart, the window [0, 31]; collective 10 overlaps
    # collective 9 (issued before 9 completed), the last one is still in flight at the end
    spans = [LinkSpan(1.5 * i, 1.5 * i + 1.0) for i in range(20)]
    spans[10] = LinkSpan(13.8, 15.5)  # 9 ran 13.5-14.5
    spans[19] = LinkSpan(28.5, None)
    spans.append(LinkSpan(40.0, 41.0))  # after the window: not counted
    idle = link_idle(spans, 0.0, 31.0)
    assert idle.collectives == 20
    # tenths of 20: collectives 0-1 (head), 18-19 (tail); gaps of 0.5 s before 1..19 but
    # none before 10 (it started while 9 ran) and before 11 only 15.5 -> 16.5 = 1.0 s
    assert idle.head == pytest.approx(500.0)  # before collective 1
    assert idle.tail == pytest.approx(1000.0)  # before 18 and 19
    assert idle.between == pytest.approx(500.0 * 14 + 1000.0)  # 2..17 but 10, and 11 1 s
    assert idle.after == pytest.approx(0.0)  # the last is in flight until the window's end
    assert idle.busy + idle.idle == pytest.approx(31_000.0)
    assert idle.idle == pytest.approx(idle.head + idle.between + idle.tail + idle.after)
    # an empty window is all idle, after the (absent) last collective
    empty = link_idle([], 0.0, 2.0)
    assert (empty.busy, empty.idle, empty.after, empty.collectives) == (0.0, 2000.0, 2000.0, 0)
