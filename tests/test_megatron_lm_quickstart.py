"""The README quick start under the real torchrun: the tiny preset (configs/tiny.json's sizes
as Megatron arguments) through `megatron.training.pretrain` on 4 gloo ranks with TP=2,
PP=2, and the same command line with --dhelix, which runs the W-shaped schedule over the
folded model and logs the same losses. Without pipelining (the one-stage SI list, its
evaluation on dhelix's engine), through the same `pretrain()`: tests/test_megatron_lm_parity.py
(`bf16_tp2` and the PP=1 fp32 cases)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# the README's command after `torchrun --nproc-per-node 4`
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


def _train(extra, log_dir):
    """Run the quick start with `extra` on 4 ranks under torchrun, in a shell's environment
    (Megatron's JIT warm-up compiled, as a user's run does; the other tests' processes run
    it eagerly, tests/conftest.py); torchrun's logs under `log_dir` (its default, a
    /tmp/torchelastic_* directory per run, is never removed)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    command = [TORCHRUN, "--nproc-per-node", "4", "--log-dir", str(log_dir), *QUICK_START,
               *extra]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = {int(i): float(v) for i, v in LOSS.findall(proc.stdout)}
    assert sorted(losses) == [1, 2, 3, 4, 5], proc.stdout[-3000:]
    validation = VALIDATION.findall(proc.stdout)
    assert len(validation) >= 1, proc.stdout[-3000:]
    losses["validation"] = float(validation[-1])
    return losses, proc.stdout


def test_quick_start_with_and_without_dhelix(tmp_path):
    stock, _ = _train([], tmp_path / "torchrun.stock")
    saved = tmp_path / "plan.json"
    dhelix, out = _train(["--dhelix", "--dhelix-save-plan", str(saved)],
                         tmp_path / "torchrun.dhelix")
    assert "dhelix: W-shaped schedule over the folded model" in out
    _check_saved_plans(saved, out)
    print(f"stock: {stock}\n--dhelix: {dhelix}")
    # training losses, then the validation loss (evaluate() runs the forward-only action
    # list on the schedule engine with --dhelix)
    for i in stock:  # the log prints 7 significant digits
        assert abs(stock[i] - dhelix[i]) <= 1e-5 * abs(stock[i])


def _check_saved_plans(saved: Path, out: str) -> None:
    """`--dhelix-save-plan` with PP=2 wrote each stage's start-up plan (`plan.stage<k>.json`)
    and said so on the plan line; each loads, carries its memory bound's block peaks, and
    `dhelix plan show` prints it."""
    from dhelix.cli import main
    from planner.plan import load_plan

    assert not saved.exists()
    # (a run whose SI blocks stream says so between the path and the stages)
    line = next(x for x in out.splitlines() if "dhelix: W-shaped" in x)
    stages = "(stage 0's; each stage's in plan.stage0.json .. plan.stage1.json)"
    assert (f"saved to {saved.with_name('plan.stage0.json')} {stages}" in line
            or f"saved to {saved.with_name('plan.stage0.json')} (the block plan: this run's "
               f"SI blocks run streamed) {stages}" in line), line
    for stage in (0, 1):
        plan = load_plan(saved.with_name(f"plan.stage{stage}.json"))
        assert len(plan.search["memory"]["block_peak_mib"]) == len(plan.blocks)
        assert main(["plan", "show", str(saved.with_name(f"plan.stage{stage}.json"))]) == 0
