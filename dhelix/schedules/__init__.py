"""Pipeline schedules as data (per-rank action lists), their validator and simulator, and
the executor that runs them: the W-shaped DHelix schedule over the folded model, Megatron's
1F1B for comparison, and a sequential reference."""
