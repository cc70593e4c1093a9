"""`dhelix.arriving`: a value still in flight is waited on once, and a `Finishing`'s last
local step runs exactly once, after its work completed and before the value is read."""

import torch

from dhelix.arriving import Arriving, Finishing, buffer_of, landed


class _Work:
    """A Work stand-in that completes when `done` is set; counts its waits."""

    def __init__(self, done: bool = False):
        self.done = done
        self.waits = 0

    def wait(self):
        self.waits += 1
        self.done = True
        return True

    def is_completed(self):
        return self.done


def test_finishing_runs_its_last_step_once_after_the_wait():
    buffer = torch.zeros(3)
    work, steps = _Work(), []

    def finish():
        assert work.done, "the last step ran before the work completed"
        steps.append(1)
        buffer.add_(1.0)

    value = Finishing(buffer, work, finish)
    assert isinstance(value, Arriving) and buffer_of(value) is buffer
    assert not value.is_completed() and steps == []
    assert landed(value) is buffer and torch.equal(buffer, torch.ones(3))
    value.wait()
    assert landed(value) is buffer and steps == [1] and work.waits == 1
    assert torch.equal(buffer, torch.ones(3)) and value.is_completed()


def test_finishing_whose_work_completed_still_finishes_at_its_first_wait():
    """`is_completed()` says the wait will not block on communication; the last step is
    the waiting reader's (it has not run yet)."""
    steps = []
    value = Finishing(torch.zeros(1), _Work(done=True), lambda: steps.append(1))
    assert value.is_completed() and steps == []
    value.wait()
    assert steps == [1]
