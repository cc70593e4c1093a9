"""Bad input to scripts/pretrain_gpt.py: a one-line error naming the argument and the fix,
exit code 2, before any process group exists (so no hang and nothing written)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dhelix.arguments import ArgumentError, parse_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"

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
