"""The calculator's bulk paths (steps as columns, layers painted from arrays) give the report that painting every
interval one at a time gives, on random ledgers of every shape; the columns a live collector keeps give the report
of the events they came from, however they were added; and the collector keeps a step as numbers, not as an event."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient.events import Event, EventKind, read_events
from resilient.events.follow import _STEP_LINE
from resilient.goodput.calculator import compute_report
from resilient.goodput.columns import ReportInputs
from resilient.goodput.metrics import LedgerCollector
from resilient.goodput.paint import _layer_codes
from tests.goodput.random_ledgers import random_ledger


def assert_same(a: object, b: object, path: str = "report") -> None:
    if isinstance(a, float) and isinstance(b, float):
        assert a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b)), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_bulk_paths_give_the_report_of_painting_one_interval_at_a_time(seed: int) -> None:
    rng = random.Random(seed)  # a seed, not hypothesis's randoms: a ledger draws thousands of numbers
    evs = random_ledger(rng)
    now = max(e.wall for e in evs) + rng.uniform(0, 5)
    bulk = compute_report(evs, now=now)
    one_by_one = compute_report(evs, now=now, _reference=True)
    assert_same(bulk.to_json(timeline=True), one_by_one.to_json(timeline=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(1, 7))
def test_columns_added_in_any_chunks_give_the_report_of_the_events(seed: int, chunks: int) -> None:
    rng = random.Random(seed)
    evs = random_ledger(rng)
    now = max(e.wall for e in evs) + 1.0
    whole = compute_report(evs, now=now)
    inp = ReportInputs()
    cut = sorted(rng.randint(0, len(evs)) for _ in range(chunks))
    for lo, hi in zip([0, *cut], [*cut, len(evs)]):
        inp.extend(evs[lo:hi])
        if len(inp):
            compute_report(inp, now=now, timeline=False)  # a report between chunks changes nothing kept
    assert inp.step_count == sum(e.kind is EventKind.STEP for e in evs)
    got = compute_report(inp, now=now)
    assert_same(got.to_json(timeline=True), whole.to_json(timeline=True))
    assert compute_report(inp, now=now, timeline=False).timeline == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=40),
       st.booleans())
def test_a_layer_painted_in_bulk_equals_painting_it_in_order(ivs: list[tuple[int, int, int]], disjoint: bool) -> None:
    if disjoint:  # the shape of a ledger's steps: back to back or with gaps, never overlapping
        at, out = 0, []
        for gap, length, code in ivs:
            out.append((at + gap, length, code))
            at += gap + length
        ivs = out
    s = np.array([a for a, _, _ in ivs], dtype=np.float64)
    e = s + np.array([n for _, n, _ in ivs], dtype=np.float64)
    c = np.array([k for _, _, k in ivs], dtype=np.int64)
    points = np.unique(np.concatenate([s, e, [-1.0, 1000.0]]))
    assert (_layer_codes(points, s, e, c, False) == _layer_codes(points, s, e, c, True)).all()
    same = np.zeros_like(c)
    assert (_layer_codes(points, s, e, same, False) == _layer_codes(points, s, e, same, True)).all()


def _steps_ledger(run_dir: Path, t0: float, steps: int) -> None:
    """A run's ledger whose even steps are written as the worker's formatter writes them (one compact line, read
    as numbers) and odd ones in another spelling (read as events)."""
    evs = [Event(EventKind.RUN_START, node="n0", wall=t0),
           Event(EventKind.ATTEMPT_START, node="n0", attempt=0, details={"world_size": 2}, wall=t0 + 0.5)]
    evs += [Event(EventKind.STEP, node="n0", rank=0, attempt=0, wall=t0 + 1.0 + s, mono=s,
                  details={"step": s, "seconds": 0.9 + (s % 3) * 0.01, "compute_seconds": 0.8}) for s in range(steps)]
    with open(run_dir / "events.jsonl", "w") as f:
        for ev in evs:
            compact = ev.kind is EventKind.STEP and ev.details["step"] % 2 == 0
            f.write(json.dumps(ev.to_json(), separators=(",", ":") if compact else None) + "\n")
    assert sum(bool(_STEP_LINE.fullmatch(raw)) for raw in (run_dir / "events.jsonl").read_bytes().splitlines()) \
        == (steps + 1) // 2


def test_the_collector_keeps_steps_as_columns_and_serves_the_calculators_figures(tmp_path: Path) -> None:
    steps = 3000
    t0 = time.time() - steps - 2.0  # a run in progress: the collector reports it up to now
    _steps_ledger(tmp_path, t0, steps)
    c = LedgerCollector(tmp_path)
    fams = {m.name: m for m in c.collect()}
    held = c._inputs
    assert held.step_count == steps and len(held.others) == 2  # no Event kept per step
    assert held.nbytes() / steps <= 48
    assert fams["resilient_ledger_events"].samples[-1].labels == {"kind": "step"}
    assert fams["resilient_ledger_events"].samples[-1].value == steps
    assert fams["resilient_last_step"].samples[0].value == steps - 1
    rep = compute_report(read_events(tmp_path), now=time.time())
    assert rep.goodput > 0.8
    assert fams["resilient_goodput_ratio"].samples[0].value == pytest.approx(rep.goodput, rel=0.01)
    # a step appended later is read by the next scrape and lands in the columns
    with open(tmp_path / "events.jsonl", "a") as f:  # the formatter's spelling
        f.write(json.dumps(Event(EventKind.STEP, node="n0", rank=0, attempt=0, wall=t0 + 1.0 + steps, mono=0.0,
                                 details={"step": steps, "seconds": 0.9, "compute_seconds": 0.8}).to_json(),
                           separators=(",", ":")) + "\n")
    c._report = None
    fams = {m.name: m for m in c.collect()}
    assert held.step_count == steps + 1
    assert fams["resilient_last_step"].samples[0].value == steps
    assert not math.isnan(fams["resilient_goodput_ratio"].samples[0].value)

