"""`--dhelix` inside `megatron.training`'s `train()` and `evaluate()`: the function
`megatron_patches.training_hooks` hands them is the engine `dhelix.runtime.setup` built
(`dhelix.schedules.runner.ScheduleEngine`, the same for every layout) bound to Megatron's
args (the folded model's data view and loss relay: `megatron_patches.folded_stage_io`).
"""

from __future__ import annotations


def megatron_forward_backward(setup, args):
    """The function `train()` and `evaluate()` get for this `--dhelix` run: `setup.engine`
    with `args`' data view and the loss dicts on the last pipeline stage."""
    return setup.engine.for_megatron(args).forward_backward
