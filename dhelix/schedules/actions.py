"""Pipeline schedules as data: per-rank action lists over a route of (stage, chunk) hops.

A micro-batch's forward pass visits the hops of a `PipelinePath` in order, its backward pass
visits them in reverse. The hop index of a pass is its position along its own direction's
route, so forward hop h and backward hop h of the folded path sit on the same stage (the
pairing of an SI block). Micro-batches are numbered from 0 (shown from 1).

Action kinds (one rank's list is executed strictly in order):
- `F`: forward of one chunk of one micro-batch (`forward` set);
- `B`: backward of one chunk of one micro-batch (`backward` set);
- `SI`: an SI block, the forward of one micro-batch co-executed with the backward of
  another on this stage (`forward` and `backward` set);
- `SEND` / `RECV`: the tensors in `tensors`, to / from the stage `peer`. Tensors that travel
  together (an SI block's activation and gradient) are one action. Sends are posted without
  waiting for the receiver (isend semantics); a receive waits until its tensors arrived.
  Each ordered (sender, receiver) channel is FIFO: the k-th SEND on it pairs with the k-th
  RECV, with the same tensors in the same order.

A `TensorRef(mb, direction, hop)` names the output of that pass: an activation (direction
F) or the gradient with respect to the pass's input (direction B), consumed by the next hop.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD, BACKWARD = "F", "B"
DIRECTIONS = (FORWARD, BACKWARD)
COMPUTE_KINDS = ("F", "B", "SI")
COMM_KINDS = ("SEND", "RECV")
KINDS = COMPUTE_KINDS + COMM_KINDS
PHASES = ("warmup", "steady", "cooldown")


@dataclass(frozen=True, order=True)
class Pass:
    """One hop of one micro-batch's forward or backward pass (direction given by context)."""

    microbatch: int
    hop: int


@dataclass(frozen=True, order=True)
class TensorRef:
    """The output of pass `hop` of `microbatch` in `direction`, bound for hop + 1."""

    microbatch: int
    direction: str
    hop: int

    def label(self) -> str:
        kind = "act" if self.direction == FORWARD else "grad"
        return f"{kind}(mb{self.microbatch + 1},{self.direction}{self.hop})"


def directed_passes(forward: Pass | None, backward: Pass | None) -> list[tuple[str, Pass]]:
    """[(F, forward), (B, backward)] without the absent ones."""
    out = []
    if forward is not None:
        out.append((FORWARD, forward))
    if backward is not None:
        out.append((BACKWARD, backward))
    return out


def compute_kind(forward: Pass | None, backward: Pass | None) -> str:
    """F, B or SI for a computation with these passes."""
    if forward is not None and backward is not None:
        return "SI"
    return "F" if forward is not None else "B"


@dataclass(frozen=True)
class Action:
    """One step of one rank's list; see the module docstring for the kinds."""

    kind: str
    forward: Pass | None = None
    backward: Pass | None = None
    peer: int | None = None
    tensors: tuple = ()
    phase: str = "steady"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def passes(self) -> list[tuple[str, Pass]]:
        """(direction, pass) of the computation, forward first."""
        return directed_passes(self.forward, self.backward)

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "phase": self.phase}
        if self.forward is not None:
            out["forward"] = [self.forward.microbatch, self.forward.hop]
        if self.backward is not None:
            out["backward"] = [self.backward.microbatch, self.backward.hop]
        if self.peer is not None:
            out["peer"] = self.peer
            out["tensors"] = [[t.microbatch, t.direction, t.hop] for t in self.tensors]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Action":
        return cls(
            kind=d["kind"],
            forward=Pass(*d["forward"]) if "forward" in d else None,
            backward=Pass(*d["backward"]) if "backward" in d else None,
            peer=d.get("peer"),
            tensors=tuple(TensorRef(*t) for t in d.get("tensors", ())),
            phase=d.get("phase", "steady"),
        )


@dataclass(frozen=True)
class PipelinePath:
    """The route of a micro-batch's forward pass as (stage, chunk) hops; backward reverses it.

    `folded(p)`: (0,0) .. (p-1,0), (p-1,1) .. (0,1) (model folding, two chunks per stage).
    `linear(p)`: (0,0) .. (p-1,0) (stock Megatron pipeline, one chunk per stage).
    """

    name: str
    num_stages: int
    forward_hops: tuple

    @classmethod
    def folded(cls, num_stages: int) -> "PipelinePath":
        _check_stages(num_stages)
        down = [(s, 0) for s in range(num_stages)]
        up = [(s, 1) for s in reversed(range(num_stages))]
        return cls("folded", num_stages, tuple(down + up))

    @classmethod
    def linear(cls, num_stages: int) -> "PipelinePath":
        _check_stages(num_stages)
        return cls("linear", num_stages, tuple((s, 0) for s in range(num_stages)))

    @classmethod
    def named(cls, name: str, num_stages: int) -> "PipelinePath":
        if name == "folded":
            return cls.folded(num_stages)
        if name == "linear":
            return cls.linear(num_stages)
        raise ValueError(f"unknown pipeline path {name!r} (folded or linear)")

    @property
    def num_hops(self) -> int:
        return len(self.forward_hops)

    @property
    def chunks_per_stage(self) -> int:
        return self.num_hops // self.num_stages

    def hop(self, direction: str, hop: int) -> tuple[int, int]:
        """(stage, chunk) of `hop` along `direction`'s route."""
        if direction == FORWARD:
            return self.forward_hops[hop]
        if direction == BACKWARD:
            return self.forward_hops[self.num_hops - 1 - hop]
        raise ValueError(f"direction must be F or B, got {direction!r}")

    def stage(self, direction: str, hop: int) -> int:
        return self.hop(direction, hop)[0]

    def chunk(self, direction: str, hop: int) -> int:
        return self.hop(direction, hop)[1]

    def mirror_hop(self, hop: int) -> int:
        """Hop index, in the other direction, of the same (stage, chunk)."""
        return self.num_hops - 1 - hop


def _check_stages(num_stages: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"number of pipeline stages must be >= 1, got {num_stages!r}")


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists (`ranks[s]` for stage s) of one global batch. A
    `forward_only` schedule (evaluation) computes every forward pass once and no backward."""

    kind: str
    path: PipelinePath
    num_microbatches: int
    ranks: tuple
    forward_only: bool = False

    @property
    def directions(self) -> tuple:
        """The directions every micro-batch's passes go: (F,) or (F, B)."""
        return (FORWARD,) if self.forward_only else DIRECTIONS

    @property
    def num_stages(self) -> int:
        return self.path.num_stages

    def describe(self, action: Action) -> str:
        """Short human-readable form, e.g. `SI F(mb5,c0) + B(mb1,c1)` or `SEND->1 [...]`."""
        if action.kind in COMM_KINDS:
            arrow = "->" if action.kind == "SEND" else "<-"
            refs = ", ".join(t.label() for t in action.tensors)
            return f"{action.kind}{arrow}{action.peer} [{refs}]"
        parts = [f"{d}(mb{p.microbatch + 1},c{self.path.chunk(d, p.hop)})"
                 for d, p in action.passes()]
        return f"{action.kind} " + " + ".join(parts)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "path": self.path.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "ranks": [[a.to_dict() for a in actions] for actions in self.ranks],
            "forward_only": self.forward_only,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(
            kind=d["kind"],
            path=PipelinePath.named(d["path"], d["num_stages"]),
            num_microbatches=d["num_microbatches"],
            ranks=tuple(tuple(Action.from_dict(a) for a in actions) for actions in d["ranks"]),
            forward_only=d.get("forward_only", False),
        )
