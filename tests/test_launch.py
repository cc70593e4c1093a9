"""What a user sees when training fails on bad input (issue 14 item 8), with real torchrun:

- `dhelix train` (dhelix.launch): the one-line `error: ...` is the last line on stderr and
  the exit code is 2, both for input refused before any process starts and for a clear
  error found by the ranks at run time (after torchrun's failure report); a good run exits 0.
- plain `torchrun scripts/dhelix_trainer.py`: rank 0 prints the error line once, torchrun's
  report follows (its root cause repeats the line) and torchrun exits 1, as README says.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "dhelix_trainer.py"
TINY = ["--preset", "tiny", "--train-iters", "1", "--global-batch-size", "4"]


def _run(cmd, timeout=240):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _dhelix_train(*args, timeout=240):
    return _run([sys.executable, "-m", "dhelix", "train", *args], timeout=timeout)


def _lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def test_bad_input_is_refused_before_torchrun_starts():
    cases = [
        (["--nproc-per-node", "2", "--micro-batch-size", "0"],
         "error: --micro-batch-size must be >= 1, got 0"),
        (["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
         "error: world size 3 is not divisible by --tensor-model-parallel-size 2 x "
         "--pipeline-model-parallel-size 1; launch a multiple of 2 processes"),
        (["--nproc-per-node", "0"], "error: --nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "2", "--no-such-flag"],
         "error: unrecognized arguments: --no-such-flag (see dhelix_trainer.py --help)"),
    ]
    for argv, line in cases:
        proc = _dhelix_train(*argv, *TINY, timeout=60)
        # exactly the one line: torchrun, had it started, prints its OMP_NUM_THREADS banner
        assert (proc.returncode, _lines(proc.stderr), proc.stdout) == (2, [line], ""), argv


@pytest.mark.slow
def test_good_run_exits_0_and_run_time_error_is_printed_last(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    good = _dhelix_train("--nproc-per-node", "1", *TINY, "--save", str(ckpt),
                         "--log-json", str(log))
    assert good.returncode == 0, good.stderr[-3000:]
    assert "error:" not in good.stderr and len(log.read_text().splitlines()) == 1
    # The arguments are valid, so torchrun starts both ranks; loading the checkpoint into a
    # smaller model fails inside the ranks, after the process group exists.
    bad = _dhelix_train("--nproc-per-node", "2", *TINY, "--tensor-model-parallel-size", "2",
                        "--load", str(ckpt), "--hidden-size", "64")
    lines = _lines(bad.stderr)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert any("ChildFailedError" in ln for ln in lines)  # torchrun ran and reported
    assert lines[-1].startswith(f"error: {ckpt}/iter_0000001: checkpoint does not fit this "
                                "model: --hidden-size saved 128 vs now 64;"), lines[-5:]
    assert sum(ln.startswith("error: ") for ln in lines) == 1


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
