"""The pipeline executor's point-to-point transfers on 2 real gloo ranks (one launch): the W
schedule (p = 2, m = 5) on a toy folded model whose SI blocks prove, by waiting for the
peer, that

- an SI block's output bound for the next SEND leaves while the block still runs (early
  send): after reporting it, stage 0's block waits until stage 1's SI block has landed that
  many tensors of its kind, which never happens if the tensor waits for the SEND (only
  stage 0 waits: waits in both directions would wait for each other);
- a RECV hands the engine its tensors still in flight (`dhelix.arriving.Arriving`): the
  peer's SI block lands the early tensor before the other one was even sent;
- with transfer groups (a group per kind and direction), a gradient reported before the
  activation of the same payload is sent at once (a channel of its own); on the one
  default channel it waits for the activation before it in the payload;
- a RECV posts the next RECV's receives too: stage 1's SI blocks wait for those to land
  before the RECV holding them runs (and the peer, not waiting, sends them meanwhile);

and that every variant gives the plain autograd engine's losses and gradients exactly.
The same launch checks `dhelix.schedules.sends_in_flight.SendsInFlight` on gloo: a sent
tensor is dropped (its storage freed) once the peer received it, mid-step, not at the
step's end (gloo's point-to-point Works report `is_completed()` False until waited on).
"""

from __future__ import annotations

import pytest

from dhelix.harness import run_on_ranks

pytestmark = pytest.mark.slow

M = 5
SHAPE = (4, 1, 8)  # [sequence, batch, hidden] of the pipeline's tensors
WAIT_S = 60.0


def _toy_engine(executor_box, store, tag, first, weights, land_ahead=False):
    """An autograd engine over `weights[chunk]` (tanh of a matmul a chunk) that takes
    arriving inputs and runs its SI blocks `first` ("F" or "B") first, as the module
    docstring describes. `executor_box[0]`: the executor (to see what it sent early).
    With `land_ahead`, stage 0 does not wait for its peer and stage 1 ends each SI block by
    waiting for every receive its executor posted ahead of their RECV (`landed_ahead`: the
    tensors that landed so); `posted_at_gradient`: what the executor had posted ahead when
    an SI block reported its gradient."""
    import time

    from dhelix.arriving import Arriving, landed
    from dhelix.schedules.executor import AutogradPasses

    def chunk(batch, c, inp):
        import torch

        return torch.tanh((batch if inp is None else inp) @ weights[c])

    class Toy(AutogradPasses):
        accepts_arriving = True

        def __init__(self):
            super().__init__(chunk)
            self.early = []  # (kind, sent at once) per reported output bound for the peer
            self.landed_ahead = set()
            self.posted_at_gradient = set()

        def forward(self, work):
            work.inp = landed(work.inp)
            return super().forward(work)

        def backward(self, work):
            work.grad = landed(work.grad)
            return super().backward(work)

        def _land_counted(self, kind, value):
            if isinstance(value, Arriving):
                value.landed()
                store.add(f"{tag}/landed/{kind}/{executor_box[0].stage}", 1)

        def _report(self, kind, tensor, produced):
            executor = executor_box[0]
            if kind == "B":
                self.posted_at_gradient.update(ref.label() for ref in executor._receiving)
            before = len(executor._sent_early)
            produced(kind, tensor)
            if len(executor._sent_early) > before:
                self.early.append((kind, True))
                if executor.stage != 0 or land_ahead:
                    return
                sent = sum(1 for k, s in self.early if k == kind and s)
                peer = 1
                deadline = time.monotonic() + WAIT_S
                while int(store.add(f"{tag}/landed/{kind}/{peer}", 0)) < sent:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{tag}: the peer never landed {kind} #{sent}")
                    time.sleep(0.01)
            else:
                self.early.append((kind, False))

        def si(self, forward, backward, produced=None):
            results = {}
            for kind in (first, "B" if first == "F" else "F"):
                if kind == "F":
                    self._land_counted("F", forward.inp)
                    forward.inp = landed(forward.inp)
                    results["F"] = super().forward(forward)
                    output = results["F"][1]
                else:
                    self._land_counted("B", backward.grad)
                    backward.grad = landed(backward.grad)
                    results["B"] = output = super().backward(backward)
                if produced is not None and output is not None:
                    self._report(kind, output, produced)
            if land_ahead and executor_box[0].stage == 1:
                for ref, arriving in list(executor_box[0]._receiving.items()):
                    arriving.landed()
                    self.landed_ahead.add(ref.label())
            return results["F"], results["B"]

    return Toy()


