#!/usr/bin/env python
"""Run a torchrun command on an emulated multi-node cluster (needs root, ip and tc).

    scripts/emulated_cluster.py --nodes 2 --ranks-per-node 1 --bandwidth 800mbit \
        -- -m dhelix.megatron_lm scripts/pretrain_gpt.py --tensor-model-parallel-size 2 ...

One network namespace per node, joined by tc-shaped veth links through a switch namespace;
one torchrun per node; everything it created is removed again on exit, failure or Ctrl-C.
Options and guarantees: `--help` and docs/emulated_cluster.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dhelix.cluster.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
