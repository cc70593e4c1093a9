"""The emulation's forecast of collectives in flight (`collective_clock`): a kernel is slowed
only for the part of it a collective is expected to run beside, and a kind never observed
slows the whole kernel. Pure: no process group (the mode's charging is driven directly with
a stand-in Work whose completion the test sets)."""

import time
from pathlib import Path

import pytest

from dhelix.gpu_emulation.collective_clock import (
    CollectiveDurations, CollectiveKind, InFlightCollective, slowed_kernel_s)

H100_PROFILE = Path("/work/shared/measurements/h100_llama8b_layer_comp_only_profile.json")


def test_slowed_kernel_is_slowed_only_while_collectives_run():
    # unknown end: the whole kernel at 1 + s
    assert slowed_kernel_s(1.0, start=10.0, busy_until=None, slowdown=0.25) == 1.25
    # ended before the kernel starts: full speed
    assert slowed_kernel_s(1.0, start=10.0, busy_until=9.0, slowdown=0.25) == 1.0
    # half a second beside it: 0.4 s of work done slowed, 0.6 s after at full speed
    assert slowed_kernel_s(1.0, start=10.0, busy_until=10.5, slowdown=0.25) == \
        pytest.approx(1.1)
    # running past the kernel's slowed end: the whole kernel slowed, no more
    assert slowed_kernel_s(1.0, start=10.0, busy_until=20.0, slowdown=0.25) == 1.25


def test_durations_keep_the_shortest_observation_per_kind():
    durations = CollectiveDurations()
    kind = CollectiveKind("allreduce_", None, 1024)
    record = InFlightCollective(work=None, stream_start=5.0, kind=kind)
    assert durations.expected_end(record) is None
    durations.observe(record, seen_done_at=5.3)
    durations.observe(InFlightCollective(None, 7.0, kind), seen_done_at=7.2)
    durations.observe(InFlightCollective(None, 9.0, kind), seen_done_at=9.9)
    assert durations.expected_end(record) == pytest.approx(5.2)
    other = InFlightCollective(None, 1.0, CollectiveKind("allreduce_", None, 2048))
    assert durations.expected_end(other) is None


class _Work:
    """Stands in for a collective's Work: completed when the test says."""

    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


@pytest.mark.skipif(not H100_PROFILE.exists(), reason="needs the shared H100 profile")
def test_mode_slows_a_kernel_only_for_the_collectives_forecast_overlap():
    from dhelix.gpu_emulation.kernel_model import fit_kernel_model
    from dhelix.gpu_emulation.mode import EmulationConfig, GpuEmulationMode
    from profiler.profile_file import load_profile

    model = fit_kernel_model(load_profile(H100_PROFILE))
    durations = CollectiveDurations()
    kind = CollectiveKind("allreduce_", None, 4096)
    # one collective of this kind was seen to take 50 ms
    durations.observe(InFlightCollective(None, 0.0, kind), seen_done_at=0.05)
    mode = GpuEmulationMode(model, EmulationConfig(time_scale=1.0, overlap_slowdown=0.25),
                            durations)
    now = time.perf_counter()
    # in flight, expected to end 20 ms from now: a 100 ms kernel starting now runs 20 ms
    # beside it (16 ms of its work), the remaining 84 ms alone: 104 ms
    work = _Work()
    mode._in_flight = [InFlightCollective(work, now - 0.03, kind)]
    mode._charge("gemm.fwd", "mm", 100.0)
    first = mode.report().by_term["gemm.fwd"]
    assert first.slowed == 1 and first.modelled_ms == pytest.approx(104.0, abs=1.5)
    # the next kernel starts when that one ends, after the forecast end: not slowed, even
    # though the collective is still not seen completed
    mode._charge("gemm.dgrad", "mm", 100.0)
    second = mode.report().by_term["gemm.dgrad"]
    assert second.slowed == 0 and second.modelled_ms == pytest.approx(100.0)
    # a kind never observed slows the whole kernel
    mode._in_flight.append(InFlightCollective(_Work(), time.perf_counter(),
                                              CollectiveKind("allreduce_", None, 8)))
    mode._charge("gemm.wgrad", "mm", 100.0)
    assert mode.report().by_term["gemm.wgrad"].modelled_ms == pytest.approx(125.0)
    # once seen completed, a collective is dropped and its duration noted: it started 30
    # ms before `now` and was seen done just after, shorter than the 50 ms seen before
    work.done = True
    mode._in_flight = mode._in_flight[:1]
    mode._charge("memory.norm", "norm", 1.0)
    assert mode._in_flight == []
    shortest = durations.expected_end(InFlightCollective(None, 0.0, kind))
    assert 0.03 <= shortest < 0.05
