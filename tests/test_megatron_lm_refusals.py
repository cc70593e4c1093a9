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
# what the MoE operators implement: top-2 of 4 experts, the alltoall dispatcher, EP=2
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--expert-model-parallel-size", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "0.01"]
REFUSED = {
    "virtual pipeline": (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"],
                         "--num-layers-per-virtual-pipeline-stage"),
    "uneven stages": (PP2 + ["--decoder-first-pipeline-num-layers", "1"],
                      "--decoder-first-pipeline-num-layers"),
    "recomputation": (["--recompute-granularity", "full"], "--recompute-granularity full"),
    "fp16": (["--fp16"], "--fp16"),
    "moe allgather dispatcher": (["--num-experts", "4"], "--moe-token-dispatcher-type alltoall"),
    "moe grouped gemm": (MOE + ["--moe-grouped-gemm"], "--moe-grouped-gemm"),
    "moe expert tensor parallel": (MOE + ["--expert-tensor-parallel-size", "2"],
                                   "--expert-tensor-parallel-size"),
    "moe with tensor parallel, no SP": (MOE + ["--tensor-model-parallel-size", "2"],
                                        "--sequence-parallel"),
    # Megatron's default expert TP is the TP size: TP=2 needs an explicit expert TP of 1
    "moe with tensor parallel, expert TP 2": (MOE + ["--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel"],
                                              "--expert-tensor-parallel-size 1"),
    "moe with tensor parallel and pipelining": (
        MOE + PP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--expert-tensor-parallel-size", "1"], "--tensor-model-parallel-size 1"),
    "moe sinkhorn balancing": (MOE + ["--moe-router-load-balancing-type", "sinkhorn"],
                               "aux_loss or none"),
    "moe shared expert gate": (MOE + ["--moe-shared-expert-intermediate-size", "64",
                                      "--moe-shared-expert-gate"], "--moe-shared-expert-gate"),
    "moe shared experts with TP": (MOE + ["--moe-shared-expert-intermediate-size", "64",
                                          "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel",
                                          "--expert-tensor-parallel-size", "1"],
                                   "--tensor-model-parallel-size 1 only"),
    "moe domino": (MOE + ["--dhelix-pairer", "domino"], "--dhelix-pairer domino"),
    "context parallel": (["--context-parallel-size", "2"], "--context-parallel-size"),
    "overlap grad reduce with PP": (PP2 + ["--overlap-grad-reduce"], "--overlap-grad-reduce"),
    "reset attention mask": (["--reset-attention-mask"], "--reset-attention-mask"),
}


# refused on the typed run, after Megatron's validate_args (dhelix.options.check_run)
REFUSED_ONCE_VALIDATED = {
    "dropout": (["--hidden-dropout", "0.1"], "--hidden-dropout 0"),  # the last value wins
    "layers that do not fold": (PP2 + ["--num-layers", "6"], "multiple of 2 x 2 = 4"),
    "domino with PP": (PP2 + ["--dhelix-pairer", "domino"], "--pipeline-model-parallel-size 1"),
    "domino with an odd micro-batch": (["--dhelix-pairer", "domino", "--micro-batch-size", "3",
                                        "--global-batch-size", "6"],
                                       "--micro-batch-size must be even (got 3)"),
}


def _parse(argv, validate=False):
    """Megatron's parse_args with the plugin's hook, in this process (then its
    validate_args with `validate`, which the plugin hooks too): (exit code or None,
    stderr)."""
    from megatron.training import arguments

    from megatron_patches.training_hooks import install_training_hooks
    from megatron_patches.training_shims import apply_training_cpu_shims

    apply_training_cpu_shims()  # as the plugin does before pretrain() validates (TP > 1
    install_training_hooks()    # asks the device's architecture there)
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


@pytest.mark.parametrize("extra, named", [
    (["--dhelix"], "with --pipeline-model-parallel-size 1"),
    (["--dhelix"] + PP2 + ["--dhelix-pairer", "sequential"], "other than dp"),
    (PP2, "--dhelix-pipeline-transfer-ms needs --dhelix"),
    (["--dhelix"] + PP2 + ["--dhelix-pipeline-transfer-ms", "-1"], "number of ms >= 0")])
def test_pipeline_transfer_time_only_where_the_start_up_plan_uses_it(monkeypatch, extra,
                                                                     named):
    """`--dhelix-pipeline-transfer-ms` (the start-up planning's transfer time instead of the
    probe's) is refused in one line where nothing would read it: without pipelining, with a
    pairer other than dp, without --dhelix; a negative time at parse time. With PP=2 and the
    dp pairer it is taken."""
    from megatron_patches.run_options import current_run

    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = TINY + ["--train-iters", "1", "--num-layers", "4"]
    if "--dhelix-pipeline-transfer-ms" not in extra:
        extra = extra + ["--dhelix-pipeline-transfer-ms", "2.5"]
    code, err = _parse(argv + extra, validate=True)
    lines = err.strip().splitlines()
    assert code == 2 and named in lines[-1], err
    code, err = _parse(argv + PP2 + ["--dhelix", "--dhelix-pipeline-transfer-ms", "2.5"],
                       validate=True)
    assert code is None, err
    assert current_run().options.pipeline_transfer_ms == 2.5


@pytest.mark.parametrize("parallel", [[], ["--tensor-model-parallel-size", "2",
                                          "--sequence-parallel",
                                          "--expert-tensor-parallel-size", "1"], PP2])
def test_supported_moe_is_not_refused(monkeypatch, parallel):
    """EP=2 (TP=1, TP=2 with SP and expert TP 1, or TP=1 with PP=2: the folded model) with
    the alltoall dispatcher and the aux loss, in a mixed dense/MoE stack, passes the
    `--dhelix` argument checks (tests/test_megatron_lm_moe.py trains it,
    tests/test_dhelix_moe.py and tests/test_dhelix_moe_pipeline.py check its parity)."""
    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", *MOE, *parallel,
                               "--moe-layer-freq", "[1,0,1,0]"], validate=True)
    assert code is None, err


