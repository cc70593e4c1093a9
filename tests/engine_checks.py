"""What a `--dhelix` run's ranks recorded about the engine that ran them (`engine_record`
of tests/plugin_parity_ranks.py): one check shared by the
PP=1, PP>1, Domino and Wavelet parity launches, so all of them are held to the same
executor."""

ENGINE = "ScheduleEngine"


def assert_ran_on_the_engine(executed: dict, schedule_kind: str, pass_engine: str,
                             path: str) -> None:
    """Training: every rank ran its whole `schedule_kind` action list on `path` through the
    executor (actions counted while running) with `pass_engine`; evaluation: the forward-only
    list of the same path through the same executor, with the chunk module's autograd
    passes."""
    for phase, kind, passes in (("train", schedule_kind, pass_engine),
                                ("eval", "forward", "AutogradPasses")):
        ranks = executed[phase]
        assert ranks, phase
        for rank in ranks:
            assert rank["engine"] == ENGINE, rank
            assert rank["schedule_kind"] == kind and rank["path"] == path, rank
            assert rank["pass_engine"] == passes, rank
            assert rank["forward_only"] == (phase == "eval"), rank
            assert rank["actions_run"] == rank["listed"] > 0, rank
