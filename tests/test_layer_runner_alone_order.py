"""A layer with no partner strand (`LayerRunner.forward_alone` / `backward_alone`: the first
forward and the last backward of a step, the pipeline's unpaired passes) runs in its
program's order, not in the plan's: the plan moves a weight-gradient GEMM behind the wait
on the all-reduce it would hide, which pays off only when the other strand fills that
wait (`layer_runner.alone_order`). Paired layers (`run_paired`) keep the plan's blocks.
Stand-in executions that record the order their operators ran in (no communication)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dhelix.runtime.layer_runner import LayerRunner, alone_order
from dhelix.runtime.strand_executor import Block

FWD = ("ln", "gemm", "all_reduce", "add")
BWD = ("dgrad", "all_reduce_grad", "wgrad", "norm_bwd")
PLAN_BWD = ("dgrad", "all_reduce_grad", "norm_bwd", "wgrad")  # wgrad after the wait


class _Program(dict):
    def __init__(self, ids: tuple):
        super().__init__({op: SimpleNamespace(kind="comm" if "all_reduce" in op else "comp")
                          for op in ids})
        self.ids = list(ids)


class _Execution:
    def __init__(self, ran: list):
        programs = {"fwd": _Program(FWD), "bwd": _Program(BWD)}
        self.programs = SimpleNamespace(program=programs.__getitem__)
        self.ran, self.phase, self.strand_slot = ran, None, None

    def begin_forward(self, x, attention_mask=None, rotary_pos_emb=None):
        self.phase = "fwd"

    def end_forward(self):
        return torch.zeros(2)

    def begin_backward(self, grad):
        self.phase = "bwd"

    def end_backward(self):
        return torch.zeros(2)

    def op_ready(self, op_id):
        return True

    def wait_inputs(self, op_id):
        pass

    def run(self, op_id):
        self.ran.append(op_id)

    def wait_pending(self):
        pass


class _Runner(LayerRunner):
    def __init__(self, ran: list):
        super().__init__(bound_layers=[None], lanes=None, fwd_order=FWD, bwd_order=PLAN_BWD,
                         blocks=(Block(FWD[:2], PLAN_BWD[:2]), Block(FWD[2:], PLAN_BWD[2:])))
        self.ran = ran

    def new_execution(self, layer: int):
        return _Execution(self.ran)


def test_a_lone_layer_runs_its_program_order_and_a_pair_the_plan():
    ran = []
    runner = _Runner(ran)
    _, executions = runner.forward_alone([0], [torch.ones(2)])
    assert ran == list(FWD)
    ran.clear()
    runner.backward_alone(executions, [torch.ones(2)])
    assert ran == list(BWD)  # not PLAN_BWD: the wgrad runs beside its all-reduce
    assert alone_order(executions[0].programs, "bwd") == BWD

    _, executions = runner.forward_alone([0], [torch.ones(2)])
    ran.clear()
    runner.run_paired([0], [torch.ones(2)], None, executions, [torch.ones(2)])
    backward_ran = [op for op in ran if op in BWD]
    assert backward_ran == list(PLAN_BWD)  # the plan's order inside its blocks
