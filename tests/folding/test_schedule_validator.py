"""The validator rejects deliberately broken action lists, each for the right reason, and
the executor refuses them before it computes or communicates anything."""

import dataclasses

import pytest
import torch

from dhelix.schedules.actions import Action, Pass, TensorRef
from dhelix.schedules.executor import AutogradPasses, StageExecutor
from dhelix.schedules.validate import ScheduleError, find_problems, validate
from dhelix.schedules.w_schedule import build_w_schedule


def with_rank(schedule, rank, actions):
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def index_of(actions, predicate):
    return next(i for i, a in enumerate(actions) if predicate(a))


def without_first(schedule, rank, kind):
    """`schedule` with the first action of `kind` removed from `rank`'s list."""
    acts = list(schedule.ranks[rank])
    del acts[index_of(acts, lambda a: a.kind == kind)]
    return with_rank(schedule, rank, acts)


def rejected(schedule, *fragments):
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def w():
    schedule = build_w_schedule(3, 5)
    assert find_problems(schedule) == []
    return schedule


def test_missing_forward(w):
    rejected(without_first(w, 1, "F"), "computed 0 times")


def test_duplicate_computation(w):
    acts = list(w.ranks[0])
    acts.append(next(a for a in acts if a.kind == "SI"))
    rejected(with_rank(w, 0, acts), "computed 2 times")


def test_backward_before_its_forward(w):
    acts = list(w.ranks[2])  # the last stage turns locally: no receive involved
    i = index_of(acts, lambda a: a.backward is not None and a.backward.microbatch == 0)
    acts.insert(0, acts.pop(i))
    rejected(with_rank(w, 2, acts), "backward before the forward of mb1")


def test_send_to_wrong_peer(w):
    acts = list(w.ranks[0])
    i = index_of(acts, lambda a: a.kind == "SEND")
    acts[i] = dataclasses.replace(acts[i], peer=2)
    rejected(with_rank(w, 0, acts), "was not produced here for stage 2",
             "channel 0->2 message 0")


def test_send_split_no_longer_matches_receive(w):
    """Both tensors are still sent after they exist, but in two messages while the
    receiver expects one: the FIFO pairing would mismatch."""
    acts = list(w.ranks[0])
    i = index_of(acts, lambda a: a.kind == "SEND" and len(a.tensors) == 2)
    first, second = (dataclasses.replace(acts[i], tensors=(t,)) for t in acts[i].tensors)
    acts[i:i + 1] = [first, second]
    message = rejected(with_rank(w, 0, acts), "channel 0->1")
    assert "never" not in message  # flow on rank 0 itself is fine


def test_receive_nobody_sends(w):
    acts = list(w.ranks[1])
    i = index_of(acts, lambda a: a.kind == "RECV")
    acts.insert(i, acts[i])
    rejected(with_rank(w, 1, acts), "received twice")


def test_consumed_input_missing(w):
    rejected(without_first(w, 1, "RECV"), "not available")


def test_malformed_actions(w):
    acts = list(w.ranks[0])
    si = next(a for a in acts if a.kind == "SI")
    cases = {
        "unknown kind": dataclasses.replace(si, kind="FB"),
        "unknown phase": dataclasses.replace(si, phase="steady-ish"),
        "pairs a micro-batch with itself": dataclasses.replace(
            si, backward=Pass(si.forward.microbatch, si.backward.hop)),
        "belongs to stage": Action("F", forward=Pass(0, 1)),
        "outside [0, 5)": Action("F", forward=Pass(7, 0)),
        "communication with itself": Action("SEND", peer=0, tensors=(TensorRef(0, "F", 0),)),
    }
    for fragment, bad in cases.items():
        rejected(with_rank(w, 0, acts + [bad]), fragment)


def test_wrong_number_of_lists(w):
    broken = dataclasses.replace(w, ranks=w.ranks[:2])
    rejected(broken, "2 action lists for 3 stages")


def test_executor_rejects_before_running(w):
    broken = without_first(w, 0, "SI")

    def must_not_run(*_args):
        raise AssertionError("the executor ran something for a broken schedule")

    executor = StageExecutor(
        broken, 0, passes=AutogradPasses(must_not_run), loss_func=must_not_run,
        next_batch=must_not_run, tensor_shape=(4, 1, 8), dtype=torch.float32,
        device=torch.device("cpu"), peer_rank=must_not_run)
    with pytest.raises(ScheduleError, match="computed 0 times"):
        executor.run()
