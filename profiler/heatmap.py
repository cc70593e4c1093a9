"""Overlap effectiveness by operator class: the table printed after profiling and the
heatmap PNG (like Figure 4 of the DHelix paper).

Each measured pair contributes `OEF = (T_i + T_j - P_ij) / min(T_i, T_j)` to the cell of its
two operator classes (unordered, so the matrix is symmetric). A cost key's class, kind and
channel come from the profile's `meta.ops` (written by `dhelix profile` from the operator
registry); a profile without it shows class '?'. Cells without a measured pair stay blank.
"""

from __future__ import annotations

import math
from statistics import fmean, median

from profiler.profile_file import oef

CLASS_ORDER = ("gemm", "attention", "norm", "elementwise", "all_gather", "reduce_scatter",
               "all_reduce", "send_recv", "all_to_all")
CLASS_LABEL = {"gemm": "GEMM", "attention": "attention", "norm": "norm",
               "elementwise": "elementwise", "all_gather": "all-gather",
               "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
               "send_recv": "send/recv", "all_to_all": "all-to-all"}


def _info(profile, key: str) -> dict:
    return profile.meta.get("ops", {}).get(key, {"class": "?", "kind": "?", "channel": "?"})


def pair_oefs(profile) -> list[dict]:
    """One row per measured pair: keys, classes, kinds, solo and pair times, OEF."""
    rows = []
    for key, p_ab in profile.pairs.items():
        names = sorted(key) if isinstance(key, frozenset) else [key[0], key[0]]
        a, b = (_info(profile, n) for n in names)
        t_a, t_b = profile.solo[names[0]], profile.solo[names[1]]
        rows.append({"keys": tuple(names), "classes": (a["class"], b["class"]),
                     "kinds": (a["kind"], b["kind"]), "t_a": t_a, "t_b": t_b, "p": p_ab,
                     "oef": oef(t_a, t_b, p_ab)})
    return sorted(rows, key=lambda r: r["keys"])


def classes_present(rows) -> list[str]:
    found = {c for row in rows for c in row["classes"]}
    return [c for c in CLASS_ORDER if c in found] + sorted(found - set(CLASS_ORDER))


def oef_by_class(rows) -> dict:
    """{frozenset of one or two classes: [OEF values]}"""
    cells: dict = {}
    for row in rows:
        cells.setdefault(frozenset(row["classes"]), []).append(row["oef"])
    return cells


def kind_group(row) -> str:
    kinds = sorted(row["kinds"])
    return {("comp", "comp"): "comp-comp", ("comm", "comp"): "comp-comm",
            ("comm", "comm"): "comm-comm"}.get(tuple(kinds), "?")


def class_table(profile) -> str:
    """Text table: mean/median/min/max OEF and count per class pair, then per kind group.
    (The median is the robust reading: an OEF divides by the shorter solo time, so timing
    noise on pairs with a very short operator swings the mean.)"""
    rows = pair_oefs(profile)
    if not rows:
        return "no measured pairs"
    lines = [f"{'class pair':<34} {'mean OEF':>8} {'median':>7} {'min':>7} {'max':>7} {'n':>4}"]
    order = {c: i for i, c in enumerate(classes_present(rows))}
    cells = oef_by_class(rows)
    for cell in sorted(cells, key=lambda s: sorted(order[c] for c in s)):
        names = sorted(cell, key=order.get)
        label = " x ".join(CLASS_LABEL.get(c, c) for c in (names * 2)[:2])
        lines.append(_stats_line(label, cells[cell]))
    groups: dict = {}
    for row in rows:
        groups.setdefault(kind_group(row), []).append(row["oef"])
    lines.append("")
    for name in sorted(groups):
        lines.append(_stats_line(name, groups[name]))
    return "\n".join(lines)


def _stats_line(label: str, values: list) -> str:
    return (f"{label:<34} {fmean(values):>8.3f} {median(values):>7.3f} {min(values):>7.3f} "
            f"{max(values):>7.3f} {len(values):>4}")


def render_heatmap(profile, path, title: str | None = None):
    """Write the class x class OEF heatmap PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = pair_oefs(profile)
    classes = classes_present(rows)
    cells = oef_by_class(rows)
    n = len(classes)
    grid = np.full((n, n), np.nan)
    counts = np.zeros((n, n), dtype=int)
    for i, a in enumerate(classes):
        for j, b in enumerate(classes):
            values = cells.get(frozenset((a, b)))
            if values:
                grid[i, j], counts[i, j] = fmean(values), len(values)
    size = 1.0 + 0.9 * max(n, 2)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=-0.25, vmax=1.0)
    labels = [CLASS_LABEL.get(c, c) for c in classes]
    ax.set_xticks(range(n), labels, rotation=45, ha="right")
    ax.set_yticks(range(n), labels)
    for i in range(n):
        for j in range(n):
            if counts[i, j]:
                ax.text(j, i, f"{grid[i, j]:.2f}\nn={counts[i, j]}", ha="center",
                        va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="OEF = (Ti + Tj - Pij) / min(Ti, Tj)")
    hardware = profile.hardware
    where = str(hardware)
    if isinstance(hardware, dict):
        inter = hardware.get("link", {}).get("inter", "none")
        where = f"{hardware.get('device', '')}, {hardware.get('nodes')} node(s)" + (
            f", inter-node {inter}" if inter != "none" else "")
    ax.set_title(title or f"Overlap effectiveness by operator class\n{where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def all_finite(profile) -> bool:
    return all(math.isfinite(row["oef"]) for row in pair_oefs(profile))
