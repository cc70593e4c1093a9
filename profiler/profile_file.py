"""The operator profile file (`dhelix-profile`, version 1): reader, writer, validation, hash.

Layout (all times in milliseconds):
    {"format": "dhelix-profile", "version": 1,
     "hardware": "<fingerprint string>" | {fingerprint fields},
     "solo":  {cost_key: ms},               # each operator timed alone
     "pairs": {"keyA|keyB": ms},            # two operators co-executed (unordered pair)
     "pair_compute": {"keyA|keyB": ms},     # optional: a computation x collective pair's
                                            # computation alone (its stream's end)
     "meta":  {"repeats": int >= 1, "warmup": int >= 0, "ranks": int >= 1,
               "created": "ISO-8601 time"}}

A pair names two cost keys that must both have a solo time (otherwise the overlap
effectiveness of the pair cannot be computed); a pair is unordered, so "a|b" and "b|a" are the
same pair and may appear at most once between them. Cost keys may not contain "|".

`pair_compute` (optional; absent in profiles made before it): for a pair of a computation
and a collective, when the computation ended, measured from the pair's start like the pair
itself (on CUDA an event on the compute stream right after the computation, before the
collective is waited for). The pair's own time is its makespan, which is the collective's
whenever the computation is the shorter: only this entry shows how much the collective
slowed the computation (`planner.costs.computation_slowdown`). Every entry names a pair of
`pairs`.

The profiler (a later issue) measures and writes these files; the planner reads them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dhelix.file_formats import read_parsed, write_versioned

PROFILE_FORMAT_VERSION = 1
PAIR_SEPARATOR = "|"
META_FIELDS = {"repeats": 1, "warmup": 0, "ranks": 1}  # integer field -> smallest legal value


def oef(t_a: float, t_b: float, p_ab: float) -> float:
    """Overlap effectiveness factor (T_a + T_b - P_ab) / min(T_a, T_b)."""
    return (t_a + t_b - p_ab) / min(t_a, t_b)


def pair_key(key_a: str, key_b: str) -> frozenset | tuple:
    """The lookup key of an unordered pair of cost keys (a frozenset, or a 1-tuple when both
    operators share one cost key)."""
    return (key_a,) if key_a == key_b else frozenset((key_a, key_b))


def canonical_hardware(hardware) -> str:
    """A hardware fingerprint as one stable string: strings stay as they are, a dict becomes
    compact JSON with sorted keys (so field order never changes the fingerprint)."""
    if isinstance(hardware, str):
        return hardware
    return json.dumps(hardware, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Profile:
    """A validated profile. `pairs` maps `pair_key(a, b)` to the co-executed time of the two
    operators; `sha` is `profile_sha` of the document it was read from or will be written as."""

    hardware: str | dict
    solo: dict
    pairs: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    pair_compute: dict = field(default_factory=dict)

    def pair_ms(self, key_a: str, key_b: str) -> float | None:
        """Measured co-execution time of the two cost keys, or None if not profiled."""
        return self.pairs.get(pair_key(key_a, key_b))

    def pair_compute_ms(self, key_a: str, key_b: str) -> float | None:
        """When the computation of a measured computation x collective pair ended (ms from
        the pair's start), or None if not measured."""
        return self.pair_compute.get(pair_key(key_a, key_b))

    def to_document(self) -> dict:
        """The JSON payload (without the format/version header), pairs as "a|b" strings in
        a deterministic order; `pair_compute` only when it has entries (so a profile without
        them keeps the hash it had before the section existed)."""
        document = {
            "hardware": self.hardware,
            "solo": dict(sorted(self.solo.items())),
            "pairs": _named_pairs(self.pairs),
            "meta": dict(self.meta),
        }
        if self.pair_compute:
            document["pair_compute"] = _named_pairs(self.pair_compute)
        return document

    @property
    def sha(self) -> str:
        return profile_sha(self.to_document())


def _named_pairs(pairs: dict) -> dict:
    """{pair_key: ms} as {"a|b": ms}, names sorted."""
    named = {}
    for key, ms in pairs.items():
        names = sorted(key) if isinstance(key, frozenset) else [key[0], key[0]]
        named[PAIR_SEPARATOR.join(names)] = ms
    return dict(sorted(named.items()))


def profile_sha(document: dict) -> str:
    """sha256 (hex) of the profile's canonical JSON (header removed, times as floats, sorted
    keys, compact separators): the same measurements give the same hash whatever the file's
    formatting, key order, number spelling (2 vs 2.0) or pair spelling ("a|b" vs "b|a")."""
    body = {k: v for k, v in document.items() if k not in ("format", "version")}
    body["solo"] = {key: float(ms) for key, ms in body.get("solo", {}).items()}
    body["pairs"] = _canonical_pairs(body.get("pairs", {}))
    if "pair_compute" in body:
        body["pair_compute"] = _canonical_pairs(body["pair_compute"])
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical_pairs(section: dict) -> dict:
    return {PAIR_SEPARATOR.join(sorted(name.split(PAIR_SEPARATOR))): float(ms)
            for name, ms in section.items()}


def _positive_ms(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: time must be a number of milliseconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: time must be a positive finite number of ms, got {value!r}")
    return value


def profile_from_document(document: dict) -> Profile:
    """Validate a profile payload and return it as a `Profile`. Raises ValueError naming the
    offending entry: a missing section, a non-positive time, a cost key containing '|', a
    pair naming a cost key that has no solo time, a pair listed twice, a `pair_compute`
    entry of no listed pair, bad meta fields."""
    for section in ("hardware", "solo", "pairs", "meta"):
        if section not in document:
            raise ValueError(f"missing section {section!r}")
    hardware = document["hardware"]
    if not (isinstance(hardware, str) and hardware) and not (
        isinstance(hardware, dict) and hardware
    ):
        raise ValueError(f"hardware must be a non-empty string or object, got {hardware!r}")
    solo_in, pairs_in, meta = document["solo"], document["pairs"], document["meta"]
    if not isinstance(solo_in, dict) or not solo_in:
        raise ValueError("solo must be a non-empty object {cost_key: ms}")
    if not isinstance(pairs_in, dict):
        raise ValueError("pairs must be an object {\"keyA|keyB\": ms}")
    solo = {}
    for key, ms in solo_in.items():
        if not key or PAIR_SEPARATOR in key:
            raise ValueError(f"solo: cost key {key!r} is empty or contains {PAIR_SEPARATOR!r}")
        solo[key] = _positive_ms(f"solo[{key!r}]", ms)
    pairs = {}
    for name, ms in pairs_in.items():
        parts = name.split(PAIR_SEPARATOR)
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"pairs: {name!r} is not of the form 'keyA|keyB'")
        unknown = [p for p in parts if p not in solo]
        if unknown:
            raise ValueError(
                f"pairs[{name!r}] names cost key(s) {unknown} that have no solo time"
            )
        key = pair_key(*parts)
        if key in pairs:
            raise ValueError(f"pairs: {name!r} is listed twice (as 'a|b' and 'b|a')")
        pairs[key] = _positive_ms(f"pairs[{name!r}]", ms)
    pair_compute = _pair_compute(document.get("pair_compute", {}), pairs)
    if not isinstance(meta, dict):
        raise ValueError("meta must be an object")
    for name, least in META_FIELDS.items():
        value = meta.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"meta.{name} must be an integer >= {least}, got {value!r}")
    if not isinstance(meta.get("created"), str) or not meta["created"]:
        raise ValueError(f"meta.created must be a timestamp string, got {meta.get('created')!r}")
    return Profile(hardware=hardware, solo=solo, pairs=pairs, meta=dict(meta),
                   pair_compute=pair_compute)


