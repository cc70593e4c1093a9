"""`LayerRunner` keeps no reference to what it is handed (`layer_runner.take_handed`): a
layer input or output gradient is freed as soon as the layer execution holding it drops it,
while the layers still run, as in Megatron's forward and backward (where a layer's input
dies after its first bias-dropout-add reads it as the residual). Stand-in executions (no
communication); the real executions' own frees are covered by the parity and memory tests.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from dhelix.runtime.layer_runner import LayerRunner, take_handed
from dhelix.runtime.strand_executor import Block
from tests.layer_runner_stand_ins import StandInExecution

FWD = ("read_input", "compute")
BWD = ("read_grad", "compute")


class _Execution(StandInExecution):
    """Holds the tensor handed to `begin_forward` / `begin_backward` until its `read_*`
    operator runs, then drops it and records whether anyone else still kept it alive."""

    def __init__(self, layer: int, freed: list):
        super().__init__(FWD, BWD)
        self.layer, self.freed = layer, freed

    def run(self, op_id):
        if op_id.startswith("read_"):
            ref = weakref.ref(self.held)
            self.held = None
            self.freed.append((self.layer, self.phase, ref() is None))


class _Runner(LayerRunner):
    def __init__(self, layers: int, freed: list):
        super().__init__(bound_layers=[None] * layers, lanes=None, fwd_order=FWD,
                         bwd_order=BWD, blocks=(Block(FWD, BWD),))
        self.freed = freed

    def new_execution(self, layer: int):
        return _Execution(layer, self.freed)


def _handed() -> list:
    return [torch.ones(4)]  # the list holds the only reference


def test_forward_alone_keeps_no_reference_to_the_input():
    freed = []
    runner = _Runner(2, freed)
    inputs = _handed()
    _, executions = runner.forward_alone(range(2), inputs)
    assert inputs == [] and len(executions) == 2
    assert freed == [(0, "fwd", True), (1, "fwd", True)]


def test_backward_alone_keeps_no_reference_to_the_gradient():
    freed = []
    runner = _Runner(2, freed)
    _, executions = runner.forward_alone(range(2), _handed())
    freed.clear()
    grads = _handed()
    runner.backward_alone(list(reversed(executions)), grads)
    assert grads == []
    assert freed == [(1, "bwd", True), (0, "bwd", True)]


def test_run_paired_keeps_no_reference_to_the_input_or_the_gradient():
    freed = []
    runner = _Runner(2, freed)
    _, previous = runner.forward_alone(range(2), _handed())
    freed.clear()
    inputs, grads = _handed(), _handed()
    runner.run_paired(range(2), inputs, None, list(reversed(previous)), grads)
    assert inputs == [] and grads == []
    # every handed tensor (the first ones included) died when its execution dropped it
    assert sorted(freed) == [(0, "bwd", True), (0, "fwd", True), (1, "bwd", True),
                             (1, "fwd", True)]


def test_a_caller_that_keeps_a_reference_is_seen():
    """The check above can fail: a tensor the caller still holds is not freed."""
    freed = []
    runner = _Runner(1, freed)
    kept = torch.ones(4)
    runner.forward_alone(range(1), [kept])
    assert freed == [(0, "fwd", False)]


def test_take_handed_wants_one_tensor():
    with pytest.raises(ValueError, match="one-element list"):
        take_handed([])
    with pytest.raises(ValueError, match="one-element list"):
        take_handed([torch.ones(1), torch.ones(1)])