@pytest.mark.parametrize("extra,line", [
    (["--dhelix-commfree-timing-only"], "error: --dhelix-commfree-timing-only needs --dhelix"),
    (["--dhelix-streamed"], "error: --dhelix-streamed needs --dhelix"),
    (["--dhelix", "--dhelix-streamed", "--dhelix-pairer", "round_robin"],
     "error: --dhelix-streamed plans its own operator sequence from the profile: use it with "
     "--dhelix-pairer dp (got round_robin)"),
])
def test_runtime_flags_that_need_a_dhelix_dp_run(extra, line, monkeypatch):
    """The benchmark's communication-free bound (wrong numerics) is never a stock run, and
    streamed SI blocks are never silently ignored: without --dhelix, or with a pairer
    whose plan they would not use."""
    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = _parse(TINY + ["--train-iters", "1", *extra], validate=True)
    lines = err.strip().splitlines()
    assert code == 2 and lines == [line], err


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
    assert (run.options.block_barriers, run.options.layer_seams) == (True, True)  # defaults
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-no-block-barriers",
                               "--dhelix-no-layer-seams"], validate=True)
    assert code is None, err
    assert (current_run().options.block_barriers, current_run().options.layer_seams) \
        == (False, False)
    # the memory bound's default: on, margin AUTO_MEMORY_MARGIN of the layers' activations
    assert (current_run().options.memory_bound, current_run().options.memory_margin_mib) \
        == (True, None)
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-memory-margin",
                               "1.5"], validate=True)
    assert code is None and current_run().options.memory_margin_mib == 1.5, err
    assert current_run().options.memory_bound, err
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-no-memory-bound"],
                       validate=True)
    assert code is None and current_run().options.memory_bound is False, err
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-memory-margin",
                               "-1"], validate=True)
    assert code == 2 and "--dhelix-memory-margin" in err and ">= 0" in err, err


def test_refusal_through_the_launcher():
    proc = subprocess.run(
        [sys.executable, "-m", "dhelix.megatron_lm", SCRIPT, *TINY, "--train-iters", "1",
         "--recompute-granularity", "full", "--dhelix"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --dhelix does not support --recompute-granularity full")
    assert "initializing torch distributed" not in proc.stdout


def _one_line(argv, monkeypatch) -> str:
    """The one `error:` line (exit code 2) of parsing ARGV with the plugin's hook, before
    any process group exists."""
    import torch.distributed as dist

    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    code, err = _parse(TINY + ["--train-iters", "1"] + argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err[-3000:])
    assert not dist.is_initialized()
    return lines[0]


def _plan_and_profile_files(tmp_path) -> dict:
    """name -> (path, expected message after 'error: OPTION PATH')."""
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    stale_plan = tmp_path / "stale_plan.json"
    stale_plan.write_text('{"format": "dhelix-plan", "version": 0}')
    stale_profile = tmp_path / "stale_profile.json"
    stale_profile.write_text('{"format": "dhelix-profile", "version": 0}')
    return {
        "missing": (tmp_path / "none.json", ": no such file; check the path"),
        "directory": (tmp_path, ": is a directory or special file; give a file"),
        "corrupt": (corrupt, ": "),
        "stale plan": (stale_plan, ": "),
        "stale profile": (stale_profile, ": "),
    }


@pytest.mark.parametrize("option", ["--dhelix-plan", "--dhelix-profile"])
def test_plan_and_profile_files_are_checked_at_parse_time(option, tmp_path, monkeypatch):
    files = _plan_and_profile_files(tmp_path)
    for name, (path, message) in files.items():
        if name.startswith("stale") and not name.endswith(option.split("-")[-1]):
            continue
        line = _one_line(["--dhelix", option, str(path)], monkeypatch)
        assert line.startswith(f"error: {option} {path}{message}"), (name, line)
        if name.startswith("stale"):
            assert "version" in line, line
        if name == "corrupt":
            assert "JSON" in line or "json" in line, line


def test_plan_without_dhelix_is_refused_not_ignored(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    for option in ("--dhelix-plan", "--dhelix-profile"):
        assert _one_line([option, str(plan)], monkeypatch) == (
            f"error: {option} needs --dhelix (without it the file would be ignored); add "
            f"--dhelix or drop {option}")


def test_save_plan_path_is_checked_at_parse_time(tmp_path, monkeypatch):
    """--dhelix-save-plan names a file the run can write, and needs --dhelix; with
    --dhelix-plan or the Domino split it would save nothing built here."""
    option = "--dhelix-save-plan"
    missing = tmp_path / "no_dir" / "plan.json"
    assert _one_line(["--dhelix", option, str(missing)], monkeypatch) == (
        f"error: {option} {missing}: its directory {missing.parent} does not exist; create "
        "it first or choose another path")
    assert _one_line(["--dhelix", option, str(tmp_path)], monkeypatch) == (
        f"error: {option} {tmp_path}: is a directory or special file; give a file path")
    assert _one_line([option, str(tmp_path / "plan.json")], monkeypatch) == (
        f"error: {option} needs --dhelix (without it no plan is built); add --dhelix or "
        f"drop {option}")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-pairer", "domino",
                               option, str(tmp_path / "plan.json")], validate=True)
    assert code == 2 and err.strip().splitlines() == [
        "error: --dhelix-pairer domino does no planning: drop --dhelix-plan, --dhelix-profile "
        "and --dhelix-save-plan"], err


def test_save_plan_with_a_plan_file_is_refused(tmp_path, monkeypatch):
    from planner.build import make_plan
    from planner.costs import build_cost_model
    from planner.plan import save_plan
    from planner.synthetic import layer_dags

    fwd, bwd = layer_dags()
    save_plan(make_plan(fwd, bwd, build_cost_model(fwd, bwd), pairer="sequential"),
              tmp_path / "given.json")
    monkeypatch.delenv("DHELIX_ERROR_FILE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, err = _parse(TINY + ["--train-iters", "1", "--dhelix", "--dhelix-plan",
                               str(tmp_path / "given.json"), "--dhelix-save-plan",
                               str(tmp_path / "saved.json")], validate=True)
    assert code == 2 and err.strip().splitlines() == [
        "error: --dhelix-save-plan writes the plan built at start-up, and --dhelix-plan "
        "gives one: drop --dhelix-save-plan (the plan is that file)"], err
    assert not (tmp_path / "saved.json").exists()