def _pair_compute(section, pairs: dict) -> dict:
    """The validated `pair_compute` section: every entry a positive time of a pair listed
    in `pairs`."""
    if not isinstance(section, dict):
        raise ValueError("pair_compute must be an object {\"keyA|keyB\": ms}")
    result = {}
    for name, ms in section.items():
        parts = name.split(PAIR_SEPARATOR)
        if len(parts) != 2 or not all(parts) or pair_key(*parts) not in pairs:
            raise ValueError(f"pair_compute[{name!r}] names no pair of 'pairs'")
        key = pair_key(*parts)
        if key in result:
            raise ValueError(f"pair_compute: {name!r} is listed twice (as 'a|b' and 'b|a')")
        result[key] = _positive_ms(f"pair_compute[{name!r}]", ms)
    return result


def save_profile(profile: Profile, path) -> Path:
    """Write `profile` atomically as a dhelix-profile v1 file (validating it first)."""
    document = profile.to_document()
    profile_from_document(document)
    return write_versioned(path, "profile", PROFILE_FORMAT_VERSION, document)


def load_profile(path) -> Profile:
    """Read and validate a dhelix-profile v1 file; FormatError names the file and the problem."""
    return read_parsed(path, "profile", PROFILE_FORMAT_VERSION, profile_from_document)
