"""The side-by-side benchmark of issue 8: systems, configurations, report (see
docs/benchmark.md; the command is scripts/bench_systems.py)."""
