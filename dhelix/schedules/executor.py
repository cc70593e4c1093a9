"""Executes this rank's action list of a schedule with torch.distributed point-to-point ops.

`StageExecutor.run()` validates the whole schedule first (`dhelix.schedules.validate`; once
per schedule object, so a schedule reused step after step is checked once), so a broken list
is rejected before any tensor moves. Then, in list order:

- `F`: one chunk forward. Its input is the previous hop's activation (received, or produced
  on this rank at the folded path's turn); hop 0 embeds the batch. On the route's last hop
  the output goes through `loss_func` and is scaled like Megatron's schedules (`* cp / m`).
- `B`: one chunk backward with the received (or local) output gradient, or from the loss on
  the first backward hop (scaled by `grad_scale_func` when given, like Megatron); the
  input's gradient is the hop's output. The engine's `keep_loss(state, scaled_loss)`, called
  right after the loss is computed, decides whether that loss is back-propagated then (the
  DHelix engine does, so the logits do not wait for the backward pass) or at the backward.
- `SI`: an SI block, the forward of one micro-batch and the backward of another given to the
  pass engine together (`passes.si`).
- A forward-only schedule (evaluation) computes the loss on the last hop and keeps nothing
  for a backward; run it under `torch.no_grad()`.
- `SEND`: `isend` of each tensor in payload order (never blocks; each sent tensor is
  held until its send completed, `dhelix.schedules.sends_in_flight`, and all sends are
  waited for at the end); `RECV`: the received tensors of its payload, in payload order.
  Each direction of a stage pair is FIFO with tag 0, which gives the deterministic pairing
  the validator proved. With `transfer_groups` (`dhelix.schedules.transfer_groups`: a group
  per kind and direction of travel) activations and gradients are two FIFO channels a
  direction, each keeping the validator's order, so neither kind queues behind the other,
  and on every group a rank only sends to a peer or only receives from it.
- Receives posted a RECV ahead: a RECV posts the `irecv`s of the next RECV of the list too
  (in payload order, after its own), so what the peer sends during the actions between
  them (an early send) moves then: a point-to-point send moves its bytes only once the
  receive is posted (gloo, and NCCL beyond its buffers). Each channel's receives are still
  posted in the list's order.
- Early sends: an SI block's two outputs bound for the SEND right after it are sent as soon
  as the engine reports each final (`passes.si(..., produced=...)`), while the rest of the
  block still runs, in the SEND's order on each channel (with one channel, a tensor waits
  for those before it in the payload). The SEND then posts only what was not sent.
- Receives the engine can start before (`passes.accepts_arriving`): a RECV hands the
  buffers of its payload's `irecv`s on as `dhelix.arriving.Arriving`;
  the engine waits on each where it reads it. Other engines get the received tensors.

How a pass computes is the pass engine's business (`passes`): `AutogradPasses` runs the
chunk module with autograd (SI blocks forward, then backward); the DHelix runtime's engine
runs the layers operator by operator and co-executes an SI block's two passes
(`dhelix.runtime.operator_passes`). The executor owns the bookkeeping: which tensors are
ready, what each pass saved, the loss and its scaling.

Gradient synchronisation (`no_sync`, one rule for every schedule): every action before this
rank's last action holding a backward pass runs inside `no_sync()` (Megatron DDP's
`no_sync`: gradients only accumulate); that last backward, the last micro-batch's, and
what follows run outside it. This is the rule of Megatron's own schedules
(`forward_backward_no_pipelining`, `combined_1f1b_schedule_for_no_pipelining`, 1F1B's
`enable_grad_sync()` before the last backward): with `overlap_grad_reduce` a bucket's
reduction starts when each of its parameters' gradient arrives outside `no_sync`, so the
reduction must see each parameter's final accumulation of the step and no earlier one. It
is exact where every parameter of the rank receives its last gradient in that last action
(one model chunk per rank with the loss back-propagated at the backward pass:
`AutogradPasses`, the one-stage DHelix schedules); without `overlap_grad_reduce` the
context only sets DDP's is-last-micro-batch flag and `finalize_model_grads` reduces
everything after the list, so the rule is exact for every schedule (the folded model's two
chunks get their last gradients in different actions: `--dhelix` refuses
`overlap_grad_reduce` there).

Guarantees: every micro-batch's passes and their accumulation into `.grad`/`main_grad`
happen in the schedule's order; at the end nothing is left half-done (a leftover tensor
raises RuntimeError). Communication tensors all have the pipeline shape `tensor_shape`.
`actions_run` counts the actions the last `run()` executed (what ran, observed, not the
list's length).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dhelix.arriving import Arriving
from dhelix.schedules.actions import (BACKWARD, COMPUTE_KINDS, FORWARD, Action, Pass, Schedule,
                                      TensorRef)
from dhelix.schedules.sends_in_flight import SendsInFlight
from dhelix.schedules.transfer_groups import TransferGroups
from dhelix.schedules.validate import validate

_VALIDATED: "weakref.WeakValueDictionary[int, Schedule]" = weakref.WeakValueDictionary()


def validate_once(schedule: Schedule) -> None:
    """`validate(schedule)` unless this very object passed it before (identity, O(1))."""
    if _VALIDATED.get(id(schedule)) is not schedule:
        validate(schedule)
        _VALIDATED[id(schedule)] = schedule


def _recvs_feeding_si(actions) -> set:
    """The ids of the RECVs of `actions` whose first computation after them (F, B or SI) is
    an SI block: one pass from the end, carrying the next computation's kind."""
    feeding, next_compute = set(), None
    for action in reversed(actions):
        if action.kind in COMPUTE_KINDS:
            next_compute = action.kind
        elif action.kind == "RECV" and next_compute == "SI":
            feeding.add(id(action))
    return feeding


