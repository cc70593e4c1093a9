"""The operator registry: kernels (what an operator does) and operators (one use of a kernel
inside a program, with its data flow).

One registry serves the planner, the profiler and the runtime. A *kernel* is registered by
name with `@register_kernel`; it declares its kind (`comp` or `comm`), its operator class
(the `op_class` of the DAG format) and a `run(op, state)` that executes one operator on an
execution state (`dhelix.ops.runner.LayerExecution`). An *operator* (`Operator`) names the
kernel, the values it reads and writes, static attributes (module path, process group) and
its cost key. New operator families are new kernels plus new program builders; nothing here
changes:

- context parallelism: a `send_recv` kernel (ring exchange of KV blocks, op_class
  send_recv, comm on the CP group's channel) whose outputs the attention kernels consume;
- MoE expert parallelism: `router` and `permute` (comp), `all_to_all` (comm on the EP
  group) and `grouped_gemm` fwd/dgrad/wgrad (comp, wgrad movable) kernels.

Cost keys name the kernel, its shapes and dtype, and for communication the group size and
channel: `name(k=v,...)/dtype[/gN/channel]`. They never contain '|' (profile pair keys are
'keyA|keyB').
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional

from dhelix.dag import CHANNELS, KINDS, OpNode


class Kernel:
    """Base class of registered kernels. Subclasses set `name`, `kind`, `op_class` and
    implement `run`. Kernels are stateless: all state lives in the execution state."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "comp"
    op_class: ClassVar[str] = ""

    def run(self, op: "Operator", state) -> None:
        """Read `op.inputs` from `state`, write `op.outputs` to it. Must not modify input
        tensors in place unless the kernel documents it (all_reduce does)."""
        raise NotImplementedError


_KERNELS: dict[str, Kernel] = {}


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    """Class decorator: register one instance of `cls` under `cls.name`."""
    if not cls.name:
        raise ValueError(f"kernel class {cls.__name__} has no name")
    if cls.kind not in KINDS:
        raise ValueError(f"kernel {cls.name}: kind {cls.kind!r} not in {KINDS}")
    if cls.name in _KERNELS and type(_KERNELS[cls.name]) is not cls:
        raise ValueError(f"kernel {cls.name!r} registered twice")
    _KERNELS[cls.name] = cls()
    return cls


def get_kernel(name: str) -> Kernel:
    _ensure_builtin_kernels()
    try:
        return _KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel named {name!r} (known: {sorted(_KERNELS)})") from None


def kernel_names() -> list[str]:
    _ensure_builtin_kernels()
    return sorted(_KERNELS)


def _ensure_builtin_kernels() -> None:
    # The built-in kernels import this module; load them on first lookup (no import cycle).
    if not _KERNELS:
        import dhelix.ops.kernels  # noqa: F401  (registers on import)
        import dhelix.ops.moe_kernels  # noqa: F401


def cost_key(name: str, dtype: str, dims: Mapping[str, object], *, group_size: Optional[int] = None,
             channel: Optional[str] = None) -> str:
    """`name(k=v,...)/dtype`, plus `/g<size>/<channel>` for communication."""
    body = ",".join(f"{k}={_fmt(v)}" for k, v in dims.items())
    key = f"{name}({body})/{dtype}"
    if group_size is not None:
        key += f"/g{group_size}/{channel}"
    if "|" in key:
        raise ValueError(f"cost key {key!r} must not contain '|'")
    return key


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return "x".join(str(v) for v in value)
    return str(value)


@dataclass(frozen=True)
class Operator:
    """One operator of a program.

    `inputs`/`outputs` are value names in the execution state; `deps` (filled by the
    program) are the ids of the operators of the same direction producing the inputs.
    `attrs` are static kernel arguments (e.g. `module` - a submodule path of the layer -
    or `group` - a process-group role such as "tp").
    """

    id: str
    kernel: str
    kind: str
    op_class: str
    channel: str
    inputs: tuple = ()
    outputs: tuple = ()
    attrs: Mapping = field(default_factory=dict)
    cost_key: str = ""
    movable: bool = False
    deps: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"op {self.id}: kind {self.kind!r} not in {KINDS}")
        if self.channel not in CHANNELS:
            raise ValueError(f"op {self.id}: channel {self.channel!r} not in {CHANNELS}")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "deps", tuple(self.deps))

    def node(self) -> OpNode:
        """This operator as a node of the shared DAG format."""
        return OpNode(id=self.id, kind=self.kind, channel=self.channel, deps=self.deps,
                      cost_key=self.cost_key, movable=self.movable, op_class=self.op_class)

