"""The strand executor's choices, on stand-in executions (no torch, no communication: these
check which operator runs when, which lane slot a strand uses and where blocks wait; the
parity tests run the same executor on real layers and real gloo groups)."""

from __future__ import annotations

from types import SimpleNamespace

from dhelix.runtime.strand_executor import Block, run_blocks


class _Execution:
    """Records every operator it runs into a shared log; collectives complete when waited."""

    def __init__(self, name, kinds, log, phase="fwd"):
        self.name, self.log, self.phase = name, log, phase
        program = {op: SimpleNamespace(kind=kind) for op, kind in kinds.items()}
        self.programs = SimpleNamespace(program=lambda phase: program)
        self.strand_slot = None
        self.slots_seen = set()
        self.waits = 0

    def op_ready(self, op_id):
        return True

    def wait_inputs(self, op_id):
        pass

    def run(self, op_id):
        self.slots_seen.add(self.strand_slot)
        self.log.append(f"{self.name}.{op_id}")

    def wait_pending(self):
        self.waits += 1


def test_the_strand_nearest_its_collective_runs_first_and_slots_are_fixed():
    log = []
    fwd = _Execution("f", {"c1": "comp", "c2": "comp", "ar": "comm", "c3": "comp"}, log)
    bwd = _Execution("b", {"d1": "comp", "rs": "comm", "d2": "comp", "d3": "comp"}, log,
                     phase="bwd")
    run_blocks(fwd, bwd, [Block(("c1", "c2", "ar", "c3"), ("d1", "rs", "d2", "d3"))])
    # b is one computation away from its collective, f two: b goes first, its collective is
    # issued at once, then f (now nearest its collective) runs up to and issues its own
    assert log[:5] == ["b.d1", "b.rs", "f.c1", "f.c2", "f.ar"]
    assert sorted(log) == sorted(["f.c1", "f.c2", "f.ar", "f.c3",
                                  "b.d1", "b.rs", "b.d2", "b.d3"])
    assert fwd.slots_seen == {0} and bwd.slots_seen == {1}


def test_only_a_layer_pair_s_last_block_waits_unless_barriers_are_asked_for():
    blocks = [Block(("a",), ("x",)), Block(("b",), ("y",)), Block(("c",), ("z",))]
    for barrier, expected in ((False, 1), (True, 3)):
        log = []
        fwd = _Execution("f", {"a": "comp", "b": "comm", "c": "comp"}, log)
        bwd = _Execution("b", {"x": "comp", "y": "comm", "z": "comp"}, log, phase="bwd")
        run_blocks(fwd, bwd, blocks, barrier=barrier)
        assert (fwd.waits, bwd.waits) == (expected, expected)
        # each strand keeps its plan order across blocks
        assert [e for e in log if e.startswith("f.")] == ["f.a", "f.b", "f.c"]
        assert [e for e in log if e.startswith("b.")] == ["b.x", "b.y", "b.z"]


def test_run_blocks_marks_each_block_s_end_numbered_from_first_index():
    from dhelix.runtime.timeline import Timeline

    log = []
    fwd = _Execution("f", {"a": "comp", "b": "comm"}, log)
    bwd = _Execution("b", {"x": "comp", "y": "comp"}, log, phase="bwd")
    clock = iter(range(100))
    timeline = Timeline(block_clock=lambda: float(next(clock)))
    run_blocks(fwd, bwd, [Block(("a",), ("x",)), Block(("b",), ("y",))], timeline=timeline,
               first_index=3)  # the blocks after a seam's head start at index 3
    assert [(index, start, end) for index, start, end in timeline.blocks] == [
        (3, 0.0, 1.0), (4, 1.0, 2.0)]
    assert {kind for kind, *_ in timeline.spans} >= {"compute", "issue", "barrier"}
