"""A layer with no partner strand (`LayerRunner.forward_alone` / `backward_alone`: the first
forward and the last backward of a step, the pipeline's unpaired passes) runs in its
program's order, not in the plan's: the plan moves a weight-gradient GEMM behind the wait
on the all-reduce it would hide, which pays off only when the other strand fills that
wait (`layer_runner.alone_order`). Paired layers (`run_paired`) keep the plan's blocks.
Stand-in executions that record the order their operators ran in (no communication)."""

from __future__ import annotations

import torch

from dhelix.runtime.layer_runner import LayerRunner, alone_order
from dhelix.runtime.strand_executor import Block
from tests.layer_runner_stand_ins import CPU, StandInExecution

FWD = ("ln", "gemm", "all_reduce", "add")
BWD = ("dgrad", "all_reduce_grad", "wgrad", "norm_bwd")
PLAN_BWD = ("dgrad", "all_reduce_grad", "norm_bwd", "wgrad")  # wgrad after the wait


class _Execution(StandInExecution):
    def __init__(self, ran: list):
        super().__init__(FWD, BWD, collectives=("all_reduce", "all_reduce_grad"))
        self.ran = ran

    def run(self, op_id):
        self.ran.append(op_id)


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
    _, executions = runner.forward_alone([0], [torch.ones(4, device=CPU)])
    assert ran == list(FWD)
    ran.clear()
    runner.backward_alone(executions, [torch.ones(4, device=CPU)])
    assert ran == list(BWD)  # not PLAN_BWD: the wgrad runs beside its all-reduce
    assert alone_order(executions[0].programs, "bwd") == BWD

    _, executions = runner.forward_alone([0], [torch.ones(4, device=CPU)])
    ran.clear()
    runner.run_paired([0], [torch.ones(4, device=CPU)], None, executions,
                      [torch.ones(4, device=CPU)])
    backward_ran = [op for op in ran if op in BWD]
    assert backward_ran == list(PLAN_BWD)  # the plan's order inside its blocks


def test_a_lone_moe_backward_runs_a_weight_gradient_beside_its_dispatch_gradient():
    """The one change to the program's order: the dispatch all-to-all's gradient, read at
    once by `permute.bwd`, takes the last expert's FC1 weight gradient (the nearest movable
    operator before it) to run while it travels; every dependency kept, the forward and a
    dense layer's backward in program order."""
    from dataclasses import replace

    from dhelix.ops.layer_program import build_layer_programs
    from tests.ops.test_moe_programs import describe_moe

    for desc in (describe_moe(), replace(describe_moe(), add_bias_linear=False)):
        programs = build_layer_programs(desc)
        order = list(alone_order(programs, "bwd"))
        programs.backward.check_order(order)
        at = order.index("dispatch.a2a_grad")
        assert order[at + 1:at + 3] == ["experts.fc1.wgrad.0", "permute.bwd"]
        moved = [op for op in programs.backward.ids if op != "experts.fc1.wgrad.0"]
        assert [op for op in order if op != "experts.fc1.wgrad.0"] == moved
        assert alone_order(programs, "fwd") == tuple(programs.forward.ids)
    dense = build_layer_programs(replace(describe_moe(), moe=None))
    assert alone_order(dense, "bwd") == tuple(dense.backward.ids)
