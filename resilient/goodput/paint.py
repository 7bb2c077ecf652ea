"""The calculator's time line: intervals painted in layers, then swept into segments of one category each.

Each instant goes to the category of the highest layer that covers it; within a layer, the interval painted last
wins. A run's time line holds a few intervals per attempt, save and restore, and one or two per step; the steps
are what make a long run long (two million intervals at a million steps), so a layer is painted in bulk from
arrays. The sweep works on the elementary segments between every end point: a layer with one category is a
coverage count, a layer whose intervals do not overlap (the steps of a well-formed ledger) an index per segment,
and only a layer with overlapping intervals of different categories is painted interval by interval, in order.
``ordered=True`` paints every layer that way: the reference the bulk paths are tested against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Swept:
    """Segments of one category each, in time order: ``start``/``end`` (float64), ``code`` (an index into the
    painter's categories); two neighbours of one category are merged unless a cut lies between them."""

    start: np.ndarray
    end: np.ndarray
    code: np.ndarray

    @property
    def seconds(self) -> np.ndarray:
        return self.end - self.start


class LayeredPainter:
    """``paint`` one interval or ``paint_many`` arrays of them onto a layer, then ``sweep`` once."""

    def __init__(self, lo: float, hi: float, categories: Sequence[str], base: str):
        self.lo, self.hi = lo, hi
        self.categories = list(categories)
        self._code = {c: i for i, c in enumerate(self.categories)}
        self.base = self._code[base]  # what no layer covers
        # layer → its parts in painting order, each (starts, ends, codes) arrays; single intervals wait in
        # _singles until the layer's next bulk part or the sweep, so that they keep their place in that order
        self._layers: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._singles: dict[int, list[tuple[float, float, int]]] = {}

    def code(self, category: str) -> int:
        return self._code[category]

    def paint(self, start: float, end: float, layer: int, category: str) -> None:
        s, e = max(start, self.lo), min(end, self.hi)
        if e > s:
            self._singles.setdefault(layer, []).append((s, e, self._code[category]))

    def paint_many(self, starts: np.ndarray, ends: np.ndarray, layer: int, codes: np.ndarray | int) -> None:
        """Paint ``[starts[i], ends[i]]`` in the order given, after everything painted on this layer before."""
        self._flush(layer)
        s = np.maximum(np.asarray(starts, dtype=np.float64), self.lo)
        e = np.minimum(np.asarray(ends, dtype=np.float64), self.hi)
        c = np.broadcast_to(np.asarray(codes, dtype=np.int64), s.shape)
        keep = e > s
        if keep.any():
            self._layers.setdefault(layer, []).append((s[keep], e[keep], c[keep]))

    def _flush(self, layer: int) -> None:
        """Single intervals painted so far become one part, so the painting order is kept."""
        single = self._singles.pop(layer, None)
        if single:
            arr = np.array(single, dtype=np.float64).reshape(-1, 3)
            self._layers.setdefault(layer, []).append((arr[:, 0], arr[:, 1], arr[:, 2].astype(np.int64)))

    def sweep(self, cuts: Iterable[float] = (), *, ordered: bool = False) -> Swept:
        for layer in list(self._singles):
            self._flush(layer)
        layers = {k: tuple(np.concatenate(x) for x in zip(*parts)) for k, parts in self._layers.items()}
        cut = np.array(sorted({c for c in cuts if self.lo < c < self.hi}), dtype=np.float64)
        pts = [np.array([self.lo, self.hi]), cut]
        for s, e, _ in layers.values():
            pts += [s, e]
        points = np.unique(np.concatenate(pts))
        m = len(points) - 1
        top = np.full(m, -1, dtype=np.int64)
        for layer in sorted(layers, reverse=True):
            s, e, c = layers[layer]
            codes = _layer_codes(points, s, e, c, ordered)
            free = top < 0
            top[free] = codes[free]
        top[top < 0] = self.base
        # a segment starts where the category changes or at a cut
        new = np.ones(m, dtype=bool)
        new[1:] = (top[1:] != top[:-1]) | np.isin(points[1:-1], cut)
        first = np.flatnonzero(new)
        ends = np.append(points[first[1:]], points[-1])
        return Swept(points[first], ends, top[first])


def _layer_codes(points: np.ndarray, s: np.ndarray, e: np.ndarray, c: np.ndarray, ordered: bool) -> np.ndarray:
    """For each elementary segment ``[points[k], points[k+1]]``, the code of the interval of this layer painted
    last among those covering it, or -1."""
    m = len(points) - 1
    out = np.full(m, -1, dtype=np.int64)
    i0 = np.searchsorted(points, s)  # exact: every end point is one of the points
    i1 = np.searchsorted(points, e)
    if not ordered and (c == c[0]).all():
        depth = np.cumsum(np.bincount(i0, minlength=m + 1) - np.bincount(i1, minlength=m + 1))[:m]
        out[depth > 0] = c[0]
        return out
    if not ordered:
        order = np.argsort(i0, kind="stable")
        a, b = i0[order], i1[order]
        if len(a) < 2 or (a[1:] >= np.maximum.accumulate(b)[:-1]).all():  # no two overlap: one owner a segment
            k = np.arange(1, len(a) + 1, dtype=np.int64)
            owner = np.cumsum(np.bincount(a, weights=k, minlength=m + 1)
                              - np.bincount(b, weights=k, minlength=m + 1))[:m].round().astype(np.int64)
            hit = owner > 0
            out[hit] = c[order][owner[hit] - 1]
            return out
    for lo, hi, code in zip(i0.tolist(), i1.tolist(), c.tolist()):  # later paint wins
        out[lo:hi] = code
    return out
