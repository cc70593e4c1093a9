"""dhelix.parallel.Job: the process-group state `init_process_group_from_env` returns (store
and timeout, no module globals) reaches what is built from it, on 2 real gloo ranks: a
second call returns the first call's store and timeout, Megatron's groups and the DHelix
lanes get the timeout, the stall guard finds the store; a group created elsewhere gives
`Job()`, whose lanes keep torch's default timeout and which has no stall guard, and the
plugin's `job_of_megatron_group` of such a group gives the lanes its timeout and the stall
guard its store (the test harness and the plugin use this module, not only the look-alike
trainer)."""

from datetime import timedelta

import pytest

from dhelix.harness import run_on_ranks
from tests.job_ranks import job_checks

pytestmark = pytest.mark.slow  # multi-process: not in the fast tier

TIMEOUT_S = 37  # neither torch's/Megatron's 30 min nor init_process_group_from_env's 300 s
JOB_TIMEOUT = timedelta(seconds=TIMEOUT_S)
TORCH_DEFAULT = timedelta(minutes=30)


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(job_checks, 2, TIMEOUT_S, timeout_s=240,
                        env={"OMP_NUM_THREADS": "1"})


def test_second_call_returns_the_first_calls_store_and_timeout(ranks):
    for out in ranks:
        assert out["timeouts"] == (JOB_TIMEOUT, JOB_TIMEOUT)
        assert out["created_elsewhere"] == (False, False)
        assert out["probes"] == ["from rank 0", "from rank 1"]


def test_groups_built_with_the_job_get_its_timeout(ranks):
    for out in ranks:
        assert out["megatron_tp_timeout"] == JOB_TIMEOUT
        assert out["lane_timeouts"] == [JOB_TIMEOUT]
        assert out["elsewhere_lane_timeouts"] == [TORCH_DEFAULT]


def test_lanes_for_the_used_channel_only_and_pooled_groups_reused(ranks):
    for out in ranks:
        assert out["lane_keys"] == [("tp", "inter", 0), ("tp", "inter", 1)]
        assert out["pool_size"] == 2 and out["pool_reused"]
        assert out["pooled_lane_sum"] == 2.0
        assert "unknown communication channels ['nvlink']" in out["unknown_channel"]


def test_stall_guard_finds_the_store(ranks):
    for out in ranks:
        assert out["guard_timeout_s"] == TIMEOUT_S
        assert out["published_pids_ok"] == [True, True]
        assert out["roll_call_missing"] == []
        assert out["elsewhere_guard"] is None


def test_a_plan_is_searched_on_the_stages_first_rank_and_handed_to_the_rest(ranks):
    for out in ranks:
        assert out["planned"] == "planned on rank 0"
        assert out["plan_error"] == "no plan on rank 0"


def test_group_created_elsewhere_gives_an_empty_job(ranks):
    for out in ranks:
        assert out["megatron_style_group"] == (True, None)  # Job(): no store, no timeout


def test_plugin_job_of_megatrons_group_reaches_lanes_and_stall_guard(ranks):
    """The plugin's path: megatron.training created the group, `job_of_megatron_group`
    gives its lanes the run's timeout and its stall guard the group's store."""
    for out in ranks:
        assert out["plugin_job_timeout"] == JOB_TIMEOUT
        assert out["plugin_lane_timeouts"] == [JOB_TIMEOUT]
        assert out["plugin_guard_pids_ok"] == [True, True]
        assert out["plugin_roll_call_missing"] == []
