"""The plan file (`dhelix-plan`, version 1): a strand-interleaving plan for one layer, and the
fingerprint that ties it to one run.

Document (all times in ms):
    {"format": "dhelix-plan", "version": 1,
     "fingerprint": {"model", "parallel", "hardware", "profile_sha", "dag_sha"},
     "pairer": "dp" | "sequential" | "round_robin",
     "cost_source": "profile" | "analytic",
     "options": {"max_orders", "wgrad_move"},
     "fwd_order": [ids], "bwd_order": [ids],
     "blocks": [{"fwd": [ids], "bwd": [ids], "start_ms", "predicted_ms", "estimated"}],
     "predicted": {"sequential_ms", "planned_ms", "speedup", "estimated"},
     "ops": {"fwd": {id: {"kind", "channel", "op_class", "solo_ms"}}, "bwd": {...}},
     "timeline": [{"strand", "op", "block", "start_ms", "end_ms"}],
     "search": {"fwd_orders", "bwd_orders", "seconds",
                "memory": {bound summary, "plan_peak_mib", "block_peak_mib", "ops"}},
     "command": "the dhelix plan command line that made it"}

`search.memory` (a plan the dp pairer built within a memory bound, `planner.build`) holds
the bound (MiB above a layer pair's start), each block's peak by the bound's model and the
per-operator readings it was made from. `estimated` is true for a block whose prediction
used at least one estimated number (a pair time derived from OEF statistics rather than
measured, or the analytic default); the plan's `predicted.estimated` is true if any block
is. `ops` and `timeline` make the file
self-contained for `dhelix plan show`. The runtime checks `fingerprint` against its own run
with `check_fingerprint` before using a plan.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dhelix.dag import OpDAG, topological_violation
from dhelix.file_formats import FormatError, read_parsed, write_versioned

PLAN_FORMAT_VERSION = 1
FINGERPRINT_FIELDS = ("model", "parallel", "hardware", "profile_sha", "dag_sha")
UNSPECIFIED = "unspecified"
_REL_TOL = 1e-6


class PlanMismatch(FormatError):
    """A plan was made for another model, parallel layout, hardware, profile or DAG."""


def fingerprint_string(fields: dict) -> str:
    """A stable one-line fingerprint of a configuration mapping, "key=value,..." with sorted
    keys (e.g. {"tp": 2, "pp": 2, "sp": True} -> "pp=2,sp=True,tp=2"). Use the same function
    when writing a plan and when checking it, so that field order never matters."""
    return ",".join(f"{key}={fields[key]}" for key in sorted(fields))


def dag_sha(fwd: OpDAG, bwd: OpDAG) -> str:
    """sha256 of the canonical JSON of both DAGs: identifies the operator set a plan is for."""
    text = json.dumps([fwd.to_dict(), bwd.to_dict()], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PlanBlock:
    fwd: tuple
    bwd: tuple
    start_ms: float
    predicted_ms: float
    estimated: bool


@dataclass(frozen=True)
class Plan:
    """A validated plan (see the module docstring for the meaning of each field)."""

    fingerprint: dict
    pairer: str
    cost_source: str
    options: dict
    fwd_order: tuple
    bwd_order: tuple
    blocks: tuple
    sequential_ms: float
    planned_ms: float
    estimated: bool
    ops: dict
    timeline: tuple
    search: dict = field(default_factory=dict)
    command: str = ""

    @property
    def speedup(self) -> float:
        return self.sequential_ms / self.planned_ms

    def block_solo_ms(self, block: PlanBlock) -> float:
        """What the block's operators take one after another (its time without pairing)."""
        return (sum(self.ops["fwd"][o]["solo_ms"] for o in block.fwd)
                + sum(self.ops["bwd"][o]["solo_ms"] for o in block.bwd))

    def to_document(self) -> dict:
        return {
            "fingerprint": dict(self.fingerprint),
            "pairer": self.pairer,
            "cost_source": self.cost_source,
            "options": dict(self.options),
            "fwd_order": list(self.fwd_order),
            "bwd_order": list(self.bwd_order),
            "blocks": [{"fwd": list(b.fwd), "bwd": list(b.bwd), "start_ms": b.start_ms,
                        "predicted_ms": b.predicted_ms, "estimated": b.estimated}
                       for b in self.blocks],
            "predicted": {"sequential_ms": self.sequential_ms, "planned_ms": self.planned_ms,
                          "speedup": self.speedup, "estimated": self.estimated},
            "ops": {s: {k: dict(v) for k, v in self.ops[s].items()} for s in ("fwd", "bwd")},
            "timeline": [dict(span) for span in self.timeline],
            "search": dict(self.search),
            "command": self.command,
        }


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(1.0, abs(a), abs(b))


