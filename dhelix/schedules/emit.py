"""Turns per-stage orders of computations into action lists with their sends and receives.

A builder decides only *what each stage computes, in which order* (a list of `Task`s per
stage); `emit_schedule` adds the communication every task implies:

- before a task, one RECV per peer for the inputs that come from another stage (an SI
  block's activation and gradient come from the same neighbour on the folded path, so they
  travel as one two-tensor RECV);
- after it, one SEND per peer for the outputs the next hop needs on another stage.

Inputs from the same stage (the turn at the last stage of the folded path, or the loss at
the end of the forward route) need no communication. The result is deterministic: the same
tasks always give the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.schedules.actions import (
    Action,
    Pass,
    PipelinePath,
    Schedule,
    TensorRef,
    compute_kind,
    directed_passes,
)


@dataclass(frozen=True)
class Task:
    """What one stage computes in one step: a forward pass, a backward pass, or both (an SI
    block)."""

    forward: Pass | None = None
    backward: Pass | None = None
    phase: str = "steady"

    def __post_init__(self):
        if self.forward is None and self.backward is None:
            raise ValueError("a task needs a forward or a backward pass")

    @property
    def kind(self) -> str:
        return compute_kind(self.forward, self.backward)

    def parts(self) -> list[tuple[str, Pass]]:
        return directed_passes(self.forward, self.backward)


def _grouped(items: list[tuple[int, TensorRef]]) -> list[tuple[int, tuple]]:
    """[(peer, ref)] -> [(peer, refs)] grouped by peer in first-seen order."""
    order: list[int] = []
    refs: dict[int, list] = {}
    for peer, ref in items:
        if peer not in refs:
            order.append(peer)
            refs[peer] = []
        refs[peer].append(ref)
    return [(peer, tuple(refs[peer])) for peer in order]


def task_actions(path: PipelinePath, stage: int, task: Task) -> list[Action]:
    """RECVs, the compute action, then SENDs for `task` on `stage`."""
    last = path.num_hops - 1
    inputs, outputs = [], []
    for direction, p in task.parts():
        if p.hop > 0:
            src = path.stage(direction, p.hop - 1)
            if src != stage:
                inputs.append((src, TensorRef(p.microbatch, direction, p.hop - 1)))
        if p.hop < last:
            dst = path.stage(direction, p.hop + 1)
            if dst != stage:
                outputs.append((dst, TensorRef(p.microbatch, direction, p.hop)))
    actions = [Action("RECV", peer=peer, tensors=refs, phase=task.phase)
               for peer, refs in _grouped(inputs)]
    actions.append(Action(task.kind, forward=task.forward, backward=task.backward,
                          phase=task.phase))
    actions += [Action("SEND", peer=peer, tensors=refs, phase=task.phase)
                for peer, refs in _grouped(outputs)]
    return actions


def emit_schedule(kind: str, path: PipelinePath, num_microbatches: int,
                  stage_tasks: list[list[Task]], forward_only: bool = False) -> Schedule:
    """The schedule whose stage s computes `stage_tasks[s]` in order."""
    if len(stage_tasks) != path.num_stages:
        raise ValueError(f"{len(stage_tasks)} task lists for {path.num_stages} stages")
    ranks = []
    for stage, tasks in enumerate(stage_tasks):
        actions: list[Action] = []
        for task in tasks:
            actions += task_actions(path, stage, task)
        ranks.append(tuple(actions))
    return Schedule(kind=kind, path=path, num_microbatches=num_microbatches, ranks=tuple(ranks),
                    forward_only=forward_only)


def check_microbatches(num_microbatches: int) -> None:
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"number of micro-batches must be >= 1, got {num_microbatches!r}")
