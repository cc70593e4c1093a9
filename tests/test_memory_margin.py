"""The memory bound's default margin (`dhelix.runtime.setup._memory_margin`): 5% of what the
bound sees of Megatron's peak, the stage's layers' saved activations plus the loss part's
reading; `--dhelix-memory-margin` replaces it."""

import pytest

from dhelix.options import AUTO_MEMORY_MARGIN, DHelixOptions
from dhelix.runtime.setup import _memory_margin
from planner.memory import MIB, OpMemory
from tests.planner.test_planner_memory import _chain


def test_default_margin_is_a_share_of_the_activations_and_the_loss_part():
    fwd = _chain("fwd", [("fa", "compute", "gf"), ("fc", "intra", "agf")])
    mem_f = OpMemory({"fa": 8 * MIB, "fc": 2 * MIB}, {"fa": 8 * MIB, "fc": 2 * MIB})
    default = DHelixOptions(enabled=True)
    # 4 layers of 10 MiB saved activations, and a 60 MiB loss part on top of them
    assert _memory_margin(default, 4, fwd, mem_f, 60 * MIB) == pytest.approx(
        AUTO_MEMORY_MARGIN * 100 * MIB)
    assert _memory_margin(default, 4, fwd, mem_f) == pytest.approx(
        AUTO_MEMORY_MARGIN * 40 * MIB)  # pipelined: no loss part reading
    given = DHelixOptions(enabled=True, memory_margin_mib=1.5)
    assert _memory_margin(given, 4, fwd, mem_f, 60 * MIB) == 1.5 * MIB
