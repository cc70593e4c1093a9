"""Megatron-style command-line arguments of dhelix's look-alike trainer (`parse_args`,
`trainer_run`), kept only while these still build their model through it:
`dhelix/training.py`, the benchmark (`scripts/bench_systems.py`, `scripts/bench_dhelix_pp1.py`,
`scripts/bench_gpu.py`, `dhelix/bench/`, `tests/test_dhelix_memory.py`), the profiler CLI
(`profiler/cli.py`), `dhelix ops` (`dhelix/ops/`) and the parity matrices
(`tests/foundation_ranks.py`, `tests/test_dhelix_pp1.py`, `tests/ops/`, `tests/profiler/`).
It goes with them; users train through the Megatron-LM plugin (`dhelix.megatron_lm`,
`dhelix train`), whose `--dhelix*` arguments are `dhelix.dhelix_arguments` and whose presets
are `dhelix.presets` (re-exported here, with `ArgumentError`, for those callers).

Argument names and meanings follow Megatron-LM's `megatron/training/arguments.py`.
`--preset NAME|PATH` loads defaults from `configs/`; arguments given on the command line
override the preset. `parse_args` checks every value (ranges and paths,
`dhelix.input_checks`) and every size relation (`validate_args`) before any process group
exists, and raises `ArgumentError` with a one-line message naming the argument and the fix.
"""

from __future__ import annotations

import argparse
import os

from dhelix.argument_error import ArgumentError
from dhelix.dhelix_arguments import add_dhelix_runtime_args, check_dhelix_files
from dhelix.input_checks import (
    check_ranges,
    check_readable_dir,
    check_text_data_file,
    check_writable_dir,
    check_writable_file,
)
from dhelix.options import DHelixRun, run_from_args
from dhelix.presets import load_preset

