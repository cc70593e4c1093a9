"""One profiling job: build the layer, time every operator alone, pick the candidate pairs,
time them co-executed, write the profile - resuming from a partial file.

Runs on every rank of the world (torchrun); all ranks take the same decisions in the same
order (collectives stay matched): what to resume is decided on rank 0 and broadcast, solo
times are the slowest rank's (identical everywhere), and the candidates and chains are a
pure function of them (`profiler.candidates`).

Partial file (`<output>.partial`, `dhelix-profile-partial` v1, written atomically by rank 0
after the solo passes and after every chain): the hardware fingerprint, the run (model and
parallel fingerprints, world size, ranks per node), the measuring options, and what has been
measured so far (the solo medians that ranked the pairs, every solo sample, the pair
medians, and when the computation of each computation x collective pair ended). A re-run
with the same fingerprint, run and options resumes: the solo phase is not repeated,
measured pairs are skipped. A partial file of another machine, run or options is
refused (`PartialMismatch`) unless `overwrite` is set. The partial file is removed once the
profile is written.

Solo samples are spread over the whole job: after the solo phase (which ranks the pairs by
potential gain), one more solo pass follows every chain, and a cost key's final solo time
is the median of all its samples. A machine whose load drifts during the job then biases
solo and pair times alike, instead of comparing pairs measured late with solos measured
early (OEF divides by the shorter solo time, so such a bias is amplified).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from dhelix.file_formats import FormatError, read_versioned, write_versioned
from profiler.candidates import chains, select_pairs
from profiler.fingerprint import hardware_differences, hardware_fingerprint
from profiler.profile_file import Profile, pair_key, save_profile
from profiler.progress import Progress
from profiler.timing import LayerUnderTest, Timer, median_ms, pair_pass, solo_pass

PARTIAL_KIND = "profile-partial"
PARTIAL_VERSION = 1


class PartialMismatch(FormatError):
    """A partial profile file belongs to another machine, run or set of options."""


@dataclass(frozen=True)
class ProfileOptions:
    """How to measure. Only the fields in `identity()` must match for a resume."""

    warmup: int = 1
    repeats: int = 5
    max_pairs: int | None = None
    comp_only: bool = False

    def __post_init__(self):
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("--warmup must be >= 0 and --repeats >= 1")
        if self.max_pairs is not None and self.max_pairs < 0:
            raise ValueError("--max-pairs must be >= 0")

    def identity(self) -> dict:
        return asdict(self)


def partial_path(output) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".partial")


@dataclass
class PartialState:
    """What a partial file holds besides its header."""

    hardware: dict
    run: dict
    options: dict
    solo: dict          # solo-phase medians: what ranked the pairs (fixed once measured)
    solo_samples: dict  # cost key -> every slowest-rank solo sample so far
    pairs: dict
    ops: dict
    pair_compute: dict = field(default_factory=dict)  # absent in older partial files

    def to_document(self) -> dict:
        return asdict(self)


def load_partial(path) -> PartialState:
    document = read_versioned(path, PARTIAL_KIND, PARTIAL_VERSION)
    try:
        optional = {"pair_compute"}
        return PartialState(**{k: document[k] for k in PartialState.__dataclass_fields__
                               if k in document or k not in optional})
    except KeyError as exc:
        raise FormatError(f"{path}: partial profile lacks {exc}; delete it or pass "
                          "--overwrite") from exc


def check_partial(state: PartialState, path, hardware: dict, run: dict, options: dict) -> None:
    """Raise PartialMismatch (naming the file and each difference) unless the partial file
    was written by a job with this fingerprint, run and options."""
    problems = hardware_differences(state.hardware, hardware)
    for name, mine, theirs in (("run", run, state.run), ("options", options, state.options)):
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                problems.append(f"{name}.{key}: partial file has {theirs.get(key)!r}, this "
                                f"job has {mine.get(key)!r}")
    if problems:
        raise PartialMismatch(
            f"{path}: partial profile of another job ({'; '.join(problems)}); re-run with the "
            "same arguments on the same machine to resume it, or pass --overwrite to start "
            "over (the partial file is then replaced)")


@dataclass
class ProfileResult:
    """What a job did (returned on every rank; `profile` only complete jobs have)."""

    output: str
    complete: bool
    solo: dict
    pairs: dict
    ops: dict
    resumed_pairs: int
    measured_pairs: int
    skipped_same_channel: int
    capped: int
    wall_s: float
    profile: Profile | None = None


def _broadcast(obj, rank: int):
    holder = [obj if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _resume_decision(output, hardware, run, options, overwrite: bool):
    """On rank 0: ('ok', state or None) or ('error', message)."""
    path = partial_path(output)
    if not path.exists() or overwrite:
        return "ok", None
    try:
        state = load_partial(path)
        check_partial(state, path, hardware, run, options)
    except FormatError as exc:
        return "error", str(exc)
    return "ok", state


def op_table(layer: LayerUnderTest) -> dict:
    """{cost key: {class, kind, channel}} of the layer's operators (profile meta `ops`)."""
    table = {}
    for program in (layer.forward, layer.backward):
        for op in program.ops:
            table.setdefault(op.cost_key, {"class": op.op_class, "kind": op.kind,
                                           "channel": op.channel})
    return table


