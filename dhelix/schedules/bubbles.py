"""The paper's bubble-ratio formulas (section 4.1) and where they hold.

p stages, m micro-batches, s = SI speedup (an SI block takes 1/s of its forward plus
backward). Bubble ratio = idle time / makespan of a stage.

- 1F1B: (p-1) / (m-1+p). The simulator reproduces it exactly for any forward and backward
  cost (zero P2P latency).
- DHelix W-shaped: (p-1) / (m-1+p*s). The simulator reproduces it exactly for the W-shaped
  schedule of `dhelix.schedules.w_schedule` whenever m > p and s is physically possible,
  s <= (f+b)/max(f,b) (an SI block cannot be shorter than the longer of its two passes);
  beyond that bound the schedule's real bubble is larger than the formula. With m <= p there
  is no SI block at all and the formula does not apply (the simulator gives the real value).
"""

from __future__ import annotations


def bubble_ratio_1f1b(num_stages: int, num_microbatches: int) -> float:
    p, m = num_stages, num_microbatches
    return (p - 1) / (m - 1 + p)


def bubble_ratio_dhelix(num_stages: int, num_microbatches: int, si_speedup: float) -> float:
    p, m = num_stages, num_microbatches
    return (p - 1) / (m - 1 + p * si_speedup)


def max_physical_si_speedup(forward: float, backward: float) -> float:
    """Largest s for which an SI block still lasts at least as long as the longer of its two
    passes: (f+b)/max(f,b)."""
    return (forward + backward) / max(forward, backward)


def dhelix_formula_applies(num_stages: int, num_microbatches: int, forward: float,
                           backward: float, si_speedup: float) -> bool:
    """Whether the W-shaped schedule's bubble ratio equals `bubble_ratio_dhelix` exactly."""
    return (num_microbatches > num_stages
            and si_speedup <= max_physical_si_speedup(forward, backward) + 1e-12)