def _require(document: dict, key: str, kind):
    if key not in document:
        raise ValueError(f"missing field {key!r}")
    value = document[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def plan_from_document(document: dict) -> Plan:
    """Validate a plan payload and build a `Plan`. Raises ValueError naming the first
    inconsistency: missing or mistyped fields, orders that are not permutations of the listed
    ops, blocks that do not cut the orders, same-channel communication paired in a block,
    per-block times that do not add up to the planned time, a wrong speedup."""
    fp = _require(document, "fingerprint", dict)
    for name in FINGERPRINT_FIELDS:
        if not isinstance(fp.get(name), str) or not fp[name]:
            raise ValueError(f"fingerprint.{name} must be a non-empty string")
    ops = _require(document, "ops", dict)
    for strand in ("fwd", "bwd"):
        if not isinstance(ops.get(strand), dict):
            raise ValueError(f"ops.{strand} must be an object")
        for op_id, info in ops[strand].items():
            if not isinstance(info, dict) or {"kind", "channel", "solo_ms"} - set(info):
                raise ValueError(f"ops.{strand}.{op_id} needs kind, channel and solo_ms")
            _number(info["solo_ms"], f"ops.{strand}.{op_id}.solo_ms")
    orders = {}
    for strand in ("fwd", "bwd"):
        order = _require(document, f"{strand}_order", list)
        if sorted(order) != sorted(ops[strand]):
            missing = sorted(set(ops[strand]) - set(order))
            extra = sorted(set(order) - set(ops[strand]))
            raise ValueError(f"{strand}_order is not a permutation of the {strand} ops "
                             f"(missing {missing}, unknown {extra})")
        orders[strand] = tuple(order)
    blocks, cut = [], {"fwd": [], "bwd": []}
    clock = 0.0
    for number, raw in enumerate(_require(document, "blocks", list), start=1):
        if not isinstance(raw, dict):
            raise ValueError(f"block {number} is not an object")
        seg = {s: tuple(raw.get(s, ())) for s in ("fwd", "bwd")}
        if not seg["fwd"] and not seg["bwd"]:
            raise ValueError(f"block {number} is empty")
        for s in ("fwd", "bwd"):
            cut[s].extend(seg[s])
        channels = [{ops[s][o]["channel"] for o in seg[s] if ops[s][o]["kind"] == "comm"}
                    for s in ("fwd", "bwd")]
        if channels[0] & channels[1]:
            raise ValueError(f"block {number} pairs communication of both strands on channel "
                             f"{sorted(channels[0] & channels[1])}")
        start = _number(raw.get("start_ms"), f"block {number} start_ms")
        ms = _number(raw.get("predicted_ms"), f"block {number} predicted_ms")
        if not _close(start, clock):
            raise ValueError(f"block {number} starts at {start} ms, expected {clock} ms "
                             f"(blocks run back to back)")
        clock += ms
        blocks.append(PlanBlock(seg["fwd"], seg["bwd"], start, ms, bool(raw.get("estimated"))))
    for s in ("fwd", "bwd"):
        if tuple(cut[s]) != orders[s]:
            raise ValueError(f"the blocks' {s} segments do not concatenate to {s}_order")
    predicted = _require(document, "predicted", dict)
    seq = _number(predicted.get("sequential_ms"), "predicted.sequential_ms")
    planned = _number(predicted.get("planned_ms"), "predicted.planned_ms")
    if not _close(planned, clock):
        raise ValueError(f"predicted.planned_ms {planned} differs from the sum of the blocks' "
                         f"predicted_ms {clock}")
    solo_total = sum(i["solo_ms"] for s in ("fwd", "bwd") for i in ops[s].values())
    if not _close(seq, solo_total):
        raise ValueError(f"predicted.sequential_ms {seq} differs from the sum of solo times "
                         f"{solo_total}")
    if planned <= 0 or not _close(_number(predicted.get("speedup"), "speedup"), seq / planned):
        raise ValueError(f"predicted.speedup {predicted.get('speedup')} is not "
                         f"sequential_ms / planned_ms")
    timeline = _require(document, "timeline", list)
    seen = set()
    for span in timeline:
        if not isinstance(span, dict) or span.get("strand") not in ("fwd", "bwd") or \
                span.get("op") not in ops[span.get("strand")]:
            raise ValueError(f"timeline entry {span!r} names no known op")
        block = span.get("block")
        if isinstance(block, bool) or not isinstance(block, int) or \
                not 0 <= block < len(blocks):
            raise ValueError(f"timeline entry for {span['op']!r} names no block ({block!r})")
        start = _number(span.get("start_ms"), f"timeline {span['op']!r} start_ms")
        if _number(span.get("end_ms"), f"timeline {span['op']!r} end_ms") < start:
            raise ValueError(f"timeline entry for {span['op']!r} ends before it starts")
        seen.add((span["strand"], span["op"]))
    if len(seen) != len(timeline) or len(seen) != len(ops["fwd"]) + len(ops["bwd"]):
        raise ValueError("timeline must list every op exactly once")
    return Plan(
        fingerprint={k: fp[k] for k in FINGERPRINT_FIELDS},
        pairer=_require(document, "pairer", str),
        cost_source=_require(document, "cost_source", str),
        options=dict(_require(document, "options", dict)),
        fwd_order=orders["fwd"], bwd_order=orders["bwd"], blocks=tuple(blocks),
        sequential_ms=seq, planned_ms=planned, estimated=bool(predicted.get("estimated")),
        ops={s: {k: dict(v) for k, v in ops[s].items()} for s in ("fwd", "bwd")},
        timeline=tuple(dict(span) for span in timeline),
        search=dict(document.get("search", {})),
        command=str(document.get("command", "")),
    )


def save_plan(plan: Plan, path) -> Path:
    """Validate and atomically write `plan` as a dhelix-plan v1 file."""
    document = plan.to_document()
    plan_from_document(document)
    return write_versioned(path, "plan", PLAN_FORMAT_VERSION, document)


def load_plan(path) -> Plan:
    """Read and validate a dhelix-plan v1 file; FormatError names the file and the problem."""
    return read_parsed(path, "plan", PLAN_FORMAT_VERSION, plan_from_document,
                       regenerate=regenerate_command)


def load_checked_plan(path, expected: dict, fwd: OpDAG | None = None,
                      bwd: OpDAG | None = None, inputs: dict | None = None) -> Plan:
    """What a run uses: `load_plan`, then `check_fingerprint` against the run's `expected`
    fields, then (if the run's DAGs are given) `check_plan_dags`. Raises FormatError (or its
    subclass PlanMismatch) naming the file, every difference and the regenerate command
    (`regenerate_command`; `inputs` names this run's files for it)."""
    plan = load_plan(path)
    check_fingerprint(plan, expected, str(path), inputs)
    if fwd is not None and bwd is not None:
        check_plan_dags(plan, fwd, bwd, str(path), inputs)
    return plan


def _set_option(words: list, flag: str, value) -> None:
    """Give `flag` the value `value` in a command's words (inserted before `-o`, or appended
    for `-o` itself, if absent); value None removes the flag and its value."""
    if flag in words[:-1]:
        at = words.index(flag)
        if value is None:
            del words[at:at + 2]
        else:
            words[at + 1] = value
    elif value is not None:
        at = words.index("-o") if "-o" in words and flag != "-o" else len(words)
        words[at:at] = [flag, value]


def regenerate_command(plan_or_document, expected: dict | None = None,
                       inputs: dict | None = None) -> str:
    """The `dhelix plan` command that rebuilds this plan (as recorded in it), with the
    --model / --parallel / --hardware values replaced by `expected` ones where given, and
    the options in `inputs` (e.g. {"--fwd-dag": F, "--bwd-dag": B, "--profile": P, "-o":
    PLAN}; value None drops the option) set to this run's files. A recorded --profile is
    dropped when `expected` names another model or parallel layout than the plan's and
    `inputs` gives none: a profile is tied to both, and `dhelix plan` would refuse it."""
    if isinstance(plan_or_document, Plan):
        command = plan_or_document.command
        recorded = plan_or_document.fingerprint
    else:
        command = (plan_or_document or {}).get("command", "")
        recorded = (plan_or_document or {}).get("fingerprint", {})
    if not isinstance(command, str) or not command.startswith("dhelix plan"):
        command = "dhelix plan --fwd-dag FWD --bwd-dag BWD --profile PROFILE -o PLAN"
    words = shlex.split(command)
    expected = expected or {}
    for name in ("model", "parallel", "hardware"):
        if name in expected:
            _set_option(words, f"--{name}", expected[name])
    inputs = dict(inputs or {})
    if any(name in expected and expected[name] != recorded.get(name)
           for name in ("model", "parallel")):
        inputs.setdefault("--profile", None)
    for flag, value in inputs.items():
        _set_option(words, flag, value)
    return shlex.join(words)


def check_fingerprint(plan: Plan, expected: dict, path: str = "plan",
                      inputs: dict | None = None) -> None:
    """Raise PlanMismatch if any fingerprint field given in `expected` differs from the plan's,
    naming every differing field (plan value vs run value) and the command that regenerates
    the plan for this run (`regenerate_command(plan, expected, inputs)`). Fields absent
    from `expected` are not compared."""
    unknown = set(expected) - set(FINGERPRINT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fingerprint field(s) {sorted(unknown)}; "
                         f"known: {FINGERPRINT_FIELDS}")
    diffs = [f"{name}: plan has {plan.fingerprint[name]!r}, this run has {expected[name]!r}"
             for name in FINGERPRINT_FIELDS
             if name in expected and plan.fingerprint[name] != expected[name]]
    if diffs:
        hint = ""
        if "--fwd-dag" not in (inputs or {}) and any(
                d.startswith(("profile_sha", "dag_sha")) for d in diffs):
            hint = " (pass this run's operator DAGs and profile)"
        raise PlanMismatch(
            f"{path}: plan does not match this run: " + "; ".join(diffs)
            + f"; regenerate it with `{regenerate_command(plan, expected, inputs)}`{hint}"
        )


def check_plan_dags(plan: Plan, fwd: OpDAG, bwd: OpDAG, path: str = "plan",
                    inputs: dict | None = None) -> None:
    """Raise PlanMismatch if the plan was not made for these operator DAGs: different op sets,
    an order that breaks a dependency of the DAG, or a different DAG hash. The advice is
    `regenerate_command(plan, inputs=inputs)`."""
    for dag, order in ((fwd, plan.fwd_order), (bwd, plan.bwd_order)):
        problem = topological_violation(dag, order)
        if problem:
            raise PlanMismatch(f"{path}: plan does not fit the {dag.direction} DAG: {problem}; "
                               f"regenerate it with `{regenerate_command(plan, inputs=inputs)}`")
    check_fingerprint(plan, {"dag_sha": dag_sha(fwd, bwd)}, path, inputs)
