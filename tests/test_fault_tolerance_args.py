"""The fault-tolerance arguments (Megatron's names): defaults, and one-line errors."""

import pytest

from dhelix.arguments import ArgumentError, parse_args


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_defaults_check_nan_and_fail_a_stall_within_a_minute():
    args = parse_args(["--preset", "tiny"])
    assert args.check_for_nan_in_loss_and_grad is True
    assert 0 < args.distributed_timeout_minutes * 60 < 60
    assert args.ckpt_step is None


def test_flags_parse():
    args = parse_args(["--preset", "tiny", "--no-check-for-nan-in-loss-and-grad",
                       "--distributed-timeout-minutes", "0.1", "--load", ".", "--ckpt-step", "4"])
    assert args.check_for_nan_in_loss_and_grad is False
    assert args.distributed_timeout_minutes == pytest.approx(0.1)
    assert args.ckpt_step == 4


@pytest.mark.parametrize("argv,message", [
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be in "
                                             "(0, 1e+06), got 0.0"),
    (["--distributed-timeout-minutes", "nan"], "--distributed-timeout-minutes must be in"),
    (["--distributed-timeout-minutes", "1e7"], "--distributed-timeout-minutes must be in"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--load", ".", "--ckpt-step", "-1"], "--ckpt-step must be >= 0, got -1"),
])
def test_bad_values_are_refused_in_one_line(argv, message):
    with pytest.raises(ArgumentError) as info:
        parse_args(["--preset", "tiny"] + argv)
    assert message in str(info.value) and "\n" not in str(info.value)
