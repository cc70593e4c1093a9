"""Looking at a pipeline schedule: a text listing and a timeline picture like the paper's
Figure 8.

The picture has one row per stage (GPU 0 at the top) and simulated time on the x axis:
forward chunks blue, backward chunks green, an SI block split in two (its forward on top,
its backward below), labelled with the strand and 1-based micro-batch number (alpha/beta by
groups of p, as in the paper). Chunk-1 passes (the folded model's way back up) are drawn a
shade lighter than chunk-0 passes; dashed lines mark where the steady phase starts and ends.
matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

from pathlib import Path

from dhelix.schedules.actions import BACKWARD, FORWARD, Schedule
from dhelix.schedules.simulate import SimulationResult
from dhelix.schedules.w_schedule import strand

COLORS = {(FORWARD, 0): "#3a6ea5", (FORWARD, 1): "#7fa7d1",
          (BACKWARD, 0): "#3f8f3a", (BACKWARD, 1): "#86c17f"}


def pass_label(schedule: Schedule, microbatch: int) -> str:
    """'α5'/'β5' on the folded W schedule, 'mb5' otherwise (1-based)."""
    if schedule.kind == "w":
        return f"{strand(microbatch, schedule.num_stages)}{microbatch + 1}"
    return f"{microbatch + 1}"


def action_label(schedule: Schedule, action) -> str:
    parts = [f"{d}:{pass_label(schedule, p.microbatch)}.c{schedule.path.chunk(d, p.hop)}"
             for d, p in action.passes()]
    return "+".join(parts)


def schedule_text(schedule: Schedule, result: SimulationResult | None = None,
                  width: int = 100) -> str:
    """Each stage's computations in execution order (communication omitted), and the
    simulated makespan and bubble ratio when `result` is given."""
    lines = [f"{schedule.kind} schedule: p={schedule.num_stages} stages, "
             f"m={schedule.num_microbatches} micro-batches, {schedule.path.name} path "
             f"({schedule.path.chunks_per_stage} chunk(s) per stage)",
             "  F:x.cK forward of micro-batch x, chunk K; B: backward; F+B: an SI block"]
    for rank, actions in enumerate(schedule.ranks):
        row = f"stage {rank}:"
        for action in actions:
            if not action.is_compute:
                continue
            item = action_label(schedule, action)
            if len(row) + len(item) + 1 > width:
                lines.append(row)
                row = " " * 8
            row += " " + item
        lines.append(row)
    if result is not None:
        lines.append(f"simulated makespan {result.makespan:.3f}, bubble ratio "
                     f"{result.bubble_ratio:.4f}")
    return "\n".join(lines)


def _draw_panel(ax, schedule: Schedule, result: SimulationResult, title: str,
                points_per_unit: float) -> None:
    p = schedule.num_stages
    for iv in result.intervals:
        if not iv.action.is_compute:
            continue
        row = iv.rank
        parts = iv.action.passes()
        height = 0.84 / len(parts)
        top = row - 0.42
        for k, (direction, ps) in enumerate(parts):
            chunk = schedule.path.chunk(direction, ps.hop)
            y = top + k * height
            ax.add_patch(_rectangle(iv.start, y, iv.end - iv.start, height,
                                    COLORS[(direction, chunk)]))
            label = pass_label(schedule, ps.microbatch)
            box_points = (iv.end - iv.start) * points_per_unit
            size = min(8.5, box_points / (0.62 * max(len(label), 2)), height * 30)
            if size >= 4:
                ax.text((iv.start + iv.end) / 2, y + height / 2, label, ha="center",
                        va="center", fontsize=size, color="white")
    _draw_phases(ax, result)
    ax.set_ylim(p - 0.5, -0.95)
    ax.set_xlim(0, result.makespan)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"GPU {s}" for s in range(p)])
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)


def _draw_phases(ax, result: SimulationResult) -> None:
    """Dashed lines where the steady phase starts (first SI block, or first 1F1B backward
    after warmup) and ends, with the phase names above the rows."""
    steady = [iv for iv in result.intervals if iv.action.is_compute and iv.action.phase == "steady"]
    if not steady:
        return
    start = min(iv.start for iv in steady)
    end = max(iv.end for iv in steady)
    for x in (start, end):
        ax.axvline(x, color="#888888", linestyle="--", linewidth=0.8, zorder=0.5)
    for name, (a, b) in (("warmup", (0, start)), ("steady", (start, end)),
                         ("cooldown", (end, result.makespan))):
        if b > a:
            ax.text((a + b) / 2, -0.7, name, ha="center", va="center", fontsize=8,
                    color="#555555")


def _rectangle(x, y, w, h, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=0.6)


def draw_schedules_png(path: str | Path, panels: list[tuple[str, Schedule, SimulationResult]],
                       footer: str = "") -> Path:
    """One timeline panel per (title, schedule, result), on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(result.makespan for _, _, result in panels)
    most = max(sum(a.is_compute for a in acts) for _, s, _ in panels for acts in s.ranks)
    width = min(40.0, max(11.0, 2.0 + 0.42 * most))
    heights = [0.45 * s.num_stages + 0.9 for _, s, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(heights) + 1.1),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    points_per_unit = (width * 0.86 * 72) / span
    for ax, (title, schedule, result) in zip(axes[:, 0], panels):
        _draw_panel(ax, schedule, result, title, points_per_unit)
        ax.set_xlim(0, span)
    axes[-1, 0].set_xlabel("time (units of the given costs)")
    handles = [Patch(color=COLORS[(FORWARD, 0)], label="forward, chunk 0 (down)"),
               Patch(color=COLORS[(FORWARD, 1)], label="forward, chunk 1 (back up)"),
               Patch(color=COLORS[(BACKWARD, 0)], label="backward, chunk 0"),
               Patch(color=COLORS[(BACKWARD, 1)], label="backward, chunk 1"),
               Patch(facecolor="white", edgecolor="#555555",
                     label="SI block: forward (top) + backward (bottom)")]
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.02))
    if footer:
        fig.text(0.5, 0.004, footer, fontsize=7, color="#555555", ha="center")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
