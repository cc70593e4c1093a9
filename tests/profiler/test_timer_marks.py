"""`profiler.timing.Timer.mark` on the CPU timer: a region reports when it reached its mark
(after draining an emulated stream, as a CUDA event would be reached) besides its end; a
mark outside a region is refused. Pure: no process group (`Timer.align` barriers only when
one exists)."""

import time

import pytest

from profiler.timing import Timer


def test_a_region_reports_its_mark_and_its_end():
    timer = Timer(cuda=False)

    def marked():
        time.sleep(0.02)
        timer.mark()
        time.sleep(0.03)

    timer.time(marked)
    timer.time(lambda: time.sleep(0.01))
    (total, mark), (plain, no_mark) = timer.collect_marked()
    assert 20.0 <= mark < 20.0 + 25.0 and total >= mark + 30.0
    assert plain >= 10.0 and no_mark is None
    assert timer.collect_marked() == []
    with pytest.raises(RuntimeError, match="outside a timed region"):
        timer.mark()


def test_the_mark_waits_for_the_emulated_stream():
    """With `synchronize` (an emulated GPU's drain) the mark is taken once the work issued
    so far has ended on the stream, not when the host issued it."""
    stream_end = []

    def drain():
        while stream_end and time.perf_counter() < stream_end[-1]:
            time.sleep(0.001)

    timer = Timer(cuda=False, synchronize=drain)

    def issue_then_mark():
        stream_end.append(time.perf_counter() + 0.04)  # a 40 ms kernel, issued at once
        timer.mark()

    timer.time(issue_then_mark)
    [(total, mark)] = timer.collect_marked()
    assert mark >= 40.0 and total >= mark
