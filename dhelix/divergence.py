"""Stop training when the loss or the grad norm stops being a finite number
(`--check-for-nan-in-loss-and-grad`, Megatron's name, on by default).

Both values are reduced over every rank before the check (`Trainer.train_step`), so every
rank stops at the same iteration and none waits in a collective for one that stopped.
"""

from __future__ import annotations

import math
from pathlib import Path


def nonfinite_error(iteration: int, loss: float, grad_norm: float,
                    last_checkpoint: Path | None) -> str | None:
    """One-line error naming the iteration and the value that is NaN/inf, or None when both
    are finite. `last_checkpoint` is the newest checkpoint of this run (saved or loaded);
    the caller must stop without saving, so it stays the last good one."""
    bad = [f"{name} is {value}" for name, value in (("lm loss", loss), ("grad norm", grad_norm))
           if not math.isfinite(value)]
    if not bad:
        return None
    kept = (f"the last good checkpoint, {last_checkpoint}, is untouched (resume from it with "
            "--load)" if last_checkpoint is not None else "nothing of it was saved")
    return (f"iteration {iteration}: {' and '.join(bad)}; training stopped before saving it; "
            f"{kept}; lower --lr or check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to train on regardless")
