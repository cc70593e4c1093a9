"""Value checks of dhelix_trainer.py's arguments (dhelix.input_checks through parse_args):
every numeric argument has a range and is refused outside it, every path argument is
checked the way the run will use it, preset values are type-checked; each refusal is one
line naming the argument, and nothing is created on disk."""

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dhelix.arguments import ArgumentError, build_parser, parse_args
from dhelix.input_checks import RANGES, Bound, flag

ROOT = Path(__file__).resolve().parent.parent


def _refused(argv, message, world=1):
    with pytest.raises(ArgumentError) as info:
        parse_args(["--preset", "tiny"] + argv, world_size=world)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text
    return text


def _numeric_actions():
    return {a.dest: a for a in build_parser()._actions if a.type in (int, float)}


def test_every_numeric_argument_has_a_range():
    missing = sorted(set(_numeric_actions()) - set(RANGES))
    assert not missing, (f"give these arguments a bound in dhelix/input_checks.py RANGES: "
                         f"{', '.join(flag(d) for d in missing)}")
    assert not set(RANGES) - set(_numeric_actions()), "RANGES names unknown arguments"


def _violations(bound: Bound, kind) -> list:
    step = 1 if kind is int else 0.5
    values = []
    if bound.low is not None:
        values.append(bound.low if bound.low_open else bound.low - step)
    if bound.high is not None:
        values.append(bound.high if bound.high_open else bound.high + step)
    if kind is float:
        values += [math.nan, math.inf]
    return values


RANGE_CASES = [(dest, value) for dest, action in sorted(_numeric_actions().items())
               if dest in RANGES  # the others fail test_every_numeric_argument_has_a_range
               for value in _violations(RANGES[dest], action.type)]


@pytest.mark.parametrize("dest,value", RANGE_CASES)
def test_out_of_range_value_is_refused(dest, value):
    _refused([flag(dest), str(value)], f"{flag(dest)} must be {RANGES[dest].describe()}")


@pytest.mark.parametrize("argv", [
    ["--lr", "0"], ["--min-lr", "0"], ["--clip-grad", "0"], ["--weight-decay", "0"],
    ["--seed", "0"], ["--seed", str(2**31 - 1)], ["--hidden-dropout", "0.5"],
    ["--rotary-percent", "1"], ["--adam-beta2", "0.95"], ["--log-interval", "5"],
    ["--train-iters", "1"], ["--global-batch-size", "2", "--micro-batch-size", "1"],
])
def test_values_at_the_edges_are_accepted(argv):
    parse_args(["--preset", "tiny"] + argv, world_size=1)


# ---- --data-path ------------------------------------------------------------------------

def test_data_path(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 64)  # tiny's --seq-length 64 needs 65 bytes
    _refused(["--data-path", str(short)], "64 bytes, needs at least 65")
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"text" * 40 + b"\0\x01\x02" + b"more" * 10)
    _refused(["--data-path", str(binary)], "binary data (NUL byte at offset 160)")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 ".encode("latin-1") * 30)
    _refused(["--data-path", str(latin1)], "not UTF-8 text (invalid byte at offset 3)")
    _refused(["--data-path", str(tmp_path / "none.txt")], "none.txt: no such file")
    _refused(["--data-path", str(tmp_path)], "is a directory or special file")
    text = tmp_path / "ok.txt"
    text.write_text("h\u00e9llo w\u00f6rld " * 5)  # 65+ bytes, multi-byte characters
    args = parse_args(["--preset", "tiny", "--data-path", str(text), "--vocab-size", "300"],
                      world_size=1)
    assert args.data_path == str(text)
    _refused(["--data-path", str(text), "--vocab-size", "100"], "--vocab-size 100 is too small")


def test_data_path_cut_character_across_chunks(tmp_path, monkeypatch):
    """A multi-byte character split by the read chunk is fine; a bad byte after it is found
    at its true offset."""
    import dhelix.input_checks as checks

    monkeypatch.setattr(checks, "_TEXT_CHUNK", 7)
    data = ("abcdef\u00e9" * 20).encode()  # '\u00e9' is 2 bytes, straddling chunk ends
    good = tmp_path / "good.txt"
    good.write_bytes(data)
    parse_args(["--preset", "tiny", "--data-path", str(good)], world_size=1)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(data + b"\xff" + data)
    _refused(["--data-path", str(bad)], f"invalid byte at offset {len(data)}")
    cut = tmp_path / "cut.txt"
    cut.write_bytes(data + "\u00e9".encode()[:1])
    _refused(["--data-path", str(cut)], "cut-off character at the end")


# ---- read paths: --load, --dhelix-plan, --dhelix-profile, --preset ----------------------

