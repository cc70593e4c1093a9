"""The profile file format and the cost model built from it."""

import json

import pytest

from dhelix.dag import OpDAG, OpNode
from dhelix.file_formats import FormatError
from planner.cosched import collective_sigma
from planner.costs import (ANALYTIC_PROFILE_SHA, DEFAULT_OEF, build_cost_model,
                           computation_slowdown, default_solo_ms, oef, sigma_from_oef)
from planner.streamed import _compute_end
from profiler.profile_file import (Profile, load_profile, pair_key, profile_from_document,
                                   profile_sha, save_profile)

META = {"repeats": 5, "warmup": 2, "ranks": 2, "created": "2025-01-01T00:00:00"}


def _doc(**changes):
    doc = {"hardware": {"gpu": "H100", "nvlink": True},
           "solo": {"gemm_a": 2.0, "gemm_b": 1.0, "ag": 1.0, "rs": 0.5, "a2a": 2.0},
           "pairs": {"gemm_a|ag": 2.2, "rs|gemm_b": 1.2}, "meta": dict(META)}
    doc.update(changes)
    return doc


def _write(tmp_path, document, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "dhelix-profile", "version": 1, **document}))
    return path


def test_profile_round_trip_and_stable_sha(tmp_path):
    profile = profile_from_document(_doc())
    save_profile(profile, tmp_path / "a.json")
    again = load_profile(tmp_path / "a.json")
    assert again == profile
    assert again.pair_ms("ag", "gemm_a") == 2.2 == again.pair_ms("gemm_a", "ag")
    # same content, other spelling (key order, pair order, int vs float) -> same sha
    other = _doc(pairs={"gemm_b|rs": 1.2, "ag|gemm_a": 2.2},
                 solo={"rs": 0.5, "a2a": 2, "ag": 1, "gemm_b": 1.0, "gemm_a": 2.0})
    assert profile_sha(other) == profile.sha == load_profile(_write(tmp_path, other)).sha
    assert profile_sha(_doc(solo={**_doc()["solo"], "ag": 1.01})) != profile.sha


@pytest.mark.parametrize("change, message", [
    ({"pairs": {"gemm_a|nope": 1.0}}, "nope"),
    ({"pairs": {"gemm_a": 1.0}}, "keyA|keyB"),
    ({"pairs": {"ag|gemm_a": 2.0, "gemm_a|ag": 2.1}}, "listed twice"),
    ({"solo": {"gemm_a": -1.0}}, "positive"),
    ({"solo": {"a|b": 1.0}}, "contains"),
    ({"solo": {"gemm_a": "fast"}}, "number"),
    ({"meta": {"repeats": 0, "warmup": 0, "ranks": 1, "created": "x"}}, "meta.repeats"),
    ({"meta": {"repeats": 1, "warmup": 0, "ranks": 1}}, "meta.created"),
    ({"hardware": ""}, "hardware"),
    ({"pair_compute": {"gemm_b|ag": 1.0}}, "names no pair"),
    ({"pair_compute": {"gemm_a|ag": 0.0}}, "positive"),
    ({"pair_compute": {"gemm_a|ag": 2.1, "ag|gemm_a": 2.0}}, "listed twice"),
    ({"pair_compute": [1.0]}, "pair_compute must be an object"),
])
def test_invalid_profiles_are_rejected_with_the_reason(tmp_path, change, message):
    with pytest.raises(FormatError, match=message) as err:
        load_profile(_write(tmp_path, _doc(**change)))
    assert "p.json" in str(err.value) and "dhelix profile" in str(err.value)


