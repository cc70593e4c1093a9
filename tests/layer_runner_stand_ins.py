"""Stand-in layer executions for `LayerRunner` tests that need no model: what the runner and
the strand executor call on a `dhelix.ops.runner.LayerExecution`, with nothing computed and
no communication. Subclasses say what running an operator does (`run`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

CPU = torch.device("cpu")  # stand-ins compute nothing; their tensors are placeholders


class StandInProgram(dict):
    """A program's operators by id (`kind` "comm" for ids in `collectives`, else "comp";
    no all-to-all, no dependencies, nothing movable) and `ids`, their program order."""

    def __init__(self, ids: tuple, collectives: tuple = ()):
        super().__init__({op: SimpleNamespace(kind="comm" if op in collectives else "comp",
                                              op_class="stand-in", deps=(), movable=False)
                          for op in ids})
        self.ids = list(ids)


class StandInExecution:
    """A layer execution of the programs `fwd` / `bwd` (operator ids in program order): the
    tensor handed to `begin_forward` / `begin_backward` is kept in `held`, the `end_*`
    calls return a fresh tensor, every input is ready, `run` does nothing."""

    def __init__(self, fwd: tuple, bwd: tuple, collectives: tuple = ()):
        programs = {"fwd": StandInProgram(fwd, collectives),
                    "bwd": StandInProgram(bwd, collectives)}
        self.programs = SimpleNamespace(program=programs.__getitem__)
        self.strand_slot = None
        self.phase = None
        self.held = None

    def begin_forward(self, x, attention_mask=None, rotary_pos_emb=None):
        self.phase, self.held = "fwd", x

    def end_forward(self):
        return torch.zeros(4, device=CPU)

    def begin_backward(self, grad):
        self.phase, self.held = "bwd", grad

    def end_backward(self):
        return torch.zeros(4, device=CPU)

    def op_ready(self, op_id):
        return True

    def wait_inputs(self, op_id):
        pass

    def run(self, op_id):
        pass

    def wait_pending(self):
        pass
