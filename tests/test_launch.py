"""What a user sees when training fails on bad input, with real torchrun:

- `dhelix train` (dhelix.launch, the Megatron-LM plugin: `torchrun -m dhelix.megatron_lm
  scripts/pretrain_gpt.py`): the one-line `error: ...` is the last line on stderr and the
  exit code is 2, both for input refused before any process starts and for a clear error
  found by the ranks at run time (after torchrun's failure report); a good run exits 0.
- plain `torchrun scripts/dhelix_trainer.py` (the look-alike trainer, still shipped): rank 0
  prints the error line once, torchrun's report follows (its root cause repeats the line)
  and torchrun exits 1, as README says.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dhelix_trainer.py"
TINY = ["--preset", "tiny", "--train-iters", "1", "--global-batch-size", "4"]
# the plugin's tiny run: the preset plus what scripts/pretrain_gpt.py needs without a corpus
PLUGIN_TINY = TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                      "--transformer-impl", "local", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--eval-interval", "1000", "--eval-iters", "0",
                      "--num-workers", "0"]
HELP = "python -m dhelix.megatron_lm SCRIPT --help lists the arguments"


def _run(cmd, timeout=240):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _dhelix_train(*args, timeout=240):
    return _run([sys.executable, "-m", "dhelix", "train", *args], timeout=timeout)


def _lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def _errors(text):
    return [ln for ln in _lines(text) if ln.startswith("error: ")]


@pytest.mark.slow  # five `dhelix train` processes, each importing Megatron-LM
def test_bad_input_is_refused_before_torchrun_starts(tmp_path):
    cases = [
        (["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
         "error: world size 3 is not divisible by --tensor-model-parallel-size 2 x "
         "--pipeline-model-parallel-size 1; launch a multiple of 2 processes"),
        (["--nproc-per-node", "0"], "error: --nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "2", "--no-such-flag"],
         f"error: unrecognized arguments: --no-such-flag; {HELP}"),
        (["--nproc-per-node", "2", "--dhelix-plan", str(tmp_path / "none.json"), "--dhelix"],
         f"error: --dhelix-plan {tmp_path / 'none.json'}: no such file; check the path"),
        (["--nproc-per-node", "2", "--dhelix", "--fp16"],
         "error: --dhelix does not support --fp16 (its schedules do no fp16 loss scaling); "
         "use --bf16 or fp32"),
    ]
    for argv, line in cases:
        proc = _dhelix_train(*argv, *PLUGIN_TINY, timeout=120)
        # torchrun, had it started, would print its banner and the ranks' output on stdout
        assert (proc.returncode, _errors(proc.stderr), proc.stdout) == (2, [line], ""), \
            (argv, proc.stderr[-2000:])
        assert _lines(proc.stderr)[-1] == line


def test_preset_expands_to_megatron_arguments():
    from dhelix.launch import preset_arguments

    assert preset_arguments("tiny", ["--num-layers", "8", "--lr=1e-3"]) == [
        "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "1024", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10"]


@pytest.mark.slow
def test_good_run_exits_0_and_run_time_error_is_printed_last(tmp_path):
    ckpt = tmp_path / "ckpt"
    good = _dhelix_train("--nproc-per-node", "2", *PLUGIN_TINY, "--save", str(ckpt),
                         "--save-interval", "1", "--dhelix")
    assert good.returncode == 0, good.stderr[-3000:]
    assert "error:" not in good.stderr and "dhelix: SI schedule" in good.stdout
    assert " iteration        1/       1 |" in good.stdout
    # The arguments are valid, so torchrun starts both ranks; the checkpoint they load has
    # one byte changed: refused inside the ranks, after the process group exists.
    shard = ckpt / "iter_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = _dhelix_train("--nproc-per-node", "2", *PLUGIN_TINY, "--load", str(ckpt),
                        "--train-iters", "2", "--dhelix")
    lines = _lines(bad.stderr)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert any("ChildFailedError" in ln for ln in lines)  # torchrun ran and reported
    assert lines[-1] == (
        f"error: --load {ckpt}: iter_0000001/__0_0.distcp does not match its saved SHA-256 "
        "(its bytes changed since the save); nothing was loaded; no earlier iteration is "
        f"saved under {ckpt}; start without --load"), lines[-5:]
    assert sum(ln.startswith("error: ") for ln in lines) == 1


@pytest.mark.slow
def test_plain_torchrun_prints_the_error_then_its_report_and_exits_1():
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 str(SCRIPT), *TINY, "--micro-batch-size", "0"], timeout=120)
    line = "error: --micro-batch-size must be >= 1, got 0"
    lines = _lines(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines.count(line) == 1  # rank 0 only
    assert f"traceback : {line}" in [ln.strip() for ln in lines]  # torchrun's root cause
    assert lines.index(line) < next(i for i, ln in enumerate(lines)
                                    if "ChildFailedError" in ln)
