"""Stop training when the loss or the grad norm stops being a finite number
(`--check-for-nan-in-loss-and-grad`, Megatron's name, on by default).

Both values are reduced over every rank before the check (`Trainer.train_step`), so every
rank stops at the same iteration and none waits in a collective for one that stopped.
The plugin path stops the same way, with the same wording, when Megatron-LM's own check
(its rerun state machine) rejects a result (`megatron_patches.nan_stop`).
"""

from __future__ import annotations

import math
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


def nonfinite_error(iteration: int, loss: float, grad_norm: float,
                    last_checkpoint: Path | None) -> str | None:
    """One-line error naming the iteration and the value that is NaN/inf, or None when both
    are finite. `last_checkpoint` is the newest checkpoint of this run (saved or loaded);
    the caller must stop without saving, so it stays the last good one."""
    bad = [f"{name} is {value}" for name, value in (("lm loss", loss), ("grad norm", grad_norm))
           if not math.isfinite(value)]
    if not bad:
        return None
    return divergence_message(iteration, bad, last_checkpoint)
