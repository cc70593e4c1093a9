"""Rank bodies for the tests of the Megatron-LM plugin (`dhelix.megatron_lm`): each runs
`scripts/pretrain_gpt.py` through `megatron.training.pretrain` in this rank's process, one
run after another in the same job (Megatron's global state is torn down between runs), and
records what the real training loop did."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "pretrain_gpt.py")
# The tiny preset (configs/tiny.json) as Megatron arguments, dropout off (--dhelix needs it).
TINY = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1024",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0", "--attention-dropout",
        "0", "--transformer-impl", "local", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "0", "--num-workers", "0"]


class _Recorder:
    """Per training step of the current run: the full parameters before the step, the full
    gradients after the schedule (both layout-independent, `dhelix.parity`), and the global
    batch's mean token loss (only rank 0 keeps them); and the layer pairs this rank
    co-executed (`LayerRunner.run_paired`: the DHelix SI path really ran)."""

    steps: list = []
    pairs: int = 0
    attention: set = set()  # class names of the model's core-attention modules


def _counting_pairs(run_paired):
    def counted(self, fwd_layers, *args, **kwargs):
        _Recorder.pairs += len(fwd_layers)
        return run_paired(self, fwd_layers, *args, **kwargs)

    counted._dhelix_test_counter = True
    return counted


def _global_loss(losses: list) -> float:
    """Token-weighted mean of the 'lm loss' reports of every rank (TP copies cancel out)."""
    total = [0.0, 0.0]
    for report in losses:
        value = report["lm loss"].double().view(-1)
        total[0] += float(value[0])
        total[1] += float(value[1])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return sum(t[0] for t in everyone) / sum(t[1] for t in everyone)


def _recording(get_forward_backward_func):
    from dhelix.parity import gather_full_tensors

    def get(*args, **kwargs):
        forward_backward = get_forward_backward_func(*args, **kwargs)

        def recorded(**step):
            if step.get("forward_only"):
                return forward_backward(**step)
            _Recorder.attention |= {type(m.core_attention).__name__ for chunk in step["model"]
                                    for m in chunk.modules() if hasattr(m, "core_attention")}
            params = gather_full_tensors(step["model"], "param")
            losses = forward_backward(**step)
            grads = gather_full_tensors(step["model"], "grad")
            loss = _global_loss(losses)
            if dist.get_rank() == 0:
                _Recorder.steps.append({"params": params, "grads": grads, "loss": loss})
            return losses

        return recorded

    return get


def install_recorder() -> None:
    """Wrap the forward/backward function `train()` gets (after the plugin's hook), once."""
    from megatron.training import training

    from megatron_patches.training_hooks import install_training_hooks
    from megatron_patches.training_shims import apply_training_cpu_shims

    apply_training_cpu_shims()
    install_training_hooks()
    from dhelix.runtime.layer_runner import LayerRunner

    if not getattr(LayerRunner.run_paired, "_dhelix_test_counter", False):
        LayerRunner.run_paired = _counting_pairs(LayerRunner.run_paired)
    if not getattr(training.get_forward_backward_func, "_dhelix_test_recorder", False):
        training.get_forward_backward_func = _recording(training.get_forward_backward_func)
        training.get_forward_backward_func._dhelix_test_recorder = True


def pretrain_in_process(argv: list[str]) -> list:
    """Run scripts/pretrain_gpt.py ARGV under the plugin in this process and return the
    recorded steps (rank 0; [] elsewhere; `_Recorder.pairs` counts this run's co-executed
    layer pairs); Megatron's global state is torn down after."""
    from megatron.training.training import destroy_global_state

    from dhelix.megatron_lm import run_script

    install_recorder()
    _Recorder.steps, _Recorder.pairs, _Recorder.attention = [], 0, set()
    try:
        run_script(SCRIPT, list(argv))
    finally:
        destroy_global_state()
    return _Recorder.steps


def compare_runs(stock: list, dhelix: list) -> dict:
    """Per step: loss, |loss diff|, max |grad diff| and max |param diff| (before the step)
    with the keys where they occur."""
    from dhelix.parity import max_abs_diff

    rows = []
    for a, b in zip(stock, dhelix):
        grad_diff, grad_key = max_abs_diff(a["grads"], b["grads"])
        param_diff, param_key = max_abs_diff(a["params"], b["params"])
        rows.append({"loss": a["loss"], "loss_diff": abs(a["loss"] - b["loss"]),
                     "grad_diff": grad_diff, "grad_key": grad_key, "param_diff": param_diff,
                     "param_key": param_key, "params": len(a["grads"])})
    return {"steps": (len(stock), len(dhelix)), "rows": rows}


def parity_body(ctx, cases: dict, train_iters: int) -> dict:
    """For each case NAME -> extra Megatron arguments: train stock Megatron, then the same
    command line with --dhelix, and compare them step by step (rank 0 returns the report,
    with the core-attention classes each run's model used)."""
    report = {}
    for name, extra in cases.items():
        argv = TINY + ["--train-iters", str(train_iters)] + list(extra)
        stock = pretrain_in_process(argv)
        stock_attention = sorted(_Recorder.attention)
        dhelix = pretrain_in_process(argv + ["--dhelix"])
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, _Recorder.pairs)
        if ctx.rank == 0:
            report[name] = {**compare_runs(stock, dhelix), "pairs": pairs,
                            "attention": (stock_attention, sorted(_Recorder.attention))}
    return report