def _run(ctx, store, tag, engine: str, transfer_groups, land_ahead=False,
         early_direction=None):
    import torch
    import torch.distributed as dist

    from dhelix.schedules.executor import AutogradPasses, StageExecutor
    from dhelix.schedules.w_schedule import build_w_schedule

    cpu = torch.device("cpu")
    stage = ctx.rank
    gen = torch.Generator(device=cpu).manual_seed(stage)
    weights = [(torch.randn(8, 8, generator=gen, device=cpu) / 3).requires_grad_()
               for _ in range(2)]
    seeds = [torch.Generator(device=cpu).manual_seed(100 + i) for i in range(M)]
    batches = iter([torch.randn(SHAPE, generator=seed, device=cpu) for seed in seeds])
    box = []
    if engine == "plain":
        passes = AutogradPasses(lambda batch, c, inp: torch.tanh(
            (batch if inp is None else inp) @ weights[c]))
    else:
        passes = _toy_engine(box, store, tag, engine, weights, land_ahead)
    executor = StageExecutor(
        build_w_schedule(2, M), stage, passes=passes,
        loss_func=lambda batch, out: (out.square().mean(),
                                      {"loss": out.square().mean().detach()}),
        next_batch=lambda: next(batches), tensor_shape=SHAPE, dtype=torch.float32,
        device=cpu, peer_rank=lambda s: s, transfer_groups=transfer_groups,
        early_direction=early_direction)
    box.append(executor)
    losses = [float(d["loss"]) for d in executor.run()]
    dist.barrier()
    return {"losses": losses, "grads": [w.grad.clone() for w in weights],
            "early": getattr(passes, "early", None),
            "landed_ahead": sorted(getattr(passes, "landed_ahead", ())),
            "posted_at_gradient": sorted(getattr(passes, "posted_at_gradient", ()))}


def _sends_released(ctx) -> dict:
    """Rank 0 sends 4 tensors held only by a `SendsInFlight`; once rank 1 has received them
    (a barrier after its waits), rank 0's `release_finished()` drops them within 30 s, on
    rank 0's own thread (a free on the watcher thread would be invisible to the CPU memory
    reading, `dhelix.memtrace`)."""
    import threading
    import time
    import weakref

    import torch
    import torch.distributed as dist

    from dhelix.schedules.sends_in_flight import SendsInFlight

    cpu = torch.device("cpu")
    out = {}
    if ctx.rank == 0:
        sends, alive, died_on = SendsInFlight(), [], []
        for i in range(4):
            tensor = torch.full((1 << 16,), float(i), device=cpu)
            alive.append(weakref.ref(tensor))
            weakref.finalize(tensor, lambda: died_on.append(threading.get_ident()))
            sends.add(dist.isend(tensor, dst=1), tensor)
        del tensor
        out["held_after_posting"] = len(sends)  # (the watcher may have dropped some)
        gloo_reports = [dist.isend(torch.ones(4, device=cpu), dst=1)]
        dist.barrier()  # rank 1 has received everything
        deadline = time.monotonic() + 30
        while len(sends) and time.monotonic() < deadline:
            sends.release_finished()
            time.sleep(0.01)
        out["held_after_receipt"] = (len(sends), sends.held_bytes())
        out["freed"] = [ref() is None for ref in alive]
        out["freed_on_this_thread"] = died_on == [threading.get_ident()] * 4
        # what the executor saw before: the plain Work, not waited on, still "in flight"
        out["gloo_is_completed"] = gloo_reports[0].is_completed()
        gloo_reports[0].wait()
        sends.finish()
    else:
        received = [torch.empty(1 << 16, device=cpu) for _ in range(5)]
        works = [dist.irecv(t, src=0) for t in received[:4]]
        works.append(dist.irecv(torch.empty(4, device=cpu), src=0))
        for work in works:
            work.wait()
        dist.barrier()
        out["received"] = [float(t[0]) for t in received[:4]]
    dist.barrier()
    return out


