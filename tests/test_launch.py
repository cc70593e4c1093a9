"""What a user sees when training fails on bad input through `dhelix train` (dhelix.launch,
the Megatron-LM plugin: `torchrun -m dhelix.megatron_lm scripts/pretrain_gpt.py`), with real
torchrun: the one-line `error: ...` is the last line on stderr and the exit code is 2, both
for input refused before any process starts and for a clear error found by the ranks at run
time (after torchrun's failure report); a good run exits 0. Its presets (`dhelix.presets`)
expand to Megatron arguments, and a preset that cannot be read is one line.
(Plain torchrun of the plugin: `tests/test_megatron_lm_faults.py`.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--preset", "tiny", "--train-iters", "1", "--global-batch-size", "4"]
# the plugin's tiny run: the preset plus what scripts/pretrain_gpt.py needs without a corpus
PLUGIN_TINY = TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer",
                      "--transformer-impl", "local", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--eval-interval", "1000", "--eval-iters", "0",
                      "--num-workers", "0"]
HELP = "python -m dhelix.megatron_lm SCRIPT --help lists the arguments"


def _run(cmd, timeout=240, env=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _dhelix_train(*args, timeout=240, env=None):
    return _run([sys.executable, "-m", "dhelix", "train", *args], timeout=timeout, env=env)


def _start_dhelix_train(argvs) -> list:
    """`dhelix train` of every command line in `argvs`, started together (independent
    processes: on the 2-core machine two import Megatron-LM at once); collect them with
    `_finished`."""
    return [subprocess.Popen([sys.executable, "-m", "dhelix", "train", *argv], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in argvs]


def _finished(procs, timeout=120) -> list:
    """The `CompletedProcess`es of `_start_dhelix_train`'s processes, in order (any still
    running after `timeout` is killed)."""
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def _lines(text):
    return [ln for ln in text.splitlines() if ln.strip()]


def _errors(text):
    return [ln for ln in _lines(text) if ln.startswith("error: ")]


def _run_leftovers(temp: Path) -> list:
    """What a run left in its temporary directory but torch's shared compile cache
    (torchinductor_<user>, kept across runs on purpose)."""
    return [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]


BAD_INPUT_TEST = "test_bad_input_is_refused_before_torchrun_starts"


def _bad_input_cases(workdir):
    """(launcher and Megatron arguments, the one error line) of what `dhelix train`
    refuses before torchrun starts."""
    return [
        (["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
         "error: world size 3 is not divisible by --tensor-model-parallel-size 2 x "
         "--pipeline-model-parallel-size 1; launch a multiple of 2 processes"),
        (["--nproc-per-node", "0"], "error: --nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "2", "--no-such-flag"],
         f"error: unrecognized arguments: --no-such-flag; {HELP}"),
        (["--nproc-per-node", "2", "--dhelix-plan", str(workdir / "none.json"), "--dhelix"],
         f"error: --dhelix-plan {workdir / 'none.json'}: no such file; check the path"),
        (["--nproc-per-node", "2", "--dhelix", "--fp16"],
         "error: --dhelix does not support --fp16 (its schedules do no fp16 loss scaling); "
         "use --bf16 or fp32"),
    ]


@pytest.fixture(scope="module")
def bad_input(request, tmp_path_factory):
    """The six `dhelix train` processes of `BAD_INPUT_TEST` (the cases of `_bad_input_cases`,
    then an unknown preset), started when the first test that asks for them starts, if
    `BAD_INPUT_TEST` is selected (else None): (cases, processes). The good run's test asks
    first, so their Megatron imports run beside that test's single-process stretches
    (`dhelix train`'s own checks, torchrun's start) instead of after it."""
    if not any(item.name == BAD_INPUT_TEST for item in request.session.items):
        yield None
        return
    cases = _bad_input_cases(tmp_path_factory.mktemp("bad_input"))
    procs = _start_dhelix_train([[*argv, *PLUGIN_TINY] for argv, _ in cases]
                                + [["--nproc-per-node", "2", "--preset", "nope", "--mock-data"]])
    try:
        yield cases, procs
    finally:
        for proc in procs:  # not collected (the test was not reached or failed first)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_preset_expands_to_megatron_arguments():
    from dhelix.launch import preset_arguments

    assert preset_arguments("tiny", ["--num-layers", "8", "--lr=1e-3"]) == [
        "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "1024", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "10"]


def test_preset_flags_and_nulls(tmp_path):
    """true is the flag alone; false and null give nothing; `_`-keys are comments."""
    from dhelix.launch import preset_arguments

    preset = tmp_path / "p.json"
    preset.write_text('{"_comment": "x", "swiglu": true, "bf16": false, "lr": null, '
                      '"num_layers": 2}')
    assert preset_arguments(str(preset), []) == ["--swiglu", "--num-layers", "2"]


def test_unusable_preset_is_one_line(tmp_path):
    """What `dhelix train --preset` refuses before anything starts (`dhelix.presets`)."""
    from dhelix.argument_error import ArgumentError
    from dhelix.launch import preset_arguments

    def preset(name, text):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    cases = [
        ("nope", "--preset: no preset 'nope' (known: llama8b, tiny; or give a JSON file "
                 "path)"),
        (str(tmp_path / "none.json"), f"--preset {tmp_path / 'none.json'}: no such file; "
                                      "check the path"),
        (str(tmp_path) + "/", f"--preset {tmp_path}: is a directory or special file; give "
                              "a file"),
        (preset("bad.json", "{"), f"--preset: {tmp_path / 'bad.json'} is not valid JSON ("),
        (preset("list.json", "[1, 2]"), f"--preset: {tmp_path / 'list.json'} must hold a JSON "
                                        "object of argument values, found list"),
    ]
    for name, message in cases:
        with pytest.raises(ArgumentError) as info:
            preset_arguments(name, [])
        assert str(info.value).startswith(message) and "\n" not in str(info.value), \
            (name, str(info.value))


@pytest.mark.slow
def test_good_run_exits_0_and_run_time_error_is_printed_last(tmp_path, bad_input):
    # (`bad_input` is asked for only to start those processes beside this test's runs)
    ckpt = tmp_path / "ckpt"
    temp = tmp_path / "tmp"  # dhelix train's and torchrun's temporary files go here
    temp.mkdir()
    in_temp = dict(os.environ, TMPDIR=str(temp))
    good = _dhelix_train("--nproc-per-node", "2", *PLUGIN_TINY, "--save", str(ckpt),
                         "--save-interval", "1", "--dhelix", env=in_temp)
    assert good.returncode == 0, good.stderr[-3000:]
    assert _run_leftovers(temp) == []  # torchrun's log directory (--log-dir) removed
    assert "error:" not in good.stderr and "dhelix: SI schedule" in good.stdout
    assert " iteration        1/       1 |" in good.stdout
    # The arguments are valid, so torchrun starts both ranks; the checkpoint they load has
    # one byte changed: refused inside the ranks, after the process group exists.
    shard = ckpt / "iter_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = _dhelix_train("--nproc-per-node", "2", *PLUGIN_TINY, "--load", str(ckpt),
                        "--train-iters", "2", "--dhelix", env=in_temp)
    lines = _lines(bad.stderr)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert any("ChildFailedError" in ln for ln in lines)  # torchrun ran and reported
    assert lines[-1] == (
        f"error: --load {ckpt}: iter_0000001/__0_0.distcp does not match its saved SHA-256 "
        "(its bytes changed since the save); nothing was loaded; no earlier iteration is "
        f"saved under {ckpt}; start without --load"), lines[-5:]
    assert sum(ln.startswith("error: ") for ln in lines) == 1
    assert _run_leftovers(temp) == []


@pytest.mark.slow  # six `dhelix train` processes, five importing Megatron-LM
def test_bad_input_is_refused_before_torchrun_starts(bad_input):
    cases, procs = bad_input
    *refused, bad_preset = _finished(procs)
    for (argv, line), proc in zip(cases, refused):
        # torchrun, had it started, would print its banner and the ranks' output on stdout
        assert (proc.returncode, _errors(proc.stderr), proc.stdout) == (2, [line], ""), \
            (argv, proc.stderr[-2000:])
        assert _lines(proc.stderr)[-1] == line
    assert (bad_preset.returncode, _lines(bad_preset.stderr), bad_preset.stdout) == (2, [
        "error: --preset: no preset 'nope' (known: llama8b, tiny; or give a JSON file path)"],
        ""), bad_preset.stderr[-2000:]
