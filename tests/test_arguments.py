"""Bad input to scripts/dhelix_trainer.py: a one-line error naming the argument and the fix,
exit code 2, before any process group exists (so no hang and nothing written)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dhelix.arguments import ArgumentError, parse_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dhelix_trainer.py"

BAD_INPUTS = [
    # (argv, world size, text the message must contain)
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
     "world size 6 is not divisible by --tensor-model-parallel-size 2"),
    (["--pipeline-model-parallel-size", "3"], 3,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "8"], 8,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (["--num-query-groups", "3"], 1, "--num-query-groups 3 must divide"),
    (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--global-batch-size", "7"], 1, "--global-batch-size 7 is not divisible"),
    (["--load", "/nonexistent/ckpt"], 1, "--load /nonexistent/ckpt: no such checkpoint directory"),
    (["--no-such-flag", "1"], 1, "unrecognized arguments: --no-such-flag 1"),
    (["--bf16"], 1, "--bf16 needs a GPU"),
    (["--preset", "nope"], 1, "--preset: no preset 'nope'"),
    (["--pipeline-model-parallel-size", "4", "--dhelix"], 4,
     "--num-layers 4 must be a multiple of 2 x 4 = 8"),
]


@pytest.mark.parametrize("argv,world,message", BAD_INPUTS)
def test_parse_args_rejects(argv, world, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ArgumentError) as info:
        parse_args(["--preset", "tiny"] + argv)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_missing_required_argument_names_it(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ArgumentError, match="--num-layers is required"):
        parse_args(["--hidden-size", "64"])


def test_preset_values_are_overridable(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(["--preset", "tiny", "--tensor-model-parallel-size", "2",
                       "--num-layers", "8"])
    assert args.num_layers == 8 and args.hidden_size == 128
    assert args.data_parallel_size == 2 and args.num_microbatches == 2
    assert args.padded_vocab_size % (128 * 2) == 0


def test_launcher_exits_2_with_one_line_before_any_process_group(tmp_path):
    """Run the real launcher as torchrun would start rank 0 of 6 ranks: it must fail on
    the sizes without trying to rendezvous (MASTER_PORT points nowhere) and write nothing."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="6", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--save", str(save)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: world size 6 is not divisible by --tensor-model-parallel-size 2 x "
                     "--pipeline-model-parallel-size 2; launch a multiple of 4 processes"]
    assert not save.exists()


def _item6_inputs(tmp: Path) -> list:
    """Issue 14 item 6: inputs that once ended in tracebacks, late failures or silent runs.
    (extra argv, text the one error line must contain)"""
    short = tmp / "short.txt"
    short.write_text("too short")
    binary = tmp / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return [
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (["--micro-batch-size", "-2"], "--micro-batch-size must be >= 1, got -2"),
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
        (["--num-layers", "0"], "--num-layers must be >= 1, got 0"),
        (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
        (["--lr", "-0.001"], "--lr must be >= 0, got -0.001"),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
        (["--data-path", str(short)], "9 bytes, needs at least 65"),
        (["--data-path", str(binary)], "binary data (NUL byte at offset 0)"),
        (["--log-json", "/proc/version"], "--log-json /proc/version: cannot be written"),
        (["--log-json", str(tmp)], "is a directory or special file"),
        (["--save", str(a_file)], "is a file, not a directory"),
    ]


def test_issue14_item6_inputs_fail_in_one_line_before_any_process_group(tmp_path):
    """Each input through the real script as rank 0 of 2 (MASTER_PORT points nowhere, so
    joining a process group would fail differently): exit 2, one `error:` line, nothing
    written."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="9")
    save = tmp_path / "ckpt"
    for argv, message in _item6_inputs(tmp_path):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--preset", "tiny", "--save", str(save)] + argv,
            env=env, capture_output=True, text=True, timeout=60,
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2, (argv, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            (argv, proc.stderr)
        assert not save.exists()


def test_command_line_wins_over_the_preset_even_with_the_default_value():
    # tiny's micro-batch size is 2; the parser's default is 1: asking for 1 must give 1
    assert parse_args(["--preset", "tiny", "--micro-batch-size", "1",
                       "--global-batch-size", "8"]).micro_batch_size == 1
    assert parse_args(["--preset", "tiny"]).micro_batch_size == 2


def test_block_barriers_are_the_default_and_can_be_dropped(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--preset", "tiny", "--tensor-model-parallel-size", "2", "--dhelix"]
    assert parse_args(base).dhelix_block_barriers is True
    assert parse_args(base + ["--dhelix-block-barriers"]).dhelix_block_barriers is True
    assert parse_args(base + ["--dhelix-no-block-barriers"]).dhelix_block_barriers is False