HELP = "python -m dhelix.megatron_lm SCRIPT --help lists the arguments"


def test_argparse_errors_are_one_line(monkeypatch):
    cases = {
        ("--dhelix", "--dhelix-plan"): "error: argument --dhelix-plan: expected one argument",
        ("--dhelix", "--dhelix-pairer", "bogus"):
            "error: argument --dhelix-pairer: invalid choice: 'bogus' (choose from 'dp', "
            "'sequential', 'round_robin', 'domino')",
        ("--dhelx",): "error: unrecognized arguments: --dhelx (did you mean: --dhelx -> "
                      "--dhelix)",
        ("--distributed-timeout-minutes", "0.5"):
            "error: argument --distributed-timeout-minutes: invalid int value: '0.5'",
    }
    for argv, line in cases.items():
        got = _one_line(list(argv), monkeypatch)
        assert got == f"{line}; {HELP}", got


def test_layers_the_folded_model_cannot_split(monkeypatch):
    line = _one_line(["--dhelix", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
                     monkeypatch)
    # the same rule and words as the typed run's check (`dhelix.options.folding_problem`)
    assert line == ("error: --dhelix with --pipeline-model-parallel-size 2 folds the layers "
                    "into a U (two chunks per stage): --num-layers 2 must be a multiple of "
                    "2 x 2 = 4")


@pytest.mark.parametrize("extra, named", [
    (["--reset-attention-mask"], "--reset-attention-mask"),
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "--spec"),
])
def test_sdpa_attention_refuses_stock_runs_it_cannot_honour(extra, named, monkeypatch):
    """`--dhelix-attention sdpa` also applies without `--dhelix`: a mask that is not plain
    causal, or a user layer spec it would not reach, stops stock runs in one line."""
    line = _one_line(extra + ["--dhelix-attention", "sdpa"], monkeypatch)
    assert line.startswith("error: --dhelix-attention sdpa") and named in line, line
    assert _parse(TINY + ["--train-iters", "1"] + extra)[0] is None  # Megatron's own takes it


def test_dhelix_runs_build_no_unread_attention_masks(monkeypatch, capsys):
    """With --dhelix the data loader builds no attention mask (the DHelix layers never read
    it; building it left an H100 idle between micro-batches), said in one line on rank 0;
    stock runs keep Megatron's default."""
    from megatron.training import arguments

    from megatron_patches.training_hooks import install_training_hooks

    install_training_hooks()
    monkeypatch.setenv("RANK", "0")
    masks = {}
    for label, extra in (("stock", []), ("dhelix", ["--dhelix"])):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, "--train-iters", "1",
                                          *extra])
        masks[label] = arguments.parse_args().create_attention_mask_in_dataloader
        out = capsys.readouterr().out
        assert ("--no-create-attention-mask-in-dataloader" in out) == (label == "dhelix"), out
    assert masks == {"stock": True, "dhelix": False}
