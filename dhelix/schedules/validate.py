"""Static validation of a schedule before anything runs.

`validate(schedule)` raises `ScheduleError` listing every problem found (rank, action index,
what is wrong); `find_problems` returns them as strings. Checked:

1. Shape: one list per stage; known action kinds and phases; compute actions carry the
   passes their kind needs (an SI block: one forward and one backward of two different
   micro-batches); communication actions name another stage and at least one tensor;
   micro-batch and hop indices in range; every pass sits on the rank that holds it; a
   forward-only schedule holds no backward.
2. Counts: every (micro-batch, direction, hop) is computed exactly once (forward only for a
   `forward_only` schedule, which has no backward at all).
3. Order and data flow on each rank, in list order: a forward's input (the previous hop's
   activation) was received or produced locally before it; a backward comes after the
   forward of the same micro-batch and chunk on this rank, and its output gradient was
   received or produced locally before it; a SEND only carries tensors this rank produced
   for that peer and has not sent yet; a RECV only names tensors that peer produces for
   this rank; nothing produced for another stage stays unsent, nothing received stays
   unused.
4. Matching: on every (sender, receiver) channel the sequence of SEND payloads equals the
   sequence of RECV payloads (FIFO pairing, same tensors, same grouping and order), so the
   pairing of sends and receives is deterministic.

Deadlock freedom is a dynamic property: `dhelix.schedules.simulate` checks it.
"""

from __future__ import annotations

from collections import defaultdict

from dhelix.schedules.actions import (
    BACKWARD,
    COMM_KINDS,
    FORWARD,
    KINDS,
    PHASES,
    Action,
    Pass,
    Schedule,
    TensorRef,
)

MAX_LISTED = 20


