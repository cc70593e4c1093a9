"""`--dhelix` with a Megatron argument the DHelix runtime cannot honour stops in the
argument hook (`megatron_patches.training_hooks`), before Megatron validates anything and
before any process group exists, with one `error: ...` line naming the argument (exit
code 2). The same command lines without `--dhelix` parse. One real launch checks what the
user sees: the last stderr line and the exit code, with no rank started."""

import contextlib
import io
import subprocess
import sys

import pytest

from tests.megatron_lm_ranks import ROOT, SCRIPT, TINY

PP2 = ["--pipeline-model-parallel-size", "2"]
REFUSED = {
    "virtual pipeline": (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
                         "--num-layers-per-virtual-pipeline-stage"),
    "uneven stages": (PP2 + ["--decoder-first-pipeline-num-layers", "1"],
                      "--decoder-first-pipeline-num-layers"),
    "recomputation": (["--recompute-granularity", "full"], "--recompute-granularity full"),
    "fp16": (["--fp16"], "--fp16"),
    "moe": (["--num-experts", "2"], "--num-experts"),
    "expert parallel": (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    "context parallel": (["--context-parallel-size", "2"], "--context-parallel-size"),
    "overlap grad reduce with PP": (PP2 + ["--overlap-grad-reduce"], "--overlap-grad-reduce"),
    "reset attention mask": (["--reset-attention-mask"], "--reset-attention-mask"),
}


# refused on the typed run, after Megatron's validate_args (dhelix.options.check_run)
REFUSED_ONCE_VALIDATED = {
    "dropout": (["--hidden-dropout", "0.1"], "--hidden-dropout 0"),  # the last value wins
    "layers that do not fold": (PP2 + ["--num-layers", "6"], "multiple of 2 x 2 = 4"),
    "domino with PP": (PP2 + ["--dhelix-pairer", "domino"], "--pipeline-model-parallel-size 1"),
}


def _parse(argv, validate=False):
    """Megatron's parse_args with the plugin's hook, in this process (then its
    validate_args with `validate`, which the plugin hooks too): (exit code or None,
    stderr)."""
    from megatron.training import arguments

    from megatron_patches.training_hooks import install_training_hooks

    install_training_hooks()
    stderr = io.StringIO()
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stderr(stderr):
            args = arguments.parse_args()
            if validate:
                arguments.validate_args(args, {"tokenizer_type": "NullTokenizer"})
        return None, stderr.getvalue()
    except SystemExit as exc:
        return exc.code, stderr.getvalue()
    finally:
        sys.argv = saved


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_dhelix_refuses_before_any_process_group(name, monkeypatch):
    import torch.distributed as dist

    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    extra, named = REFUSED[name]
    argv = TINY + ["--train-iters", "1"] + extra
    code, err = _parse(argv + ["--dhelix"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --dhelix") and named in lines[0], lines[0]
    assert not dist.is_initialized()
    assert _parse(argv)[0] is None  # without --dhelix Megatron takes it


@pytest.mark.parametrize("name", sorted(REFUSED_ONCE_VALIDATED))
def test_dhelix_rules_checked_on_the_validated_run(name, monkeypatch):
    import torch.distributed as dist

    from megatron_patches.run_options import current_run

    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    extra, named = REFUSED_ONCE_VALIDATED[name]
    argv = TINY + ["--train-iters", "1"] + extra
    code, err = _parse(argv + ["--dhelix"], validate=True)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --dhelix") and named in lines[0], lines[0]
    assert not dist.is_initialized()
    assert _parse(argv, validate=True)[0] is None  # without --dhelix Megatron takes it
    assert current_run().options.enabled is False


def test_validated_run_is_typed(monkeypatch):
    """The run the plugin hands to setup_dhelix: Megatron's validated values."""
    from megatron_patches.run_options import current_run

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = _parse(TINY + PP2 + ["--train-iters", "1", "--dhelix", "--dhelix-pairer",
                                     "sequential", "--disable-bias-linear"], validate=True)
    assert code is None, err
    run = current_run()
    assert run.options.enabled and run.options.pairer == "sequential"
    assert (run.model.num_layers, run.model.ffn_hidden_size, run.model.num_query_groups) \
        == (4, 512, 4)
    assert run.model.add_bias_linear is False and run.model.dtype == "fp32"
    assert (run.parallel.pipeline_model_parallel_size, run.parallel.data_parallel_size,
            run.parallel.num_microbatches) == (2, 2, 2)


def test_refusal_through_the_launcher():
    proc = subprocess.run(
        [sys.executable, "-m", "dhelix.megatron_lm", SCRIPT, *TINY, "--train-iters", "1",
         "--recompute-granularity", "full", "--dhelix"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --dhelix does not support --recompute-granularity full")
    assert "initializing torch distributed" not in proc.stdout


@pytest.mark.parametrize("extra, named", [
    (["--reset-attention-mask"], "--reset-attention-mask"),
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "--spec"),
])
def test_sdpa_attention_refuses_stock_runs_it_cannot_honour(extra, named, monkeypatch):
    """`--dhelix-attention sdpa` also applies without `--dhelix`: a mask that is not plain
    causal, or a user layer spec it would not reach, stops stock runs in one line."""
    import torch.distributed as dist

    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    argv = TINY + ["--train-iters", "1"] + extra
    code, err = _parse(argv + ["--dhelix-attention", "sdpa"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --dhelix-attention sdpa") and named in lines[0], lines[0]
    assert not dist.is_initialized()
    assert _parse(argv)[0] is None  # Megatron's own attention takes it
