"""The step records as ``resilient goodput --plot`` and ``--tensorboard`` draw them (resilient.goodput.columns.StepPoints):
read as columns (a long run's million steps, no event each) they are what the events give, and which steps were
redone is what walking the events taught."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from resilient.events import Event, EventKind
from resilient.events.follow import read_events, read_ledgers
from resilient.goodput.calculator import report_for_run
from resilient.goodput.columns import ReportInputs, StepPoints
from tests.goodput.test_ledger_read import _mixed_run


def _reference(events: list[Event]) -> tuple[list[float], list[float], list[float], list[bool]]:
    """Walking the events, as the plot did: in wall order, a record without a step number at step 0, one whose
    step is not a number on no axis; redone when a later record has the same or an earlier step."""
    steps = sorted((e for e in events if e.kind is EventKind.STEP), key=lambda e: e.wall)
    nums: list[float] = []
    for e in steps:
        try:
            n = float(e.details.get("step", 0))
        except (TypeError, ValueError, OverflowError):
            n = math.nan
        nums.append(n if math.isfinite(n) else math.nan)
    redone = [False] * len(steps)
    low = math.inf
    for i in range(len(steps) - 1, -1, -1):
        if math.isnan(nums[i]):
            continue
        redone[i] = nums[i] >= low
        low = min(low, nums[i])
    secs = []
    for e in steps:
        try:
            v = float(e.details.get("seconds", 0.0))
        except (TypeError, ValueError, OverflowError):
            v = 0.0
        secs.append(v if math.isfinite(v) else 0.0)
    return [e.wall for e in steps], secs, nums, redone


def _same(p: StepPoints, ref: tuple) -> None:
    wall, secs, nums, redone = ref
    assert p.wall.tolist() == wall and p.seconds.tolist() == secs and p.redone.tolist() == redone
    assert np.array_equal(p.step, np.array(nums, dtype=float), equal_nan=True)


def test_random_records_are_drawn_as_walking_the_events_drew_them() -> None:
    for seed in range(400):
        r = random.Random(seed)
        evs = []
        for i in range(r.randrange(30)):
            d: dict = {}
            if r.random() < 0.9:
                d["step"] = r.choice([r.randrange(8), r.randrange(8), "x", None, 10**400, 2.5])
            if r.random() < 0.9:
                d["seconds"] = r.choice([r.random(), 0.5, "y", float("inf")])
            kind = EventKind.STEP if r.random() < 0.85 else EventKind.CKPT_SAVE
            evs.append(Event(kind, node="n", rank=0, details=d, wall=float(r.randrange(12)), mono=0.0))
        _same(StepPoints.of(evs), _reference(evs))


def test_a_real_ledger_read_as_columns_draws_what_its_events_draw(crashed_run, tmp_path) -> None:
    run = _mixed_run(crashed_run, tmp_path)
    inputs = ReportInputs()
    read_ledgers([run], into=inputs)
    events = list(read_events(run))
    assert sum(e.kind is EventKind.STEP for e in events) >= 40
    got = StepPoints.of(inputs)
    _same(got, _reference(events))
    assert got.redone.sum() >= 3  # the SIGKILLed attempt's steps after the last save were done again


@pytest.mark.timeout(120)
def test_the_plot_of_a_real_run_from_columns(crashed_run, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from resilient.goodput.plot import plot_timeline

    inputs = ReportInputs()
    read_ledgers([crashed_run], into=inputs)
    rep = report_for_run(crashed_run, timeline=True)
    plot_timeline(inputs, rep, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
