"""Name the rank that stopped answering when a plugin run's collective times out
(the roll call of `dhelix.stall`, around Megatron-LM's `pretrain()`; megatron-core 0.19.2
tested).

Wraps two names of `megatron.training.training`, also where `megatron.training` re-exports
them (pretrain scripts import `pretrain` from there):

- `initialize_megatron` (called by `pretrain()`): once it has created the default process
  group (timeout `--distributed-timeout-minutes`), this rank publishes its host and pid in
  that group's store (`dhelix.stall.StallGuard`; under torchrun the store lives in the
  agent, so it answers while a rank is stalled).
- `pretrain`: when it raises a communication failure (a gloo timeout after
  `--distributed-timeout-minutes`, a peer that closed its connection), the ranks that still
  run hold a roll call; the lowest of them prints one `error: ...` line naming the ranks
  that did not answer (a stopped rank on this host is killed, so torchrun ends now), and
  every answering rank exits with code 2. Any other exception, or a roll call every rank
  answers, is re-raised unchanged.

Applies with and without `--dhelix`.
"""

from __future__ import annotations

import functools


class _Guard:
    """This process's stall guard, built once `initialize_megatron` created the group."""

    current = None


def _publish_this_rank() -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.training import get_args

    from dhelix.parallel import job_of_megatron_group
    from dhelix.stall import StallGuard

    if not dist.is_initialized():
        _Guard.current = None
        return
    timeout = timedelta(minutes=get_args().distributed_timeout_minutes)
    _Guard.current = StallGuard.for_job(job_of_megatron_group(timeout))


def _wrap_initialize(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        result = original(*args, **kwargs)
        _publish_this_rank()
        return result

    return initialize_megatron


def _wrap_pretrain(original):
    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        _Guard.current = None
        try:
            return original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a stalled peer
            from dhelix.rank_errors import ERROR_EXIT_CODE, report_error

            guard = _Guard.current
            if guard is None or guard.explain(exc, report_error) is None:
                raise
            raise SystemExit(ERROR_EXIT_CODE) from None

    return pretrain


def install_stall_roll_call() -> None:
    """Wrap `initialize_megatron` and `pretrain` as described above (idempotent)."""
    import megatron.training
    from megatron.training import training

    if hasattr(training.pretrain, "__dhelix_original__"):
        return
    for name, wrap in (("initialize_megatron", _wrap_initialize),
                       ("pretrain", _wrap_pretrain)):
        original = getattr(training, name)
        wrapped = wrap(original)
        wrapped.__dhelix_original__ = original
        setattr(training, name, wrapped)
        if getattr(megatron.training, name, None) is original:
            setattr(megatron.training, name, wrapped)