# A stalled rank fails the job within a minute on dhelix's small runs (Megatron: 10).
DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES = 0.75


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default: 4 x hidden (8/3 x with --swiglu)")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int, help="grouped-query attention groups")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--vocab-size", type=int, help="mock-data vocabulary size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with CUDA, gloo without")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 training (GPU only)")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--mock-data", action="store_true",
                   help="synthetic GPT data (the default when --data-path is not given)")
    g.add_argument("--data-path", type=str, default=None,
                   help="a UTF-8 text file, tokenised bytewise (vocab 256 + eod)")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="directory to save checkpoints to")
    g.add_argument("--load", type=str, default=None, help="directory to load a checkpoint from")
    g.add_argument("--save-interval", type=int, default=None,
                   help="iterations between saves (default: only at the end)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def _add_dhelix_args(p: argparse.ArgumentParser) -> None:
    g = add_dhelix_runtime_args(p)
    g.add_argument("--preset", type=str, default=None,
                   help="model preset: a name in configs/ (e.g. tiny) or a JSON file path")
    g.add_argument("--log-json", type=str, default=None,
                   help="also write one JSON record per logged iteration to this file (rank 0)")


def _add_fault_tolerance_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="stop with an error naming the iteration when the loss or the grad "
                        "norm is NaN/inf, before anything of that iteration is saved "
                        "(default: on; --no-check-for-nan-in-loss-and-grad trains on)")
    g.add_argument("--distributed-timeout-minutes", type=float,
                   default=DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES,
                   help="how long a rank waits on another in a collective before the job "
                        "fails naming the ranks that stopped answering (fractions allowed: "
                        f"0.1 = 6 s; default {DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES} = "
                        f"{DEFAULT_DISTRIBUTED_TIMEOUT_MINUTES * 60:.0f} s, Megatron's is "
                        "10; raise it for slow saves or long first steps)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="with --load: load this iteration instead of the latest")


def _validate_fault_tolerance_args(ns: argparse.Namespace) -> None:
    if ns.ckpt_step is not None and ns.load is None:
        raise ArgumentError("--ckpt-step needs --load (the directory holding that iteration)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dhelix.arguments",
        description="Megatron-style arguments of dhelix's look-alike trainer.",
        allow_abbrev=False,
    )
    _add_model_args(p)
    _add_parallel_args(p)
    _add_training_args(p)
    _add_checkpoint_args(p)
    _add_dhelix_args(p)
    _add_fault_tolerance_args(p)
    return p


def _preset_value(action: argparse.Action, key: str, value, preset: str):
    """`value` for `action` as the command line would give it (null: not set); ArgumentError
    if the preset holds another type (argparse never sees preset values)."""
    if value is None:
        return None
    if action.choices is not None and value not in action.choices:
        wanted = "one of " + ", ".join(map(str, action.choices))
    elif action.nargs == 0:  # a flag (store_true)
        wanted = None if isinstance(value, bool) else "true or false"
    elif action.type is int:
        wanted = None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    elif action.type is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        wanted = None if ok else "a number"
        value = float(value) if ok else value
    else:
        wanted = None if isinstance(value, str) else "a string"
    if wanted:
        raise ArgumentError(f"--preset {preset}: '{key}' must be {wanted}, found {value!r}")
    return value


def _given_on_command_line(argv) -> set:
    """The dests the command line sets (whatever their value): parsed again with every
    default suppressed, so only given arguments appear."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


def parse_args(argv=None, world_size: int | None = None) -> argparse.Namespace:
    """Parse, apply the preset and derived defaults, validate. Raises ArgumentError.

    Sizes are validated against `world_size`, by default $WORLD_SIZE (torchrun's) or 1."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ArgumentError(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.preset:
        preset = load_preset(ns.preset)
        actions = {a.dest: a for a in parser._actions}
        given = _given_on_command_line(argv)
        for key, value in preset.items():
            if key not in actions or key == "help":
                raise ArgumentError(f"--preset: unknown key '{key}' in preset {ns.preset}")
            if key not in given:  # the command line wins, also with the default's value
                setattr(ns, key, _preset_value(actions[key], key, value, ns.preset))
    check_ranges(ns)
    fill_derived_args(ns)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(ns, world_size=world_size)
    return ns


def fill_derived_args(ns: argparse.Namespace) -> None:
    """Megatron's derived defaults (ffn size, kv channels, padded vocab, query groups)."""
    required = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters"]
    for name in required:
        if getattr(ns, name) is None:
            raise ArgumentError(
                f"--{name.replace('_', '-')} is required (or give --preset tiny)"
            )
    if ns.max_position_embeddings is None:
        ns.max_position_embeddings = ns.seq_length
    if ns.ffn_hidden_size is None:
        ffn = 4 * ns.hidden_size
        if ns.swiglu:
            ffn = int((ffn * 2 / 3) / 64) * 64 or 64
        ns.ffn_hidden_size = ffn
    if ns.num_query_groups is None:
        ns.num_query_groups = ns.num_attention_heads
    if ns.kv_channels is None and ns.hidden_size % ns.num_attention_heads == 0:
        ns.kv_channels = ns.hidden_size // ns.num_attention_heads
    if ns.vocab_size is None:
        ns.vocab_size = 257 if ns.data_path else 1024
    multiple = ns.make_vocab_size_divisible_by * ns.tensor_model_parallel_size
    ns.padded_vocab_size = -(-ns.vocab_size // multiple) * multiple
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size
    if not ns.data_path:
        ns.mock_data = True


def validate_args(ns: argparse.Namespace, world_size: int) -> None:
    """Every size relation Megatron needs and every path argument, checked before any
    process group is created. Expects `check_ranges` and `fill_derived_args` done."""
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise ArgumentError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes"
        )
    dp = world_size // (tp * pp)
    if ns.num_layers % pp != 0:
        raise ArgumentError(
            f"--num-layers {ns.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp}; choose a layer count that is a multiple of {pp}"
        )
    if ns.num_attention_heads % tp != 0:
        raise ArgumentError(
            f"--num-attention-heads {ns.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if ns.num_query_groups % tp != 0 or ns.num_attention_heads % ns.num_query_groups != 0:
        raise ArgumentError(
            f"--num-query-groups {ns.num_query_groups} must divide --num-attention-heads "
            f"{ns.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}"
        )
    if ns.kv_channels is None:
        raise ArgumentError(
            f"--hidden-size {ns.hidden_size} is not divisible by --num-attention-heads "
            f"{ns.num_attention_heads}; give --kv-channels"
        )
    if ns.ffn_hidden_size % tp != 0:
        raise ArgumentError(
            f"--ffn-hidden-size {ns.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if ns.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if ns.sequence_parallel and ns.seq_length % tp != 0:
        raise ArgumentError(
            f"--seq-length {ns.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{tp}, which --sequence-parallel needs"
        )
    if ns.seq_length > ns.max_position_embeddings and ns.position_embedding_type != "rope":
        raise ArgumentError(
            f"--seq-length {ns.seq_length} exceeds --max-position-embeddings "
            f"{ns.max_position_embeddings}"
        )
    per_step = ns.micro_batch_size * dp
    if ns.global_batch_size % per_step != 0:
        raise ArgumentError(
            f"--global-batch-size {ns.global_batch_size} is not divisible by "
            f"--micro-batch-size {ns.micro_batch_size} x data-parallel size {dp}"
        )
    if ns.bf16 and not _cuda_available():
        raise ArgumentError("--bf16 needs a GPU on this build; drop --bf16 on CPU")
    if ns.distributed_backend == "nccl" and not _cuda_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    if ns.data_path is not None and ns.vocab_size < 257:
        raise ArgumentError(f"--vocab-size {ns.vocab_size} is too small for --data-path (byte "
                            "tokens 0-255 and end-of-document need 257); drop --vocab-size")
    ns.data_parallel_size = dp
    ns.num_microbatches = ns.global_batch_size // per_step
    trainer_run(ns)  # the --dhelix rules (dhelix.options.check_run)
    check_path_args(ns)
    _validate_fault_tolerance_args(ns)


def trainer_run(ns: argparse.Namespace) -> DHelixRun:
    """The typed run (`dhelix.options.DHelixRun`) of a namespace `parse_args` returned;
    raises `OptionError` (an `ArgumentError`) for an unsupported `--dhelix` run."""
    return run_from_args(ns, add_bias_linear=not ns.disable_bias_linear,
                         num_query_groups=ns.num_query_groups, vocab_size=ns.vocab_size)


def check_path_args(ns: argparse.Namespace) -> None:
    """Every path argument is usable as the run will use it: --load a readable directory,
    --data-path a UTF-8 text file of at least one sample, --dhelix-plan/--dhelix-profile
    readable plan/profile files given with --dhelix (`check_dhelix_files`), --save a directory and --log-json a file that can be written. Creates
    nothing."""
    if ns.load is not None:
        check_readable_dir("--load", ns.load, what="checkpoint directory")
    if ns.data_path is not None:
        check_text_data_file("--data-path", ns.data_path, min_bytes=ns.seq_length + 1,
                             needed_for=f"one sample of --seq-length {ns.seq_length} + 1")
    check_dhelix_files(ns)
    if ns.save is not None:
        check_writable_dir("--save", ns.save)
    if ns.log_json is not None:
        check_writable_file("--log-json", ns.log_json)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
