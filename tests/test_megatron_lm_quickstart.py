"""The README quick start under the real torchrun: the tiny preset (configs/tiny.json's sizes
as Megatron arguments) through `megatron.training.pretrain` on 4 gloo ranks with TP=2,
PP=2, and the same command line with --dhelix, which runs the W-shaped schedule over the
folded model and logs the same losses."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# the README's command after `torchrun --nproc-per-node 4` (`_train` gives the rank count)
QUICK_START = [
    "-m", "dhelix.megatron_lm", "scripts/pretrain_gpt.py",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1024",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-4", "--mock-data",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "5",
    "--eval-iters", "1", "--log-interval", "1", "--num-workers", "0", "--train-iters", "5",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*5 \|.*?lm loss: (\S+)")
VALIDATION = re.compile(r"validation loss at iteration 5\b.*?\| lm loss value: (\S+) \|")


def _train(extra, compile_warmup: bool = True, ranks: int = 4):
    """Run the quick start with `extra` on `ranks` ranks under torchrun, in a shell's
    environment. Without `compile_warmup`, Megatron's JIT warm-up runs eagerly
    (`TORCH_COMPILE_DISABLE=1`, as the other tests' processes run, tests/conftest.py): on
    CPU nothing the warm-up compiles is called by the model, and compiling it costs each
    rank ~5 s."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    if not compile_warmup:
        env["TORCH_COMPILE_DISABLE"] = "1"
    command = [TORCHRUN, "--nproc-per-node", str(ranks), *QUICK_START, *extra]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {int(i): float(v) for i, v in LOSS.findall(proc.stdout)}
    assert sorted(losses) == [1, 2, 3, 4, 5], proc.stdout[-3000:]
    validation = VALIDATION.findall(proc.stdout)
    assert len(validation) >= 1, proc.stdout[-3000:]
    losses["validation"] = float(validation[-1])
    return losses, proc.stdout


def test_quick_start_with_and_without_dhelix():
    stock, _ = _train([])
    dhelix, out = _train(["--dhelix"])
    assert "dhelix: W-shaped schedule over the folded model" in out
    print(f"stock: {stock}\n--dhelix: {dhelix}")
    # training losses, then the validation loss (evaluate() runs the forward-only action
    # list on the schedule engine with --dhelix)
    for i in stock:  # the log prints 7 significant digits
        assert abs(stock[i] - dhelix[i]) <= 1e-5 * abs(stock[i])


def test_quick_start_without_pipelining_with_and_without_dhelix():
    """The same command line with PP=1 on 2 ranks (TP=2; data parallelism through the plugin
    is in tests/test_megatron_lm_parity.py): --dhelix trains with the one-stage SI list and
    evaluate() runs the forward-only list on the same engine (not Megatron's schedule);
    training and validation losses are Megatron's. The JIT warm-up runs eagerly here (the
    PP=2 test above keeps the compiled one, whose random draws the folded model replays)."""
    pp1 = ["--pipeline-model-parallel-size", "1"]  # the last value wins
    stock, _ = _train(pp1, compile_warmup=False, ranks=2)
    dhelix, out = _train(pp1 + ["--dhelix"], compile_warmup=False, ranks=2)
    assert "dhelix: SI schedule" in out
    print(f"stock: {stock}\n--dhelix: {dhelix}")
    for i in stock:
        assert abs(stock[i] - dhelix[i]) <= 1e-5 * abs(stock[i])
