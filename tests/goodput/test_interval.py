"""IntervalTuner: the Young/Daly arithmetic, bounds, re-evaluation, and seeding from a real run's ledger."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient.checkpoint.save.interval import IntervalTuner


def test_young_daly_from_observations():
    t = IntervalTuner(prior_mtbf_s=3600, prior_weight=1e9)  # prior dominates: M stays 3600 s
    assert t.interval_steps() == 10  # nothing measured yet: a first guess (not the next step, see below)
    for _ in range(10):
        t.observe_step(1.0)
    for _ in range(3):
        t.observe_save(2.0)
    expected = math.sqrt(2 * 2.0 * 3600) - 2.0
    assert t.optimal_seconds() == pytest.approx(expected, rel=1e-6)
    assert t.interval_steps() == round(expected)
    inp = t.inputs()
    for key in ("step_seconds", "save_blocking_seconds", "mtbf_seconds", "interruptions", "optimal_seconds",
                "interval_steps", "prior_mtbf_seconds", "uptime_seconds"):
        assert key in inp
    assert inp["interval_steps"] == round(expected) and inp["save_blocking_seconds"] == 2.0


def test_interruptions_shorten_the_interval_and_bounds_hold():
    t = IntervalTuner(prior_mtbf_s=6 * 3600, min_steps=5, max_steps=400)
    for _ in range(50):
        t.observe_step(0.5)
    t.observe_save(1.0)
    before = t.interval_steps()
    assert before == 400  # long prior MTBF: capped at max_steps
    for _ in range(200):
        t.observe_interruption()
    after = t.interval_steps()
    assert 5 <= after < before
    assert t.mtbf_seconds() < 6 * 3600 / 100
    for _ in range(10_000):
        t.observe_interruption()
    assert t.interval_steps() == 5


def test_hysteresis_keeps_the_interval_steady():
    t = IntervalTuner(prior_mtbf_s=3600, prior_weight=1e9, hysteresis=0.1)
    for _ in range(100):
        t.observe_step(1.0)
    t.observe_save(2.0)
    k = t.interval_steps()
    t.observe_save(2.1)  # median 2.05: optimum moves ~1 %
    assert t.interval_steps() == k
    for _ in range(5):
        t.observe_save(8.0)  # median jumps: optimum roughly doubles
    assert t.interval_steps() > 1.5 * k


def test_persistent_every_follows_upload_time():
    t = IntervalTuner(prior_mtbf_s=3600, prior_weight=1e9, persistent_prior=7)
    assert t.persistent_every() == 7
    for _ in range(20):
        t.observe_step(1.0)
    t.observe_save(2.0)
    k = t.interval_steps()  # ~ 118 s between saves
    t.observe_upload(600.0)
    assert t.persistent_every() == math.ceil(1.5 * 600.0 / k)
    t2 = IntervalTuner(prior_mtbf_s=3600, prior_weight=1e9)
    for _ in range(20):
        t2.observe_step(1.0)
    t2.observe_save(2.0)
    t2.observe_upload(1.0)
    assert t2.persistent_every() == 1  # uploads keep up: every local save goes up


@pytest.mark.parametrize("kw, word", [({"prior_mtbf_s": 0}, "prior_mtbf_s"), ({"min_steps": 5, "max_steps": 2},
                                                                                  "min_steps"),
                                      ({"prior_weight": 0}, "prior_weight"), ({"hysteresis": 1.5}, "hysteresis")])
def test_bad_config_names_the_problem(kw, word):
    with pytest.raises(ValueError, match=word):
        IntervalTuner(**kw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), max_size=30), st.lists(st.floats(0, 1e4, allow_nan=False),
                                                                            max_size=10),
       st.integers(0, 50), st.integers(1, 50), st.integers(0, 5000))
def test_property_always_within_bounds(steps, saves, interruptions, lo, span):
    t = IntervalTuner(min_steps=lo, max_steps=lo + span)
    for s in steps:
        t.observe_step(s)
    for s in saves:
        t.observe_save(s)
    for _ in range(interruptions):
        t.observe_interruption()
    assert lo <= t.interval_steps() <= lo + span
    assert 1 <= t.persistent_every() <= 1000


def test_seeded_from_a_real_runs_ledger(crashed_run):
    t = IntervalTuner.from_run_dir(crashed_run)
    inp = t.inputs()
    assert inp["interruptions"] == 1  # the SIGKILL, counted once
    assert inp["step_seconds"] and inp["save_blocking_seconds"] is not None
    assert inp["uptime_seconds"] > 0
    assert 1 <= t.interval_steps() <= 10000
    assert IntervalTuner.from_run_dir(crashed_run / "nothing-here").inputs()["interruptions"] == 0


def test_restarts_that_resumed_from_snapshots_do_not_shorten_the_interval():
    disk, snap = (IntervalTuner(prior_mtbf_s=3600, max_steps=100_000) for _ in range(2))
    for t in (disk, snap):
        for _ in range(50):
            t.observe_step(1.0)
        t.observe_save(0.5)
    for _ in range(20):
        disk.observe_interruption()
        snap.observe_interruption(from_snapshot=True)
    assert snap.mtbf_seconds() == pytest.approx((0.5 * 3600 + 50.5) / 0.5)  # the prior and the uptime only
    assert disk.mtbf_seconds() == pytest.approx((0.5 * 3600 + 50.5) / 20.5)
    assert snap.interval_steps() > 5 * disk.interval_steps()
    assert snap.inputs()["interruptions"] == 20 and snap.inputs()["interruptions_from_snapshots"] == 20


@pytest.mark.parametrize("tier, held, covered", [("snapshot", False, 1), ("local", False, 0), ("peer", False, 0),
                                                 (None, False, 0), ("local", True, 1), ("peer", True, 1)])
def test_this_attempts_restore_says_whether_its_interruption_needed_the_disk(tier, held, covered):
    # held: every rank held a snapshot within a snapshot interval of the disk step restored (the restorer's verdict)
    t = IntervalTuner()
    t.observe_interruption()
    t.observe_restore(tier, covered=held)
    t.observe_restore("snapshot")  # one restore an attempt counts
    assert t.inputs()["interruptions_from_snapshots"] == covered
    fresh = IntervalTuner()
    fresh.observe_restore("snapshot")  # a snapshot with no interruption seen: nothing to take back
    assert fresh.inputs()["interruptions_from_snapshots"] == 0


def test_with_no_step_measured_the_next_save_is_not_the_next_step():
    # the interval in force at a save sets the next save: 1 here would put a second save right behind the first,
    # waiting for its write
    t = IntervalTuner(min_steps=1, max_steps=10_000)
    assert t.interval_steps() == 10
    t.observe_save(0.2)
    assert t.interval_steps() == 10
    assert IntervalTuner(min_steps=1, max_steps=4).interval_steps() == 4
    assert IntervalTuner(min_steps=20, max_steps=400).interval_steps() == 20
    for _ in range(10):
        t.observe_step(1.0)
    assert t.interval_steps() == round(t.optimal_seconds())  # measured: Young/Daly as before


def _ledger_line(kind, wall, **details):
    from resilient.events import Event

    return json.dumps(Event(kind, node="n0", rank=0, attempt=0, details=details, wall=wall, mono=wall).to_json()) + "\n"


def test_following_a_ledger_one_step_stands_in_for_the_interference_until_a_save_shows_it(tmp_path):
    """The blocking part of a save is a fraction of its cost, and a save's interference shows in the ledger only
    once its background work ended: until then one step stands in for it (else the first intervals of a run come
    out a third of the later ones); measured, the measurement replaces it. Without a ledger nothing would measure
    it, and the blocking time alone is the cost, as before."""
    from resilient.events import EventKind as K

    run = tmp_path / "run"
    run.mkdir()
    ledger = run / "events.jsonl"
    ledger.write_text("")
    t = IntervalTuner.from_run_dir(run, prior_mtbf_s=4.0, prior_weight=1e9)
    t.follow_every_s = 0.0  # look at the ledger at every question (its spacing is the tail's floor)
    alone = IntervalTuner(prior_mtbf_s=4.0, prior_weight=1e9)
    for tuner in (t, alone):
        for _ in range(20):
            tuner.observe_step(0.025)
        tuner.observe_save(0.003)
    assert t.inputs()["save_interference_seconds"] is None
    assert t.save_seconds() == pytest.approx(0.028)
    assert alone.save_seconds() == pytest.approx(0.003)
    assert t.interval_steps() > 2 * alone.interval_steps()
    # the ledger now holds clean 25-ms steps and two saves: the first (cold) under four 75-ms steps, the second
    # under four 35-ms steps
    slow = {7: 0.075, 8: 0.075, 9: 0.075, 10: 0.075, 17: 0.035, 18: 0.035, 19: 0.035, 20: 0.035}
    lines, wall = [], 100.0
    for step in range(24):
        wall += slow.get(step, 0.025)
        lines.append(_ledger_line(K.STEP, wall, step=step, seconds=slow.get(step, 0.025)))
        if step in (6, 16):
            took = sum(slow.get(s, 0.025) for s in range(step + 1, step + 5)) - 0.001
            lines.append(_ledger_line(K.CKPT_SAVE, wall + 0.001, step=step, blocking_seconds=0.003))
            lines.append(_ledger_line(K.CKPT_TIER_DONE, wall + took + 0.001, step=step, tier="local", seconds=took))
        if step == 14:
            ledger.write_text("".join(lines))  # the first save only: still the stand-in (a cold save is left out)
            deadline = time.monotonic() + 10
            while t._follower.bytes_read < ledger.stat().st_size and time.monotonic() < deadline:
                time.sleep(0.001)
                t.inputs()
            assert t.inputs()["save_interference_seconds"] is None
            assert t.save_seconds() == pytest.approx(0.028)
    ledger.write_text("".join(lines))
    deadline = time.monotonic() + 10  # the tuner's next look (at most one per 2 ms per file followed)
    while t.inputs()["save_interference_seconds"] is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert t.inputs()["save_interference_seconds"] == pytest.approx(0.04, abs=0.002)  # 4 steps 10 ms over the clean
    assert t.save_seconds() == pytest.approx(0.003 + t.inputs()["save_interference_seconds"])
