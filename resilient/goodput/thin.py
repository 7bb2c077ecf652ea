"""What a figure of a long run can show: at most a few values per pixel column.

A week's run has a million steps, two time-line segments each; drawn one by one, matplotlib held them all
(1.6 GB and most of the 44 s of ``resilient goodput --plot`` at a million steps). Past a few thousand columns,
more drawn objects change no pixel, so the figure draws per column of time instead:

* :func:`band`: each column painted with the category that covers most of it, runs of equal columns merged;
* :func:`envelope`: each column's lowest and highest value (drawn as a vertical stroke between them).

Both are exact per column (coverage is integrated, not sampled), and a short run is drawn as before (the caller
thins only above a number of objects)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def _covered_before(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Seconds of the spans ``[starts, ends)`` that lie before each time in ``t``: the sum over spans of
    ``clip(t - start, 0, end - start)``, from sorted starts and ends and their prefix sums."""
    s, e = np.sort(starts), np.sort(ends)
    ps = np.concatenate(([0.0], np.cumsum(s)))
    pe = np.concatenate(([0.0], np.cumsum(e)))
    ks = np.searchsorted(s, t, side="left")
    ke = np.searchsorted(e, t, side="left")
    return (t * ks - ps[ks]) - (t * ke - pe[ke])


def band(spans: Mapping[str, Sequence[tuple[float, float]]], t0: float, t1: float,
         columns: int) -> dict[str, list[tuple[float, float]]]:
    """``spans``: per category, ``(start, seconds)`` pairs on one time line. Returns, per category, the
    ``(start, width)`` runs of the ``columns`` equal columns of ``[t0, t1]`` it covers most of (a column
    covered by nothing is left out; a tie goes to the category listed first)."""
    if columns < 1 or not t1 > t0:
        raise ValueError(f"band needs columns >= 1 and t1 > t0, got {columns}, [{t0}, {t1}]")
    cats = list(spans)
    edges = np.linspace(t0, t1, columns + 1)
    cover = np.zeros((len(cats), columns))
    for i, c in enumerate(cats):
        if not len(spans[c]):
            continue
        a = np.asarray(spans[c], dtype=float).reshape(-1, 2)
        start, width = a[:, 0], np.maximum(a[:, 1], 0.0)
        cover[i] = np.diff(_covered_before(start, start + width, edges))
    out: dict[str, list[tuple[float, float]]] = {c: [] for c in cats}
    if not cats:
        return out
    best = np.argmax(cover, axis=0)
    # prefix sums leave rounding residue in columns nothing covers
    best = np.where(cover.max(axis=0) > 1e-9 * (t1 - t0) / columns, best, -1)
    # runs of equal columns: where the winner changes
    cut = np.flatnonzero(np.diff(best)) + 1
    lo = np.concatenate(([0], cut))
    hi = np.concatenate((cut, [columns]))
    for a, b in zip(lo, hi):
        w = int(best[a])
        if w >= 0:
            out[cats[w]].append((float(edges[a]), float(edges[b] - edges[a])))
    return out


def envelope(x: np.ndarray, y: np.ndarray, t0: float, t1: float,
             columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``[t0, t1]`` that holds points (``x`` outside it goes to the nearest end column, a ``y``
    that is not a number is left out): the column's centre, its lowest and its highest ``y``."""
    if columns < 1 or not t1 > t0:
        raise ValueError(f"envelope needs columns >= 1 and t1 > t0, got {columns}, [{t0}, {t1}]")
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = ~np.isnan(y) & ~np.isnan(x)
    x, y = x[keep], y[keep]
    col = np.clip(((x - t0) / (t1 - t0) * columns).astype(np.int64), 0, columns - 1)
    lo = np.full(columns, np.inf)
    hi = np.full(columns, -np.inf)
    np.minimum.at(lo, col, y)
    np.maximum.at(hi, col, y)
    has = lo <= hi  # an empty column keeps inf > -inf
    centre = t0 + (np.arange(columns) + 0.5) * (t1 - t0) / columns
    return centre[has], lo[has], hi[has]
