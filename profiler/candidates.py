"""Which operator pairs the profiler co-executes, in which order, and how they are grouped
into measurement passes.

A candidate is one (forward operator, backward operator) pair per distinct pair of cost
keys (the profile stores pairs by cost key; the first pair in program order represents
all pairs of the same keys). Pairs the planner can never use are skipped: communication of
both strands on the same channel (`planner.blocks.shared_channels`). The rest are ordered by
potential gain `min(T_i, T_j)` - what perfect overlap would save - largest first, ties by
cost key, and optionally capped. Everything here is a pure function of the programs and the
solo times, so every rank derives the same list in the same order (collectives stay
matched).

A *chain* is a list of candidates whose forward and backward positions both strictly
increase: one forward execution and one backward execution can then walk through all of
them in program order, so one pass measures a whole chain (`chains`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dhelix.dag import shared_channels
from profiler.profile_file import PAIR_SEPARATOR


@dataclass(frozen=True)
class Candidate:
    """A pair to measure: forward op `fwd` (position `fwd_pos` in the forward program) with
    backward op `bwd` (`bwd_pos`); `name` is the profile's pair key 'keyA|keyB' (sorted)."""

    fwd: str
    bwd: str
    fwd_pos: int
    bwd_pos: int
    name: str
    gain_ms: float


@dataclass(frozen=True)
class Selection:
    """The candidates to measure (ordered by gain) and how many pairs were left out."""

    candidates: tuple
    skipped_same_channel: int   # distinct cost-key pairs never co-run by the planner
    capped: int                 # legal distinct pairs beyond --max-pairs


def pair_name(key_a: str, key_b: str) -> str:
    return PAIR_SEPARATOR.join(sorted((key_a, key_b)))


def select_pairs(forward, backward, solo_ms: dict, max_pairs: int | None = None,
                 comp_only: bool = False) -> Selection:
    """Candidates from a forward and a backward `Program` given solo times by cost key.
    `comp_only` keeps computation pairs only; pairs whose cost keys have no solo time are
    left out (nothing to compare them with)."""
    seen: dict[str, Candidate] = {}
    illegal: set[str] = set()
    for i, a in enumerate(forward.ops):
        for j, b in enumerate(backward.ops):
            name = pair_name(a.cost_key, b.cost_key)
            if name in seen or name in illegal:
                continue
            if shared_channels([a], [b]) or (comp_only and "comm" in (a.kind, b.kind)):
                illegal.add(name)
                continue
            if a.cost_key not in solo_ms or b.cost_key not in solo_ms:
                continue
            gain = min(solo_ms[a.cost_key], solo_ms[b.cost_key])
            seen[name] = Candidate(a.id, b.id, i, j, name, gain)
    ordered = sorted(seen.values(), key=lambda c: (-c.gain_ms, c.name))
    keep = ordered if max_pairs is None else ordered[:max(0, max_pairs)]
    return Selection(tuple(keep), len(illegal - set(seen)), len(ordered) - len(keep))


def chains(candidates) -> list[list[Candidate]]:
    """Partition candidates into chains (forward and backward positions strictly
    increasing), greedily in (forward, backward) position order: each candidate joins the
    first chain it can extend. Deterministic; the chains' order is their creation order."""
    result: list[list[Candidate]] = []
    for cand in sorted(candidates, key=lambda c: (c.fwd_pos, c.bwd_pos, c.name)):
        for chain in result:
            last = chain[-1]
            if last.fwd_pos < cand.fwd_pos and last.bwd_pos < cand.bwd_pos:
                chain.append(cand)
                break
        else:
            result.append([cand])
    return result
