"""Operator DAG of one transformer layer in one direction: the interface between the
operator programs (which produce it), the profiler (which times its cost keys) and the
planner (which orders, segments and pairs it).

File format (`dhelix-dag`, version 1):
    {"format": "dhelix-dag", "version": 1, "direction": "fwd"|"bwd",
     "ops": [{"id", "kind": "comp"|"comm", "channel": "compute"|"intra"|"inter",
              "deps": [ids], "cost_key", "movable", "op_class"}]}

`op_class` (gemm, attention, norm, elementwise, all_gather, reduce_scatter, all_reduce,
send_recv, all_to_all, ...) groups operators for overlap-effectiveness estimates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

from dhelix.file_formats import read_parsed, write_versioned

DAG_FORMAT_VERSION = 1
KINDS = ("comp", "comm")
CHANNELS = ("compute", "intra", "inter")
DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class OpNode:
    """One operator: computation on the compute channel, or communication on the
    intra-node or cross-node channel."""

    id: str
    kind: str
    channel: str
    deps: tuple = ()
    cost_key: str = ""
    movable: bool = False
    op_class: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"op {self.id}: kind {self.kind!r} not in {KINDS}")
        if self.channel not in CHANNELS:
            raise ValueError(f"op {self.id}: channel {self.channel!r} not in {CHANNELS}")
        if (self.kind == "comp") != (self.channel == "compute"):
            raise ValueError(f"op {self.id}: kind {self.kind} cannot use channel {self.channel}")
        object.__setattr__(self, "deps", tuple(self.deps))


@dataclass(frozen=True)
class OpDAG:
    """Operators of one direction in their default (program) order; deps form a DAG."""

    direction: str
    ops: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction {self.direction!r} not in {DIRECTIONS}")
        object.__setattr__(self, "ops", tuple(self.ops))
        self.validate()

    @property
    def ids(self) -> list[str]:
        return [op.id for op in self.ops]

    def by_id(self) -> dict[str, OpNode]:
        return {op.id: op for op in self.ops}

    def validate(self) -> None:
        """Unique ids, known deps, no cycles (raises ValueError naming the problem)."""
        seen: set[str] = set()
        for op in self.ops:
            if op.id in seen:
                raise ValueError(f"duplicate op id {op.id!r}")
            seen.add(op.id)
        for op in self.ops:
            for dep in op.deps:
                if dep not in seen:
                    raise ValueError(f"op {op.id!r} depends on unknown op {dep!r}")
        topological_sort(self)  # raises ValueError on a cycle

    def to_dict(self) -> dict:
        ops = []
        for op in self.ops:
            entry = asdict(op)
            entry["deps"] = list(op.deps)
            ops.append(entry)
        return {"direction": self.direction, "ops": ops}

    @classmethod
    def from_dict(cls, data: dict) -> "OpDAG":
        return cls(direction=data["direction"], ops=tuple(OpNode(**op) for op in data["ops"]))


def shared_channels(fwd_ops: Iterable[OpNode], bwd_ops: Iterable[OpNode]) -> list[str]:
    """Communication channels used by both operator lists (empty when they may be paired)."""
    a = {op.channel for op in fwd_ops if op.kind == "comm"}
    b = {op.channel for op in bwd_ops if op.kind == "comm"}
    return sorted(a & b)


def computation_beside_collective(a, b) -> bool:
    """True when one of two operators (anything with a `kind`: OpNode or a program's
    Operator) is a computation and the other a collective."""
    return {a.kind, b.kind} == {"comp", "comm"}


def topological_sort(dag: OpDAG) -> list[str]:
    """A topological order preferring the program order (stable Kahn). Raises on a cycle."""
    index = {op.id: i for i, op in enumerate(dag.ops)}
    remaining = {op.id: set(op.deps) for op in dag.ops}
    order: list[str] = []
    while remaining:
        ready = sorted((i for i, deps in remaining.items() if not deps), key=index.__getitem__)
        if not ready:
            raise ValueError(f"dependency cycle among {sorted(remaining)}")
        chosen = ready[0]
        order.append(chosen)
        del remaining[chosen]
        for deps in remaining.values():
            deps.discard(chosen)
    return order


def topological_violation(dag: OpDAG, order: Sequence[str]) -> str | None:
    """None if `order` is a permutation of the DAG's ops respecting every dependency;
    otherwise a sentence describing the first problem."""
    ops = dag.by_id()
    if sorted(order) != sorted(ops):
        missing = sorted(set(ops) - set(order))
        extra = sorted(set(order) - set(ops))
        return f"order is not a permutation of the ops (missing {missing}, unknown {extra})"
    position = {op_id: i for i, op_id in enumerate(order)}
    for op_id in order:
        for dep in ops[op_id].deps:
            if position[dep] > position[op_id]:
                return f"{op_id!r} is placed before its dependency {dep!r}"
    return None


def check_order(dag: OpDAG, order: Iterable[str]) -> list[str]:
    """Return `order` as a list, or raise ValueError if it breaks a dependency."""
    order = list(order)
    problem = topological_violation(dag, order)
    if problem:
        raise ValueError(f"illegal {dag.direction} order: {problem}")
    return order


def save_dag(dag: OpDAG, path) -> None:
    write_versioned(path, "dag", DAG_FORMAT_VERSION, dag.to_dict())


def load_dag(path) -> OpDAG:
    return read_parsed(path, "dag", DAG_FORMAT_VERSION, OpDAG.from_dict)
