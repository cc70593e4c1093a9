"""The `dhelix` console command.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds an
argparse sub-parser whose `func(args) -> int` runs it. A sub-parser that sets
`pass_through=True` gets the arguments it does not define in `args.extra_args` (used to
accept Megatron's model/parallel arguments unchanged). Add a subcommand by appending its
module to `SUBCOMMAND_MODULES`; imports happen only when the CLI starts, and heavy imports
(torch, megatron) belong inside the subcommand's `func`, so `dhelix --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = [
    "dhelix.env_report",
    "dhelix.launch",
    "dhelix.ops.cli",
    "profiler.cli",
    "planner.cli",
    "dhelix.schedules.cli",
    "dhelix.cluster.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dhelix",
        description="DHelix for Megatron-core: profile operators, plan strand interleaving, "
        "and train with double-strand micro-batch co-execution.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # A subcommand that takes Megatron's own arguments (set_defaults(pass_through=True))
    # receives whatever it does not define itself in `args.extra_args`.
    if extra and not getattr(args, "pass_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
