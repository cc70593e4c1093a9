"""Rank bodies for the tests of the Megatron-LM plugin (`dhelix.megatron_lm`): each runs
`scripts/pretrain_gpt.py` through `megatron.training.pretrain` in this rank's process, one
run after another in the same job (Megatron's global state is torn down between runs), and
records what the real training loop did."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "pretrain_gpt.py")
RANKS = 4  # the parity launch's ranks (`launch_parity`): on CUDA, one GPU each
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
    batch's mean token loss (only rank 0 keeps them); per evaluation call (forward only) its
    mean token loss (rank 0); the layer pairs this rank co-executed
    (`LayerRunner.run_paired`: the DHelix SI path really ran); and the devices this rank's
    model was on ("cpu", "cuda:1", ...)."""

    steps: list = []
    evals: list = []
    pairs: int = 0
    attention: set = set()  # class names of the model's core-attention modules
    devices: set = set()


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
    from dhelix.devices import model_device
    from dhelix.parity import gather_full_tensors

    def get(*args, **kwargs):
        forward_backward = get_forward_backward_func(*args, **kwargs)

        def recorded(**step):
            if step.get("forward_only"):
                losses = forward_backward(**step)
                loss = _global_loss(losses)
                if dist.get_rank() == 0:
                    _Recorder.evals.append(loss)
                return losses
            _Recorder.attention |= {type(m.core_attention).__name__ for chunk in step["model"]
                                    for m in chunk.modules() if hasattr(m, "core_attention")}
            _Recorder.devices.add(str(model_device(step["model"])))
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

    from dhelix.megatron_lm import install_plugin

    install_plugin()
    from dhelix.runtime.layer_runner import LayerRunner

    if not getattr(LayerRunner.run_paired, "_dhelix_test_counter", False):
        LayerRunner.run_paired = _counting_pairs(LayerRunner.run_paired)
    if not getattr(training.get_forward_backward_func, "_dhelix_test_recorder", False):
        training.get_forward_backward_func = _recording(training.get_forward_backward_func)
        training.get_forward_backward_func._dhelix_test_recorder = True


def pretrain_in_process(argv: list[str]) -> list:
    """Run scripts/pretrain_gpt.py ARGV under the plugin in this process and return the
    recorded steps (rank 0; [] elsewhere; `_Recorder.pairs` counts this run's co-executed
    layer pairs); after it, `tear_down_pretrain`: Megatron's and the plugin's state go and
    the process groups the run made are destroyed (each idle gloo group keeps threads that
    wake every few ms: left alive, the parity launch's 14 runs reached ~950 threads a
    rank and a third of its CPU time was the kernel's)."""
    from dhelix.megatron_lm import run_script, tear_down_pretrain
    from dhelix.parallel import process_groups

    install_recorder()
    _Recorder.steps, _Recorder.evals, _Recorder.pairs = [], [], 0
    _Recorder.attention, _Recorder.devices = set(), set()
    before = process_groups()
    try:
        run_script(SCRIPT, list(argv))
    finally:
        tear_down_pretrain(before)
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


def many_runs_env() -> dict:
    """For a launch that builds many `pretrain()` runs: every gloo group of a rank on one
    shared transport device (`dhelix.gloo_device`; the caller's DHELIX_GLOO_SHARED_DEVICE
    wins, for A/B runs). Each run's 25-60 Megatron groups, mostly idle, would otherwise
    each keep a loop thread waking every 10 ms; one device costs ~30% more per small
    collective (4 ranks on 2 cores), so it pays only where idle groups dominate, as here
    (the 4-rank matrices launch: 121-123 s -> 73-82 s wall on the 2-core machine), and
    the other launches keep torch's one device per group."""
    return {"DHELIX_GLOO_SHARED_DEVICE": os.environ.get("DHELIX_GLOO_SHARED_DEVICE", "1")}


def parity_env(device: str) -> dict:
    """The ranks' environment for `parity_body` on `device` ("cpu": CUDA hidden, so a GPU
    machine runs the CPU path too; "cuda": the visible GPUs, one per rank: `run_on_ranks`
    sets LOCAL_RANK=rank and Megatron calls `torch.cuda.set_device(args.local_rank)`, so
    rank r runs on cuda:r (the plugin refuses fewer GPUs than ranks); Megatron's
    `validate_args` demands CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 before Blackwell)."""
    if device == "cpu":
        return {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **many_runs_env()}
    return {"OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def parity_body(ctx, cases: dict, train_iters: int) -> dict:
    """For each case NAME -> extra Megatron arguments: train stock Megatron, then the same
    command line with --dhelix, and compare them step by step, and their evaluation losses
    call by call (rank 0 returns the report, with the core-attention classes each run's
    model used). Run with `parity_env(DEVICE)`. Per case the report also holds "devices",
    the device types every rank's model was on in both runs, "rank_devices", per rank the
    devices its model was on in both runs ({"cuda:1"}), and "host_tensors", every
    device-less tensor factory call the --dhelix run made from dhelix/ or megatron_patches/
    on any rank (`tests.device_watch`: on a GPU each would be a CPU tensor next to the
    model)."""
    from tests.device_watch import HostTensorWatch

    report = {}
    for name, extra in cases.items():
        argv = TINY + ["--train-iters", str(train_iters)] + list(extra)
        stock = pretrain_in_process(argv)
        stock_attention = sorted(_Recorder.attention)
        stock_evals = list(_Recorder.evals)
        devices = set(_Recorder.devices)
        with HostTensorWatch() as watch:
            dhelix = pretrain_in_process(argv + ["--dhelix"])
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, (_Recorder.pairs, devices | _Recorder.devices,
                                       sorted(watch.found)))
        if ctx.rank == 0:
            report[name] = {**compare_runs(stock, dhelix), "pairs": [f[0] for f in found],
                            "devices": {d.split(":")[0] for f in found for d in f[1]},
                            "rank_devices": [f[1] for f in found],
                            "host_tensors": sorted(set().union(*(f[2] for f in found))),
                            "attention": (stock_attention, sorted(_Recorder.attention)),
                            "evals": (len(stock_evals), len(_Recorder.evals)),
                            "eval_diff": max((abs(a - b) for a, b in
                                              zip(stock_evals, _Recorder.evals)), default=0.0)}
    return report


def launch_parity(cases: dict, train_iters: int, timeout_s: int = 600,
                  env: dict | None = None) -> dict:
    """`parity_body` on `RANKS` ranks (hard timeout; `env` defaults to one OpenMP thread per
    CPU rank); prints every case's rows and evaluation differences (pytest -s)."""
    from dhelix.harness import run_on_ranks

    env = {"OMP_NUM_THREADS": "1"} if env is None else env
    result = run_on_ranks(parity_body, RANKS, cases, train_iters, timeout_s=timeout_s,
                          env=env)[0]
    for name, case in result.items():
        for i, row in enumerate(case["rows"]):
            print(f"{name} step {i + 1}: loss {row['loss']:.6f} diff {row['loss_diff']:.1e}, "
                  f"grad diff {row['grad_diff']:.1e} ({row['grad_key']}), param diff before "
                  f"the step {row['param_diff']:.1e} ({row['param_key']}); co-executed layer "
                  f"pairs per rank {case['pairs']}")
        print(f"{name}: evaluation calls {case['evals']}, max |eval loss diff| "
              f"{case['eval_diff']:.1e}")
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
