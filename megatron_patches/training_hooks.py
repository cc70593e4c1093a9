"""The hooks that switch DHelix into `megatron.training.pretrain` without forking Megatron
(installed by `dhelix.megatron_lm`, megatron-core 0.19 tested).

1. Arguments (`megatron.training.arguments.parse_args`, which `parse_and_validate_args` and
   every pretrain script call): the script's own `extra_args_provider` still runs; the
   `--dhelix*` arguments (`dhelix.arguments.add_dhelix_runtime_args`) are added after it.
   Right after parsing, before Megatron validates anything and before any process group
   exists, `--dhelix` runs are checked (`dhelix.megatron_lm_checks`): an argument the DHelix
   runtime cannot honour stops the run with one `error: ...` line naming it (exit code 2).
   On a CPU-only machine the arguments get the CPU adaptations of
   `megatron_patches.training_shims.cpu_arguments` (gloo, no CUDA kernel fusions).
2. The folded model (`--dhelix` with PP > 1, see `megatron_patches.folded_model`):
   Megatron's parallel state gets the folded embedding group (first stage only), and
   `GPTModelBuilder.build_model` (the model-config path of `pretrain`, Megatron-LM 0.19's
   pretrain_gpt.py) builds this stage's `FoldedGPTModel` from the same config, layer spec and
   seed instead of a stock GPTModel stage.
3. The forward/backward function (`megatron.training.training.get_forward_backward_func`,
   imported by name and called by `train()` and `evaluate()`): with `--dhelix` it returns
   the DHelix schedule built for the model `setup_model_and_optimizer` returned
   (`dhelix.runtime.setup.setup_dhelix`); Megatron's no_sync / grad-sync / param-sync /
   finalize hooks reach it through the model config, as they reach Megatron's schedules.

Without `--dhelix` every hook hands the call to Megatron unchanged. One fix applies to every
run: the wheel's prebuilt dataset helpers are used instead of compiling them
(`megatron_patches.compat.use_prebuilt_dataset_helpers`).
"""

from __future__ import annotations

import functools
import sys

from dhelix.arguments import add_dhelix_runtime_args
from megatron_patches.training_shims import cpu_arguments

_INSTALLED = False


def _with_dhelix_args(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        add_dhelix_runtime_args(parser)
        return parser

    return provider


def _hook_parse_args(arguments) -> None:
    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(_with_dhelix_args(extra_args_provider), ignore_unknown_args)
        cpu_arguments(args)
        if args.dhelix:
            from dhelix.launch import ERROR_EXIT_CODE, report_error
            from dhelix.megatron_lm_checks import UnsupportedArgument, check_dhelix_args

            try:
                check_dhelix_args(args)
            except UnsupportedArgument as exc:
                report_error(str(exc))
                sys.exit(ERROR_EXIT_CODE)
        return args

    arguments.parse_args = parse_args


def install_training_hooks() -> None:
    """Install the hooks above into megatron.training (idempotent). Must run before the
    pretrain script imports `megatron.training` names it calls (run the script after)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.training import arguments

    from megatron_patches.compat import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    _hook_parse_args(arguments)
    _INSTALLED = True
