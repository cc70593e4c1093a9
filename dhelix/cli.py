"""The `dhelix` console command.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds an
argparse sub-parser whose `func(args) -> int` runs it. Add a subcommand by appending its
module to `SUBCOMMAND_MODULES`; imports happen only when the CLI starts, and heavy imports
(torch, megatron) belong inside the subcommand's `func`, so `dhelix --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = [
    "dhelix.env_report",
    "planner.cli",
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
