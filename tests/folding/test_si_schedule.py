"""The one-stage SI schedule (PP = 1 on the action-list engine), the forward-only lists and
the executor's one `no_sync` rule: validated, simulated and run in one process (one stage
needs no transport) against the sequential order's gradients."""

import contextlib
import dataclasses

import pytest
import torch

from dhelix.schedules.actions import Action, Pass, PipelinePath
from dhelix.schedules.executor import AutogradPasses, StageExecutor
from dhelix.schedules.sequential import (
    build_forward_only_schedule,
    build_no_pipelining_schedule,
    build_sequential_schedule,
)
from dhelix.schedules.si_schedule import build_si_schedule
from dhelix.schedules.simulate import Costs, simulate
from dhelix.schedules.validate import ScheduleError, find_problems, validate
from dhelix.schedules.w_schedule import build_w_schedule

EXACT = 1e-9


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_si_schedule_shape(m):
    """F(1); SI[F(i+1)+B(i)] ...; B(m): Megatron's combined-1F1B no-pipelining order."""
    schedule = build_si_schedule(1, m)
    assert find_problems(schedule) == []
    (actions,) = schedule.ranks
    assert [a.kind for a in actions] == ["F"] + ["SI"] * (m - 1) + ["B"]
    assert [a.phase for a in actions] == ["warmup"] + ["steady"] * (m - 1) + ["cooldown"]
    for i, action in enumerate(actions[1:-1]):
        assert action.forward == Pass(i + 1, 0) and action.backward == Pass(i, 0)
    assert schedule.path == PipelinePath.linear(1)


def test_si_schedule_is_one_stage_only():
    with pytest.raises(ValueError, match="without pipelining"):
        build_si_schedule(2, 4)
    with pytest.raises(ValueError, match="1 stage"):
        build_no_pipelining_schedule(2, 4)


@pytest.mark.parametrize("f,b", [(1.0, 2.0), (2.0, 3.0)])
def test_si_schedule_simulated_makespan(f, b):
    """One rank never idles: makespan f + (m-1)(f+b)/s + b, bubble ratio 0 (the DHelix
    bubble formula (p-1)/(m-1+ps) at p=1)."""
    for s in (1.0, 1.25, 1.5):
        for m in (1, 2, 5, 16):
            sim = simulate(build_si_schedule(1, m), Costs(f, b, si_speedup=s))
            assert sim.makespan == pytest.approx(f + (m - 1) * (f + b) / s + b, abs=EXACT)
            assert sim.bubble_ratio == pytest.approx(0.0, abs=EXACT)


def test_validator_rejects_broken_si_lists():
    schedule = build_si_schedule(1, 3)
    acts = list(schedule.ranks[0])
    swapped = dataclasses.replace(schedule, ranks=(tuple([acts[-1]] + acts[:-1]),))
    with pytest.raises(ScheduleError, match="backward before the forward of mb3"):
        validate(swapped)
    self_paired = acts[:1] + [Action("SI", forward=Pass(1, 0), backward=Pass(1, 0))] + acts[2:]
    with pytest.raises(ScheduleError, match="pairs a micro-batch with itself"):
        validate(dataclasses.replace(schedule, ranks=(tuple(self_paired),)))


@pytest.mark.parametrize("path", [PipelinePath.linear(1), PipelinePath.folded(3),
                                  PipelinePath.linear(4)])
def test_forward_only_schedules(path):
    """Evaluation lists: every forward once, no backward, deadlock-free; a backward in a
    forward-only list is refused."""
    schedule = build_forward_only_schedule(path, 5)
    assert find_problems(schedule) == []
    assert all(a.backward is None for actions in schedule.ranks for a in actions)
    sim = simulate(schedule, Costs(forward=1.0))
    assert sim.busy == pytest.approx([5.0] * path.num_stages, abs=EXACT)  # 5 forwards each
    if path.name == "linear":  # micro-batches stream through the stages
        assert sim.makespan == pytest.approx(5 + path.num_stages - 1, abs=EXACT)
    full = build_sequential_schedule(path, 5)
    with pytest.raises(ScheduleError, match="computes no backward"):
        validate(dataclasses.replace(full, forward_only=True))


class _Recorder:
    """A model chunk and loss for the executor, noting whether each backward ran inside
    `no_sync`."""

    def __init__(self):
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.in_no_sync = False
        self.synced_backwards = []

    def forward_chunk(self, batch, chunk, inp):
        out = torch.tanh(batch @ self.weight)
        out.register_hook(self._note)
        return out

    def _note(self, grad):
        self.synced_backwards.append(not self.in_no_sync)
        return grad

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False


def _run(schedule, m):
    rec = _Recorder()
    batches = iter([torch.full((2, 4), float(i + 1)) / 7 for i in range(m)])
    executor = StageExecutor(
        schedule, 0, passes=AutogradPasses(rec.forward_chunk),
        loss_func=lambda batch, out: (out.square().mean(), {"loss": out.square().mean().detach()}),
        next_batch=lambda: next(batches), tensor_shape=(), dtype=torch.float32,
        device=torch.device("cpu"), peer_rank=lambda s: s, no_sync=rec.no_sync)
    losses = executor.run()
    assert executor.actions_run == len(schedule.ranks[0])  # counted while running
    return rec, losses, executor


@pytest.mark.parametrize("m", [1, 4])
def test_executor_runs_the_si_list_with_megatrons_no_sync_rule(m):
    """The SI list gives the sequential (Megatron no-pipelining) order's loss and gradient;
    every backward but the last one runs inside `no_sync`, the last outside it."""
    ref, ref_losses, _ = _run(build_no_pipelining_schedule(1, m), m)
    got, got_losses, _ = _run(build_si_schedule(1, m), m)
    assert [float(d["loss"]) for d in got_losses] == [float(d["loss"]) for d in ref_losses]
    assert torch.equal(got.weight.grad, ref.weight.grad)
    assert got.synced_backwards == [False] * (m - 1) + [True]
    assert ref.synced_backwards == [False] * (m - 1) + [True]


def test_executor_runs_a_forward_only_list():
    m = 3
    rec, losses, executor = _run(build_forward_only_schedule(PipelinePath.linear(1), m), m)
    assert len(losses) == m and rec.synced_backwards == []
    assert rec.weight.grad is None and not executor._saved and not executor._batches


def test_w_schedule_with_one_stage_is_not_the_si_schedule():
    """(The W schedule is for the folded model: two chunks even with p=1.)"""
    assert build_w_schedule(1, 3).path.chunks_per_stage == 2
    assert build_si_schedule(1, 3).path.chunks_per_stage == 1
