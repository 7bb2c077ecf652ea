"""Timeline figure of a run: where the time went, step times, checkpoints, faults, restarts, world size."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from resilient.events.api import Event, EventKind
from resilient.goodput.api import CATEGORIES, PRODUCTIVE, GoodputReport
from resilient.goodput.columns import ReportInputs, StepPoints
from resilient.goodput.thin import band, envelope

COLORS = {
    PRODUCTIVE: "#2ca02c",
    "startup": "#9467bd",
    "checkpoint_save_stall": "#1f77b4",
    "checkpoint_restore": "#17becf",
    "wasted_progress": "#d62728",
    "detection": "#ff7f0e",
    "recovery": "#e377c2",
    "straggler_slowdown": "#bcbd22",
    "checkpoint_interference": "#aec7e8",
    "step_slowdown": "#dbdb8d",
    "waiting_for_spares": "#8c564b",
    "other": "#c7c7c7",
}
# above this many segments or points in a panel, it is drawn per column of time (see goodput/thin.py): COLUMNS is
# about twice the figure's width in pixels, so the thinned drawing shows what the full one could
THIN_ABOVE = 20_000
COLUMNS = 3_000
SAVE_LINES = 200  # more saves than this are ticks along the panel's bottom, not full-height lines


def plot_timeline(events: "Iterable[Event] | ReportInputs", report: GoodputReport,
                  path: str | os.PathLike[str]) -> None:
    """Draw the run (its events, or a :class:`~resilient.goodput.columns.ReportInputs` of them: a long run's
    million step records as arrays, not events) and its ``report`` (with its time line) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t0 = report.start_wall
    inputs = events if isinstance(events, ReportInputs) else ReportInputs(events)
    evs = sorted(inputs.others, key=lambda e: e.wall)  # every record but the steps
    pts = StepPoints.of(inputs)
    fig, (ax_band, ax_step, ax_prog) = plt.subplots(
        3, 1, figsize=(14, 8.5), sharex=True, gridspec_kw={"height_ratios": [1.1, 3, 2]})
    gp = f"{report.goodput:.1%}"
    fig.suptitle(f"goodput {gp} of {report.wall_seconds:,.1f} s wall · {report.disruptions} disruption(s) · "
                 f"{len(report.attempts)} attempt(s){' · in progress' if report.in_progress else ''}", fontsize=12)

    # 1: where the time went
    cats = (PRODUCTIVE, *CATEGORIES)
    arrays = report.timeline_arrays
    by_cat: dict[str, Any] = {}
    if arrays is not None:  # the report's arrays: no object a segment
        start, end, code = (np.asarray(a) for a in (arrays.start, arrays.end, arrays.code))
        for i, c in enumerate(cats):
            mask = code == i
            by_cat[c] = np.column_stack((start[mask] - t0, end[mask] - start[mask]))
        n = len(arrays)
    else:
        by_cat = {c: [] for c in cats}
        for s in report.timeline:
            by_cat[s.category].append((s.start - t0, s.seconds))
        n = len(report.timeline)
    width = max(report.wall_seconds, 1e-9)
    if n > THIN_ABOVE:
        by_cat = band(by_cat, 0.0, width, COLUMNS)
    for cat, spans in by_cat.items():
        if len(spans):
            ax_band.broken_barh([(float(a), float(b)) for a, b in spans], (0, 1), facecolors=COLORS[cat],
                                edgecolor="none")
    ax_band.set_yticks([])
    ax_band.set_ylim(0, 1)
    ax_band.set_ylabel("time\nspent", rotation=0, ha="right", va="center")
    shown = [c for c in (PRODUCTIVE, *CATEGORIES)
             if (report.productive_seconds if c == PRODUCTIVE else report.badput_seconds.get(c, 0.0)) > 0]
    ax_band.legend(handles=[Patch(color=COLORS[c], label=_label(c, report)) for c in shown],
                   loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=min(5, len(shown)), fontsize=8,
                   frameon=False)

    # 2: step times, saves, uploads, faults, detections
    for group, color, label in ((~pts.redone, COLORS[PRODUCTIVE], "step (kept)"),
                                (pts.redone, COLORS["wasted_progress"], "step (redone later)")):
        if group.any():
            if group.sum() > THIN_ABOVE:  # each column's range of step times
                x, lo, hi = envelope(pts.wall[group] - t0, pts.seconds[group], 0.0, width, COLUMNS)
                ax_step.vlines(x, lo, hi, colors=color, lw=0.8, label=label)
            else:
                ax_step.plot(pts.wall[group] - t0, pts.seconds[group], ".", ms=4, color=color, label=label)
    saves = [e for e in evs if e.kind is EventKind.CKPT_SAVE]
    if len(saves) > SAVE_LINES:
        # a line per save would cover the panel: a tick per column of time that holds a save, along the bottom
        x, _, _ = envelope(np.array([e.wall - t0 for e in saves]), np.zeros(len(saves)), 0.0, width, COLUMNS)
        ax_step.plot(x, np.full(len(x), 0.02), "|", ms=9, color=COLORS["checkpoint_save_stall"],
                     transform=ax_step.get_xaxis_transform(), label="checkpoint save")
    for i, e in enumerate(saves if len(saves) <= SAVE_LINES else ()):
        ax_step.axvline(e.wall - t0, color=COLORS["checkpoint_save_stall"], lw=0.8, alpha=0.6,
                        label="checkpoint save" if i == 0 else None)
    ymax = (float(pts.seconds.max()) if len(pts.seconds) else 1.0) * 1.15 or 1.0
    tiers = sorted({str(e.details.get("tier")) for e in evs if e.kind is EventKind.CKPT_TIER_DONE})
    for ti, tier in enumerate(tiers):
        y = ymax * (1.0 + 0.07 * (ti + 1))
        spans = [(e.wall - t0 - float(e.details.get("seconds", 0.0)), float(e.details.get("seconds", 0.0)))
                 for e in evs if e.kind is EventKind.CKPT_TIER_DONE and str(e.details.get("tier")) == tier]
        ax_step.broken_barh(spans, (y - ymax * 0.025, ymax * 0.05), facecolors="#1f77b4", alpha=0.35 + 0.2 * ti)
        ax_step.text(0, y, f" {tier} ", fontsize=7, va="center", ha="right", color="#1f77b4",
                     transform=ax_step.get_yaxis_transform())
    failed = [e for e in evs if e.kind is EventKind.CKPT_TIER_FAILED]
    if failed:
        ax_step.plot([e.wall - t0 for e in failed], [ymax] * len(failed), "v", color="black", label="tier failed")
    faults = [a for a in report.attempts if a.fault_wall is not None]
    if faults:
        ax_step.plot([a.fault_wall - t0 for a in faults], [ymax * 0.5] * len(faults), "X", ms=10,
                     color=COLORS["wasted_progress"], label="fault")
        ax_step.plot([a.detect_wall - t0 for a in faults], [ymax * 0.5] * len(faults), "D", ms=7,
                     color=COLORS["detection"], label="detected")
    for kind, marker, color in ((EventKind.STRAGGLER, "^", COLORS["straggler_slowdown"]),
                                (EventKind.HOST_UNHEALTHY, "s", "black"),
                                (EventKind.PREEMPTION_NOTICE, "P", "black")):
        xs = [e.wall - t0 for e in evs if e.kind is kind]
        if xs:
            ax_step.plot(xs, [ymax * 0.8] * len(xs), marker, color=color, ms=8, label=kind.value)
    ax_step.set_ylim(0, ymax * (1.0 + 0.07 * (len(tiers) + 1.5)))
    ax_step.set_ylabel("step time (s)")
    if ax_step.get_legend_handles_labels()[0]:
        ax_step.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax_step.grid(alpha=0.3)

    # 3: progress (step number) and world size
    if len(pts.wall) > THIN_ABOVE:
        x, lo, hi = envelope(pts.wall - t0, pts.step, 0.0, width, COLUMNS)
        ax_prog.vlines(x, lo, hi, colors="#333333", lw=1.5, label="step number")
    elif len(pts.wall):
        ax_prog.plot(pts.wall - t0, pts.step, ".", ms=3, color="#333333", label="step number")
    ax_prog.set_ylabel("step")
    ax_prog.set_xlabel("seconds since start")
    ax_prog.grid(alpha=0.3)
    ws_x, ws_y = [], []
    for a in report.attempts:
        if a.world_size is not None:
            ws_x += [a.start - t0, a.end - t0]
            ws_y += [a.world_size, a.world_size]
    if ws_x:
        ax_ws = ax_prog.twinx()
        ax_ws.plot(ws_x, ws_y, "-", color="#ff7f0e", lw=2, label="world size")
        ax_ws.set_ylabel("world size", color="#ff7f0e")
        ax_ws.set_ylim(0, max(ws_y) * 1.3)
    handles = [Line2D([], [], color="#333333", marker=".", ls="", label="step number"),
               Line2D([], [], color="gray", ls="--", label="attempt start (restart)")]
    if ws_x:
        handles.append(Line2D([], [], color="#ff7f0e", lw=2, label="world size"))
    ax_prog.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=8, frameon=False)

    for a in report.attempts[1:]:
        for ax in (ax_step, ax_prog):
            ax.axvline(a.start - t0, color="gray", ls="--", lw=1)
        ax_step.text(a.start - t0, ymax * 1.02, f" attempt {a.attempt}", fontsize=8, color="gray")
    ax_prog.set_xlim(0, max(report.wall_seconds, 1e-9))
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)


def _label(cat: str, report: GoodputReport) -> str:
    secs = report.productive_seconds if cat == PRODUCTIVE else report.badput_seconds[cat]
    share = secs / report.wall_seconds if report.wall_seconds > 0 else 0.0
    return f"{cat.replace('_', ' ')} {share:.1%}"
