"""The one line a run ends with when Megatron-LM's `--check-for-nan-in-loss-and-grad` (on
by default) rejects a loss or gradient (`megatron_patches.nan_stop`): the iteration, what
was found, that the run stopped before saving it, and which checkpoint stays the last good
one."""

from __future__ import annotations

from pathlib import Path


def divergence_message(iteration: int, bad: list[str], last_checkpoint: Path | None) -> str:
    """One-line error: at `iteration`, `bad` (e.g. ["lm loss is nan"]) were found; the run
    stops without saving, so `last_checkpoint` (the newest checkpoint of this run, saved or
    loaded; None if there is none) stays the last good one."""
    kept = (f"the last good checkpoint, {last_checkpoint}, is untouched (resume from it with "
            "--load)" if last_checkpoint is not None else "nothing of it was saved")
    return (f"iteration {iteration}: {' and '.join(bad)}; training stopped before saving it; "
            f"{kept}; lower --lr or check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to train on regardless")
