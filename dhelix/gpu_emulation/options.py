"""The command-line options every emulated-GPU command shares (`dhelix profile`,
`scripts/bench_systems.py`). Pure argparse: no torch import, so `dhelix --help` stays quick."""

from __future__ import annotations


def add_options(parser, applies_to: str) -> None:
    """`--gpu-emulation PROFILE` and `--time-scale S` on `parser` (an argparse parser), the
    help saying what runs on the emulated GPU (`applies_to`); both default to None."""
    parser.add_argument("--gpu-emulation", default=None, metavar="PROFILE",
                        help=f"{applies_to} on the emulated GPU (docs/gpu_emulation.md): "
                             "compute kernels take PROFILE's times (a `dhelix profile "
                             "--comp-only` file) x S, holding no core; collectives real")
    parser.add_argument("--time-scale", type=float, default=None, metavar="S",
                        help="with --gpu-emulation: kernel times x S (the link must run at "
                             "the GPU cluster's rate / S)")