def test_read_paths(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("{}")
    _refused(["--load", str(tmp_path / "none")], "no such checkpoint directory")
    _refused(["--load", str(a_file)], "is a file, not a checkpoint directory")
    for option in ("--dhelix-plan", "--dhelix-profile"):
        _refused(["--dhelix", option, str(tmp_path / "none.json")], "no such file")
        _refused(["--dhelix", option, str(tmp_path)], "is a directory or special file")
        _refused([option, str(a_file)], f"{option} needs --dhelix")
    parse_args(["--preset", "tiny", "--load", str(tmp_path)], world_size=1)


UNPRIVILEGED_CHECKS = """
import sys
sys.path.insert(0, sys.argv[1])
from dhelix.input_checks import (ArgumentError, check_readable_dir, check_readable_file,
                                 check_text_data_file, check_writable_dir, check_writable_file)
for check, path in [(check_readable_file, "secret.txt"), (check_readable_dir, "closed"),
                    (check_readable_file, "closed/x"), (check_writable_dir, "closed/ckpt"),
                    (check_writable_file, "secret.txt"), (check_writable_file, "closed/log")]:
    try:
        check("--opt", path)
        print("accepted", path)
    except ArgumentError as exc:
        print(exc)
"""


def _unprivileged_python() -> list:
    """A command that runs Python as a user without root's bypass of file modes."""
    if os.geteuid() != 0:
        return [sys.executable]
    setpriv, system_python = shutil.which("setpriv"), "/usr/bin/python3"
    if not setpriv or not os.access(system_python, os.X_OK):
        pytest.skip("running as root without setpriv or /usr/bin/python3 to drop privileges")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", system_python]


def test_unreadable_and_unwritable_paths():
    """File modes refuse access (checked as an unprivileged user: root bypasses modes)."""
    work = Path(tempfile.mkdtemp(prefix="dhelix-modes-"))
    try:
        work.chmod(0o755)
        (work / "secret.txt").write_text("x" * 100)
        (work / "secret.txt").chmod(0)
        (work / "closed").mkdir(mode=0)
        proc = subprocess.run(_unprivileged_python() + ["-c", UNPRIVILEGED_CHECKS, str(ROOT)],
                              cwd=work, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            "--opt secret.txt: cannot be read (Permission denied); fix its permissions",
            "--opt closed: cannot be read (Permission denied); fix its permissions",
            "--opt closed/x: cannot be read (Permission denied); fix the permissions on its "
            "path",
            f"--opt closed/ckpt: cannot write there (in {work}/closed): Permission denied; "
            "give a writable directory",
            "--opt secret.txt: cannot be written (Permission denied); fix its permissions or "
            "give another file",
            f"--opt closed/log: cannot create a file in {work}/closed: Permission denied; "
            "give a writable location",
        ]
    finally:
        (work / "closed").chmod(0o700)
        shutil.rmtree(work)


def test_preset_files(tmp_path):
    def preset(name, text):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    def refused(path, message):
        with pytest.raises(ArgumentError, match=message):
            parse_args(["--preset", path], world_size=1)

    refused(str(tmp_path / "none.json"), "--preset .*none.json: no such file")
    refused("nope", "no preset 'nope'")
    refused(str(tmp_path) + "/", "is a directory or special file")
    refused(preset("bad.json", "{"), "is not valid JSON")
    refused(preset("list.json", "[1, 2]"), "must hold a JSON object .* found list")
    base = '"num-layers": 2, "hidden-size": 64, "num-attention-heads": 2, ' \
           '"seq-length": 16, "train-iters": 1'
    refused(preset("str.json", "{%s, \"lr\": \"fast\"}" % base),
            "'lr' must be a number, found 'fast'")
    refused(preset("float.json", "{%s, \"micro-batch-size\": 1.5}" % base),
            "'micro_batch_size' must be an integer")
    refused(preset("bool.json", "{%s, \"swiglu\": 1}" % base), "'swiglu' must be true or false")
    refused(preset("choice.json", "{%s, \"optimizer\": \"lion\"}" % base),
            "'optimizer' must be one of adam, sgd")
    refused(preset("neg.json", "{%s, \"global-batch-size\": 0}" % base),
            "--global-batch-size must be >= 1, got 0")
    refused(preset("key.json", "{%s, \"layers\": 2}" % base), "unknown key 'layers'")
    args = parse_args(["--preset", preset("ok.json", "{%s, \"lr\": 1, \"swiglu\": true}" % base)],
                      world_size=1)
    assert args.lr == 1.0 and isinstance(args.lr, float) and args.swiglu is True


# ---- write paths: --save, --log-json ----------------------------------------------------

def test_write_paths_are_checked_and_nothing_is_created(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _refused(["--save", str(a_file)], "is a file, not a directory")
    _refused(["--save", str(a_file / "sub")], "is a file, so the directory cannot be created")
    _refused(["--save", "/proc/dhelix-ckpt"], "cannot write there (in /proc)")
    _refused(["--log-json", str(tmp_path)], "is a directory or special file")
    _refused(["--log-json", str(tmp_path / "no" / "log.jsonl")], "does not exist")
    _refused(["--log-json", "/proc/version"], "cannot be written")
    _refused(["--log-json", "/proc/dhelix-log.jsonl"], "cannot create a file in /proc")
    before = sorted(p.name for p in tmp_path.iterdir())
    save, log = tmp_path / "new" / "ckpt", tmp_path / "log.jsonl"
    parse_args(["--preset", "tiny", "--save", str(save), "--log-json", str(log)], world_size=1)
    a_file.write_text("kept")
    parse_args(["--preset", "tiny", "--log-json", str(a_file)], world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert a_file.read_text() == "kept"
