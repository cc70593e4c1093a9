"""Operator-by-operator execution of layer programs on live megatron-core layers.

`BoundLayer` binds a layer's programs to the layer. `LayerExecution` is the execution state
of one layer for one micro-batch - values by name, pending communication handles, which
operators have run - and is what an executor drives: `begin_forward`, `run(op_id)` for each
operator in any legal order (possibly in segments interleaved with another execution),
`end_forward`; then `begin_backward`, `run`, `end_backward`. `run_forward`/`run_backward`
do a whole program in one call; `LayerStack` chains layers.

Ownership and lifetime guarantees:
- The execution holds each value from the moment an operator produces it (or it is handed
  in) until the last operator reading it - forward or backward - has run; then the state
  drops its reference. Saved activations therefore live exactly until their last backward
  reader. `end_forward`/`end_backward` hand the program output over and keep no reference.
  A caller who keeps its own reference to the input keeps it alive.
- Communication operators return immediately with their output *pending*; the first reader
  waits on the handle (`get`). Until then the pending record keeps the collective's input
  and output buffers alive. `end_*` verifies nothing is left pending.
- Every tensor value is checked against its declared shape when produced, so a layer that
  does not match its description fails at the first operator, not with wrong numbers.
- All ranks of a tensor-parallel group must run their collectives in the same order: use
  the same operator order on every rank.
"""

from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence

import torch

from dhelix.arriving import Arriving, Producing, buffer_of
from dhelix.ops.binding import LayerBinding
from dhelix.ops.collectives import GroupCollectives, NoOpCollectives
from dhelix.ops.layer_program import build_layer_programs
from dhelix.ops.program import LayerPrograms
from dhelix.ops.registry import get_kernel
from dhelix.topology import NodeTopology


@functools.lru_cache(maxsize=64)
def _programs_for(description) -> LayerPrograms:
    return build_layer_programs(description)


class BoundLayer:
    """A TransformerLayer with its programs. Layers with equal descriptions share one
    (immutable) LayerPrograms object."""

    def __init__(self, layer, seq_length: int, micro_batch_size: int, *, rope: bool,
                 topology: Optional[NodeTopology] = None):
        self.binding = LayerBinding(layer)
        self.description = self.binding.describe(seq_length, micro_batch_size, rope=rope,
                                                 topology=topology)
        self.programs = _programs_for(self.description)

    @property
    def layer(self):
        return self.binding.layer

    def new_execution(self) -> "LayerExecution":
        return LayerExecution(self)


class _Pending:
    __slots__ = ("tensor", "work", "keepalive")

    def __init__(self, tensor, work, keepalive):
        self.tensor, self.work, self.keepalive = tensor, work, keepalive


