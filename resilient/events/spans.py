"""Time spans a ledger's checkpoint events describe: when training was blocked by a save, and when a save's
background work (local write, replication, upload) ran. Pure functions of events, shared by the goodput
calculator (which charges steps that overlapped background work) and the interval tuner (which learns a
save's cost from them)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from resilient.events.api import Event, EventKind

CKPT_KINDS = {EventKind.CKPT_SAVE, EventKind.CKPT_TIER_DONE, EventKind.CKPT_TIER_FAILED}


def finite(v: object) -> float | None:
    if isinstance(v, bool):
        return None
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of ``(start, end)`` spans (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(sp for sp in spans if sp[1] > sp[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def overlap_seconds(a: float, b: float, merged: Sequence[tuple[float, float]],
                    ends: Sequence[float] | None = None) -> float:
    """Length of ``[a, b]`` covered by ``merged`` (sorted, disjoint; ``ends`` its end points, for speed)."""
    if ends is None:
        ends = [e for _, e in merged]
    i = bisect.bisect_right(ends, a)
    total = 0.0
    while i < len(merged) and merged[i][0] < b:
        total += min(b, merged[i][1]) - max(a, merged[i][0])
        i += 1
    return max(0.0, total)


def stall_spans(events: Iterable[Event]) -> list[tuple[float, float]]:
    """When training was blocked by a save: ``[wall - blocking_seconds, wall]`` of each CKPT_SAVE, merged."""
    out = []
    for ev in events:
        if ev.kind is EventKind.CKPT_SAVE:
            b = finite(ev.details.get("blocking_seconds"))
            if b is not None and b > 0:
                out.append((ev.wall - b, ev.wall))
    return merge_spans(out)


def save_spans(events: Iterable[Event]) -> dict[tuple[Any, Any], tuple[list[tuple[float, float]], bool]]:
    """Background work of each save, keyed by (attempt, step): its spans, and whether any tier finished it.

    A save's background work runs from its CKPT_SAVE (the end of the blocking part) to its first tier's
    CKPT_TIER_DONE/FAILED; each CKPT_TIER_DONE also covers ``[wall - seconds, wall]`` (local write, peer
    replication, persistent upload, which may run long after the save)."""
    saves: dict[tuple[Any, Any], float] = {}
    out: dict[tuple[Any, Any], tuple[list[tuple[float, float]], bool]] = {}
    for ev in sorted((e for e in events if e.kind in CKPT_KINDS), key=lambda e: e.wall):
        step = ev.details.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        key = (ev.attempt, step)
        spans, _ = out.setdefault(key, ([], False))
        if ev.kind is EventKind.CKPT_SAVE:
            saves.setdefault(key, ev.wall)  # several ranks may report the same save: the first opens it
            continue
        start = saves.pop(key, None)
        if start is not None:
            spans.append((start, ev.wall))
        if ev.kind is EventKind.CKPT_TIER_DONE:
            secs = finite(ev.details.get("seconds"))
            if secs is not None and secs > 0:
                spans.append((ev.wall - secs, ev.wall))
        out[key] = (spans, True)
    return out


def background_spans(events: Iterable[Event]) -> list[tuple[float, float]]:
    """When checkpoint work ran in the background (writes, replication, uploads), merged. A save whose
    tiers have not reported yet contributes nothing until they do."""
    return merge_spans(sp for spans, _ in save_spans(events).values() for sp in spans)
