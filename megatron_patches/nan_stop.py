"""One line, no checkpoint, when Megatron-LM's `--check-for-nan-in-loss-and-grad` finds a
NaN/inf under the plugin (megatron-core 0.19.2 tested).

Megatron's check is its rerun state machine (`megatron.core.rerun_state_machine`): the
loss function and the gradient check call `validate_result`; a rejected result makes the
step rerun in place, and `train_step` then asks `should_checkpoint_and_exit()`. For a
reproducible NaN that answers "save a checkpoint and exit 16" (a diagnostic flow for
faulty GPUs: resume on another GPU), which leaves no readable error, saves the state that
diverged, and without `--save` ends in a TypeError traceback.

Wrapped here: `RerunStateMachine.should_checkpoint_and_exit` (called once per step by
every rank of `train_step`). When Megatron would exit because a result was rejected (the
first rerun, in place, reproduced it or not), every rank instead learns what was rejected
where (one all_gather_object) and stops with one `error: ...` line naming the iteration,
the value, the check and the rank (`dhelix.divergence.divergence_message`), exit code 2,
and nothing is saved: the newest checkpoint stays the last good one. Every other answer is
Megatron's, unchanged. Applies with and without `--dhelix`.
"""

from __future__ import annotations

import functools


def _rejected(machine) -> tuple[str, str] | None:
    """(check message, value) of the result this rank's check rejected, or None."""
    call = getattr(machine, "failed_validation_call", None)
    if call is None:
        return None
    value = machine.initial_result
    value = value.item() if hasattr(value, "item") and value.numel() == 1 else value
    return call.caller.message, str(value)


def _stop_line(machine) -> str:
    import torch.distributed as dist
    from megatron.training import get_args

    from dhelix.divergence import divergence_message
    from megatron_patches.checkpoint_guard import last_checkpoint

    mine = _rejected(machine)
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    found = [(rank, what) for rank, what in enumerate(everyone) if what is not None]
    if found:
        rank, (message, value) = found[0]
        others = f" and {len(found) - 1} other rank(s)" if len(found) > 1 else ""
        bad = [f"Megatron's --check-for-nan-in-loss-and-grad found {value} ({message}, "
               f"rank {rank}{others})"]
    else:
        bad = ["Megatron's --check-for-nan-in-loss-and-grad rejected a result"]
    # the iteration as Megatron's log numbers it (its rerun state machine counts one ahead)
    return divergence_message(get_args().curr_iteration + 1, bad, last_checkpoint())


def install_nan_stop() -> None:
    """Wrap `RerunStateMachine.should_checkpoint_and_exit` as described above (idempotent)."""
    from megatron.core.rerun_state_machine import RerunState, RerunStateMachine

    original = RerunStateMachine.should_checkpoint_and_exit
    if hasattr(original, "__dhelix_original__"):
        return
    # the states in which the step's first rerun (in place) has judged a rejected result
    stopping = (RerunState.WILL_RERUN_FROM_CHECKPOINT, RerunState.RERUNNING_IN_PLACE)

    @functools.wraps(original)
    def should_checkpoint_and_exit(self):
        from dhelix.rank_errors import exit_with_error

        decision = original(self)
        if decision[1] and self.state in stopping:
            exit_with_error(_stop_line(self))
        return decision

    should_checkpoint_and_exit.__dhelix_original__ = original
    RerunStateMachine.should_checkpoint_and_exit = should_checkpoint_and_exit