def solo_samples(layer: LayerUnderTest, timer: Timer, options: ProfileOptions,
                 samples: dict) -> None:
    """One solo pass; appends the slowest rank's time of every operator to
    `samples[cost_key]` (computation keys only with `comp_only`)."""
    ops = {op.id: op for program in (layer.forward, layer.backward) for op in program.ops}
    local = solo_pass(layer, timer)
    for op_id, ms in zip(local, timer.slowest(list(local.values()))):
        op = ops[op_id]
        if not options.comp_only or op.kind == "comp":
            samples.setdefault(op.cost_key, []).append(ms)


def medians(samples: dict) -> dict:
    """Median of each cost key's samples (ms, kept positive), sorted by key."""
    return {key: max(median_ms(values), 1e-6) for key, values in sorted(samples.items())}


def measure_solo(layer: LayerUnderTest, timer: Timer, options: ProfileOptions,
                 progress: Progress, samples: dict) -> dict:
    """The solo phase: `warmup` discarded passes, then `repeats` passes into `samples`;
    returns their medians by cost key (median over repeats and operators sharing a key)."""
    for number in range(options.warmup + options.repeats):
        solo_samples(layer, timer, options, samples if number >= options.warmup else {})
        progress.advance(note="operators alone")
    return medians(samples)


def slowest_pair_times(timer: Timer, marked: list) -> tuple[list, list]:
    """A pair pass's (pair ms, computation ms or None) as the slowest rank's, in one MAX
    reduction (collective: every rank has marks at the same positions, the chain being the
    same everywhere)."""
    with_mark = [i for i, (_, mark) in enumerate(marked) if mark is not None]
    slowest = timer.slowest([total for total, _ in marked] + [marked[i][1] for i in with_mark])
    pair_ms, marks = slowest[:len(marked)], slowest[len(marked):]
    compute_ms: list = [None] * len(marked)
    for i, ms in zip(with_mark, marks):
        compute_ms[i] = ms
    return pair_ms, compute_ms


