"""Cost model of the planner: solo time of every operator and co-execution slowdown of every
(forward operator, backward operator) pair.

Co-execution is described by the overlap effectiveness factor of the paper,
    OEF(a, b) = (T_a + T_b - P_ab) / min(T_a, T_b),
with T the solo times and P_ab the time two operators take when started together. The block
model (`planner.cosched`) turns it into a slowdown: while a and b co-run, each progresses at
1/sigma of its solo speed, sigma = 2 - OEF. Two operators started together then finish after
exactly P_ab (the shorter ends at sigma*min, the longer runs its last max-min alone), so
measured pairs are reproduced exactly; OEF = 1 is perfect overlap (sigma 1), OEF = 0 is no gain
(sigma 2, as if run back to back), negative OEF is interference worse than sequential.

Where each number comes from (its *source*):
- solo: "measured" (profile `solo[cost_key]`) or "default" (no profile: `DEFAULT_SOLO_MS`).
- pair: "measured" (profile `pairs`), else estimated from the mean OEF measured for the same
  pair of operator classes ("class"), else for the same pair of resource kinds
  comp / comm:intra / comm:inter ("kind"), else `DEFAULT_OEF` ("default"). Every source other
  than "measured" is an estimate, and plans mark blocks that relied on one.

Analytic default (no profile at all): rough relative costs, chosen to resemble a TP+SP GPT
layer (hidden 4096, sequence 4096, TP 8, bf16) on an NVLink node, with a GEMM as 1.0:
attention core 1.5, LayerNorm 0.15, element-wise 0.1, all-gather / reduce-scatter 0.6,
all-reduce 1.0, send/recv 0.3, all-to-all 0.8; a communication op on the cross-node channel
costs `INTER_NODE_FACTOR` (2.5) times its intra-node figure; an unknown class costs 0.5.
Default OEFs follow the paper's measurements (section 3.1): computation does not overlap with
computation (0.0); communication overlaps well with computation (0.75, i.e. the 20-30% kernel
slowdown of section 6.3.3); intra-node with cross-node communication overlaps fairly (0.6).
These only have to rank plans sensibly; a profile replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean

from dhelix.dag import OpDAG, OpNode, computation_beside_collective, shared_channels
from dhelix.file_formats import REGENERATE, FormatError
from profiler.profile_file import Profile, canonical_hardware, oef

ANALYTIC_PROFILE_SHA = "analytic-v1"

DEFAULT_SOLO_MS = {
    "gemm": 1.0,
    "attention": 1.5,
    "norm": 0.15,
    "elementwise": 0.1,
    "all_gather": 0.6,
    "reduce_scatter": 0.6,
    "all_reduce": 1.0,
    "send_recv": 0.3,
    "all_to_all": 0.8,
}
DEFAULT_UNKNOWN_MS = 0.5
INTER_NODE_FACTOR = 2.5

# OEF by resource-kind pair (unordered); same-channel communication is never co-run (illegal).
DEFAULT_OEF = {
    frozenset(["comp"]): 0.0,
    frozenset(["comp", "comm:intra"]): 0.75,
    frozenset(["comp", "comm:inter"]): 0.75,
    frozenset(["comm:intra", "comm:inter"]): 0.6,
    frozenset(["comm:intra"]): 0.0,
    frozenset(["comm:inter"]): 0.0,
}

PAIR_SOURCES = ("measured", "class", "kind", "default")


def resource_kind(op: OpNode) -> str:
    """comp, comm:intra or comm:inter: the resource an operator occupies."""
    return "comp" if op.kind == "comp" else f"comm:{op.channel}"


def default_solo_ms(op: OpNode) -> float:
    """The analytic-default solo time of an operator (see the module docstring)."""
    ms = DEFAULT_SOLO_MS.get(op.op_class, DEFAULT_UNKNOWN_MS)
    return ms * INTER_NODE_FACTOR if op.channel == "inter" else ms


def sigma_from_oef(value: float) -> float:
    """Co-run slowdown for an OEF; OEF above 1 (a pair faster than its longer operator,
    i.e. measurement noise) is treated as perfect overlap."""
    return 2.0 - min(value, 1.0)


@dataclass(frozen=True)
class CostModel:
    """Costs for one forward DAG and one backward DAG.

    source: "profile" (solo times measured) or "analytic" (everything is the default);
    solo_f / solo_b: op id -> solo ms; sigma: (fwd id, bwd id) -> co-run slowdown (>= 1);
    pair_source: (fwd id, bwd id) -> one of PAIR_SOURCES. `profile_sha` and `hardware` feed
    the plan fingerprint. compute_sigma: (fwd id, bwd id) -> how much the collective of a
    computation x collective pair slowed the computation while both ran
    (`computation_slowdown`), for the pairs whose profile entry has the computation's own
    time (`Profile.pair_compute`); empty otherwise."""

    source: str
    solo_f: dict
    solo_b: dict
    sigma: dict
    pair_source: dict
    profile_sha: str
    hardware: str
    compute_sigma: dict = field(default_factory=dict)

    def estimated_pair(self, fwd_id: str, bwd_id: str) -> bool:
        """True unless this pair's co-execution time was measured."""
        return self.source != "profile" or self.pair_source[(fwd_id, bwd_id)] != "measured"

    def sequential_ms(self) -> float:
        return sum(self.solo_f.values()) + sum(self.solo_b.values())


