"""`dhelix schedule show`: text, formulas, PNG and JSON output, and bad input."""

import pytest

from dhelix.cli import main
from dhelix.file_formats import read_versioned
from dhelix.schedules.actions import Schedule
from dhelix.schedules.cli import SCHEDULE_FORMAT_VERSION
from dhelix.schedules.w_schedule import build_w_schedule


def test_show_prints_draws_and_exports(tmp_path, capsys):
    png, js = tmp_path / "w.png", tmp_path / "w.json"
    rc = main(["schedule", "show", "--pp", "4", "--microbatches", "12", "--png", str(png),
               "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "w schedule: p=4 stages, m=12" in out and "1f1b schedule" in out
    assert "paper formula (p-1)/(m-1+p*s) = 0.1852" in out
    assert "bubble ratio 0.1852" in out  # simulated W equals the formula here
    assert "paper formula (p-1)/(m-1+p) = 0.2000" in out and "bubble ratio 0.2000" in out
    assert png.stat().st_size > 20_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = read_versioned(js, "schedule", SCHEDULE_FORMAT_VERSION)
    assert Schedule.from_dict(document) == build_w_schedule(4, 12)


def test_formula_caveats_are_printed(capsys):
    assert main(["schedule", "show", "--pp", "4", "--microbatches", "3", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "not applicable: m <= p" in out and "1f1b schedule" not in out
    assert main(["schedule", "show", "--pp", "2", "--microbatches", "6", "--si-speedup", "1.9",
                 "--no-compare"]) == 0
    assert "not applicable: s > (f+b)/max(f,b) = 1.500" in capsys.readouterr().out


def test_other_schedules(capsys):
    assert main(["schedule", "show", "--pp", "3", "--microbatches", "2",
                 "--schedule", "sequential", "--no-compare"]) == 0
    assert "sequential schedule" in capsys.readouterr().out


def test_bad_input(capsys):
    with pytest.raises(SystemExit) as info:
        main(["schedule", "show", "--pp", "0", "--microbatches", "4"])
    assert info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["schedule", "show", "--pp", "2", "--microbatches", "4",
                 "--si-speedup", "0"]) == 2
    assert "si_speedup must be > 0" in capsys.readouterr().err