@dataclass
class ForwardWork:
    """One forward pass for the engine: `inp` is the previous hop's activation (None on the
    embedding hop; owned by the engine from now on)."""

    batch: Any
    chunk: int
    inp: torch.Tensor | None


@dataclass
class BackwardWork:
    """One backward pass for the engine: `state` is what the engine's forward of this
    (micro-batch, chunk) returned; on the loss hop `grad` is None and `loss` is what the
    engine's `keep_loss` returned, elsewhere `grad` is the gradient of the pass's output and
    `loss` is None."""

    state: Any
    loss: torch.Tensor | None
    grad: torch.Tensor | None


class AutogradPasses:
    """Passes through the chunk module with autograd; an SI block runs its forward, then its
    backward. `forward_chunk(batch, chunk, input) -> output` (input None on hop 0)."""

    def __init__(self, forward_chunk: Callable):
        self.forward_chunk = forward_chunk

    def forward(self, work: ForwardWork):
        """Returns (state, output); the state is (input leaf, output with its graph)."""
        inp = work.inp
        if inp is not None:
            inp = inp.detach().requires_grad_(True)
        out = self.forward_chunk(work.batch, work.chunk, inp)
        return (inp, out), out

    @staticmethod
    def keep_loss(state, loss):
        """The scaled loss is back-propagated when its backward pass comes (Megatron's
        order): keep it."""
        return loss

    def backward(self, work: BackwardWork):
        """Back-propagates the loss or the output; returns the gradient of the pass's input
        (None on the embedding hop)."""
        inp, out = work.state
        torch.autograd.backward(work.loss if work.loss is not None else out,
                                grad_tensors=work.grad)
        return None if inp is None else inp.grad

    def si(self, forward: ForwardWork, backward: BackwardWork, produced=None):
        """(forward's (state, output), backward's input gradient), run one after the other;
        the forward's output is reported to `produced(FORWARD, output)` before the backward
        runs (the executor may send it then)."""
        result = self.forward(forward)
        if produced is not None:
            produced(FORWARD, result[1])
        return result, self.backward(backward)