def test_corrupt_foreign_and_old_profiles(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "dhelix-profile", "version": 1, "solo": {')
    with pytest.raises(FormatError, match="corrupt or truncated"):
        load_profile(bad)
    plan_like = tmp_path / "plan.json"
    plan_like.write_text(json.dumps({"format": "dhelix-plan", "version": 1}))
    with pytest.raises(FormatError, match="expected format 'dhelix-profile'"):
        load_profile(plan_like)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "dhelix-profile", "version": 0, **_doc()}))
    with pytest.raises(FormatError, match="version 0 is not supported"):
        load_profile(old)
    missing = tmp_path / "missing.json"
    with pytest.raises(FormatError, match="no such file"):
        load_profile(missing)
    no_meta = {k: v for k, v in _doc().items() if k != "meta"}
    with pytest.raises(FormatError, match="missing section 'meta'"):
        load_profile(_write(tmp_path, no_meta))


def test_pair_compute_round_trip_and_absent_section_keeps_the_sha(tmp_path):
    """`pair_compute` is optional: a profile without it hashes as before the section
    existed; with it, it round-trips, is unordered like `pairs` and changes the sha."""
    plain = profile_from_document(_doc())
    assert plain.pair_compute == {} and "pair_compute" not in plain.to_document()
    assert plain.sha == profile_sha(_doc())
    timed = profile_from_document(_doc(pair_compute={"ag|gemm_a": 1.3}))
    assert timed.pair_compute_ms("gemm_a", "ag") == 1.3 and timed.sha != plain.sha
    assert timed.pair_compute_ms("rs", "gemm_b") is None
    save_profile(timed, tmp_path / "t.json")
    again = load_profile(tmp_path / "t.json")
    assert again == timed and again.sha == timed.sha
    assert profile_sha(_doc(pair_compute={"gemm_a|ag": 1.3})) == timed.sha


@pytest.mark.parametrize("work, collective, sigma", [
    (10.0, 40.0, 1.25),   # ends inside the collective
    (30.0, 20.0, 1.25),   # outlasts it
    (30.0, 20.0, 1.6),
    (5.0, 5.0, 1.0),      # no slowdown
])
def test_computation_slowdown_inverts_the_streamed_simulation(work, collective, sigma):
    """The streamed simulation's end of a computation started with a collective, fed back
    through `computation_slowdown`, gives the sigma it ran at."""
    ended = _compute_end(0.0, work, [(0.0, collective, sigma)])
    assert computation_slowdown(work, collective, ended) == pytest.approx(sigma)


def test_computation_slowdown_edges():
    assert computation_slowdown(10.0, 40.0, 9.0) == 1.0          # faster than alone: 1
    assert computation_slowdown(10.0, 5.0, 20.0) == pytest.approx(2.0)  # no progress beside


def test_collective_sigma_prefers_the_computations_own_times():
    """A computation shorter than the collective: the pair's makespan is the collective's
    (sigma from it ~1), the computation's own end in the pair shows the 25% slowdown."""
    fwd = OpDAG("fwd", [OpNode("ar", "comm", "inter", (), "ar", False, "all_reduce")])
    bwd = OpDAG("bwd", [OpNode("g1", "comp", "compute", (), "g1", False, "gemm"),
                        OpNode("g2", "comp", "compute", (), "g2", False, "gemm")])
    doc = {"hardware": "hw", "solo": {"ar": 10.0, "g1": 4.0, "g2": 6.0},
           "pairs": {"ar|g1": 10.1, "ar|g2": 10.1}, "meta": dict(META)}
    plain = build_cost_model(fwd, bwd, profile_from_document(doc))
    assert plain.compute_sigma == {}
    assert collective_sigma(plain, "ar", "fwd", ["g1", "g2"]) < 1.1
    timed = build_cost_model(fwd, bwd, profile_from_document(
        {**doc, "pair_compute": {"ar|g1": 5.0, "ar|g2": 7.5}}))
    assert timed.compute_sigma == {("ar", "g1"): pytest.approx(1.25),
                                   ("ar", "g2"): pytest.approx(1.25)}
    assert collective_sigma(timed, "ar", "fwd", ["g1", "g2"]) == pytest.approx(1.25)