class LayerExecution:
    """Execution state of one bound layer for one micro-batch (see the module docstring)."""

    def __init__(self, bound: BoundLayer):
        self.bound = bound
        self.binding = bound.binding
        self.programs = bound.programs
        self._values: dict = {}
        # value name -> how many of its readers have not run yet
        self._remaining = dict(self.programs.consumer_counts)
        self._done: set[str] = set()
        self._phase = "idle"
        self._program = None  # the program of the current direction, while one runs
        self._running = None  # the Operator running now
        # (group role, channel, strand slot) -> process group replacing the layer's own group
        # for the collectives of that channel (the executor's communication lanes); empty =
        # none. `strand_slot` (0 or 1) is set by the executor: the strand this execution
        # runs as in the current block (`dhelix.runtime.strand_executor`).
        self.lane_groups: dict = {}
        self.strand_slot = 0
        # True only for the benchmark's communication-free bound (timing only, wrong
        # numerics): every collective becomes a no-op (`dhelix.ops.collectives`).
        self.no_comm_timing_only = False

    # --------------------------------------------------------- state access
    def get(self, name: str):
        """The value `name`, waiting first on its communication handle if it is pending."""
        try:
            value = self._values[name]
        except KeyError:
            raise KeyError(f"value {name!r} is not available (not produced yet, or already "
                           "released after its last reader)") from None
        if isinstance(value, _Pending):
            value.work.wait()
            if value.tensor is None:  # a `Producing`: its tensor exists only now
                self.put(name, value.work.tensor)
                return value.work.tensor
            value = self._values[name] = value.tensor
        return value

    def take(self, name: str):
        """`get` for the running operator; if it is the value's last reader, the state
        drops its reference now (the kernel's reference is then the only one)."""
        value = self.get(name)
        running = self._running
        if running is not None and self._remaining[name] == 1 and name in running.inputs:
            del self._values[name]
        return value

    def put(self, name: str, value) -> None:
        """Store a produced value, checking a tensor's shape against the program."""
        info = self.programs.values[name]
        if info.kind == "tensor":
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"value {name!r} must be a tensor, got {type(value).__name__}")
            if not info.admits(value.shape):
                raise RuntimeError(
                    f"value {name!r} has shape {tuple(value.shape)} but the program expects "
                    f"{info.shape_text()} ({self.bound.description.summary()})"
                )
        self._values[name] = value

    def put_pending(self, name: str, tensor: torch.Tensor, work, keepalive: Sequence = ()):
        """Store the output of an asynchronous collective; readers wait on `work`."""
        self.put(name, tensor)
        self._values[name] = _Pending(tensor, work, tuple(keepalive))

    @property
    def phase(self) -> str:
        """'idle', 'fwd', 'between', 'bwd' or 'finished'."""
        return self._phase

    def comm_group(self, op):
        """The process group a collective operator runs on: its lane's group for (role,
        channel, strand slot) when the executor attached lanes (an error if they lack that
        one), else the layer's own group. A lane group has the same ranks as the layer's
        group, so results are identical."""
        role = op.attrs["group"]
        if not self.lane_groups:
            return self.binding.group(role)
        key = (role, op.channel, self.strand_slot)
        if key not in self.lane_groups:
            # falling back to the layer's group would let two strands share it, and their
            # collectives could then pair up differently on two ranks
            raise RuntimeError(f"operator {op.id!r}: no communication lane for group "
                               f"{role!r}, channel {op.channel!r}, strand {self.strand_slot}; "
                               f"the lanes cover {sorted(self.lane_groups)}")
        return self.lane_groups[key]

    def collectives(self, op):
        """How the collective operator `op` communicates: on `comm_group(op)`, or not at all
        when `no_comm_timing_only` is set (timing only, wrong numerics)."""
        group = self.comm_group(op)
        if self.no_comm_timing_only:
            return NoOpCollectives(group)
        return GroupCollectives(group)

    def wait_inputs(self, op_id: str) -> None:
        """Wait for every pending collective `op_id` reads (so running it will not block)."""
        program = self._program or self.programs.program(self._phase)
        for name in program[op_id].inputs:
            if isinstance(self._values.get(name), _Pending):
                self.get(name)

    def op_ready(self, op_id: str) -> bool:
        """True if running `op_id` now would not block on a pending collective: every input
        it reads is either computed or a collective whose work has completed."""
        program = self._program or self.programs.program(self._phase)
        for name in program[op_id].inputs:
            value = self._values.get(name)
            if isinstance(value, _Pending) and not value.work.is_completed():
                return False
        return True

    def wait_pending(self) -> None:
        """Wait for every collective this execution has in flight (a block barrier); the
        values stay held until their readers run."""
        for name, value in list(self._values.items()):
            if isinstance(value, _Pending) and value.tensor is not None:
                value.work.wait()
                self._values[name] = value.tensor

    def live_values(self) -> list[str]:
        """Names of the values this execution currently holds (for tests and memory
        accounting)."""
        return sorted(self._values)

    def pending_values(self) -> list[str]:
        return sorted(n for n, v in self._values.items() if isinstance(v, _Pending))

    # ------------------------------------------------------------- driving
    def begin_forward(self, x, attention_mask=None, rotary_pos_emb=None) -> None:
        """Hand in the layer input (and the mask / rotary table the layer would get). `x`
        may be a `dhelix.arriving.Arriving`: held pending, waited on by its first reader (a
        `Producing` not started yet: produced then, its shape checked once it exists)."""
        self._expect_phase("idle", "begin_forward")
        desc = self.bound.description
        if desc.rope and rotary_pos_emb is None:
            raise ValueError("this layer was described with RoPE but no rotary_pos_emb given")
        if not desc.rope and rotary_pos_emb is not None:
            raise ValueError("rotary_pos_emb given for a layer described without RoPE")
        if not isinstance(x, Producing) and buffer_of(x).requires_grad:
            raise ValueError("the layer input must be a plain tensor (detach it); the "
                             "programs produce its gradient explicitly")
        self._put_handed("x", x)
        self.put("attention_mask", attention_mask)
        self.put("rotary_pos_emb", rotary_pos_emb)
        self._phase, self._program = "fwd", self.programs.forward

    def end_forward(self) -> torch.Tensor:
        """Hand over the layer output; all forward ops must have run."""
        return self._end("fwd", "y", next_phase="between")

    def begin_backward(self, grad_output) -> None:
        """Hand in the gradient of the layer output (a tensor or a
        `dhelix.arriving.Arriving`, as `begin_forward`'s input)."""
        self._expect_phase("between", "begin_backward")
        self._put_handed("d.y", grad_output)
        self._phase, self._program = "bwd", self.programs.backward

    def end_backward(self) -> torch.Tensor:
        """Hand over the gradient of the layer input; all backward ops must have run, and
        the execution then holds nothing."""
        grad_input = self._end("bwd", "d.x", next_phase="finished")
        if self._values:
            raise RuntimeError(f"values left after the backward: {self.live_values()}")
        return grad_input

    def ran_all(self) -> bool:
        """True when every operator of the current direction has run and no collective of
        this execution is in flight: `end_forward` / `end_backward` would not wait."""
        program = self._program
        return (program is not None and all(op_id in self._done for op_id in program.ids)
                and not self.pending_values())

    def run(self, op_id: str) -> None:
        """Run one operator of the current direction; its deps must have run."""
        program = self._program
        if program is None:
            raise RuntimeError(f"cannot run {op_id!r}: no program in progress ({self._phase})")
        try:
            op = program[op_id]
        except KeyError:
            raise KeyError(f"{op_id!r} is not an operator of the {self._phase} program") from None
        done = self._done
        if op_id in done:
            raise RuntimeError(f"operator {op_id!r} already ran")
        for dep in op.deps:
            if dep not in done:
                missing = [d for d in op.deps if d not in done]
                raise RuntimeError(f"operator {op_id!r} runs before its dependencies {missing}")
        kernel = get_kernel(op.kernel)
        self._running = op
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    kernel.run(op, self)
            else:  # the caller already turned autograd off (a block of the strand executor)
                kernel.run(op, self)
        finally:
            self._running = None
        done.add(op_id)
        remaining = self._remaining
        for name in op.inputs:
            remaining[name] -= 1
            if not remaining[name]:
                self._values.pop(name, None)

    # ------------------------------------------------------------ helpers
    def _put_handed(self, name: str, value) -> None:
        if isinstance(value, Producing) and not value.started:
            # nothing to check yet: `get` checks the tensor once it is produced
            self._values[name] = _Pending(None, value, ())
        elif isinstance(value, Arriving):
            self.put_pending(name, value.tensor, value)
        else:
            self.put(name, value)

    def _expect_phase(self, phase: str, action: str) -> None:
        if self._phase != phase:
            raise RuntimeError(f"{action} called in phase {self._phase!r} (expected {phase!r})")

    def _end(self, direction: str, output: str, next_phase: str):
        self._expect_phase(direction, f"end of the {direction} program")
        program = self.programs.program(direction)
        not_run = [op_id for op_id in program.ids if op_id not in self._done]
        if not_run:
            raise RuntimeError(f"{direction} program ended with ops not run: {not_run}")
        result = self.get(output)
        del self._values[output]
        if self.pending_values():
            raise RuntimeError(f"communication never waited on: {self.pending_values()}")
        self._phase, self._program = next_phase, None
        return result