class StageExecutor:
    """Runs `schedule.ranks[stage]`.

    passes: the pass engine (`AutogradPasses` or the DHelix runtime's); on the route's last
        hop its forward output is what `loss_func` takes.
    loss_func(batch, output) -> (loss, info): Megatron's 2-tuple loss convention; the loss
        is scaled here (`* cp / m`). With `loss_is_scaled=True` the returned loss is already
        scaled (e.g. by Megatron's `forward_step_calc_loss`) and used as it is.
    next_batch() -> batch: this rank's next micro-batch (called once per micro-batch, in
        micro-batch order).
    peer_rank(stage) -> global rank of that pipeline stage.
    no_sync() -> context manager: Megatron DDP's `config.no_sync_func` (module docstring for
        the rule), None for none.
    transfer_groups: the process groups transfers travel on, by kind and direction of
        travel (`dhelix.schedules.transfer_groups.TransferGroups`, e.g.
        `dhelix.runtime.lanes.pipeline_transfer_groups`); None: the default group carries
        everything.
    early_direction: the direction (FORWARD or BACKWARD) of the SI block output the peer
        sends first (the output of the strand its plan ends first); a RECV then posts ahead
        only that direction's receives of a following RECV that feeds an SI block, and the
        others once this rank's own SI block has reported its output of that direction
        (the same plan: its first strand has ended and freed what it held), in time for
        the peer's other output, which leaves at the peer's block end; a buffer posted a
        whole block early held memory at the block's peak. None: every receive of the
        following RECV is posted ahead.
    """

    def __init__(self, schedule: Schedule, stage: int, *, passes,
                 loss_func: Callable, next_batch: Callable, tensor_shape: tuple,
                 dtype: torch.dtype, device: torch.device, peer_rank: Callable[[int], int],
                 grad_scale_func: Callable | None = None, context_parallel_size: int = 1,
                 loss_is_scaled: bool = False, no_sync: Callable | None = None,
                 transfer_groups: TransferGroups | None = None,
                 early_direction: str | None = None):
        if early_direction not in (None, FORWARD, BACKWARD):
            raise ValueError(f"early_direction is {FORWARD!r}, {BACKWARD!r} or None, got "
                             f"{early_direction!r}")
        self.schedule = schedule
        self.stage = stage
        self.path = schedule.path
        self.last_hop = schedule.path.num_hops - 1
        self.passes = passes
        self.loss_func = loss_func
        self.next_batch = next_batch
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device
        self.peer_rank = peer_rank
        self.grad_scale_func = grad_scale_func
        self.cp = context_parallel_size
        self.loss_is_scaled = loss_is_scaled
        self.no_sync = no_sync or contextlib.nullcontext
        self.transfer_groups = transfer_groups or TransferGroups()
        self.arriving = bool(getattr(passes, "accepts_arriving", False))
        self.actions = schedule.ranks[stage]
        backward_at = [i for i, a in enumerate(self.actions) if a.backward is not None]
        self._sync_from = backward_at[-1] if backward_at else len(self.actions)
        # This rank's last backward hop of a micro-batch; its batch is dropped after it.
        self._final_backward_hop = max(h for h in range(self.path.num_hops)
                                       if self.path.stage(BACKWARD, h) == stage)
        self._final_forward_hop = max(h for h in range(self.path.num_hops)
                                      if self.path.stage(FORWARD, h) == stage)
        self.actions_run = 0
        self._batches: dict = {}
        self._fetched = 0
        self._saved: dict = {}      # (mb, forward hop) -> (engine state, scaled loss or None)
        self._ready: dict = {}      # TensorRef -> tensor (received or produced, not yet used)
        self._sends = SendsInFlight()  # isends not seen complete, with their tensors
        self._sent_early: set = set()  # TensorRefs of the next SEND already sent
        self._receiving: dict = {}  # TensorRef -> Arriving posted ahead of its RECV
        self._deferred: list = []  # (RECV, TensorRef) of the next RECV not posted ahead yet
        recvs = [a for a in self.actions if a.kind == "RECV"]
        self._next_recv = {id(a): b for a, b in zip(recvs, recvs[1:])}  # RECV -> the next
        self.early_direction = early_direction
        self._recvs_before_si = _recvs_feeding_si(self.actions)
        self.losses: list = []      # loss_func infos, in micro-batch order of the loss hop

    def run(self) -> list:
        """Validate the schedule, run this rank's list, wait for sends. Returns the loss
        infos computed on this rank (empty unless it holds the route's last hop)."""
        validate_once(self.schedule)
        self.actions_run = 0
        try:
            with self.no_sync():
                self._run_actions(self.actions[:self._sync_from])
            self._run_actions(self.actions[self._sync_from:])
        except BaseException:
            self._sends.abandon()  # a send to a failed peer must not hang the error path
            raise
        self._sends.finish()
        leftovers = [f"{len(self._saved)} saved activations" if self._saved else "",
                     f"{len(self._ready)} unused tensors" if self._ready else "",
                     f"{len(self._receiving)} receives posted ahead" if self._receiving
                     else ""]
        leftovers = [x for x in leftovers if x]
        if leftovers:
            raise RuntimeError(f"stage {self.stage} finished with " + ", ".join(leftovers))
        return self.losses

    def _run_actions(self, actions) -> None:
        for index, action in enumerate(actions):
            upcoming = actions[index + 1] if index + 1 < len(actions) else None
            self._execute(action, upcoming if upcoming is not None
                          and upcoming.kind == "SEND" else None)
            if self._sends:
                # a sent tensor lives until its send completed, not until the step's end
                self._sends.release_finished()
            self.actions_run += 1

    def _channel(self, ref: TensorRef) -> str:
        """The FIFO channel `ref` takes to the peer of the SEND holding it."""
        return ref.direction if self.transfer_groups.kinds_apart else "one"

    def _send(self, action: Action, ref: TensorRef, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        self._check_shape(tensor, ref)
        group = self.transfer_groups.group(ref.direction, upward=action.peer > self.stage)
        work = dist.isend(tensor, dst=self.peer_rank(action.peer), group=group)
        self._sends.add(work, tensor)

    def _early_sender(self, action: Action, send: Action) -> Callable:
        """The `produced(direction, tensor)` callback of the SI block `action`, followed by
        `send`: sends each output of `send`'s payload once it and its predecessors on its
        channel were reported (module docstring). Holds a reported tensor until then (the
        engine returns it too; the SEND skips what went early)."""
        passes = {FORWARD: action.forward, BACKWARD: action.backward}
        held: dict = {}

        def produced(direction: str, tensor: torch.Tensor) -> None:
            if direction == self.early_direction:
                self._post_deferred()
            ref = TensorRef(passes[direction].microbatch, direction, passes[direction].hop)
            if ref not in send.tensors or ref in self._sent_early:
                return
            held[ref] = tensor
            blocked = set()
            for r in send.tensors:
                if r in self._sent_early:
                    continue
                if r in held and self._channel(r) not in blocked:
                    self._send(send, r, held.pop(r))
                    self._sent_early.add(r)
                else:
                    blocked.add(self._channel(r))

        return produced

    def _execute(self, action: Action, upcoming_send: Action | None = None) -> None:
        if action.kind == "SEND":
            for ref in action.tensors:
                tensor = self._ready.pop(ref)
                if ref in self._sent_early:
                    self._sent_early.discard(ref)
                    continue
                self._send(action, ref, tensor)
            if self._sent_early:
                raise RuntimeError(f"stage {self.stage}: sent early but not in the SEND that "
                                   f"followed: {sorted(r.label() for r in self._sent_early)}")
        elif action.kind == "RECV":
            self._deferred = []  # posted below if still pending
            posted = [(ref, self._receiving.pop(ref, None) or self._post_receive(action, ref))
                      for ref in action.tensors]
            following = self._next_recv.get(id(action))
            if following is not None:  # its receives, posted now, land during what follows
                for ref in following.tensors:
                    if self._posts_ahead(following, ref):
                        self._receiving[ref] = self._post_receive(following, ref)
                    else:
                        self._deferred.append((following, ref))
            for ref, arriving in posted:
                self._ready[ref] = arriving if self.arriving else arriving.landed()
        elif action.kind == "F":
            work = self._forward_work(action.forward)
            self._forward_done(action.forward, *self.passes.forward(work))
        elif action.kind == "B":
            work = self._backward_work(action.backward)
            self._backward_done(action.backward, self.passes.backward(work))
        else:  # SI
            forward = self._forward_work(action.forward)
            backward = self._backward_work(action.backward)
            if upcoming_send is None:
                (state, out), grad = self.passes.si(forward, backward)
            else:
                (state, out), grad = self.passes.si(
                    forward, backward, produced=self._early_sender(action, upcoming_send))
            self._forward_done(action.forward, state, out)
            self._backward_done(action.backward, grad)

    def _post_deferred(self) -> None:
        """Post the next RECV's receives held back by `early_direction`."""
        for recv, ref in self._deferred:
            self._receiving[ref] = self._post_receive(recv, ref)
        self._deferred = []

    def _posts_ahead(self, recv: Action, ref: TensorRef) -> bool:
        """Whether `ref` of the RECV `recv` is posted a RECV ahead (`early_direction`)."""
        return (self.early_direction is None or id(recv) not in self._recvs_before_si
                or ref.direction == self.early_direction)

    def _post_receive(self, action: Action, ref: TensorRef) -> Arriving:
        """An `irecv` of `ref` from `action`'s peer into a new buffer on the device."""
        buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        group = self.transfer_groups.group(ref.direction, upward=action.peer < self.stage)
        work = dist.irecv(buffer, src=self.peer_rank(action.peer), group=group)
        return Arriving(buffer, work)

    def _batch(self, microbatch: int):
        while self._fetched <= microbatch:
            self._batches[self._fetched] = self.next_batch()
            self._fetched += 1
        return self._batches[microbatch]

    def _forward_work(self, p: Pass) -> ForwardWork:
        batch = self._batch(p.microbatch)
        inp = None
        if p.hop > 0:
            inp = self._ready.pop(TensorRef(p.microbatch, FORWARD, p.hop - 1))
        return ForwardWork(batch, self.path.chunk(FORWARD, p.hop), inp)

    def _forward_done(self, p: Pass, state, out) -> None:
        if self.schedule.forward_only:
            self._forward_only_done(p, out)
            return
        loss = None
        if p.hop == self.last_hop:
            loss, info = self.loss_func(self._batches[p.microbatch], out)
            if not self.loss_is_scaled:
                loss = loss * self.cp / self.schedule.num_microbatches
            self.losses.append(info)
            if self.grad_scale_func is not None:
                loss = self.grad_scale_func(loss)
            loss = self.passes.keep_loss(state, loss)
        else:
            self._ready[TensorRef(p.microbatch, FORWARD, p.hop)] = out
        self._saved[(p.microbatch, p.hop)] = (state, loss)

    def _forward_only_done(self, p: Pass, out) -> None:
        """Evaluation: the loss info on the last hop, else the activation for the next hop;
        nothing is saved for a backward; the batch is dropped after its last hop here."""
        if p.hop == self.last_hop:
            self.losses.append(self.loss_func(self._batches[p.microbatch], out)[1])
        else:
            self._ready[TensorRef(p.microbatch, FORWARD, p.hop)] = out
        if p.hop == self._final_forward_hop:
            self._batches.pop(p.microbatch, None)

    def _backward_work(self, p: Pass) -> BackwardWork:
        state, loss = self._saved.pop((p.microbatch, self.path.mirror_hop(p.hop)))
        grad = None
        if p.hop > 0:
            grad = self._ready.pop(TensorRef(p.microbatch, BACKWARD, p.hop - 1))
        return BackwardWork(state, loss, grad)

    def _backward_done(self, p: Pass, grad_input) -> None:
        if p.hop < self.last_hop:
            self._ready[TensorRef(p.microbatch, BACKWARD, p.hop)] = grad_input
        if p.hop == self._final_backward_hop:
            self._batches.pop(p.microbatch, None)

    def _check_shape(self, tensor: torch.Tensor, ref: TensorRef) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"stage {self.stage}: {ref.label()} has shape {tuple(tensor.shape)} "
                f"{tensor.dtype}, the pipeline carries {self.tensor_shape} {self.dtype}")
