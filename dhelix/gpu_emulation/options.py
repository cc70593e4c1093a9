"""The command-line options every emulated-GPU command shares (`dhelix profile`,
`scripts/bench_systems.py`). Pure argparse: no torch import, so `dhelix --help` stays quick."""

from __future__ import annotations

import os
from pathlib import Path

# EMULATION_ENV, set in a process that times on the emulated GPU (`mark_process`): the
# hardware fingerprint (`profiler.fingerprint.hardware_fingerprint`) names the emulation as
# the device, so a profile taken there is refused by a run not emulated the same way, and back
from profiler.fingerprint import EMULATION_ENV


def emulation_label(profile: str, time_scale: float) -> str:
    """How a fingerprint names an emulated GPU: the kernel profile's file name and S."""
    return f"{Path(profile).name} x S={time_scale:g}"


def mark_process(profile: str, time_scale: float) -> None:
    """Mark this process (and the processes it starts) as timing on the emulated GPU of
    `profile` at time scale S (EMULATION_ENV)."""
    os.environ[EMULATION_ENV] = emulation_label(profile, time_scale)


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
