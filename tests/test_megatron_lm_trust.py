"""The trust features on the plugin path (`python -m dhelix.megatron_lm`), on real gloo
ranks running Megatron-LM's `pretrain()`:

- checksummed checkpoints (`megatron_patches.checkpoint_guard`): a `--dhelix` run saves
  iterations 2 and 4 through Megatron's `--save` (PP2, folded model); every kind of damage
  to a copy (random bytes or one flipped bit in a shard, a truncated or deleted shard, a
  deleted `.metadata`, an edited or truncated manifest, garbage or a missing iteration in
  the tracker, `--ckpt-step` of a missing iteration) ends the load with exactly one
  `error:` line naming the file and what to do, exit code 2, with and without `--dhelix`;
  the earlier iteration that line points to loads with `--ckpt-step`; the intact
  checkpoint loads with and without `--dhelix`, a stock save gets its manifest, and one
  without a manifest loads with one warning.
- NaN stop (`megatron_patches.nan_stop`): a `--lr 1e30` run ends with one line naming the
  iteration, the check and the rank; with `--save`, nothing of the bad iteration is saved
  and the last good checkpoint stays named by the tracker, every byte intact.
"""

import pytest

from dhelix.harness import run_on_ranks
from tests.megatron_lm_ranks import many_runs_env
from tests.megatron_lm_trust_ranks import checkpoint_guard_body

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

PP2 = ["--pipeline-model-parallel-size", "2"]
DIGEST = "does not match its saved SHA-256 (its bytes changed since the save)"


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("guard")
    result = run_on_ranks(checkpoint_guard_body, 2, str(workdir), PP2, timeout_s=900,
                          env={"OMP_NUM_THREADS": "1", **many_runs_env()})[0]
    for name, outcome in result["cases"].items():
        print(f"{name}: {outcome}")
    return workdir, result


def _refused(guard, name, line):
    workdir, result = guard
    code, lines = result["cases"][name]
    copy = workdir / name.replace(" ", "_")
    assert (code, lines) == (2, [f"error: --load {copy}: " + line]), (code, lines)


@pytest.mark.parametrize("name, file, problem", [
    ("random bytes in a shard", "__0_0.distcp", DIGEST),
    ("one flipped bit", "__1_0.distcp", DIGEST),
    ("damaged, loaded without --dhelix", "__0_0.distcp", DIGEST),
    ("deleted shard", "__1_0.distcp", "is missing"),
    ("deleted .metadata", ".metadata", "is missing"),
])
def test_damaged_file_is_refused_naming_it(guard, name, file, problem):
    copy = guard[0] / name.replace(" ", "_")
    _refused(guard, name, f"iter_0000004/{file} {problem}; nothing was loaded; resume from "
             f"an earlier iteration with --ckpt-step N (saved under {copy}: 2)")


def test_damaged_manifest_is_refused_naming_it(guard):
    workdir, result = guard
    for name, problem in [("manifest checksum edited",
                           "is damaged (its own checksum does not match)"),
                          ("truncated manifest", "is damaged (corrupt or truncated JSON")]:
        code, lines = result["cases"][name]
        copy = workdir / name.replace(" ", "_")
        assert code == 2 and len(lines) == 1, (name, lines)
        assert lines[0].startswith(f"error: --load {copy}: iter_0000004/dhelix_checksums.json "
                                   f"{problem}"), (name, lines)
        assert lines[0].endswith(f"; nothing was loaded; resume from an earlier iteration "
                                 f"with --ckpt-step N (saved under {copy}: 2)"), (name, lines)


def test_the_earlier_iteration_a_refusal_points_to_loads(guard):
    assert guard[1]["cases"]["damaged, --ckpt-step of the earlier iteration"] == (None, [])


def test_truncated_shard_is_refused_naming_it(guard):
    workdir, result = guard
    code, lines = result["cases"]["truncated shard"]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --load {workdir / 'truncated_shard'}: "
                               "iter_0000004/__0_0.distcp has ")
    assert "(truncated or overwritten); nothing was loaded; resume from an earlier " \
           "iteration with --ckpt-step N" in lines[0]


def test_bad_tracker_or_step_is_refused(guard):
    _refused(guard, "garbage tracker",
             "latest_checkpointed_iteration.txt holds 'x7!', not an iteration number; write "
             "the iteration to resume from into it or pass --ckpt-step N (saved iterations: "
             "2, 4)")
    _refused(guard, "tracker names a missing iteration",
             "latest_checkpointed_iteration.txt names iteration 6, but iter_0000006 is "
             "missing; nothing was loaded; pass --ckpt-step N for a saved iteration (saved "
             "iterations: 2, 4)")
    _refused(guard, "ckpt-step of a missing iteration",
             "--ckpt-step 3, but iter_0000003 is missing; nothing was loaded; pass "
             "--ckpt-step N for a saved iteration (saved iterations: 2, 4)")


def test_intact_checkpoints_load_and_saves_get_manifests(guard):
    workdir, result = guard
    assert result["cases"]["save"] == (0, [])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(result["files"])
    assert result["cases"]["intact with --dhelix"] == (None, [])
    assert result["cases"]["intact, stock"] == (None, [])
    assert result["next_tracker"].strip() == "6" and result["next_manifest"]
    assert result["pending"] == []
    code, lines = result["cases"]["no manifest"]
    assert code is None and lines == [
        f"warning: --load {workdir / 'no_manifest'}: iter_0000004 has no "
        "dhelix_checksums.json (not saved through dhelix.megatron_lm); loading it unverified"]


NAN_REMEDY = ("lower --lr or check the data, or pass --no-check-for-nan-in-loss-and-grad to "
              "train on regardless")


def test_nan_ends_the_run_with_one_line_and_no_save(guard):
    workdir, result = guard
    code, lines = result["cases"]["nan"]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: iteration 2: "), lines  # as Megatron's log counts
    assert "Megatron's --check-for-nan-in-loss-and-grad found nan (found NaN in local " \
           "forward loss calculation, rank 0" in lines[0], lines  # the folded model's loss
    assert lines[0].endswith("; training stopped before saving it; nothing of it was saved; "
                             + NAN_REMEDY), lines
    code, lines = result["cases"]["nan, stock, with --save"]
    assert code == 2 and len(lines) == 1, lines
    saved = result["nan_saved"]
    newest = max(name for name in saved if name.startswith("iter_"))
    assert newest == "iter_0000001", saved  # saved before the NaN of iteration 2, none after
    assert f"the last good checkpoint, {workdir / 'nan' / newest}, is untouched" in lines[0]
    assert result["nan_tracker"] == "1"  # still names the last good iteration
    assert result["nan_last_good_damage"] == "None"  # every byte matches its manifest
    assert lines[0].endswith(NAN_REMEDY)
    assert "found NaN in local grad norm" in lines[0], lines  # the gradient check