def run_profile(layer: LayerUnderTest, output, *, run: dict, options: ProfileOptions,
                overwrite: bool = False, stop_after: int | None = None, timer: Timer | None = None,
                hardware: dict | None = None, show_progress: bool = True,
                extra_meta: dict | None = None) -> ProfileResult:
    """The whole job on this rank (collective). Rank 0 writes the files. With `stop_after`
    the job stops (partial file kept, `complete=False`) once at least that many pairs have
    been measured in this run - the interruption the resume tests use."""
    started = time.monotonic()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    timer = timer or Timer()
    hardware = hardware or hardware_fingerprint(world)
    everyone = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(everyone, hardware)
    else:
        everyone = [hardware]
    if any(h != hardware for h in everyone):
        hardware = dict(hardware, per_rank=everyone)  # heterogeneous job: record all
    opts = options.identity()
    status, state = _broadcast(
        _resume_decision(output, hardware, run, opts, overwrite) if rank == 0 else None, rank)
    if status == "error":
        raise PartialMismatch(state)
    ops = op_table(layer)
    partial = PartialState(hardware=hardware, run=run, options=opts, ops=ops,
                           solo=dict(state.solo) if state else {},
                           solo_samples={k: list(v) for k, v in state.solo_samples.items()}
                           if state else {},
                           pairs=dict(state.pairs) if state else {},
                           pair_compute=dict(state.pair_compute) if state else {})

    def save_partial():
        if rank == 0:
            write_versioned(partial_path(output), PARTIAL_KIND, PARTIAL_VERSION,
                            partial.to_document())

    passes = options.warmup + options.repeats
    need_solo = not partial.solo
    progress = Progress(total=passes if need_solo else 0, enabled=show_progress and rank == 0)
    if need_solo:
        partial.solo_samples = {}
        partial.solo = measure_solo(layer, timer, options, progress, partial.solo_samples)
        save_partial()
    selection = select_pairs(layer.forward, layer.backward, partial.solo, options.max_pairs,
                             options.comp_only)
    resumed = sum(1 for c in selection.candidates if c.name in partial.pairs)
    todo = [c for c in selection.candidates if c.name not in partial.pairs]
    work = chains(todo)
    progress.total += len(work) * (passes + 1)
    progress.show(f"{len(todo)} pairs to measure in {len(work)} chains"
                  + (f", {resumed} resumed" if resumed else ""), force=True)
    measured = 0
    for chain in work:
        samples = [[] for _ in chain]
        compute_samples = [[] for _ in chain]
        for number in range(passes):
            pair_ms, compute_ms = slowest_pair_times(timer, pair_pass(layer, timer, chain))
            if number >= options.warmup:
                for row, ms in zip(samples, pair_ms):
                    row.append(ms)
                for row, ms in zip(compute_samples, compute_ms):
                    if ms is not None:
                        row.append(ms)
            progress.advance(note=f"pairs ({measured + len(chain)}/{len(todo)})")
        for cand, row, compute_row in zip(chain, samples, compute_samples):
            partial.pairs[cand.name] = max(median_ms(row), 1e-6)
            if compute_row:
                partial.pair_compute[cand.name] = max(median_ms(compute_row), 1e-6)
        solo_samples(layer, timer, options, partial.solo_samples)
        progress.advance(note=f"pairs ({measured + len(chain)}/{len(todo)})")
        measured += len(chain)
        save_partial()
        if stop_after is not None and measured >= stop_after and measured < len(todo):
            return ProfileResult(str(output), False, medians(partial.solo_samples),
                                 partial.pairs, ops, resumed,
                                 measured, selection.skipped_same_channel, selection.capped,
                                 time.monotonic() - started)
    wall = time.monotonic() - started
    solo = medians(partial.solo_samples)
    meta = {
        "repeats": options.repeats, "warmup": options.warmup, "ranks": world,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool": "dhelix profile", **run, "options": opts, "ops": ops,
        "pairs_skipped_same_channel": selection.skipped_same_channel,
        "pairs_capped": selection.capped, "wall_s": round(wall, 2), **(extra_meta or {}),
    }
    profile = Profile(hardware=hardware, solo=solo,
                      pairs={pair_key(*name.split("|")): ms
                             for name, ms in partial.pairs.items()}, meta=meta,
                      pair_compute={pair_key(*name.split("|")): ms
                                    for name, ms in partial.pair_compute.items()})
    if rank == 0:
        save_profile(profile, output)
        partial_path(output).unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()
    return ProfileResult(str(output), True, solo, partial.pairs, ops, resumed, measured,
                         selection.skipped_same_channel, selection.capped, wall, profile)