class ScheduleError(ValueError):
    """A schedule is malformed; the message lists the problems."""


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` if `find_problems` reports anything."""
    problems = find_problems(schedule)
    if problems:
        shown = problems[:MAX_LISTED]
        more = len(problems) - len(shown)
        tail = f"\n  ... and {more} more" if more else ""
        raise ScheduleError(
            f"{schedule.kind} schedule (p={schedule.num_stages}, m={schedule.num_microbatches})"
            f" is invalid ({len(problems)} problems):\n  " + "\n  ".join(shown) + tail)


def find_problems(schedule: Schedule) -> list[str]:
    """Every problem of `schedule`, as one line each (empty when valid)."""
    if len(schedule.ranks) != schedule.num_stages:
        return [f"{len(schedule.ranks)} action lists for {schedule.num_stages} stages"]
    problems = []
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            problems += [f"rank {rank} action {index} ({action.kind}): {msg}"
                         for msg in _shape_problems(schedule, rank, action)]
    if problems:
        return problems  # order checks assume well-formed actions
    problems += _count_problems(schedule)
    for rank in range(schedule.num_stages):
        problems += _flow_problems(schedule, rank)
    problems += _matching_problems(schedule)
    return problems


def _pass_problems(schedule: Schedule, rank: int, direction: str, p: Pass) -> list[str]:
    path = schedule.path
    if not 0 <= p.microbatch < schedule.num_microbatches:
        return [f"micro-batch {p.microbatch} outside [0, {schedule.num_microbatches})"]
    if not 0 <= p.hop < path.num_hops:
        return [f"hop {p.hop} outside [0, {path.num_hops})"]
    stage = path.stage(direction, p.hop)
    if stage != rank:
        return [f"{direction} hop {p.hop} of mb{p.microbatch + 1} belongs to stage {stage}"]
    return []


def _shape_problems(schedule: Schedule, rank: int, action: Action) -> list[str]:
    if action.kind not in KINDS:
        return [f"unknown kind (one of {', '.join(KINDS)})"]
    if action.phase not in PHASES:
        return [f"unknown phase {action.phase!r}"]
    if action.kind in COMM_KINDS:
        if action.forward is not None or action.backward is not None:
            return ["communication action carries a computation"]
        if action.peer is None or not 0 <= action.peer < schedule.num_stages:
            return [f"peer {action.peer} is not a stage"]
        if action.peer == rank:
            return ["communication with itself"]
        if not action.tensors:
            return ["no tensors"]
        if len(set(action.tensors)) != len(action.tensors):
            return ["a tensor appears twice"]
        bad = [t for t in action.tensors if not isinstance(t, TensorRef)
               or t.direction not in (FORWARD, BACKWARD)]
        return [f"malformed tensor {bad[0]!r}"] if bad else []
    if action.peer is not None or action.tensors:
        return ["computation carries a peer or tensors"]
    if schedule.forward_only and action.backward is not None:
        return ["a forward-only schedule computes no backward"]
    need_f, need_b = action.kind in ("F", "SI"), action.kind in ("B", "SI")
    if (action.forward is not None) != need_f or (action.backward is not None) != need_b:
        return [f"a {action.kind} action needs "
                + {"F": "a forward only", "B": "a backward only",
                   "SI": "a forward and a backward"}[action.kind]]
    problems = []
    for direction, p in action.passes():
        problems += _pass_problems(schedule, rank, direction, p)
    if action.kind == "SI" and action.forward.microbatch == action.backward.microbatch:
        problems.append("an SI block pairs a micro-batch with itself")
    return problems


def _count_problems(schedule: Schedule) -> list[str]:
    seen = defaultdict(int)
    for actions in schedule.ranks:
        for action in actions:
            for direction, p in action.passes():
                seen[(direction, p.microbatch, p.hop)] += 1
    problems = []
    for mb in range(schedule.num_microbatches):
        for direction in schedule.directions:
            for hop in range(schedule.path.num_hops):
                n = seen[(direction, mb, hop)]
                if n != 1:
                    stage = schedule.path.stage(direction, hop)
                    problems.append(f"{direction} hop {hop} of mb{mb + 1} (stage {stage}) is "
                                    f"computed {n} times, not once")
    return problems


def _flow_problems(schedule: Schedule, rank: int) -> list[str]:
    path = schedule.path
    last = path.num_hops - 1
    done: set = set()         # (direction, mb, hop) computed here
    available: set = set()    # TensorRefs received or produced locally, not yet consumed
    to_send: dict = {}        # TensorRef -> destination stage, produced here, not yet sent
    problems = []

    def where(i, action):
        return f"rank {rank} action {i} ({schedule.describe(action)})"

    for i, action in enumerate(schedule.ranks[rank]):
        if action.kind == "SEND":
            for ref in action.tensors:
                if to_send.get(ref) != action.peer:
                    problems.append(f"{where(i, action)}: {ref.label()} was not produced here "
                                    f"for stage {action.peer}, or was already sent")
                to_send.pop(ref, None)
            continue
        if action.kind == "RECV":
            for ref in action.tensors:
                producer_ok = 0 <= ref.hop < last and path.stage(ref.direction, ref.hop) == action.peer
                if not producer_ok or path.stage(ref.direction, ref.hop + 1) != rank:
                    problems.append(f"{where(i, action)}: stage {action.peer} does not produce "
                                    f"{ref.label()} for stage {rank}")
                elif ref in available:
                    problems.append(f"{where(i, action)}: {ref.label()} received twice")
                available.add(ref)
            continue
        for direction, p in action.passes():
            if direction == BACKWARD and (FORWARD, p.microbatch, path.mirror_hop(p.hop)) not in done:
                problems.append(f"{where(i, action)}: backward before the forward of "
                                f"mb{p.microbatch + 1} chunk {path.chunk(BACKWARD, p.hop)}")
            if p.hop > 0:
                ref = TensorRef(p.microbatch, direction, p.hop - 1)
                if ref in available:
                    available.remove(ref)
                else:
                    problems.append(f"{where(i, action)}: input {ref.label()} not available")
        for direction, p in action.passes():
            done.add((direction, p.microbatch, p.hop))
            if p.hop < last:
                ref = TensorRef(p.microbatch, direction, p.hop)
                dst = path.stage(direction, p.hop + 1)
                if dst == rank:
                    available.add(ref)
                else:
                    to_send[ref] = dst
    for ref, dst in sorted(to_send.items()):
        problems.append(f"rank {rank}: {ref.label()} for stage {dst} is never sent")
    for ref in sorted(available):
        problems.append(f"rank {rank}: {ref.label()} is received or produced but never used")
    return problems


def _matching_problems(schedule: Schedule) -> list[str]:
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if action.kind == "SEND":
                sends[(rank, action.peer)].append(action.tensors)
            elif action.kind == "RECV":
                recvs[(action.peer, rank)].append(action.tensors)
    problems = []
    for channel in sorted(set(sends) | set(recvs)):
        s, r = sends[channel], recvs[channel]
        for k in range(max(len(s), len(r))):
            a = s[k] if k < len(s) else None
            b = r[k] if k < len(r) else None
            if a != b:
                fmt = (lambda refs: "nothing" if refs is None
                       else "[" + ", ".join(t.label() for t in refs) + "]")
                problems.append(f"channel {channel[0]}->{channel[1]} message {k}: sent "
                                f"{fmt(a)}, received {fmt(b)}")
                break
    return problems