def _dags():
    fwd = OpDAG("fwd", [OpNode("qkv", "comp", "compute", (), "gemm_a", False, "gemm"),
                        OpNode("rs1", "comm", "intra", ("qkv",), "rs", False, "reduce_scatter"),
                        OpNode("x", "comm", "inter", (), "a2a", False, "all_to_all")])
    bwd = OpDAG("bwd", [OpNode("ag_g", "comm", "intra", (), "ag", False, "all_gather"),
                        OpNode("dgrad", "comp", "compute", ("ag_g",), "gemm_b", False, "gemm"),
                        OpNode("wgrad", "comp", "compute", ("ag_g",), "gemm_a", True, "gemm")])
    return fwd, bwd


def test_cost_sources_measured_then_class_then_kind_then_default():
    fwd, bwd = _dags()
    profile = profile_from_document(_doc())
    costs = build_cost_model(fwd, bwd, profile)
    assert costs.source == "profile" and costs.profile_sha == profile.sha
    assert costs.hardware == '{"gpu":"H100","nvlink":true}'
    assert costs.solo_f == {"qkv": 2.0, "rs1": 0.5, "x": 2.0}
    # measured: gemm_a (2.0) with ag (1.0) took 2.2 -> OEF 0.8 -> sigma 1.2
    assert costs.pair_source[("qkv", "ag_g")] == "measured"
    assert costs.sigma[("qkv", "ag_g")] == pytest.approx(1.2)
    assert not costs.estimated_pair("qkv", "ag_g")
    # class: (reduce_scatter, gemm) was measured for rs|gemm_b, reused for rs1 x wgrad
    measured_rs = oef(0.5, 1.0, 1.2)
    assert costs.pair_source[("rs1", "wgrad")] == "class"
    assert costs.sigma[("rs1", "wgrad")] == pytest.approx(2 - measured_rs)
    assert costs.estimated_pair("rs1", "wgrad")
    # default: neither the class pair (all_to_all, gemm) nor the kind pair
    # (comm:inter, comp) has a measurement
    assert costs.pair_source[("x", "dgrad")] == "default"
    assert costs.sigma[("x", "dgrad")] == pytest.approx(
        sigma_from_oef(DEFAULT_OEF[frozenset(["comp", "comm:inter"])]))
    # kind: (norm, all_gather) was never measured, but (comp, comm:intra) was
    fwd2 = OpDAG("fwd", [OpNode("n", "comp", "compute", (), "a2a", False, "norm")])
    costs2 = build_cost_model(fwd2, bwd, profile)
    assert costs2.pair_source[("n", "ag_g")] == "kind"


def test_missing_solo_times_name_the_ops_and_the_regenerate_command():
    fwd, bwd = _dags()
    document = _doc()
    del document["solo"]["a2a"]
    profile = profile_from_document(document)
    with pytest.raises(FormatError, match=r"fwd:x \('a2a'\).*dhelix profile"):
        build_cost_model(fwd, bwd, profile, "prof.json")


def test_analytic_default_without_profile():
    fwd, bwd = _dags()
    costs = build_cost_model(fwd, bwd, None)
    assert costs.source == "analytic" and costs.profile_sha == ANALYTIC_PROFILE_SHA
    assert costs.solo_f["qkv"] == 1.0
    assert costs.solo_f["x"] == default_solo_ms(fwd.by_id()["x"]) == 0.8 * 2.5
    assert costs.sigma[("qkv", "dgrad")] == 2.0  # computation does not overlap computation
    assert costs.sigma[("qkv", "ag_g")] == pytest.approx(1.25)
    assert all(costs.estimated_pair(f, b) for f, b in costs.sigma)


def test_pair_key_is_unordered():
    assert pair_key("a", "b") == pair_key("b", "a")
    assert pair_key("a", "a") != pair_key("a", "b")
    profile = Profile("hw", {"a": 1.0}, {pair_key("a", "a"): 1.5}, META)
    assert profile.to_document()["pairs"] == {"a|a": 1.5}
