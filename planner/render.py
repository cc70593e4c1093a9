"""Looking at a plan: a text table of its blocks, a timeline picture (PNG) and a Chrome trace
(JSON that chrome://tracing and Perfetto open).

Lanes are the three resources of the block model, each split by strand: compute, intra-node
communication and cross-node communication, for the forward strand and the backward strand.
Everything here reads only the `Plan` (its `ops` and `timeline`), so a plan file is enough.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from planner.plan import Plan

LANES = [("compute", "compute"), ("intra", "intra-node comm"), ("inter", "cross-node comm")]
STRAND_NAMES = {"fwd": "forward strand", "bwd": "backward strand"}
STRAND_COLORS = {"fwd": "#4c78a8", "bwd": "#54a24b"}
ROWS = [(channel, strand) for channel, _ in LANES for strand in ("fwd", "bwd")]


def _short(sha: str) -> str:
    return sha[:12] if len(sha) > 16 else sha


def plan_table(plan: Plan, width: int = 34) -> str:
    """A readable table of the plan's blocks: start, operators of each strand, what the
    operators would take one after another, the predicted time and the saving."""
    fp = plan.fingerprint
    lines = [
        f"dhelix plan: pairer {plan.pairer}, costs from "
        + ("profile " + _short(fp["profile_sha"]) if plan.cost_source == "profile"
           else "the analytic default (no profile)"),
        f"fingerprint: model={fp['model']}  parallel={fp['parallel']}  "
        f"hardware={fp['hardware']}  dag={_short(fp['dag_sha'])}",
        f"orders searched: {plan.search.get('fwd_orders', '?')} fwd x "
        f"{plan.search.get('bwd_orders', '?')} bwd in {plan.search.get('seconds', '?')} s",
        "",
    ]
    memory = plan.search.get("memory") or {}
    peaks = memory.get("block_peak_mib")
    if peaks is not None and len(peaks) != len(plan.blocks):
        peaks = None  # not this plan's blocks
    header = (f"{'#':>3} {'start':>8} {'forward ops':<{width}} {'backward ops':<{width}} "
              f"{'solo':>8} {'pred':>8} {'saved':>6}" + (f" {'peak':>8}" if peaks else ""))
    units = "  (ms; peak MiB)" if peaks else "  (ms)"
    lines += [header + units, "-" * len(header + units)]
    for number, block in enumerate(plan.blocks, start=1):
        solo = plan.block_solo_ms(block)
        saved = 1 - block.predicted_ms / solo if solo else 0.0
        fwd = textwrap.wrap(" ".join(block.fwd) or "-", width) or ["-"]
        bwd = textwrap.wrap(" ".join(block.bwd) or "-", width) or ["-"]
        mark = "*" if block.estimated else ""
        peak = f" {peaks[number - 1]:>8.1f}" if peaks else ""
        for row in range(max(len(fwd), len(bwd))):
            f = fwd[row] if row < len(fwd) else ""
            b = bwd[row] if row < len(bwd) else ""
            if row == 0:
                lines.append(f"{number:>3} {block.start_ms:>8.3f} {f:<{width}} {b:<{width}} "
                             f"{solo:>8.3f} {block.predicted_ms:>8.3f} {saved:>5.0%}{mark:<1}"
                             f"{peak}")
            else:
                lines.append(f"{'':>3} {'':>8} {f:<{width}} {b:<{width}}")
    lines.append("")
    if "budget_mib" in memory:
        lines.append(
            f"memory bound: {memory['budget_mib']:.1f} MiB above a layer pair's start "
            f"(reference {memory.get('reference_mib', 0):.1f}, margin "
            f"{memory.get('margin_mib', 0):.1f}); planned peak "
            f"{memory.get('plan_peak_mib', 0):.1f} MiB"
            + ("; peak: the most a block can hold above the pair's start, any interleaving"
               if peaks else ""))
    lines.append(f"sequential {plan.sequential_ms:.3f} ms -> planned {plan.planned_ms:.3f} ms: "
                 f"speedup {plan.speedup:.3f}x")
    if plan.cost_source != "profile":
        lines.append("* all times are the analytic default (no profile): estimates")
    elif plan.estimated:
        lines.append("* block prediction uses pair times estimated from measured OEFs "
                     "(not every pair was profiled)")
    return "\n".join(lines)


def _lane_of(plan: Plan, span: dict) -> str:
    return plan.ops[span["strand"]][span["op"]]["channel"]


def render_png(plan: Plan, path, title: str | None = None) -> Path:
    """Draw the plan's timeline: one row per (lane, strand), operators as bars labelled with
    their ids where they fit, blocks outlined and labelled with their predicted time, a legend,
    and the sequential vs planned times in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    total = plan.planned_ms
    fig_w = max(12.0, min(30.0, 1.4 * len(plan.blocks) + 8))
    fig, ax = plt.subplots(figsize=(fig_w, 5.2), dpi=110)
    row_y = {row: len(ROWS) - 1 - k for k, row in enumerate(ROWS)}  # first row on top
    bar_h = 0.72
    font_pt = 6.5
    axes_in = fig_w * 0.86  # the rest is the lane labels and margins
    char_ms = total / (axes_in * 72 / (0.62 * font_pt))  # ms per average character
    for span in plan.timeline:
        lane = _lane_of(plan, span)
        y = row_y[(lane, span["strand"])]
        start, dur = span["start_ms"], span["end_ms"] - span["start_ms"]
        kind = plan.ops[span["strand"]][span["op"]]["kind"]
        ax.barh(y, dur, left=start, height=bar_h, color=STRAND_COLORS[span["strand"]],
                alpha=0.95 if kind == "comp" else 0.65, edgecolor="white", linewidth=0.6,
                hatch="//" if kind == "comm" else None)
        if dur > char_ms * (len(span["op"]) + 1):
            ax.text(start + dur / 2, y, span["op"], ha="center", va="center", fontsize=font_pt,
                    color="white" if kind == "comp" else "black")
    top = len(ROWS) - 0.5 + 0.05
    label_end = {0: -1.0, 1: -1.0}  # right edge of the last label on each of two heights
    for number, block in enumerate(plan.blocks, start=1):
        ax.add_patch(Rectangle((block.start_ms, -0.5 - 0.05), block.predicted_ms,
                               len(ROWS) + 0.1, fill=False, edgecolor="#d62728",
                               linewidth=1.3, linestyle="--"))
        label = f"B{number}\n{block.predicted_ms:.3f} ms" + ("*" if block.estimated else "")
        middle, half = block.start_ms + block.predicted_ms / 2, 5.5 * char_ms
        height = 0 if middle - half > label_end[0] else 1  # stagger labels of narrow blocks
        label_end[height] = middle + half
        ax.text(middle, top + 0.1 + 0.75 * height, label, ha="center", va="bottom",
                fontsize=7, color="#d62728")
    ax.set_yticks([row_y[row] for row in ROWS])
    lane_names = dict(LANES)
    ax.set_yticklabels([f"{lane_names[c]} · {s}" for c, s in ROWS], fontsize=8)
    for boundary in (1.5, 3.5):
        ax.axhline(boundary, color="#999999", linewidth=0.6)
    ax.set_ylim(-0.7, len(ROWS) + 1.6)
    ax.set_xlim(0, total * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    est = " (estimated)" if plan.estimated else ""
    ax.set_title(title or (
        f"dhelix plan ({plan.pairer}): sequential {plan.sequential_ms:.3f} ms -> planned "
        f"{plan.planned_ms:.3f} ms{est}, speedup {plan.speedup:.2f}x"), fontsize=10, pad=26)
    handles = [
        Patch(color=STRAND_COLORS["fwd"], label="forward strand: computation"),
        Patch(facecolor=STRAND_COLORS["fwd"], alpha=0.65, hatch="//",
              label="forward strand: communication"),
        Patch(color=STRAND_COLORS["bwd"], label="backward strand: computation"),
        Patch(facecolor=STRAND_COLORS["bwd"], alpha=0.65, hatch="//",
              label="backward strand: communication"),
        Patch(fill=False, edgecolor="#d62728", linestyle="--",
              label="block (barrier-delimited), predicted ms; * = estimated"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
              fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def chrome_trace(plan: Plan) -> dict:
    """The plan as a Chrome trace-event document: complete events (ph "X", microseconds) on
    one thread per (lane, strand), plus a "blocks" thread with one event per block."""
    pid = 1
    tids = {row: k + 2 for k, row in enumerate(ROWS)}
    lane_names = dict(LANES)
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
               "args": {"name": f"dhelix plan ({plan.pairer})"}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1,
               "args": {"name": "blocks"}},
              {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": 1,
               "args": {"sort_index": 1}}]
    for (channel, strand), tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": f"{lane_names[channel]} / {STRAND_NAMES[strand]}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    for number, block in enumerate(plan.blocks, start=1):
        events.append({"name": f"block {number}", "cat": "block", "ph": "X", "pid": pid,
                       "tid": 1, "ts": block.start_ms * 1000.0,
                       "dur": block.predicted_ms * 1000.0,
                       "args": {"fwd": list(block.fwd), "bwd": list(block.bwd),
                                "predicted_ms": block.predicted_ms,
                                "solo_ms": plan.block_solo_ms(block),
                                "estimated": block.estimated}})
    for span in plan.timeline:
        info = plan.ops[span["strand"]][span["op"]]
        events.append({"name": span["op"], "cat": span["strand"], "ph": "X", "pid": pid,
                       "tid": tids[(info["channel"], span["strand"])],
                       "ts": span["start_ms"] * 1000.0,
                       "dur": (span["end_ms"] - span["start_ms"]) * 1000.0,
                       "args": {"block": span["block"] + 1, "op_class": info.get("op_class", ""),
                                "solo_ms": info["solo_ms"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"fingerprint": plan.fingerprint, "sequential_ms": plan.sequential_ms,
                          "planned_ms": plan.planned_ms, "speedup": plan.speedup}}


def write_trace(plan: Plan, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(plan), indent=1) + "\n")
    return path
