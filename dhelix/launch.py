"""`dhelix train`: check the arguments, then run Megatron-LM's training loop with the
dhelix plugin under torchrun (`torchrun -m dhelix.megatron_lm scripts/pretrain_gpt.py
ARGS`), so that a bad input ends in one `error: ...` line printed last, exit code 2.

    dhelix train --nproc-per-node 4 --preset tiny --mock-data --tokenizer-type NullTokenizer \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --dhelix

`--preset NAME` (a file configs/NAME.json, or a JSON file path) expands to Megatron
arguments (`"num-layers": 4` -> `--num-layers 4`; true -> the flag alone; false/null ->
nothing); an argument given on the command line wins over the preset's.

Why a launcher: under plain torchrun, any rank that exits non-zero makes torchrun print its
own ~40-line failure report (a ChildFailedError traceback) after the rank's error and exit
with code 1, whether one rank or all ranks fail. `dhelix train` instead

1. parses the arguments with Megatron-LM's parser and the plugin's hooks
   (`megatron_patches.training_hooks`: argparse errors, `--dhelix` refusals, plan/profile
   files) and checks the world size `--nproc-per-node x --nnodes` against TP x PP before
   starting anything: a bad one prints `error: ...` and exits 2, and no process is
   started;
2. otherwise runs `python -m torch.distributed.run ... -m dhelix.megatron_lm
   scripts/pretrain_gpt.py ARGS` and hands every rank the path of an error file
   (`$DHELIX_ERROR_FILE`): a rank that stops on a clear error found only at run time (a
   damaged checkpoint, a NaN, a stalled rank, a plan for another run) writes its message
   there instead of printing it (`report_error`). When torchrun fails and the file holds a
   message, the launcher prints `error: MESSAGE` after torchrun's report, as the last
   line, and exits 2; otherwise it exits with torchrun's code (0 on success, 1 when a rank
   crashed).

Ctrl-C reaches torchrun directly (same process group); while torchrun runs the launcher
ignores SIGINT and passes SIGTERM and SIGHUP on to torchrun, then waits for it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dhelix.rank_errors import ERROR_EXIT_CODE, ERROR_FILE_ENV

PRETRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pretrain_gpt.py"
_FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="check the arguments, then train under torchrun (Megatron-LM's "
        "pretrain() with the dhelix plugin, scripts/pretrain_gpt.py)",
        description=__doc__ + "\nAll other arguments are Megatron-LM's and the plugin's "
        "(`python -m dhelix.megatron_lm scripts/pretrain_gpt.py --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    parser.add_argument("--master-addr", default=None, help="node 0's address (multi-node)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="node 0's port (default: a free port on one node)")
    parser.add_argument("--preset", default=None,
                        help="model preset expanded to Megatron arguments: a name in configs/ "
                             "(e.g. tiny) or a JSON file path")
    parser.set_defaults(func=run, pass_through=True)


def preset_arguments(preset: str, megatron_args: list[str]) -> list[str]:
    """`preset`'s values as Megatron arguments, leaving out those `megatron_args` gives.
    Raises ArgumentError for an unknown or unreadable preset (`dhelix.presets`)."""
    from dhelix.presets import load_preset

    given = {word.split("=", 1)[0] for word in megatron_args if word.startswith("--")}
    expanded = []
    for dest, value in load_preset(preset).items():
        option = "--" + dest.replace("_", "-")
        if option in given or value is None or value is False:
            continue
        expanded += [option] if value is True else [option, str(value)]
    return expanded


def _plugin_problem(megatron_args: list[str], world_size: int) -> str | None:
    """Parse `megatron_args` as the ranks will (Megatron-LM's parser with the plugin's
    hooks, in this process, no process group): a rejected command line has printed its
    `error: ...` line already (returns ""); a world size TP x PP does not divide is
    returned as a message; None when the ranks can start."""
    from megatron.training import arguments

    from dhelix.megatron_lm import install_plugin

    install_plugin()
    saved = sys.argv
    sys.argv = [str(PRETRAIN_SCRIPT), *megatron_args]
    try:
        # the ranks print the machine-adaptation line again; stdout stays torchrun's
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
    except SystemExit as exc:
        return "" if exc.code else None
    finally:
        sys.argv = saved
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if world_size % model_parallel:
        return (f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{args.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size}; launch a multiple of {model_parallel} "
                "processes")
    return None


def _launcher_problem(args) -> str | None:
    """The first bad launcher option, as a one-line message, or None."""
    if args.nproc_per_node < 1:
        return f"--nproc-per-node must be >= 1, got {args.nproc_per_node}"
    if args.nnodes < 1:
        return f"--nnodes must be >= 1, got {args.nnodes}"
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank must be in [0, {args.nnodes - 1}] for --nnodes {args.nnodes}, " \
               f"got {args.node_rank}"
    if args.nnodes > 1 and not args.master_addr:
        return "--nnodes > 1 needs --master-addr (node 0's address)"
    if not PRETRAIN_SCRIPT.is_file():
        return (f"{PRETRAIN_SCRIPT} not found; dhelix train runs from a source checkout "
                "(pip install -e .)")
    return None


def torchrun_command(args, megatron_args: list[str], log_dir: str | None = None) -> list[str]:
    """The torchrun command line `dhelix train` runs (this Python's torch.distributed.run,
    the plugin's launcher `dhelix.megatron_lm` with scripts/pretrain_gpt.py); `log_dir`:
    torchrun's `--log-dir` (by default torchrun makes a /tmp/torchelastic_* directory
    per run and leaves it behind)."""
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes),
           "--node-rank", str(args.node_rank)]
    if log_dir:
        cmd += ["--log-dir", log_dir]
    if args.master_addr:
        cmd += ["--master-addr", args.master_addr]
    if args.master_port is not None:
        cmd += ["--master-port", str(args.master_port)]
    return cmd + ["-m", "dhelix.megatron_lm", str(PRETRAIN_SCRIPT), *megatron_args]


def _wait(proc: subprocess.Popen) -> int:
    """Wait for torchrun with SIGINT ignored and SIGTERM/SIGHUP passed on; its exit code
    (128 + N when signal N killed it)."""
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    for signum in _FORWARDED:
        previous[signum] = signal.signal(signum, lambda n, _f: proc.send_signal(n))
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


def _first_error(path: Path) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((ln for ln in lines if ln.strip()), None)


def run(args) -> int:
    from dhelix.argument_error import ArgumentError

    megatron_args = list(args.extra_args)
    problem = _launcher_problem(args)
    if problem is None and args.preset:
        try:
            megatron_args = preset_arguments(args.preset, megatron_args) + megatron_args
        except ArgumentError as exc:
            problem = str(exc)
    if problem is None:
        problem = _plugin_problem(megatron_args, args.nproc_per_node * args.nnodes)
        if problem == "":  # printed already
            return ERROR_EXIT_CODE
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ERROR_EXIT_CODE
    sys.stdout.flush()
    with tempfile.TemporaryDirectory(prefix="dhelix-train-") as tmp:
        error_file = Path(tmp) / "errors"
        env = dict(os.environ, **{ERROR_FILE_ENV: str(error_file)})
        command = torchrun_command(args, megatron_args, log_dir=str(Path(tmp) / "torchrun"))
        code = _wait(subprocess.Popen(command, env=env))
        message = _first_error(error_file)
    if code != 0 and message:
        print(f"error: {message}", file=sys.stderr, flush=True)
        return ERROR_EXIT_CODE
    return code
