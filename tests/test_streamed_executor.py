"""The streamed executor (`dhelix.runtime.streamed_executor.run_streamed`) ends a strand's
last layer as soon as the sequence has run its last entry with nothing of it in flight,
and says so (`on_strand_end`) while the other strand still runs: what lets a pipeline stage
send that output early. Pure: executions stand in for `dhelix.ops.runner.LayerExecution`
with the four calls the executor makes."""

from types import SimpleNamespace

from dhelix.runtime.streamed_executor import StrandChain, run_streamed
from planner.streamed import StreamedStep


class _Execution:
    """Runs operators by name; a collective stays in flight until `land()`."""

    def __init__(self, strand: str, ops: dict, log: list):
        self.strand, self.log = strand, log
        self.program = {op: SimpleNamespace(kind=kind) for op, kind in ops.items()}
        self.programs = SimpleNamespace(program=lambda phase: self.program)
        self.phase = strand
        self.done, self.in_flight = set(), set()

    def run(self, op: str) -> None:
        self.done.add(op)
        if self.program[op].kind == "comm":
            self.in_flight.add(op)
        self.log.append(("run", self.strand, op))

    def op_ready(self, op: str) -> bool:
        return True

    def wait_inputs(self, op: str) -> None:
        raise AssertionError("every input is ready here")

    def ran_all(self) -> bool:
        return self.done == set(self.program) and not self.in_flight


def _chains(executions: dict, log: list) -> dict:
    return {strand: StrandChain(open=lambda pair, s=strand: executions[s],
                                close=lambda e: log.append(("closed", e.strand)))
            for strand in executions}


def _sequence(*entries) -> tuple:
    return tuple(StreamedStep(strand, 0, op) for strand, op in entries)


def test_a_strand_ends_after_its_last_entry_while_the_other_runs():
    log: list = []
    executions = {"bwd": _Execution("bwd", {"b1": "comp", "b2": "comp"}, log),
                  "fwd": _Execution("fwd", {"f1": "comp", "f2": "comp"}, log)}
    ended = []
    run_streamed(_sequence(("bwd", "b1"), ("fwd", "f1"), ("bwd", "b2"), ("fwd", "f2")),
                 _chains(executions, log), on_strand_end=lambda s: ended.append(s) or
                 log.append(("ended", s)))
    assert log == [("run", "bwd", "b1"), ("run", "fwd", "f1"), ("run", "bwd", "b2"),
                   ("closed", "bwd"), ("ended", "bwd"), ("run", "fwd", "f2"),
                   ("closed", "fwd"), ("ended", "fwd")]
    assert ended == ["bwd", "fwd"]


def test_a_strand_with_a_collective_in_flight_ends_once_it_landed():
    """The backward's last entry is a collective: its layer is not ended there (`ran_all`
    is false) but after the first entry that finds it landed; without `on_strand_end` the
    chains end after the sequence, as before."""
    log: list = []
    executions = {"bwd": _Execution("bwd", {"b1": "comp", "bc": "comm"}, log),
                  "fwd": _Execution("fwd", {"f1": "comp", "f2": "comp", "f3": "comp"}, log)}
    original_run = executions["fwd"].run

    def run_and_land(op):  # the collective lands while f2 runs
        original_run(op)
        if op == "f2":
            executions["bwd"].in_flight.clear()

    executions["fwd"].run = run_and_land
    run_streamed(_sequence(("bwd", "b1"), ("bwd", "bc"), ("fwd", "f1"), ("fwd", "f2"),
                           ("fwd", "f3")),
                 _chains(executions, log), on_strand_end=lambda s: log.append(("ended", s)))
    assert log.index(("closed", "bwd")) == log.index(("run", "fwd", "f2")) + 1
    assert log[-2:] == [("closed", "fwd"), ("ended", "fwd")]

    quiet: list = []
    executions = {"bwd": _Execution("bwd", {"b1": "comp"}, quiet),
                  "fwd": _Execution("fwd", {"f1": "comp"}, quiet)}
    run_streamed(_sequence(("bwd", "b1"), ("fwd", "f1")), _chains(executions, quiet))
    assert quiet == [("run", "bwd", "b1"), ("run", "fwd", "f1"), ("closed", "bwd"),
                     ("closed", "fwd")]
