"""Checkpoint integrity: a save records a SHA-256 of every file it wrote, a load verifies
the files it reads first and refuses a damaged, truncated or incomplete checkpoint with one
line naming the file and what to do, loading nothing. Every kind of file is damaged in turn
(weight shards, the one holding the common state included, optimizer shard, .metadata, the
manifest itself, a missing file)
on a real TP=2 checkpoint; one 2-rank launch."""

import pytest

from dhelix.checkpoint_integrity import MANIFEST
from dhelix.harness import run_on_ranks
from tests.checkpoint_ranks import DAMAGE, damaged_loads

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

EARLIER = "resume from an earlier iteration with --ckpt-step N (saved under"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt")
    results = run_on_ranks(damaged_loads, 2, str(workdir), timeout_s=300,
                           env={"OMP_NUM_THREADS": "1"})
    assert results[0] == results[1], "ranks disagree"
    return results[0]


def test_save_writes_a_manifest_and_optimizer_state_apart(report):
    assert MANIFEST in report["files"]
    assert report["manifest_optimizer_only"] == ["optimizer.__0_1.distcp",
                                                 "optimizer.__1_1.distcp"]


def test_intact_copy_loads(report):
    """The control: the same copy-and-load path accepts an undamaged checkpoint."""
    row = report["intact"]
    assert (row["outcome"], row["iteration"]) == ("loaded", 2), row


REFUSALS = [  # (case, the file the message names, the problem it states)
    ("random_bytes_in_weight_shard", "__0_0.distcp", "does not match its saved SHA-256"),
    ("zeros_in_weight_shard", "__1_0.distcp", "does not match its saved SHA-256"),
    ("truncated_weight_shard", "__1_0.distcp", "were saved (truncated or overwritten)"),
    ("missing_weight_shard", "__1_0.distcp", "is missing"),
    ("truncated_common_state_shard", "__0_0.distcp", "(truncated or overwritten)"),
    ("missing_metadata", ".metadata", "is missing"),
    ("zeros_in_metadata", ".metadata", "does not match its saved SHA-256"),
    ("manifest_checksum_edited", MANIFEST, "is damaged (its own checksum does not match)"),
    ("truncated_manifest", MANIFEST, "is damaged (corrupt or truncated JSON"),
    ("missing_manifest", MANIFEST, "is missing, so the checkpoint cannot be checked"),
]


@pytest.mark.parametrize("case,file,problem", REFUSALS)
def test_damage_is_refused_with_one_line_and_nothing_loaded(report, case, file, problem):
    row = report[case]
    message = row["message"]
    assert row["outcome"] == "refused", row
    assert message.startswith("--load ") and f"{case}: iter_0000002/{file} " in message, message
    assert problem in message, message
    assert "nothing was loaded" in message and EARLIER in message and ": 1)" in message
    assert "\n" not in message
    assert row["params_unchanged"] and row["iteration"] == -1, row


def test_damaged_optimizer_state_suggests_no_load_optim_which_loads(report):
    refused = report["damaged_optimizer_file"]
    assert refused["outcome"] == "refused"
    assert "optimizer.__0_1.distcp does not match" in refused["message"]
    assert "it holds optimizer state only: pass --no-load-optim" in refused["message"]
    loaded = report["damaged_optimizer_file_no_load_optim"]
    assert (loaded["outcome"], loaded["iteration"]) == ("loaded", 2), loaded


def test_the_earlier_iteration_loads_and_a_missing_one_is_named(report):
    assert report["ckpt_step_1"] == {"outcome": "loaded", "iteration": 1}
    assert report["ckpt_step_7"]["message"].startswith("--ckpt-step 7: no ")
    assert "(saved iterations under" in report["ckpt_step_7"]["message"]


def test_every_damage_case_is_checked():
    checked = {case for case, _, _ in REFUSALS} | {
        "intact", "damaged_optimizer_file", "damaged_optimizer_file_no_load_optim"}
    assert checked == set(DAMAGE)
