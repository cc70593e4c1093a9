"""Programs: the operators of one layer in one direction, with their data flow.

A `Program` lists operators in their default order (Megatron's own order); each operator's
`deps` are the operators of the same program that produce its inputs, so the program is
also a DAG (`Program.dag()`, the shared format of `dhelix.dag`). `LayerPrograms` pairs the
forward and backward programs of one layer and knows, for every value, which operators of
either direction read it - which is what lets the executor free a saved activation the
moment its last reader has run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from dhelix.dag import OpDAG, check_order, load_dag, save_dag
from dhelix.ops.registry import Operator

VALUE_KINDS = ("tensor", "graph", "aux")
GRAD_PREFIX = "d."  # gradient values are named d.<value>


@dataclass(frozen=True)
class VariableDim:
    """A dimension known only at run time (MoE: how many tokens an all-to-all delivers
    depends on the routing), declared with the bounds every run must respect: a produced
    size outside [low, high] fails the shape check like a wrong fixed size."""

    name: str
    low: int
    high: int

    def __post_init__(self):
        if not 0 <= self.low <= self.high:
            raise ValueError(f"variable dimension {self.name}: bounds [{self.low}, "
                             f"{self.high}] are not 0 <= low <= high")

    def admits(self, size: int) -> bool:
        return self.low <= size <= self.high

    def __str__(self) -> str:
        return f"{self.name}[{self.low}..{self.high}]"


@dataclass(frozen=True)
class ValueInfo:
    """A named value of a layer's execution state. `shape` is given for tensors and checked
    when the value is produced (`[seq, batch, width]` for the layer's activations, token
    rows `[tokens, width]` or `[tokens]` inside an MoE layer); an entry may be a
    `VariableDim` (a run-time size within declared bounds). `graph` values are LocalGraphs;
    `aux` values are inputs such as the attention mask or rotary table (may be None) and
    run-time metadata (MoE routing maps and split sizes), not shape-checked."""

    name: str
    kind: str = "tensor"
    shape: Optional[tuple] = None

    def __post_init__(self):
        if self.kind not in VALUE_KINDS:
            raise ValueError(f"value {self.name}: kind {self.kind!r} not in {VALUE_KINDS}")

    def admits(self, shape) -> bool:
        """True when a tensor of `shape` is what this value declares: the same rank, every
        fixed dimension equal, every variable dimension within its bounds."""
        if self.shape is None:
            return True
        shape = tuple(shape)
        if len(shape) != len(self.shape):
            return False
        return all(d.admits(n) if isinstance(d, VariableDim) else d == n
                   for d, n in zip(self.shape, shape))

    def shape_text(self) -> str:
        return "(" + ", ".join(str(d) for d in self.shape) + ")" if self.shape else "()"


class Program:
    """Operators of one direction in default order, with deps derived from data flow.

    `inputs` are values supplied from outside the program (the layer input, or for the
    backward the output gradient and the saved forward values); `outputs` are the values it
    hands out at the end (the layer output, or the input gradient).
    """

    def __init__(self, direction: str, ops: Iterable[Operator], inputs: Iterable[str],
                 outputs: Iterable[str]):
        self.direction = direction
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        producers: dict[str, str] = {}
        linked = []
        for op in ops:
            if len(set(op.inputs)) != len(op.inputs):
                raise ValueError(f"{direction} op {op.id!r} reads a value twice: {op.inputs}")
            deps = []
            for value in op.inputs:
                producer = producers.get(value)
                if producer is None and value not in self.inputs:
                    raise ValueError(f"{direction} op {op.id!r} reads {value!r}, which no "
                                     "earlier op produces and is not a program input")
                if producer is not None and producer not in deps:
                    deps.append(producer)
            for value in op.outputs:
                if value in producers or value in self.inputs:
                    raise ValueError(f"{direction} value {value!r} is produced twice")
                producers[value] = op.id
            linked.append(_with_deps(op, tuple(deps)))
        missing = [v for v in self.outputs if v not in producers]
        if missing:
            raise ValueError(f"{direction} program never produces its outputs {missing}")
        self.ops = tuple(linked)
        self.producers = producers
        self._by_id = {op.id: op for op in self.ops}
        self._dag = OpDAG(direction=direction, ops=tuple(op.node() for op in self.ops))

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, op_id: str) -> Operator:
        return self._by_id[op_id]

    @property
    def ids(self) -> list[str]:
        return [op.id for op in self.ops]

    def dag(self) -> OpDAG:
        """This program in the shared DAG format (deps, channels, cost keys, movable)."""
        return self._dag

    def check_order(self, order: Optional[Iterable[str]]) -> list[str]:
        """`order` (default: program order) as a list; ValueError if it is not a
        permutation of the ops or breaks a dependency."""
        return self.ids if order is None else check_order(self._dag, order)

    def save_dag(self, path) -> None:
        save_dag(self._dag, path)

    @staticmethod
    def load_dag(path) -> OpDAG:
        return load_dag(path)


def _with_deps(op: Operator, deps: tuple) -> Operator:
    return Operator(id=op.id, kernel=op.kernel, kind=op.kind, op_class=op.op_class,
                    channel=op.channel, inputs=op.inputs, outputs=op.outputs, attrs=op.attrs,
                    cost_key=op.cost_key, movable=op.movable, deps=deps)


class LayerPrograms:
    """The forward and backward programs of one layer and the lifetimes of its values.

    `consumers[value]` is the set of op ids (forward and backward) that read the value;
    `saved` are the forward values the backward reads (the activations kept between the
    passes). Operators that modify their input in place (`attrs['inplace']`) must be its
    only reader; this is checked here.
    """

    def __init__(self, description, forward: Program, backward: Program,
                 values: Mapping[str, ValueInfo]):
        self.description = description
        self.forward = forward
        self.backward = backward
        self.values = dict(values)
        ids = set(forward.ids)
        clash = ids.intersection(backward.ids)
        if clash:
            raise ValueError(f"op ids used in both directions: {sorted(clash)}")
        consumers: dict[str, set] = {name: set() for name in self.values}
        for program in (forward, backward):
            for op in program.ops:
                for value in (*op.inputs, *op.outputs):
                    if value not in self.values:
                        raise ValueError(f"op {op.id!r} uses undeclared value {value!r}")
                for value in op.inputs:
                    consumers[value].add(op.id)
        for program in (forward, backward):
            for op in program.ops:
                if op.attrs.get("inplace"):
                    (value,) = op.inputs
                    if consumers[value] != {op.id}:
                        raise ValueError(f"op {op.id!r} modifies {value!r} in place but "
                                         f"{sorted(consumers[value] - {op.id})} also read it")
        for value in backward.inputs:
            if value not in forward.producers and not value.startswith(GRAD_PREFIX):
                raise ValueError(f"backward input {value!r} is neither a gradient "
                                 f"('{GRAD_PREFIX}...') nor produced by the forward")
        outputs = {*forward.outputs, *backward.outputs}
        for program in (forward, backward):
            for value in program.producers:
                if not consumers[value] and value not in outputs:
                    raise ValueError(f"{value!r} is produced but never read: the execution "
                                     "would hold it forever")
        self.consumers = {name: frozenset(ops) for name, ops in consumers.items()}
        # how many operators read each value (an operator reads a value at most once)
        self.consumer_counts = {name: len(ops) for name, ops in consumers.items()}
        self.saved = tuple(v for v in backward.inputs if v in forward.producers)

    def program(self, direction: str) -> Program:
        return {"fwd": self.forward, "bwd": self.backward}[direction]

    def dags(self) -> dict:
        return {"fwd": self.forward.dag(), "bwd": self.backward.dag()}
