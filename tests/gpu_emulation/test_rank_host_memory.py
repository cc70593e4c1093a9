"""The emulated GPU's ranks' host allocator (`scripts.bench_systems.EMULATED_RANK_ENVIRONMENT`):
a fresh buffer that something writes (what gloo does to a collective's buffer) faults in
huge pages, far fewer faults than 4 KiB pages; a fresh buffer never written (a faked kernel
output) still maps no memory, even when read. In processes of their own: the settings are
read at start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_systems import EMULATED_RANK_ENVIRONMENT

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = r"""
import json, resource, torch
torch.set_num_threads(1)

def faults(fn, n=8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

# a fresh 32 MiB tensor (a Llama-8B hidden state in bf16) written once, then freed
written = faults(lambda: torch.empty(16 * 2**20, dtype=torch.bfloat16).fill_(1.0))
untouched = torch.empty(128 * 2**20, dtype=torch.bfloat16)  # 256 MiB, never written
before = resident_mib()
read = float(untouched[:: 4096].sum() + untouched[-1])  # reads a page in every 8 KiB
print(json.dumps({"written_faults": written, "read_growth_mib": resident_mib() - before}))
"""


def _probe(extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**env, **extra_env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="no transparent huge pages on this kernel")
def test_emulated_ranks_fault_written_buffers_in_huge_pages_and_untouched_ones_map_nothing():
    pages = 32 * 2**20 // 4096
    default = _probe({"MALLOC_MMAP_THRESHOLD_": EMULATED_RANK_ENVIRONMENT[
        "MALLOC_MMAP_THRESHOLD_"]})
    emulated = _probe(EMULATED_RANK_ENVIRONMENT)
    print(f"4 KiB pages: {default}; the emulated ranks' settings: {emulated}")
    if "[madvise]" in THP.read_text():  # huge pages only where asked for
        assert default["written_faults"] >= pages / 2  # every 4 KiB page faults in
    assert emulated["written_faults"] <= pages / 8  # mostly 2 MiB at a time
    for result in (default, emulated):  # never written: reading maps the zero page
        assert result["read_growth_mib"] < 16
