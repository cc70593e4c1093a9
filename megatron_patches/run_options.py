"""Where the Megatron-LM plugin turns Megatron's parsed arguments into the typed run
(`dhelix.options.DHelixRun`), once, on the values the run will really use; and where
`--use-checkpoint-args` gets the `--dhelix` checks after the checkpoint's arguments are in.

Two hooks (installed by `megatron_patches.training_hooks.install_training_hooks`):

1. `megatron.training.checkpointing.load_args_from_checkpoint` (called by
   `parse_and_validate_args` for `--use-checkpoint-args`, for `--pretrained-checkpoint` and
   for `--load`, before `validate_args`): records which arguments the checkpoint set, and
   from which directory, so that a refusal can name both.
2. `megatron.training.arguments.validate_args` (called by `parse_and_validate_args` right
   after those loads; no process group exists yet): with `--dhelix --use-checkpoint-args`
   the refusals of unsupported Megatron arguments (`dhelix.megatron_lm_checks`, run at
   parse time otherwise) run first, now on the checkpoint's values; after Megatron's
   validation (derived sizes filled, data-parallel size known) the run is built
   (`run_from_megatron_args`), which checks the `--dhelix` rules (`dhelix.options.check_run`).
   A refusal is one `error:` line (exit code 2), seconds into the run.

`current_run()` is the run the last `validate_args` built: what `setup_dhelix` gets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from dhelix.options import DHelixRun, OptionError, run_from_args


def run_from_megatron_args(args) -> DHelixRun:
    """The typed run of Megatron's validated args: `add_bias_linear` as Megatron stores it,
    the query groups resolved as Megatron's layers do (heads without GQA), `--vocab-size`
    as given (None: the tokenizer's). Raises `OptionError` for an unsupported `--dhelix`
    run."""
    groups = args.num_query_groups
    if not args.group_query_attention or groups is None:
        groups = args.num_attention_heads
    return run_from_args(args, add_bias_linear=args.add_bias_linear, num_query_groups=groups,
                         vocab_size=args.vocab_size)


@dataclass
class _Boundary:
    """What the hooks learned while Megatron parsed: the arguments each checkpoint set
    (`--load DIR` -> {dest: value}) and the typed run."""

    from_checkpoint: dict = field(default_factory=dict)
    run: DHelixRun | None = None


_BOUNDARY = _Boundary()


def current_run() -> DHelixRun:
    """The run built by the last `validate_args` of this process; `OptionError` when none
    was (a script that skipped `parse_and_validate_args`)."""
    if _BOUNDARY.run is None:
        raise OptionError("--dhelix: Megatron's validate_args did not run in this process; "
                          "parse the arguments with megatron.training.arguments."
                          "parse_and_validate_args before pretrain()")
    return _BOUNDARY.run


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def checkpoint_refusal(message: str, from_checkpoint: dict) -> str:
    """`message` (a refusal of `dhelix.megatron_lm_checks` or `dhelix.options`) for a run
    whose arguments partly came from checkpoints: names the checkpoint(s) and the values
    they set that the message names; unchanged when no checkpoint set them."""
    named = []
    for source, values in from_checkpoint.items():
        hits = {d: v for d, v in values.items() if _flag(d) in message}
        if hits:
            settings = ", ".join(f"{_flag(d)} {v}" for d, v in sorted(hits.items()))
            named.append(f"{source} (--use-checkpoint-args) sets {settings}")
    if not named:
        return message
    return (f"{'; '.join(named)}: {message} (the checkpoint's values replace the command "
            "line's; drop --use-checkpoint-args to use the command line's)")


def hook_load_args_from_checkpoint(checkpointing) -> None:
    original = checkpointing.load_args_from_checkpoint

    @functools.wraps(original)
    def load_args_from_checkpoint(args, load_arg="load", checkpointing_context=None):
        before = dict(vars(args))
        result = original(args, load_arg=load_arg, checkpointing_context=checkpointing_context)
        changed = {dest: value for dest, value in vars(args).items()
                   if dest != "iteration" and before.get(dest) != value}
        if changed:
            _BOUNDARY.from_checkpoint[f"{_flag(load_arg)} {getattr(args, load_arg)}"] = changed
        return result

    checkpointing.load_args_from_checkpoint = load_args_from_checkpoint


def hook_validate_args(arguments, fail) -> None:
    """`fail(message)` reports one `error:` line and exits (`training_hooks._fail`)."""
    original = arguments.validate_args

    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's signature)
        loaded, _BOUNDARY.from_checkpoint = _BOUNDARY.from_checkpoint, {}
        _BOUNDARY.run = None
        if args.dhelix and args.use_checkpoint_args:
            from dhelix.megatron_lm_checks import UnsupportedArgument, check_plugin_args

            try:
                check_plugin_args(args)
            except UnsupportedArgument as exc:
                fail(checkpoint_refusal(str(exc), loaded))
        result = original(args, defaults)
        try:
            _BOUNDARY.run = run_from_megatron_args(args)
        except OptionError as exc:
            fail(checkpoint_refusal(str(exc), loaded))
        return result

    arguments.validate_args = validate_args
