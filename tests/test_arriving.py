"""`dhelix.arriving`: a value still in flight is waited on once, a `Finishing`'s last
local step runs exactly once, after its work completed and before the value is read, and a
`Producing` computes its value once, when started or first waited on; the layer runner
starts an SI block's produced input before the first block with forward operators."""

import torch

from dhelix.arriving import Arriving, Finishing, Producing, buffer_of, landed
from dhelix.runtime.layer_runner import _starter
from dhelix.runtime.strand_executor import Block


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


def test_producing_computes_once_when_started_or_first_waited_on():
    made = []

    def produce():
        made.append(torch.full((2,), float(len(made) + 1)))
        return made[-1]

    value = Producing(produce)
    assert isinstance(value, Arriving) and buffer_of(value) is None and made == []
    assert value.is_completed() and not value.started  # starting is local computation
    assert landed(value) is made[0] and len(made) == 1
    value.start()
    value.wait()
    assert len(made) == 1 and buffer_of(value) is made[0] and value.is_completed()

    started = Producing(produce).start()
    assert len(made) == 2 and buffer_of(started) is made[1] and started.started


def test_producing_whose_product_arrives_waits_for_it():
    buffer, work, steps = torch.zeros(2), _Work(), []
    value = Producing(lambda: Finishing(buffer, work, lambda: steps.append(1)))
    value.start()
    assert buffer_of(value) is buffer and not value.is_completed() and steps == []
    assert landed(value) is buffer and steps == [1] and work.waits == 1
    value.wait()
    assert work.waits == 1 and value.is_completed()


def test_runner_starts_the_produced_input_before_the_first_block_with_forward_ops():
    """The sequential pairing ((), backward) + (forward, ()): after the backward-only block;
    a plan whose first block pairs both strands: at once; nothing to start: no hook."""
    for blocks, expected in (([Block((), ("b1", "b2")), Block(("f1",), ())], 1),
                             ([Block(("f1",), ("b1",)), Block(("f2",), ("b2",))], 0),
                             ([Block((), ("b1",)), Block((), ("b2",)), Block(("f1",), ())], 2)):
        started_at, now = [], [None]
        value = Producing(lambda: started_at.append(now[0]) or torch.zeros(1))
        hook = _starter(value, blocks)
        for index in range(len(blocks)):
            now[0] = index
            hook(index)
        assert started_at == [expected], (blocks, started_at)
    assert _starter(None, [Block(("f1",), ())]) is None
