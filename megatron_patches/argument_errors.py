"""One line instead of argparse's usage text when Megatron-LM's parser rejects a command
line under the plugin (`megatron.training.arguments.parse_args` builds the parser;
`megatron_patches.training_hooks` hands it here after adding the `--dhelix*` arguments).

argparse's own `error` prints the full usage (about 720 lines for Megatron's parser) and
the message, on every rank. Here it reports `error: MESSAGE` once per job
(`dhelix.rank_errors.exit_with_error`: rank 0 prints it) and exits with argparse's code 2. For
an unrecognized option close to a known one (a typo like `--dhelx`), the message names it.
"""

from __future__ import annotations

import argparse
import difflib

HELP = "python -m dhelix.megatron_lm SCRIPT --help lists the arguments"
UNRECOGNIZED = "unrecognized arguments: "


def _suggestions(parser: argparse.ArgumentParser, message: str) -> str:
    if not message.startswith(UNRECOGNIZED):
        return ""
    known = [s for action in parser._actions for s in action.option_strings]
    close = []
    for word in message[len(UNRECOGNIZED):].split():
        if word.startswith("--"):
            match = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.8)
            close += [f"{word} -> {match[0]}"] if match else []
    return f" (did you mean: {', '.join(close)})" if close else ""


def one_line_parser_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser.error` (argparse's exit for every rejected command line: unknown option,
    missing value, bad type or choice) end this rank with one `error: ...` line, exit code
    2, instead of the usage text. Returns `parser`."""

    def error(message: str):
        from dhelix.rank_errors import exit_with_error

        exit_with_error(f"{message}{_suggestions(parser, message)}; {HELP}")

    parser.error = error
    return parser
