"""Decoder layers run operator by operator, alone or as the paired layers of an SI block.

One `LayerRunner` per rank serves every DHelix schedule (PP=1 and the folded W schedule):
it owns this rank's bound layers, the communication lanes and the plan (strand orders and
blocks), and knows nothing about micro-batches, embeddings or losses.

Tensor ownership: layer inputs and output gradients handed in are plain tensors (no
autograd graph), passed in a one-element list that the runner empties (`take_handed`); the
runner drops its own reference once a layer execution holds the tensor, so it is freed after
its last reader in that execution (a layer's input after its first bias-dropout-add reads it
as the residual), as in Megatron's forward and backward, not when the chunk pass ends. Each
layer execution holds its activations until their last backward reader and hands its output
over (`dhelix.ops.runner`). The executions returned by a forward belong to the caller, who
hands them back, in backward order, to `backward_alone` or `run_paired`; after their
backward they hold nothing. Compute runs on the calling thread / current stream, collectives
on the lanes (`dhelix.runtime.lanes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dhelix.arriving import Producing
from dhelix.runtime.lanes import lane_execution
from dhelix.runtime.strand_executor import Block, run_alone, run_block, run_blocks
from dhelix.runtime.streamed_executor import StrandChain, run_streamed


def take_handed(holder: list) -> torch.Tensor:
    """The one tensor in `holder`, which is emptied: the caller hands its only reference
    over (the module docstring's ownership rule)."""
    if len(holder) != 1:
        raise ValueError(f"hand one tensor over in a one-element list, got {len(holder)} items")
    return holder.pop()


class _OutputReporter:
    """`on_strand_end` of an SI block's last layer pair (`run_paired`): ends a strand's
    execution as soon as it ran everything (`LayerExecution.ran_all`), keeps the output in
    `ended` and reports it to `on_output`."""

    def __init__(self, fwd, bwd, on_output, ended: dict):
        self.fwd, self.bwd, self.on_output, self.ended = fwd, bwd, on_output, ended

    def __call__(self, execution) -> None:
        if not execution.ran_all():
            return
        if execution is self.fwd and "fwd" not in self.ended:
            self.ended["fwd"] = execution.end_forward()
            self.on_output("fwd", self.ended["fwd"])
        elif execution is self.bwd and "bwd" not in self.ended:
            self.ended["bwd"] = execution.end_backward()
            self.on_output("bwd", self.ended["bwd"])


def _starter(produced, blocks: Sequence[Block], at: int | None = None):
    """`run_blocks`' `before_block` for an SI block whose forward input is a
    `dhelix.arriving.Producing` (`produced`; None: nothing to start): starts it before block
    `at` of `blocks`, or by default before the first with forward operators (never later),
    at the same block boundary on every rank, so the next micro-batch's embedding output is
    not allocated while the backward-only blocks before it run (the backward strand's first
    operators, where a layer pair's memory peaks) unless the memory bound leaves room for
    it there (`LayerRunner.early_input_block`)."""
    if produced is None:
        return None
    first = next((i for i, block in enumerate(blocks) if block.fwd), 0)
    if at is not None:
        first = min(first, at)

    def before_block(index: int) -> None:
        if index == first:
            produced.start()
    return before_block


def alone_order(programs, direction: str) -> tuple:
    """The order a layer's `direction` ("fwd" or "bwd") runs in with no partner strand (the
    first forward and the last backward of a step, and the pipeline's unpaired passes): its
    program's order, Megatron's own, where each weight-gradient GEMM runs right after the
    input-gradient GEMM whose all-reduce it hides. Not the plan's: a plan reorders a strand
    for its pairing (a wgrad moved behind the wait on that all-reduce, so the other strand
    fills the wait), which alone leaves the all-reduce exposed. Measured on the emulated
    GPU ((d), TP=2 x PP=2, S = 300): a stage's last lone backward took 6.7 s in the plan's
    order against 5.5 s in the program's. The one change: a backward all-to-all that its
    first reader would wait for with no weight-gradient GEMM run in between takes the
    nearest one before it (`_wgrads_behind_all_to_alls`; an MoE layer's dispatch gradient
    then travels beside its last expert's FC1 weight gradient, as Megatron's
    `--delay-wgrad-compute` does)."""
    program = programs.program(direction)
    order = list(program.ids)
    if direction == "bwd":
        _wgrads_behind_all_to_alls(program, order)
    return tuple(order)


def _wgrads_behind_all_to_alls(program, order: list) -> None:
    """Reorders `order` (the ids of `program`, a backward) in place: for each all-to-all
    with no movable operator (a weight-gradient GEMM) between it and its first reader, the
    last movable operator before it, with no collective between them and nothing up to the
    all-to-all reading it, moves to right after the all-to-all; so the GEMM runs while the
    all-to-all travels instead of before it is issued. The result keeps every dependency.
    All-to-alls only: the TP collectives' order is Megatron's (see `alone_order`)."""
    for comm_id in [op_id for op_id in order if program[op_id].op_class == "all_to_all"]:
        at = order.index(comm_id)
        reader = next((i for i in range(at + 1, len(order))
                       if comm_id in program[order[i]].deps), len(order))
        if any(program[op_id].movable for op_id in order[at + 1:reader]):
            continue
        for i in range(at - 1, -1, -1):
            op = program[order[i]]
            if op.kind == "comm":
                break
            if op.movable:
                if not any(op.id in program[later].deps for later in order[i + 1:at + 1]):
                    order.insert(at, order.pop(i))  # right after the all-to-all
                break


@dataclass(frozen=True)
class PairPlan:
    """Strand orders and blocks of one (forward layer, backward layer) pair."""

    fwd_order: tuple
    bwd_order: tuple
    blocks: tuple


@dataclass
class LayerRunner:
    """`bound_layers[i]` binds local layer i; `lanes` (None without TP) routes collectives;
    `fwd_order` / `bwd_order` / `blocks` come from the plan (one plan for all layers);
    `timeline` (a `dhelix.runtime.timeline.Timeline`, default None) records what the
    compute thread does, for explaining step times; `block_barriers` (default True) ends
    every block of a layer pair with a barrier, as the planner's cost model assumes; False
    ends only the last (`strand_executor.run_blocks`). `seam` (a `planner.blocks.Seam`, or
    None) lets consecutive layer pairs of an SI block overlap: the next pair's leading
    forward-only blocks run together with this pair's trailing backward-only blocks."""

    bound_layers: Sequence
    lanes: object
    fwd_order: tuple
    bwd_order: tuple
    blocks: tuple
    timeline: object = None
    block_barriers: bool = True
    seam: object = None
    # A stack whose layers have different programs (dense and MoE layers): the plan of each
    # (forward programs, backward programs) pair a paired block meets, keyed by the two
    # `LayerPrograms` objects (shared by equal layers); None: one plan (the fields above)
    # serves every pair. Layer pairs then never meet at a seam.
    pair_plans: dict | None = None
    # `--dhelix-streamed`: a `planner.streamed.StreamedPlanner` whose schedule for the SI
    # block's size runs every SI block (`dhelix.runtime.streamed_executor`) in place of the
    # blocks and seams above; None: the blocks
    streamed: object = None
    # Where an SI block's forward input is produced early (a `dhelix.arriving.Producing`
    # whose all-reduce then travels beside the backward-only blocks: the deferred
    # embedding), the block of the first layer pair's plan it starts before
    # (`planner.memory.early_input_block`: the earliest whose rest, up to the first block
    # with forward operators, holds it within the memory bound; 0: at the SI block's
    # start); on the streamed path any value means the schedule's `input_step` (the same
    # rule per entry); None: before the first block (entry) with forward operators
    early_input_block: int | None = None

    def __post_init__(self):
        self.blocks = tuple(Block(tuple(b.fwd), tuple(b.bwd)) for b in self.blocks)
        if self.streamed is not None and (self.seam is not None or self.pair_plans is not None):
            raise ValueError("a streamed SI block has no seams and serves one layer kind")
        if self.pair_plans is not None:
            if self.seam is not None:
                raise ValueError("layer pairs of a mixed stack do not meet at seams")
            self.pair_plans = {key: PairPlan(tuple(p.fwd_order), tuple(p.bwd_order),
                                             tuple(Block(tuple(b.fwd), tuple(b.bwd))
                                                   for b in p.blocks))
                               for key, p in self.pair_plans.items()}

    def new_execution(self, layer: int):
        """A fresh execution of local layer `layer`, its collectives on the lanes."""
        return lane_execution(self.bound_layers[layer], self.lanes)

    def _plan(self, fwd_programs, bwd_programs) -> "PairPlan":
        """The plan of a forward of `fwd_programs` paired with a backward of
        `bwd_programs`."""
        if self.pair_plans is None:
            return PairPlan(self.fwd_order, self.bwd_order, self.blocks)
        for (f, b), plan in self.pair_plans.items():
            if f is fwd_programs and b is bwd_programs:
                return plan
        raise KeyError("no plan pairs these layers' programs (a forward of "
                       f"{getattr(fwd_programs, 'description', None)} with a backward of "
                       f"{getattr(bwd_programs, 'description', None)})")

    def forward_alone(self, layers: Sequence[int], inputs: list,
                      rotary_pos_emb=None) -> tuple[torch.Tensor, list]:
        """Forward of local layers `layers` in that order, each in its program's order
        (`alone_order`), from the first layer's input handed over in `inputs` (emptied).
        Returns the last output and the executions (forward order)."""
        executions = []
        x = take_handed(inputs)
        for layer in layers:
            execution = self.new_execution(layer)
            execution.begin_forward(x, None, rotary_pos_emb)
            x = None  # the execution owns it
            run_alone(execution, alone_order(execution.programs, "fwd"), self.timeline)
            x = execution.end_forward()
            executions.append(execution)
        return x, executions

    def backward_alone(self, executions: Sequence, grads: list) -> torch.Tensor:
        """Backward through `executions` given in backward order (last layer first), from
        the gradient of the last layer's output handed over in `grads` (emptied), each in
        its program's order (`alone_order`). Returns the gradient of the first layer's
        input."""
        grad = take_handed(grads)
        for execution in executions:
            execution.begin_backward(grad)
            grad = None  # the execution owns it
            run_alone(execution, alone_order(execution.programs, "bwd"), self.timeline)
            grad = execution.end_backward()
        return grad

    def run_paired(self, fwd_layers: Sequence[int], inputs: list, rotary_pos_emb,
                   bwd_executions: Sequence, grads: list, on_output=None):
        """The layers of an SI block: forward of local layer `fwd_layers[i]` co-executed,
        block by block as the plan says, with the backward of `bwd_executions[i]` (given in
        backward order). Both lists have the same length. The first forward layer's input
        and the gradient of the first backward layer's output are handed over in `inputs`
        and `grads` (both emptied). The input may be a `dhelix.arriving.Producing` (the next
        micro-batch's embedding, not computed yet): it is started before the first block with
        forward operators, or the earlier `early_input_block` (on the streamed path, the
        entry: the first forward one or the schedule's `input_step`).

        With a `seam`, between two layer pairs the next pair's head blocks (forward only)
        run as one block, ended by a barrier, with this pair's tail blocks (backward only);
        each strand still runs its operators in plan order.

        With `streamed`, the whole SI block runs as the streamed schedule's one operator
        sequence instead (`_run_streamed`).

        `on_output(direction, tensor)` ("fwd": the forward output, "bwd": the input
        gradient) is called as soon as the last layer pair's strand of that direction has
        run its last operator with nothing in flight, while the other strand may still run
        (the pipeline executor sends it then); the same tensor is returned. Not called for
        a strand that ends with a collective in flight (on the streamed path: still in
        flight when the sequence's last entry has run).

        Returns (forward output, forward executions in forward order, input gradient of the
        last backward execution)."""
        if len(fwd_layers) != len(bwd_executions):
            raise ValueError(f"an SI block pairs layers one to one: {len(fwd_layers)} "
                             f"forward layers, {len(bwd_executions)} backward layers")
        if self.streamed is not None:
            return self._run_streamed(fwd_layers, inputs, rotary_pos_emb, bwd_executions,
                                      grads, on_output)
        seam, count = self.seam, len(fwd_layers)
        x, grad = take_handed(inputs), take_handed(grads)
        produced = x if isinstance(x, Producing) else None
        executions, unfinished = [], None  # the previous pair's backward, its tail not run
        for index, (layer, bwd) in enumerate(zip(fwd_layers, bwd_executions)):
            fwd = self.new_execution(layer)
            fwd.begin_forward(x, None, rotary_pos_emb)
            x = None  # the execution owns it
            blocks = self._plan(fwd.programs, bwd.programs).blocks
            start, end = 0, len(blocks)
            if unfinished is not None:
                run_block(fwd, unfinished, seam.block, barrier=True, timeline=self.timeline)
                grad = unfinished.end_backward()
                start = seam.head
            bwd.begin_backward(grad)
            grad = None  # the execution owns it
            unfinished = bwd if seam is not None and index < count - 1 else None
            if unfinished is not None:
                end -= seam.tail
            ended = {}
            reporter = (_OutputReporter(fwd, bwd, on_output, ended)
                        if on_output is not None and index == count - 1 else None)
            run_blocks(fwd, bwd, blocks[start:end], barrier=self.block_barriers,
                       timeline=self.timeline, on_strand_end=reporter,
                       before_block=_starter(produced, blocks[start:end],
                                             self.early_input_block), first_index=start)
            produced = None
            x = ended.pop("fwd") if "fwd" in ended else fwd.end_forward()
            if unfinished is None:
                grad = ended.pop("bwd") if "bwd" in ended else bwd.end_backward()
            executions.append(fwd)
        return x, executions, grad

    def _run_streamed(self, fwd_layers: Sequence[int], inputs: list, rotary_pos_emb,
                      bwd_executions: Sequence, grads: list, on_output=None):
        """`run_paired` as one streamed sequence (`dhelix.runtime.streamed_executor`): each
        strand's layers chained, a layer's output (input gradient) handed to the next
        layer's execution when the sequence reaches it; a strand's last output reported
        to `on_output` as soon as the strand has ended; same ownership and result."""
        schedule = self.streamed.for_pairs(len(fwd_layers))
        outputs, grad_outputs, executions = [take_handed(inputs)], [take_handed(grads)], []
        before_step = None
        if isinstance(outputs[0], Producing):
            produced = outputs[0]
            at = schedule.first_forward_step
            if self.early_input_block is not None:  # the schedule's, within its bound
                at = min(at, schedule.input_step)

            def before_step(index: int) -> None:
                if index == at:
                    produced.start()

        def open_fwd(pair):
            execution = self.new_execution(fwd_layers[pair])
            execution.begin_forward(take_handed(outputs), None, rotary_pos_emb)
            executions.append(execution)
            return execution

        def open_bwd(pair):
            execution = bwd_executions[pair]
            execution.begin_backward(take_handed(grad_outputs))
            return execution

        chains = {"fwd": StrandChain(open_fwd, lambda e: outputs.append(e.end_forward())),
                  "bwd": StrandChain(open_bwd, lambda e: grad_outputs.append(e.end_backward()))}
        ended = {"fwd": outputs, "bwd": grad_outputs}

        def on_strand_end(strand: str) -> None:
            on_output(strand, ended[strand][0])  # still held there: returned below

        run_streamed(schedule.sequence, chains, self.timeline, before_step,
                     on_strand_end if on_output is not None else None)
        return take_handed(outputs), executions, take_handed(grad_outputs)
