#!/usr/bin/env python
"""Parity and memory of the operator programs against Megatron's autograd path, as tables.

Runs the same gloo launches as tests/ops/test_parity.py (TP = 1, 2, 4; all 32 layer
variants; SP off/on) and prints, per TP/SP configuration, the largest absolute difference
over variants and ranks of the stack output, the input gradient and every parameter
gradient, for the backward in program order, with wgrads last, and in a random legal
order; then the DDP main_grad check and the peak-memory ratios (tiny preset).

    .venv/bin/python scripts/ops_report.py [--tp 1 2 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.ops import rank_checks as rc  # noqa: E402

ORDERS = ("default", "wgrad_last", "random")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=sorted(rc.LAUNCHES),
                        choices=sorted(rc.LAUNCHES))
    args = parser.parse_args(argv)
    print("max abs difference, programs vs Megatron autograd (over variants and ranks)")
    print(f"{'config':<12}{'variants':>9}  " + "  ".join(
        f"{q + '/' + o:>18}" for o in ORDERS for q in ("out", "dx", "grad")))
    memory_rows, ddp_rows = [], []
    for world in args.tp:
        start = time.perf_counter()
        per_rank = rc.launch(world)
        elapsed = time.perf_counter() - start
        rows = [row for rank in per_rank for row in rank["parity"]]
        for sp in rc.LAUNCHES[world]["sp_options"]:
            subset = [r for r in rows if r["sp"] == sp]
            cells = [max(r[f"{q}_{o}"] for r in subset) for o in ORDERS
                     for q in ("out", "dx", "grad")]
            label = f"tp{world}{' sp' if sp else ''}"
            print(f"{label:<12}{len(subset) // world:>9}  "
                  + "  ".join(f"{c:>18.3g}" for c in cells))
        print(f"{'':<12}(launch of {world} rank(s): {elapsed:.1f} s)")
        for rank in per_rank:
            memory_rows += [dict(r, rank=rank["rank"]) for r in rank["memory"]]
            ddp_rows += [dict(r, rank=rank["rank"]) for r in rank["ddp"]]
    print("\nMegatron DDP (overlap_grad_reduce), wgrads last: main_grad diff, hooks")
    for r in ddp_rows:
        print(f"  tp{r['tp']}{' sp' if r['sp'] else '   '} rank {r['rank']} {r['variant']:<34}"
              f" main_grad {r['main_grad']:.3g}  param.grad cleared {r['grad_cleared']}  "
              f"grad sync dispatched in backward {r['sync_dispatched']}")
    print("\npeak live tensor bytes of fwd+bwd, tiny preset (4 layers), compute thread,"
          " + persistent global buffer")
    for r in memory_rows:
        print(f"  tp{r['tp']}{' sp' if r['sp'] else '   '} rank {r['rank']}: megatron "
              f"{r['megatron_peak']:>9} + {r['megatron_persistent']:>6}  programs "
              f"{r['programs_peak']:>9} + {r['programs_persistent']:>6}  ratio "
              f"{r['ratio']:.4f} (peaks only {r['peak_ratio']:.4f}, all threads "
              f"{r['all_threads_peak_ratio']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
