"""A long run's figure is drawn per column of time (goodput/thin.py): each column's dominant category in the band,
each column's range of step times and step numbers. Checked against brute force on random inputs, and a real
``resilient goodput --plot`` of a ledger past the threshold draws through them (a short run is drawn as before)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from resilient.goodput import plot as plot_mod
from resilient.goodput.thin import band, envelope


def _brute_band(spans: dict[str, list[tuple[float, float]]], t0: float, t1: float, columns: int) -> list[int]:
    edges = [t0 + (t1 - t0) * i / columns for i in range(columns + 1)]
    cats = list(spans)
    best = []
    for c in range(columns):
        a, b = edges[c], edges[c + 1]
        cover = [sum(max(0.0, min(b, s + max(w, 0.0)) - max(a, s)) for s, w in spans[k]) for k in cats]
        m = max(cover) if cover else 0.0
        best.append(cover.index(m) if m > 1e-9 * (t1 - t0) / columns else -1)
    return best


def _columns_of(out: dict[str, list[tuple[float, float]]], cats: list[str], t0: float, t1: float,
                columns: int) -> list[int]:
    got = [-1] * columns
    w = (t1 - t0) / columns
    for k, runs in out.items():
        for start, width in runs:
            a = round((start - t0) / w)
            for c in range(a, a + round(width / w)):
                assert got[c] == -1, "two categories painted in one column"
                got[c] = cats.index(k)
    return got


@pytest.mark.timeout(120)
def test_band_paints_each_column_with_the_category_covering_most_of_it() -> None:
    rng = random.Random(7)
    for trial in range(300):
        cats = ["productive", "startup", "other", "detection"][:rng.randint(1, 4)]
        t1 = rng.choice([1.0, 10.0, 3600.0])
        spans = {c: [(rng.uniform(-0.1, 1.0) * t1, rng.choice([0.0, -1.0, rng.expovariate(20.0 / t1),
                                                                 rng.uniform(0, 0.5) * t1]))
                     for _ in range(rng.randint(0, 30))] for c in cats}
        columns = rng.randint(1, 60)
        out = band(spans, 0.0, t1, columns)
        want = _brute_band(spans, 0.0, t1, columns)
        got = _columns_of(out, cats, 0.0, t1, columns)
        # anything else than the brute force's winner:
        for c, (g, w) in enumerate(zip(got, want)):
            if g != w:
                a, b = t1 * c / columns, t1 * (c + 1) / columns
                cov = {k: sum(max(0.0, min(b, s + max(x, 0.0)) - max(a, s)) for s, x in spans[k]) for k in cats}
                # a tie within rounding may go either way, as may a column covered by next to nothing
                top = max(cov.values())
                assert top < 1e-8 * t1 or (g >= 0 and w >= 0 and abs(cov[cats[g]] - cov[cats[w]]) < 1e-9 * t1), \
                    (trial, c, cov)
        # runs are merged: no two adjacent runs of one category
        for runs in out.values():
            for (s0, w0), (s1, _) in zip(runs, runs[1:]):
                assert s1 > s0 + w0 + 1e-12 * t1


@pytest.mark.timeout(60)
def test_envelope_gives_each_columns_lowest_and_highest_value() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, columns = int(rng.integers(0, 400)), int(rng.integers(1, 50))
        x = rng.uniform(-5.0, 105.0, n)
        y = rng.normal(size=n)
        y[rng.random(n) < 0.05] = np.nan
        cx, lo, hi = envelope(x, y, 0.0, 100.0, columns)
        col = np.clip(((x - 0.0) / 100.0 * columns).astype(int), 0, columns - 1)
        want = {}
        for c, v in zip(col, y):
            if not np.isnan(v):
                a, b = want.get(c, (np.inf, -np.inf))
                want[c] = (min(a, v), max(b, v))
        got = {int(round((c - 50.0 / columns) / (100.0 / columns))): (a, b) for c, a, b in zip(cx, lo, hi)}
        assert got == want


def test_bad_columns_or_range_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="columns >= 1"):
        band({"productive": [(0.0, 1.0)]}, 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="t1 > t0"):
        envelope(np.zeros(1), np.zeros(1), 1.0, 1.0, 10)


@pytest.mark.timeout(180)
def test_plot_of_a_long_run_is_drawn_per_column_and_a_short_one_as_before(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.ledger_read import make_ledger
    from resilient.goodput.cli import main

    calls: list[str] = []
    real_band, real_envelope = plot_mod.band, plot_mod.envelope
    monkeypatch.setattr(plot_mod, "band", lambda *a, **k: (calls.append("band"), real_band(*a, **k))[1])
    monkeypatch.setattr(plot_mod, "envelope", lambda *a, **k: (calls.append("envelope"), real_envelope(*a, **k))[1])
    for steps, thinned in ((plot_mod.THIN_ABOVE + 5000, True), (2000, False)):
        run = tmp_path / f"run{steps}"
        make_ledger(run, steps)
        png = tmp_path / f"t{steps}.png"
        calls.clear()
        assert main([str(run), "--json", "--now", repr(1.7e9 + steps + 60.0), "--plot", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if thinned:
            # the band, the kept steps' times, the step numbers
            assert calls.count("band") == 1 and calls.count("envelope") >= 2, calls
        else:
            assert calls == [], calls


@pytest.mark.timeout(120)
def test_the_reports_timeline_arrays_are_its_segments(tmp_path: Path) -> None:
    from bench.ledger_read import make_ledger
    from resilient.goodput.api import CATEGORIES, PRODUCTIVE
    from resilient.goodput.calculator import compute_report
    from resilient.goodput.columns import ReportInputs
    from resilient.events import read_events

    make_ledger(tmp_path / "run", 3000)  # faults, restarts, saves: every kind of segment the bench writes
    inputs = ReportInputs(read_events(tmp_path / "run"))
    full = compute_report(inputs, now=1.7e9 + 3060.0, timeline=True)
    bare = compute_report(inputs, now=1.7e9 + 3060.0, timeline="arrays")
    # what a live collector keeps between scrapes: no time line in either form
    none = compute_report(inputs, now=1.7e9 + 3060.0, timeline=False)
    assert none.timeline == [] and none.timeline_arrays is None and none.goodput == full.goodput
    cats = (PRODUCTIVE, *CATEGORIES)
    for rep in (full, bare):
        a = rep.timeline_arrays
        assert a is not None and len(a) == len(full.timeline) > 3000
        assert [(s, e, cats[c]) for s, e, c in zip(a.start.tolist(), a.end.tolist(), a.code.tolist())] == \
            [(s.start, s.end, s.category) for s in full.timeline]
    assert bare.timeline == []
