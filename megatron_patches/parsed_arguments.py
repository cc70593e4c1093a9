"""Megatron-LM's parsed and validated arguments for a command line, in this process, without
a process group: what `dhelix ops` describes and what `dhelix profile` checks before it
launches anything.

`parse_megatron_args(argv, world_size)` runs `megatron.training.arguments.parse_args` with
the plugin's hooks (`dhelix.megatron_lm.install_plugin`: the `--dhelix*` arguments, the
machine adaptations, the plugin's parse-time refusals) and then Megatron's `validate_args`
(hooked too: the typed run is built) as scripts/pretrain_gpt.py does, for a world of
`world_size` ranks. The `TransformerConfig` `pretrain()` builds from them is Megatron's
`core_transformer_config_from_args(args)` (as `gpt_config_from_args` calls it).

Megatron builds its parser anew on every `parse_args` call and, for the help strings of the
arguments generated from its config dataclasses, re-reads and re-parses those classes' source
(`ArgumentGroupFactory._get_field_docstrings`: 0.19 s of a 0.22 s parse on the 2-core
development machine). A class's source does not change within a process, so
`parse_megatron_args` keeps each class's docstrings after the first read
(`_cache_field_docstrings`); what the parser accepts and returns is unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import sys

PRETRAIN_DEFAULTS = {"tokenizer_type": "NullTokenizer"}  # scripts/pretrain_gpt.py's defaults


class MegatronArgumentError(ValueError):
    """Megatron's `validate_args` refused the command line (its message, one line)."""


def _cache_field_docstrings() -> None:
    """`megatron.training.argument_utils.ArgumentGroupFactory._get_field_docstrings`
    remembers its result per dataclass (idempotent; each caller gets its own copy)."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    original = ArgumentGroupFactory._get_field_docstrings
    if getattr(original, "__dhelix_cached__", False):
        return
    found: dict = {}

    @functools.wraps(original)
    def field_docstrings(self, src_cfg_class: type) -> dict:
        if src_cfg_class not in found:
            found[src_cfg_class] = original(self, src_cfg_class)
        return dict(found[src_cfg_class])

    field_docstrings.__dhelix_cached__ = True
    ArgumentGroupFactory._get_field_docstrings = field_docstrings


def parse_megatron_args(argv: list[str], world_size: int | None = None) -> argparse.Namespace:
    """Megatron's validated arguments for ARGV in a world of `world_size` ranks (rank 0;
    None: the smallest world the layout fits, TP x PP x CP).

    A command line argparse or the plugin refuses has printed its one `error: ...` line and
    raises SystemExit (code 2); one Megatron's `validate_args` refuses raises
    MegatronArgumentError. Megatron's stdout (the argument dump, the machine-adaptation line)
    is discarded. No process group is created or needed."""
    from megatron.training import arguments

    from dhelix.megatron_lm import install_plugin

    install_plugin()
    _cache_field_docstrings()
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
            args.world_size = world_size or (args.tensor_model_parallel_size
                                             * args.pipeline_model_parallel_size
                                             * args.context_parallel_size)
            args.rank = 0
            try:
                arguments.validate_args(args, dict(PRETRAIN_DEFAULTS))
            except (AssertionError, ValueError, TypeError) as exc:
                raise MegatronArgumentError(" ".join(str(exc).split()) or type(exc).__name__) \
                    from None
    finally:
        sys.argv = saved
    return args
