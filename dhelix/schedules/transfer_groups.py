"""`TransferGroups`: the process groups the pipeline executor's point-to-point transfers
travel on, one per kind (activations, gradients) and direction of travel (to a higher or a
lower stage).

Why four: on each group a rank only sends to a given peer or only receives from it. NCCL
runs a pair's sends and receives of one group in order on one stream, and a large send
completes only once the peer's matching receive runs, so two stages that each send to the
other on one group before receiving could wait for each other, and a receive posted ahead
of a send on one group (`StageExecutor` posts the next RECV's receives early) would wait
for a send queued behind it. With one direction a group, each group's sends and receives
between two ranks match in posting order, whatever the order across groups. Kinds apart
keep a gradient from queueing behind an activation not yet sent (two channels a
direction, each FIFO in the schedule's order: the pairing the validator proved).

Every field None (`TransferGroups()`) sends everything on the default group, one channel.
The groups hold this stage's pipeline peers; transfers address peers by global rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dhelix.schedules.actions import BACKWARD


@dataclass(frozen=True)
class TransferGroups:
    activations_up: Any = None    # activations sent to a higher stage
    activations_down: Any = None  # activations sent to a lower stage
    gradients_up: Any = None
    gradients_down: Any = None

    def group(self, direction: str, upward: bool):
        """The group a tensor of `direction` (FORWARD: an activation, BACKWARD: a gradient)
        travels on to a higher stage (`upward`) or a lower one."""
        if direction == BACKWARD:
            return self.gradients_up if upward else self.gradients_down
        return self.activations_up if upward else self.activations_down

    @property
    def kinds_apart(self) -> bool:
        """Whether activations and gradients to one peer travel on different groups (two
        FIFO channels, not one)."""
        return (self.gradients_up is not self.activations_up
                or self.gradients_down is not self.activations_down)