def run_forward(execution: LayerExecution, x, attention_mask=None, rotary_pos_emb=None,
                order: Optional[Iterable[str]] = None) -> torch.Tensor:
    """Whole forward program in `order` (default: program order; rejected if illegal)."""
    order = execution.programs.forward.check_order(order)
    execution.begin_forward(x, attention_mask, rotary_pos_emb)
    for op_id in order:
        execution.run(op_id)
    return execution.end_forward()


def run_backward(execution: LayerExecution, grad_output,
                 order: Optional[Iterable[str]] = None) -> torch.Tensor:
    """Whole backward program in `order` (default: program order; rejected if illegal)."""
    order = execution.programs.backward.check_order(order)
    execution.begin_backward(grad_output)
    for op_id in order:
        execution.run(op_id)
    return execution.end_backward()


class LayerStack:
    """Consecutive TransformerLayers run through their programs (one micro-batch at a time
    per `forward`/`backward` pair). The stack's input gradient comes out of `backward`."""

    def __init__(self, layers: Sequence, seq_length: int, micro_batch_size: int, *, rope: bool,
                 topology: Optional[NodeTopology] = None):
        self.bound = [BoundLayer(layer, seq_length, micro_batch_size, rope=rope,
                                 topology=topology) for layer in layers]

    def forward(self, x, attention_mask=None, rotary_pos_emb=None,
                fwd_order: Optional[Sequence[str]] = None):
        """Returns (output, executions); the executions hold the saved activations until
        `backward` consumes them."""
        executions = []
        for bound in self.bound:
            execution = bound.new_execution()
            x = run_forward(execution, x, attention_mask, rotary_pos_emb, fwd_order)
            executions.append(execution)
        return x, executions

    def backward(self, executions: list, grad_output,
                 bwd_order: Optional[Sequence[str]] = None) -> torch.Tensor:
        """Backward through the layers in reverse; empties `executions` as it goes so each
        layer's state is dropped once its backward ran. Returns the input gradient."""
        grad = grad_output
        while executions:
            grad = run_backward(executions.pop(), grad, bwd_order)
        return grad
