"""Single-process discrete-event simulation of a schedule: makespan, bubbles and deadlocks.

Cost model (`Costs`): `forward` and `backward` are the times of one stage's full forward
and backward pass of one micro-batch (L/p layers); a chunk pass on a path with c chunks per
stage takes 1/c of that (the folded path has 2). An SI block takes
(chunk forward + chunk backward) / `si_speedup`. A tensor sent at time t can be received
from t + `p2p_latency`; posting a send or a receive costs no compute time.

Semantics follow `dhelix.schedules.actions`: each rank runs its list in order; a SEND never
blocks (isend); a RECV blocks until its tensors arrived on that channel, which is FIFO. If no
rank can move while some have actions left, the schedule deadlocks: `DeadlockError` names
every blocked rank and what it waits for. The result does not depend on the order in which
ranks are stepped.

Bubble ratio of a rank: idle time / makespan, idle = makespan - compute time; the reported
ratio is the mean over ranks (all ranks are equal for uniform stages).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dhelix.schedules.actions import Action, Schedule


class DeadlockError(RuntimeError):
    """No rank can make progress; the message lists the blocked ranks."""


@dataclass(frozen=True)
class Costs:
    """Per-stage pass costs (any time unit), SI speedup s and point-to-point latency."""

    forward: float = 1.0
    backward: float = 2.0
    si_speedup: float = 1.0
    p2p_latency: float = 0.0

    def __post_init__(self):
        if self.forward <= 0 or self.backward <= 0:
            raise ValueError("forward and backward costs must be > 0")
        if self.si_speedup <= 0:
            raise ValueError("si_speedup must be > 0")
        if self.p2p_latency < 0:
            raise ValueError("p2p_latency must be >= 0")

    def action_cost(self, action: Action, chunks_per_stage: int) -> float:
        f = self.forward / chunks_per_stage
        b = self.backward / chunks_per_stage
        if action.kind == "F":
            return f
        if action.kind == "B":
            return b
        if action.kind == "SI":
            return (f + b) / self.si_speedup
        return 0.0


@dataclass(frozen=True)
class Interval:
    rank: int
    index: int
    action: Action
    start: float
    end: float


@dataclass
class SimulationResult:
    makespan: float
    busy: list            # compute time per rank
    intervals: list       # Interval per action (communication ones have zero length)
    finish: list = field(default_factory=list)  # time each rank finished its list

    @property
    def idle(self) -> list:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """Mean over ranks of idle time / makespan."""
        return sum(self.idle) / (len(self.busy) * self.makespan)

    @property
    def max_bubble_ratio(self) -> float:
        return max(self.idle) / self.makespan


def simulate(schedule: Schedule, costs: Costs) -> SimulationResult:
    """Run `schedule` under `costs`; raises `DeadlockError` if it cannot finish.

    Assumes a schedule that passes `validate` (a RECV whose tensors arrive in another order
    than it names raises ValueError).
    """
    p = schedule.num_stages
    chunks = schedule.path.chunks_per_stage
    lists = schedule.ranks
    pos = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    channels: dict[tuple[int, int], deque] = {}
    intervals: list[Interval] = []

    def step(rank: int) -> bool:
        """Run rank's next action if it can start; True if it did."""
        action = lists[rank][pos[rank]]
        start = clock[rank]
        if action.kind == "RECV":
            queue = channels.get((action.peer, rank), deque())
            if len(queue) < len(action.tensors):
                return False
            for expected in action.tensors:
                ref, arrival = queue.popleft()
                if ref != expected:
                    raise ValueError(f"rank {rank} action {pos[rank]}: expected "
                                     f"{expected.label()} from {action.peer}, got {ref.label()}")
                start = max(start, arrival)
            end = start
        elif action.kind == "SEND":
            queue = channels.setdefault((rank, action.peer), deque())
            for ref in action.tensors:
                queue.append((ref, start + costs.p2p_latency))
            end = start
        else:
            end = start + costs.action_cost(action, chunks)
            busy[rank] += end - start
        intervals.append(Interval(rank, pos[rank], action, start, end))
        clock[rank] = end
        pos[rank] += 1
        return True

    while True:
        progressed = False
        for rank in range(p):
            while pos[rank] < len(lists[rank]) and step(rank):
                progressed = True
        if all(pos[r] == len(lists[r]) for r in range(p)):
            break
        if not progressed:
            raise DeadlockError(_deadlock_message(schedule, pos, channels))
    makespan = max(clock) if clock else 0.0
    return SimulationResult(makespan=makespan, busy=busy, intervals=intervals,
                            finish=list(clock))


def _deadlock_message(schedule: Schedule, pos: list, channels: dict) -> str:
    lines = []
    for rank, actions in enumerate(schedule.ranks):
        if pos[rank] == len(actions):
            lines.append(f"rank {rank}: finished")
            continue
        action = actions[pos[rank]]
        waiting = len(channels.get((action.peer, rank), ()))
        lines.append(f"rank {rank}: blocked at action {pos[rank]} "
                     f"({schedule.describe(action)}), {waiting} message(s) queued from "
                     f"stage {action.peer}")
    return (f"{schedule.kind} schedule (p={schedule.num_stages}, m={schedule.num_microbatches})"
            " deadlocks:\n  " + "\n  ".join(lines))