def _variants(ctx):
    import torch.distributed as dist

    from dhelix.schedules.transfer_groups import TransferGroups

    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    four = TransferGroups(*[dist.new_group([0, 1]) for _ in range(4)])
    return {
        "sends": _sends_released(ctx),
        "plain": _run(ctx, store, "plain", "plain", None),
        "forward_first": _run(ctx, store, "ff", "F", None),
        "backward_first_one_channel": _run(ctx, store, "b1", "B", None),
        "backward_first_two_channels": _run(ctx, store, "b2", "B", four),
        "landed_ahead": _run(ctx, store, "la", "B", four, land_ahead=True),
        "gradients_ahead": _run(ctx, store, "ga", "B", four, land_ahead=True,
                                early_direction="B"),
    }


def test_early_sends_arriving_receives_and_the_gradient_channel():
    import torch

    results = run_on_ranks(_variants, 2, timeout_s=240)
    sender = results[0]["sends"]
    assert sender["held_after_posting"] == 4
    assert sender["held_after_receipt"] == (0, 0) and sender["freed"] == [True] * 4
    assert sender["freed_on_this_thread"]
    assert sender["gloo_is_completed"] is False  # why a watcher thread waits for them
    assert results[1]["sends"]["received"] == [0.0, 1.0, 2.0, 3.0]
    for stage, runs in enumerate(results):
        plain = runs["plain"]
        for name in ("forward_first", "backward_first_one_channel",
                     "backward_first_two_channels", "landed_ahead", "gradients_ahead"):
            assert runs[name]["losses"] == plain["losses"], (stage, name)
            for got, want in zip(runs[name]["grads"], plain["grads"]):
                assert torch.equal(got, want), (stage, name)
        # stage 0 computes the losses (the folded model's last hop)
        assert len(results[0]["plain"]["losses"]) == M and results[1]["plain"]["losses"] == []
        # the first kind of every SI block's outputs bound for the peer left at once; each
        # SI block on p = 2 sends an activation and a gradient (m - p = 3 blocks a stage)
        assert runs["forward_first"]["early"] == [("F", True), ("B", True)] * (M - 2)
        assert runs["backward_first_two_channels"]["early"] == [("B", True), ("F", True)] \
            * (M - 2)
        # one channel: the gradient waits for the activation ahead of it in the payload,
        # and both leave when the activation is reported
        assert runs["backward_first_one_channel"]["early"] == [("B", False), ("F", True)] \
            * (M - 2)
    # receives posted a RECV ahead: stage 1's SI blocks landed, before the RECV holding
    # them, every tensor of the RECV after the one before the block
    assert results[1]["landed_ahead"]["landed_ahead"] == _posted_ahead_at_si_blocks(1)
    assert results[0]["landed_ahead"]["landed_ahead"] == []
    # with the gradient the peer's plan sends first (`early_direction`), a RECV that feeds
    # an SI block has only its gradients posted ahead until the block reported its own
    # gradient (the others' whole payload at once); by the block's end everything is
    early = results[1]["gradients_ahead"]
    assert early["posted_at_gradient"] == _posted_ahead_at_si_blocks(1, early_direction="B")
    assert set(early["posted_at_gradient"]) < set(_posted_ahead_at_si_blocks(1))
    assert early["landed_ahead"] == _posted_ahead_at_si_blocks(1)


def _posted_ahead_at_si_blocks(stage: int, early_direction=None) -> list:
    """Labels of the tensors of each RECV that follows the last RECV before an SI block of
    `stage`'s W list (p = 2, m = M): what its executor has posted ahead during the block;
    with `early_direction`, of a following RECV that feeds an SI block only the tensors of
    that direction."""
    from dhelix.schedules.actions import COMPUTE_KINDS
    from dhelix.schedules.w_schedule import build_w_schedule

    def feeds_si(index):
        return next(a for a in actions[index + 1:] if a.kind in COMPUTE_KINDS).kind == "SI"

    actions = build_w_schedule(2, M).ranks[stage]
    recvs = [i for i, a in enumerate(actions) if a.kind == "RECV"]
    labels = set()
    for i, action in enumerate(actions):
        before = [r for r in recvs if r < i]
        after = [r for r in recvs if r > (before[-1] if before else len(actions))]
        if action.kind == "SI" and before and after:
            labels.update(ref.label() for ref in actions[after[0]].tensors
                          if early_direction is None or not feeds_si(after[0])
                          or ref.direction == early_direction)
    return sorted(labels)
