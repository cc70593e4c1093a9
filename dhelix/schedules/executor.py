"""Executes this rank's action list of a schedule with torch.distributed point-to-point ops.

`StageExecutor.run()` validates the whole schedule first (`dhelix.schedules.validate`), so
a broken list is rejected before any tensor moves. Then, in list order:

- `F`: one chunk forward. Its input is the previous hop's activation (received, or produced
  on this rank at the folded path's turn), detached and marked `requires_grad` so each hop
  has its own autograd graph; hop 0 embeds the batch. On the route's last hop the output
  goes through `loss_func` and is scaled like Megatron's schedules (`* cp / m`).
- `B`: one chunk backward with the received (or local) output gradient, or from the loss on
  the first backward hop (through `grad_scale_func` when given, like Megatron); the input's
  gradient is the hop's output.
- `SI`: `si_runner(run_forward, run_backward)`. The default runs the forward, then the
  backward; the strand executor (operator-level co-execution) plugs in here.
- `SEND`: `isend` of each tensor in payload order (never blocks; all sends are waited for
  at the end); `RECV`: blocking `recv` of each tensor in payload order. Each direction of a
  stage pair is FIFO with tag 0, which gives the deterministic pairing the validator proved.

Guarantees: every micro-batch's passes and their accumulation into `.grad`/`main_grad`
happen in the schedule's order; at the end nothing is left half-done (a leftover tensor
raises RuntimeError). Communication tensors all have the pipeline shape `tensor_shape`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dhelix.schedules.actions import BACKWARD, FORWARD, Action, Pass, Schedule, TensorRef
from dhelix.schedules.validate import validate


def sequential_si(run_forward: Callable[[], None], run_backward: Callable[[], None]) -> None:
    """SI block without co-execution: the forward, then the backward."""
    run_forward()
    run_backward()


class StageExecutor:
    """Runs `schedule.ranks[stage]`.

    forward_chunk(batch, chunk, input_tensor) -> output: one chunk of this stage (input None
        on hop 0); on the route's last hop its output is what `loss_func` takes.
    loss_func(batch, output) -> (loss, info): Megatron's 2-tuple loss convention.
    next_batch() -> batch: this rank's next micro-batch (called once per micro-batch, in
        micro-batch order).
    peer_rank(stage) -> global rank of that pipeline stage.
    """

    def __init__(self, schedule: Schedule, stage: int, *, forward_chunk: Callable,
                 loss_func: Callable, next_batch: Callable, tensor_shape: tuple,
                 dtype: torch.dtype, device: torch.device, peer_rank: Callable[[int], int],
                 grad_scale_func: Callable | None = None, context_parallel_size: int = 1,
                 si_runner: Callable = sequential_si):
        self.schedule = schedule
        self.stage = stage
        self.path = schedule.path
        self.last_hop = schedule.path.num_hops - 1
        self.forward_chunk = forward_chunk
        self.loss_func = loss_func
        self.next_batch = next_batch
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self.peer_rank = peer_rank
        self.grad_scale_func = grad_scale_func
        self.cp = context_parallel_size
        self.si_runner = si_runner
        # This rank's last backward hop of a micro-batch; its batch is dropped after it.
        self._final_backward_hop = max(h for h in range(self.path.num_hops)
                                       if self.path.stage(BACKWARD, h) == stage)
        self._batches: dict = {}
        self._fetched = 0
        self._saved: dict = {}      # (mb, forward hop) -> (input, output)
        self._ready: dict = {}      # TensorRef -> tensor (received or produced, not yet used)
        self._sends: list = []      # (work, tensor) pending isends
        self.losses: list = []      # loss_func infos, in micro-batch order of the loss hop

    def run(self) -> list:
        """Validate the schedule, run this rank's list, wait for sends. Returns the loss
        infos computed on this rank (empty unless it holds the route's last hop)."""
        validate(self.schedule)
        for action in self.schedule.ranks[self.stage]:
            self._execute(action)
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        leftovers = [f"{len(self._saved)} saved activations" if self._saved else "",
                     f"{len(self._ready)} unused tensors" if self._ready else ""]
        leftovers = [x for x in leftovers if x]
        if leftovers:
            raise RuntimeError(f"stage {self.stage} finished with " + ", ".join(leftovers))
        return self.losses

    def _execute(self, action: Action) -> None:
        if action.kind == "SEND":
            peer = self.peer_rank(action.peer)
            for ref in action.tensors:
                tensor = self._ready.pop(ref).detach().contiguous()
                self._check_shape(tensor, ref)
                self._sends.append((dist.isend(tensor, dst=peer), tensor))
        elif action.kind == "RECV":
            peer = self.peer_rank(action.peer)
            for ref in action.tensors:
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                dist.recv(buffer, src=peer)
                self._ready[ref] = buffer
        elif action.kind == "F":
            self._forward(action.forward)
        elif action.kind == "B":
            self._backward(action.backward)
        else:  # SI
            self.si_runner(lambda: self._forward(action.forward),
                           lambda: self._backward(action.backward))

    def _batch(self, microbatch: int):
        while self._fetched <= microbatch:
            self._batches[self._fetched] = self.next_batch()
            self._fetched += 1
        return self._batches[microbatch]

    def _forward(self, p: Pass) -> None:
        batch = self._batch(p.microbatch)
        chunk = self.path.chunk(FORWARD, p.hop)
        inp = None
        if p.hop > 0:
            inp = self._ready.pop(TensorRef(p.microbatch, FORWARD, p.hop - 1))
            inp = inp.detach().requires_grad_(True)
        out = self.forward_chunk(batch, chunk, inp)
        if p.hop == self.last_hop:
            loss, info = self.loss_func(batch, out)
            out = loss * self.cp / self.schedule.num_microbatches
            self.losses.append(info)
        else:
            self._ready[TensorRef(p.microbatch, FORWARD, p.hop)] = out
        self._saved[(p.microbatch, p.hop)] = (inp, out)

    def _backward(self, p: Pass) -> None:
        inp, out = self._saved.pop((p.microbatch, self.path.mirror_hop(p.hop)))
        if p.hop == 0:
            grad = None
            if self.grad_scale_func is not None:
                out = self.grad_scale_func(out)
        else:
            grad = self._ready.pop(TensorRef(p.microbatch, BACKWARD, p.hop - 1))
        torch.autograd.backward(out, grad_tensors=grad)
        if p.hop < self.last_hop:
            self._ready[TensorRef(p.microbatch, BACKWARD, p.hop)] = inp.grad
        if p.hop == self._final_backward_hop:
            self._batches.pop(p.microbatch, None)

    def _check_shape(self, tensor: torch.Tensor, ref: TensorRef) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"stage {self.stage}: {ref.label()} has shape {tuple(tensor.shape)} "
                f"{tensor.dtype}, the pipeline carries {self.tensor_shape} {self.dtype}")