def launch_parity(cases: dict, train_iters: int) -> dict:
    """`parity_body` on 4 gloo ranks (hard timeout); prints every case's rows (pytest -s)."""
    from dhelix.harness import run_on_ranks

    result = run_on_ranks(parity_body, 4, cases, train_iters, timeout_s=600,
                          env={"OMP_NUM_THREADS": "1"})[0]
    for name, case in result.items():
        for i, row in enumerate(case["rows"]):
            print(f"{name} step {i + 1}: loss {row['loss']:.6f} diff {row['loss_diff']:.1e}, "
                  f"grad diff {row['grad_diff']:.1e} ({row['grad_key']}), param diff before "
                  f"the step {row['param_diff']:.1e} ({row['param_key']}); co-executed layer "
                  f"pairs per rank {case['pairs']}")
    return result


def assert_parity(case: dict, train_iters: int, loss: float, grad: float, param: float) -> None:
    """Both runs made `train_iters` steps, from identical initial parameters, and every
    step's loss, gradient and parameter differences are within the bounds."""
    assert case["steps"] == (train_iters, train_iters)
    # Same seed, same weights: identical initial parameters, not merely close.
    assert case["rows"][0]["param_diff"] == 0.0, case["rows"][0]["param_key"]
    for row in case["rows"]:
        assert row["loss_diff"] <= loss
        assert row["grad_diff"] <= grad, row["grad_key"]
        assert row["param_diff"] <= param, row["param_key"]


# ------------------------------------------------------------------ data and checkpoints
BYTE_VOCAB = 257  # 256 byte ids and the end-of-document id NullTokenizer uses (vocab - 1)


def write_indexed_corpus(prefix: Path, documents: int = 200) -> str:
    """A small text corpus turned into a Megatron indexed dataset (PREFIX.bin/.idx) with
    megatron-core's own tools: its byte-level tokenizer and `IndexedDatasetBuilder`, each
    document ended by the end-of-document id of `--tokenizer-type NullTokenizer
    --vocab-size 257`. Returns the `--data-path` prefix."""
    import random

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteLevelTokenizer

    words = ("the pipeline folds the model into a u so that forward and backward strands meet "
             "on every stage while one micro batch computes another communicates").split()
    rng = random.Random(0)
    tokenizer = ByteLevelTokenizer()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(documents):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "."
        ids = tokenizer.text_to_ids(text) + [BYTE_VOCAB - 1]
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _run_to_exit(argv: list[str]) -> list:
    """`pretrain_in_process`, where Megatron's `sys.exit(0)` at `--exit-interval` is the
    normal end of the run."""
    try:
        return pretrain_in_process(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        return list(_Recorder.steps)


def _refusal_in_process(argv: list[str]) -> dict:
    """`pretrain_in_process(argv)` for a run the plugin must refuse: its exit code, the
    stderr lines it printed, and the seconds until it stopped."""
    import contextlib
    import io
    import time

    err = io.StringIO()
    start = time.perf_counter()
    code = None
    with contextlib.redirect_stderr(err):
        try:
            pretrain_in_process(argv)
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "stderr": err.getvalue().strip().splitlines(),
            "seconds": time.perf_counter() - start}


def data_and_checkpoint_body(ctx, workdir: str, data_prefix: str, layout: list) -> dict:
    """On `layout` (Megatron parallel arguments), returns on rank 0:

    - "data": per step (loss, |loss diff|) of stock vs --dhelix on the indexed corpus
      (`--data-path`, NullTokenizer), 2 steps each;
    - "chain": the losses of one uninterrupted stock run of 6 steps, and of the same run
      done in three pieces through Megatron's --save/--load: stock to step 2 (saved),
      --dhelix from that checkpoint to step 4 (saved), stock from the --dhelix checkpoint to
      step 6, and the parameter differences at each hand-over;
    - "checkpoint_args_refusal": a stock checkpoint saved with dropout 0.1, resumed with
      `--use-checkpoint-args --dhelix` (the command line says dropout 0, the checkpoint's
      0.1 wins): exit code, stderr lines and seconds until the refusal
      (`_refusal_in_process`), and the checkpoint directory."""
    from dhelix.parity import max_abs_diff

    data = TINY + layout + ["--data-path", data_prefix, "--vocab-size", str(BYTE_VOCAB),
                            "--split", "98,2,0", "--train-iters", "2"]
    data = [a for a in data if a != "--mock-data"]
    stock = pretrain_in_process(data)
    dhelix = pretrain_in_process(data + ["--dhelix"])
    base = TINY + layout + ["--train-iters", "6", "--lr-decay-style", "constant"]
    stock_dir, dhelix_dir = f"{workdir}/ckpt_stock", f"{workdir}/ckpt_dhelix"
    reference = pretrain_in_process(base)
    first = _run_to_exit(base + ["--save", stock_dir, "--save-interval", "2", "--exit-interval",
                                 "2"])
    second = _run_to_exit(base + ["--load", stock_dir, "--save", dhelix_dir, "--save-interval",
                                  "2", "--exit-interval", "4", "--dhelix"])
    third = pretrain_in_process(base + ["--load", dhelix_dir])
    dropout_dir = f"{workdir}/ckpt_dropout"
    _run_to_exit(base + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save",
                         dropout_dir, "--save-interval", "1", "--exit-interval", "1"])
    refusal = _refusal_in_process(base + ["--load", dropout_dir, "--use-checkpoint-args",
                                          "--dhelix"])
    if ctx.rank != 0:
        return {}
    pieces = first + second + third
    return {
        "data": [(a["loss"], abs(a["loss"] - b["loss"])) for a, b in zip(stock, dhelix)],
        "data_steps": (len(stock), len(dhelix)),
        "reference": [s["loss"] for s in reference],
        "chain": [s["loss"] for s in pieces],
        "handover_param_diff": [max_abs_diff(reference[i]["params"], pieces[i]["params"])[0]
                                for i in (2, 4)],
        "checkpoint_args_refusal": dict(refusal, checkpoint=dropout_dir),
    }