def pair_source_counts(costs: CostModel, fwd: OpDAG, bwd: OpDAG) -> dict:
    """How many (fwd op, bwd op) pairs a plan may co-run took their cost from each source
    (PAIR_SOURCES); pairs of same-channel communication, which no plan co-runs, are not
    counted."""
    counts = dict.fromkeys(PAIR_SOURCES, 0)
    for a in fwd.ops:
        for b in bwd.ops:
            if not shared_channels([a], [b]):
                counts[costs.pair_source[(a.id, b.id)]] += 1
    return counts


def _class_pair(a: OpNode, b: OpNode) -> frozenset:
    return frozenset([a.op_class or f"?{resource_kind(a)}", b.op_class or f"?{resource_kind(b)}"])


def _kind_pair(a: OpNode, b: OpNode) -> frozenset:
    return frozenset([resource_kind(a), resource_kind(b)])


def check_profile_covers(profile: Profile, dags: list[OpDAG], where: str = "profile") -> None:
    """Raise FormatError if some operator's cost key has no solo time in the profile (naming
    the operators and the command that regenerates the profile)."""
    missing = []
    for dag in dags:
        for op in dag.ops:
            if not op.cost_key:
                missing.append(f"{dag.direction}:{op.id} (empty cost_key)")
            elif op.cost_key not in profile.solo:
                missing.append(f"{dag.direction}:{op.id} ({op.cost_key!r})")
    if missing:
        raise FormatError(
            f"{where}: no solo time for {len(missing)} operator(s) of the DAGs: "
            f"{', '.join(missing)}; the profile was made for another model or operator set, "
            f"regenerate it with `{REGENERATE['profile']}`"
        )


def _measured_oefs(profile: Profile, ops: list[OpNode]):
    """Mean measured OEF per class pair and per kind pair, over the profile's pairs whose two
    cost keys both belong to operators of the DAGs being planned."""
    by_key: dict[str, OpNode] = {}
    for op in ops:
        by_key.setdefault(op.cost_key, op)
    by_class: dict[frozenset, list[float]] = {}
    by_kind: dict[frozenset, list[float]] = {}
    for key, p_ab in profile.pairs.items():
        names = sorted(key) if isinstance(key, frozenset) else [key[0], key[0]]
        if names[0] not in by_key or names[1] not in by_key:
            continue
        a, b = by_key[names[0]], by_key[names[1]]
        value = oef(profile.solo[a.cost_key], profile.solo[b.cost_key], p_ab)
        by_class.setdefault(_class_pair(a, b), []).append(value)
        by_kind.setdefault(_kind_pair(a, b), []).append(value)
    return ({k: fmean(v) for k, v in by_class.items()},
            {k: fmean(v) for k, v in by_kind.items()})


def computation_slowdown(computation_ms: float, collective_ms: float,
                         computation_in_pair_ms: float) -> float:
    """The slowdown sigma of a computation while a collective ran (it progressed at 1/sigma
    of its solo speed), from the solo times and when the computation ended in their pair
    (both started together): the model the streamed simulation runs (`planner.streamed`),
    inverted. Ended within the
    collective: sigma = in_pair / computation. Ended after it: the collective's C ms did
    C / sigma of the work, the rest ran at full speed, so in_pair = C + computation - C /
    sigma and sigma = C / (C + computation - in_pair). Never below 1; where the pair took
    as long as both back to back or longer (no progress beside the collective), the
    computation's whole stretch in_pair / computation."""
    work, collective, ended = computation_ms, collective_ms, computation_in_pair_ms
    if ended <= work:
        return 1.0
    if ended <= collective:
        return ended / work
    if ended < collective + work:
        return max(1.0, collective / (collective + work - ended))
    return ended / work


def build_cost_model(fwd: OpDAG, bwd: OpDAG, profile: Profile | None = None,
                     profile_path: str = "profile") -> CostModel:
    """Costs of every operator and every cross-strand pair of `fwd` x `bwd`.

    With a profile: every operator's cost key must have a solo time (else FormatError); pair
    slowdowns come from measured pairs, else from OEF estimates by class, then by kind, then
    the default (module docstring). Without a profile: the analytic default throughout."""
    if fwd.direction != "fwd" or bwd.direction != "bwd":
        raise ValueError(f"expected a fwd and a bwd DAG, got {fwd.direction} and {bwd.direction}")
    sigma, source = {}, {}
    if profile is None:
        solo_f = {op.id: default_solo_ms(op) for op in fwd.ops}
        solo_b = {op.id: default_solo_ms(op) for op in bwd.ops}
        for a in fwd.ops:
            for b in bwd.ops:
                sigma[(a.id, b.id)] = sigma_from_oef(DEFAULT_OEF[_kind_pair(a, b)])
                source[(a.id, b.id)] = "default"
        return CostModel("analytic", solo_f, solo_b, sigma, source,
                         ANALYTIC_PROFILE_SHA, "unspecified")
    check_profile_covers(profile, [fwd, bwd], profile_path)
    solo_f = {op.id: profile.solo[op.cost_key] for op in fwd.ops}
    solo_b = {op.id: profile.solo[op.cost_key] for op in bwd.ops}
    class_oef, kind_oef = _measured_oefs(profile, list(fwd.ops) + list(bwd.ops))
    for a in fwd.ops:
        for b in bwd.ops:
            p_ab = profile.pair_ms(a.cost_key, b.cost_key)
            if p_ab is not None:
                value, src = oef(solo_f[a.id], solo_b[b.id], p_ab), "measured"
            elif _class_pair(a, b) in class_oef:
                value, src = class_oef[_class_pair(a, b)], "class"
            elif _kind_pair(a, b) in kind_oef:
                value, src = kind_oef[_kind_pair(a, b)], "kind"
            else:
                value, src = DEFAULT_OEF[_kind_pair(a, b)], "default"
            sigma[(a.id, b.id)] = sigma_from_oef(value)
            source[(a.id, b.id)] = src
    return CostModel("profile", solo_f, solo_b, sigma, source, profile.sha,
                     canonical_hardware(profile.hardware),
                     _compute_sigmas(profile, fwd, bwd))


def _compute_sigmas(profile: Profile, fwd: OpDAG, bwd: OpDAG) -> dict:
    """(fwd id, bwd id) -> `computation_slowdown` of every computation x collective pair
    whose computation's own time the profile has."""
    result = {}
    for a in fwd.ops:
        for b in bwd.ops:
            if not computation_beside_collective(a, b):
                continue
            ended = profile.pair_compute_ms(a.cost_key, b.cost_key)
            if ended is None:
                continue
            comp, comm = (a, b) if a.kind == "comp" else (b, a)
            result[(a.id, b.id)] = computation_slowdown(
                profile.solo[comp.cost_key], profile.solo[comm.cost_key], ended)
    return result
